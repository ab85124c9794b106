"""The ledger of one rank: apply step inputs, check step plans.

All per-token work is vectorised with numpy; Python loops run over requests
only where the scheduler changed something (new, finished, appended blocks).
"""

from __future__ import annotations

import numpy as np
from kvledger.schemas.packing import unpack_i32, unpack_i64, unpack_u64
from kvledger.stream_app.core.tables import NULL_BLOCK, GroupTable
from kvledger.stream_app.core.violations import (
    BLOCK_OUT_OF_RANGE,
    FOREIGN_BLOCK_WRITE,
    READ_TARGET_MISMATCH,
    UNOWNED_WRITE,
    WRITE_TARGET_MISMATCH,
    Coverage,
    RankKey,
    Violation,
)

_UNCHECKED_KINDS = ("MAMBA", "OTHER")  # no token->slot addressing to check


def expand_slot_runs(data: bytes) -> np.ndarray:
    """Packed (start, length) runs -> the slot mapping, -1 runs kept as -1."""
    runs = unpack_i64(data).reshape(-1, 2)
    starts, lengths = runs[:, 0], runs[:, 1]
    if lengths.size == 0:
        return np.empty(0, np.int64)
    if (lengths == 1).all():
        return starts
    total = int(lengths.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + offsets * np.repeat(starts >= 0, lengths)


class RankState:
    def __init__(self, key: RankKey, info: dict):
        self.key = key
        self.groups = [
            GroupTable(g["group_id"], g["kind"], g["block_size"], g["num_blocks"], g["sliding_window"])
            for g in info["kv_groups"]
        ]
        self.row_of = np.full(64, -1, np.int64)  # req_index -> row, -1 when not live
        self.index_of: dict[str, int] = {}  # req_id -> req_index
        self.req_id_of: dict[int, str] = {}
        self.free_rows: list[int] = []
        self.num_rows = 0
        self.computed = np.zeros(8, np.int64)  # per row: num_computed_tokens at the current step
        self.scheduled = np.zeros(8, np.int64)  # per row: tokens scheduled at the current step
        self.pending_sends: dict[str, list[np.ndarray]] = {}
        self.reported_conflicts: set[tuple[int, int, int]] = set()  # (group, req_index, block)

    # -- rows -------------------------------------------------------------------------
    def _rows(self, indices: np.ndarray) -> np.ndarray:
        inside = (indices >= 0) & (indices < self.row_of.size)
        if inside.all():
            return self.row_of[indices]
        return np.where(inside, self.row_of[np.where(inside, indices, 0)], -1)

    def _new_row(self, req_index: int, req_id: str) -> int:
        if req_id in self.index_of:
            self._drop(req_id)
        if self.free_rows:
            row = self.free_rows.pop()
        else:
            row = self.num_rows
            self.num_rows += 1
            if row >= self.computed.size:
                grow = self.computed.size
                self.computed = np.concatenate([self.computed, np.zeros(grow, np.int64)])
                self.scheduled = np.concatenate([self.scheduled, np.zeros(grow, np.int64)])
            for g in self.groups:
                g.ensure_rows(row + 1)
        if req_index >= self.row_of.size:
            grown = np.full(max(req_index + 1, 2 * self.row_of.size), -1, np.int64)
            grown[: self.row_of.size] = self.row_of
            self.row_of = grown
        self.row_of[req_index] = row
        self.index_of[req_id] = req_index
        self.req_id_of[req_index] = req_id
        return row

    def _drop(self, req_id: str) -> None:
        index = self.index_of.pop(req_id)
        del self.req_id_of[index]
        row = int(self.row_of[index])
        self.row_of[index] = -1
        for g in self.groups:
            g.clear(row)
        self.free_rows.append(row)

    def _violation(self, kind, step, detail, req_id=None, group=None) -> Violation:
        return Violation.at(kind, self.key, step, detail, req_id=req_id, group=group)

    def req_id(self, req_index: int) -> str:
        return self.req_id_of.get(req_index, f"#{req_index}")

    # -- step input -------------------------------------------------------------------
    def apply_input(self, step: int, inp: dict, out: list[Violation], cov: Coverage) -> None:
        for req_id in inp["finished_req_ids"]:
            if req_id in self.index_of:
                self._drop(req_id)
        for req_id in inp["preempted_req_ids"]:
            index = self.index_of.get(req_id)
            if index is not None:
                for g in self.groups:
                    g.clear(int(self.row_of[index]))
        # Blocks handed out this step, per group: (rows, block arrays, request ids).
        grants: list[tuple[list[int], list[np.ndarray], list[str]]] = [([], [], []) for _ in self.groups]
        for req in inp["new_reqs"]:
            row = self._new_row(req["req_index"], req["req_id"])
            for grant, data in zip(grants, req["block_ids"], strict=False):
                grant[0].append(row)
                grant[1].append(unpack_i32(data))
                grant[2].append(req["req_id"])
            self.computed[row] = req["num_computed_tokens"]
            self.scheduled[row] = req["num_scheduled_tokens"]

        indices = unpack_i32(inp["cached_req_indices"])
        rows = self._rows(indices)
        known = rows >= 0
        if not known.all():
            cov.unchecked["unknown_request"] += int((~known).sum())
            rows = rows[known]
        self.computed[rows] = unpack_i32(inp["cached_num_computed_tokens"])[known]
        self.scheduled[rows] = unpack_i32(inp["cached_num_scheduled_tokens"])[known]
        for row in self._rows(unpack_i32(inp["resumed_req_indices"])).tolist():
            if row >= 0:  # resumed: the new block ids replace the row
                for g in self.groups:
                    g.clear(row)
        for entry in inp["new_block_ids"]:
            index, gid = entry["req_index"], entry["group_id"]
            row = int(self.row_of[index]) if 0 <= index < self.row_of.size else -1
            if row < 0 or gid >= len(self.groups):
                cov.unchecked["unknown_request"] += 1
                continue
            grants[gid][0].append(row)
            grants[gid][1].append(unpack_i32(entry["block_ids"]))
            grants[gid][2].append(self.req_id(index))
        for g, (grant_rows, blocks, req_ids) in zip(self.groups, grants, strict=True):
            if grant_rows:
                self._grant(step, g, grant_rows, blocks, req_ids, out)
            if g.window is not None and rows.size:
                g.release_out_of_window(rows, self.computed[rows] + self.scheduled[rows])

    def _grant(self, step, g: GroupTable, rows: list[int], blocks: list[np.ndarray], req_ids, out) -> None:
        counts = np.fromiter((b.size for b in blocks), np.int64, len(blocks))
        flat = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        bad = (flat < 0) | (flat >= g.num_blocks)
        if bad.any():
            owner = np.repeat(np.arange(len(blocks)), counts)
            for i in np.unique(owner[bad]).tolist():
                ids = blocks[i][(blocks[i] < 0) | (blocks[i] >= g.num_blocks)]
                out.append(
                    self._violation(
                        BLOCK_OUT_OF_RANGE,
                        step,
                        f"scheduler handed block ids {ids[:8].tolist()} outside the pool "
                        f"of {g.num_blocks} blocks",
                        req_ids[i],
                        g.group_id,
                    )
                )
        g.append_many(np.asarray(rows, np.int64), counts, flat)

    # -- step plan ----------------------------------------------------------------------
    def check_plan(self, step: int, plan: dict, out: list[Violation], cov: Coverage) -> None:
        indices = unpack_i32(plan["req_indices"])
        num_tokens = unpack_i32(plan["num_tokens"]).astype(np.int64)
        first_pos = unpack_i32(plan["first_positions"]).astype(np.int64)
        rows = self._rows(indices)
        known = rows >= 0
        if not known.all():
            cov.unchecked["unknown_request"] += int((~known).sum())
        safe_rows = np.where(known, rows, 0)
        self._check_positions(step, indices, rows, known, num_tokens, first_pos, out, cov)

        total = int(num_tokens.sum())
        if total == num_tokens.size:  # decode: one token per request
            tok_req, pos = np.arange(total), first_pos
        else:
            tok_req = np.repeat(np.arange(num_tokens.size), num_tokens)
            starts = np.cumsum(num_tokens) - num_tokens
            pos = first_pos[tok_req] + np.arange(total) - starts[tok_req]
        tok_rows = safe_rows[tok_req]
        tok_known = known[tok_req]

        for gp in plan["groups"]:
            gid = gp["group_id"]
            if gid >= len(self.groups):
                cov.unchecked["unknown_group"] += 1
                continue
            g = self.groups[gid]
            if g.kind in _UNCHECKED_KINDS:
                cov.unchecked[f"{g.kind.lower()}_group"] += 1
                continue
            slots = expand_slot_runs(gp["slot_runs"])
            num_real = gp["num_real"]
            if slots.size != num_real + gp["num_padding"] or num_real < 0:
                cov.unchecked["malformed_plan"] += 1
                continue
            cov.checks["write"] += int(known.sum())
            cov.checks["exclusivity"] += int(known.sum())
            self._check_writes(
                step, g, indices, slots[: min(num_real, total)], tok_req, tok_rows, tok_known, pos, out, cov
            )
            # Real entries beyond the scheduled tokens are owned by nobody, like padding.
            self._check_padding(step, g, slots[total:] if num_real > total else slots[num_real:], out, cov)
            self._check_reads(step, g, gp, indices, rows, known, out, cov)

    def _check_positions(self, step, indices, rows, known, num_tokens, first_pos, out, cov) -> None:
        cov.checks["position"] += int(known.sum())
        exp_pos = self.computed[np.where(known, rows, 0)]
        exp_n = self.scheduled[np.where(known, rows, 0)]
        bad = known & ((first_pos != exp_pos) | (num_tokens != exp_n))
        for i in np.flatnonzero(bad).tolist():
            out.append(
                self._violation(
                    WRITE_TARGET_MISMATCH,
                    step,
                    f"plan writes {num_tokens[i]} token(s) from position {first_pos[i]}; scheduler handed "
                    f"{exp_n[i]} token(s) from computed position {exp_pos[i]}",
                    self.req_id(int(indices[i])),
                )
            )

    def _check_writes(self, step, g: GroupTable, indices, real, tok_req, tok_rows, tok_known, pos, out, cov):
        bs = g.block_size
        n = real.size
        tok_req, tok_rows, tok_known, pos = tok_req[:n], tok_rows[:n], tok_known[:n], pos[:n]
        col = pos // bs
        in_row = tok_known & (col < g.lens[tok_rows])
        expected_block = g.table[tok_rows, np.minimum(col, g.table.shape[1] - 1)]
        expected = np.where(in_row, expected_block.astype(np.int64) * bs + pos % bs, -2)
        wrong = tok_known & (real != expected)
        if n < tok_known.size:
            cov.unchecked["tokens_without_slot"] += int(tok_known.size - n)
        if wrong.any():
            self._report_wrong_writes(step, g, indices, real, expected, tok_req, tok_rows, wrong, out)
        # Exclusivity of the blocks the ledger itself says are written.
        ok = tok_known & ~wrong
        blocks, cols = expected_block[ok].astype(np.int64), col[ok]
        in_pool = (blocks >= 0) & (blocks < g.num_blocks)  # others were reported when handed out
        if not in_pool.all():
            ok[np.flatnonzero(ok)[~in_pool]] = False
            blocks, cols = blocks[in_pool], cols[in_pool]
        if blocks.size:
            count = g.hold_count[blocks]
            shared_elsewhere = (g.hold_sum[blocks] != count * cols) | (
                g.hold_sumsq[blocks] != count * cols * cols
            )
            foreign = shared_elsewhere | (g.send_hold[blocks] > 0) | (blocks == NULL_BLOCK)
            if foreign.any():
                toks = np.flatnonzero(ok)[foreign]
                reqs, blocks = tok_req[toks], blocks[foreign]
                # A block held twice stays so until a holder leaves: report each pairing once.
                fresh = [
                    i
                    for i, key in enumerate(zip(indices[reqs].tolist(), blocks.tolist(), strict=True))
                    if (g.group_id, *key) not in self.reported_conflicts
                ]
                if fresh:
                    self.reported_conflicts.update(
                        (g.group_id, int(indices[reqs[i]]), int(blocks[i])) for i in fresh
                    )
                    self._report_foreign(step, g, indices, reqs[fresh], blocks[fresh], "ledger table", out)

    def _report_wrong_writes(self, step, g, indices, real, expected, tok_req, tok_rows, wrong, out) -> None:
        bs = g.block_size
        wrong_toks = np.flatnonzero(wrong)
        for r in np.unique(tok_req[wrong_toks]).tolist():
            toks = wrong_toks[tok_req[wrong_toks] == r]
            t = int(toks[0])
            req_id = self.req_id(int(indices[r]))
            exp = "no block in the row" if expected[t] == -2 else f"slot {expected[t]}"
            out.append(
                self._violation(
                    WRITE_TARGET_MISMATCH,
                    step,
                    f"{toks.size} token(s) written to the wrong slot; first: expected {exp}, actual slot {real[t]}",
                    req_id,
                    g.group_id,
                )
            )
            actual = real[toks]
            actual = actual[actual >= 0]
            blocks = actual // bs
            outside = blocks[(blocks < 0) | (blocks >= g.num_blocks)]
            if outside.size:
                out.append(
                    self._violation(
                        BLOCK_OUT_OF_RANGE,
                        step,
                        f"slot mapping writes block {int(outside[0])}, outside the pool "
                        f"of {g.num_blocks} blocks",
                        req_id,
                        g.group_id,
                    )
                )
            inside = blocks[(blocks >= 0) & (blocks < g.num_blocks)]
            own = np.isin(inside, g.row(int(tok_rows[t])))
            if (~own).any():
                self._report_foreign(
                    step, g, indices, np.full(int((~own).sum()), r), inside[~own], "slot mapping", out
                )

    def _report_foreign(self, step, g, indices, reqs, blocks, source, out) -> None:
        for r in np.unique(reqs).tolist():
            b = int(blocks[reqs == r][0])
            if b == NULL_BLOCK:
                whose = "the null block"
            elif g.send_hold[b] > 0:
                whose = "held by a pending KV send"
            elif g.hold_count[b] == 0:
                whose = "free (no live request holds it)"
            else:
                whose = "held by another live request at another position"
            out.append(
                self._violation(
                    FOREIGN_BLOCK_WRITE,
                    step,
                    f"writes block {b} ({source}), which is {whose}",
                    self.req_id(int(indices[r])),
                    g.group_id,
                )
            )

    def _check_padding(self, step, g: GroupTable, padding: np.ndarray, out, cov) -> None:
        cov.checks["padding"] += 1
        written = padding[padding >= 0]
        stray = written[(written // g.block_size) != NULL_BLOCK]
        if stray.size:
            out.append(
                self._violation(
                    UNOWNED_WRITE,
                    step,
                    f"{stray.size} padding slot(s) write real blocks; first slot {int(stray[0])} "
                    f"(block {int(stray[0]) // g.block_size}); no scheduled token owns them",
                    group=g.group_id,
                )
            )

    def _check_reads(self, step, g: GroupTable, gp, indices, rows, known, out, cov) -> None:
        row_lens = unpack_i32(gp["row_lens"])
        digests = unpack_u64(gp["row_digests"])
        if row_lens.size != rows.size or digests.size != rows.size:
            cov.unchecked["malformed_plan"] += 1
            return
        safe = np.where(known, rows, 0)
        cov.checks["read"] += int(known.sum())
        bad = known & ((row_lens != g.lens[safe]) | (digests != g.digests[safe]))
        if not bad.any():
            return
        full = unpack_i32(gp["rows"]) if gp.get("rows") is not None else None
        offsets = np.cumsum(row_lens) - row_lens
        for i in np.flatnonzero(bad).tolist():
            ledger_row = g.row(int(rows[i]))
            detail = f"attention reads a row of {row_lens[i]} block(s); the ledger has {ledger_row.size}"
            if full is not None:
                actual = full[offsets[i] : offsets[i] + row_lens[i]]
                diff = np.flatnonzero(actual[: ledger_row.size] != ledger_row[: actual.size])
                if diff.size:
                    j = int(diff[0])
                    detail += f"; first difference at position {j}: expected block {ledger_row[j]}, read {actual[j]}"
            elif row_lens[i] == ledger_row.size:
                detail += " with different block ids (digest differs)"
            out.append(
                self._violation(READ_TARGET_MISMATCH, step, detail, self.req_id(int(indices[i])), g.group_id)
            )

    # -- connector and snapshots -----------------------------------------------------------
    def apply_connector(self, event: dict) -> None:
        tid = event.get("transfer_id")
        if tid is None:
            return
        if event["kind"] == "SEND_INTENT" and tid not in self.pending_sends:
            blocks = [unpack_i32(b) for b in event["block_ids"]]
            self.pending_sends[tid] = blocks
            for g, b in zip(self.groups, blocks, strict=False):
                g.hold_for_send(b, +1)
        elif event["kind"] in ("SEND_DONE", "EXPIRED") and tid in self.pending_sends:
            for g, b in zip(self.groups, self.pending_sends.pop(tid), strict=False):
                g.hold_for_send(b, -1)

    def load_snapshot(self, snap: dict, info: dict) -> None:
        self.__init__(self.key, info)
        for req in snap["requests"]:
            row = self._new_row(req["req_index"], req["req_id"])
            for g, data in zip(self.groups, req["block_ids"], strict=False):
                g.replace(row, unpack_i32(data))
            self.computed[row] = req["num_computed_tokens"]
            self.scheduled[row] = 0

    def request_rows(self, req_id: str) -> list[list[int]] | None:
        """The block-table rows of a live request, per group (time-travel queries)."""
        index = self.index_of.get(req_id)
        if index is None:
            return None
        row = int(self.row_of[index])
        return [g.row(row).tolist() for g in self.groups]
