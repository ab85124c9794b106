"""The ledger of one rank: apply step inputs, check step plans.

Per-token work is vectorised with numpy and the common case (every request
known, every token where the ledger says) costs a fixed handful of array
operations per step and group; Python loops run only over what the
scheduler changed (new, finished, preempted requests) and over violations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import msgspec
import numpy as np

from kvledger.schemas.checkpoint import Reuse
from kvledger.schemas.events import (
    ConnectorEvent,
    DraftPass,
    GroupPlan,
    NewRequest,
    RankInfo,
    Snapshot,
    StepInput,
    StepPlan,
    TransferPrefix,
)
from kvledger.schemas.kinds import (
    Check,
    ConnectorKind,
    KvGroupKind,
    PdRole,
    Unchecked,
    ViolationKind,
    group_unchecked,
)
from kvledger.schemas.packing import expand_slot_runs, pack_u64, unpack_digests, unpack_i32, unpack_u64
from kvledger.stream_app.core.checks import (
    GrantFacts,
    GroupFacts,
    ReadFacts,
    RequestFacts,
    TokenSpans,
    draft_position_failures,
    grant_failures,
    in_flight_reuse_failures,
    in_flight_span,
    layout_alias_failures,
    null_grant_failures,
    overlapping_blocks,
    plan_failures,
    prefix_failures,
    prefix_known,
    slot_targets,
    token_positions,
    unwritten_failures,
)
from kvledger.stream_app.core.layout import Layout, Meeting, layout_of
from kvledger.stream_app.core.tables import NULL_BLOCK, UNKNOWN_FILL, GroupTable, written_from
from kvledger.stream_app.core.violations import Coverage, RankKey, Violation

# Steps dispatched kept for async scheduling's window: vLLM's batch queue holds two on the V1 runner
# (`max_concurrent_batches`), pipeline stages + 1 on Model Runner V2; a deeper window counts unchecked.
IN_FLIGHT_KEPT = 4
# Groups whose blocks a step uses are known from its positions: a full-attention row up to its last
# query, a sliding window's from its first query's window on. State groups keep their own rules.
IN_FLIGHT_KINDS = (KvGroupKind.FULL_ATTENTION, KvGroupKind.MLA, KvGroupKind.SLIDING_WINDOW)


@dataclass(slots=True)
class Dispatched:
    """A step scheduled while others were in flight: what its requests use until its output is processed."""

    step: int
    indices: np.ndarray  # req_index of each request it scheduled tokens for
    first: np.ndarray  # each one's first query position (num_computed_tokens)
    end: np.ndarray  # one past its last query position


@dataclass(slots=True)
class TransferHold:
    """A pending transfer's blocks on its rank, from its intent to its end: a send reads them, a
    receive writes them (the one tracker of a rank's pending transfers: holds, reuse, checkpoints)."""

    req_id: str | None  # the request transferred, when the connector named it
    intent_step: int  # step of the intent
    blocks: list[np.ndarray]  # per group
    # A send's first block handed to another request meanwhile (the checkpoint's record of it): it is
    # damaged if the send completes.
    reused: Reuse | None = None


@dataclass
class PlanFacts:
    """A step plan's facts beside a rank's tables, for the rules of checks.py."""

    indices: np.ndarray  # the plan's req_index per request, in slot-mapping order
    rows: np.ndarray  # each request's row in the tables (0 where `known` is False)
    known: np.ndarray  # the tables hold the request
    requests: RequestFacts  # per request: positions against computed and scheduled tokens
    groups: list[GroupFacts]  # per group the rules can judge: tokens' slots and the rows read


class RankTables:
    def __init__(self, key: RankKey, info: RankInfo, layout: Layout | None = None):
        self.key = key
        self.groups = [
            GroupTable(g.group_id, g.kind, g.block_size, g.num_blocks, g.sliding_window) for g in info.kv_groups
        ]
        # Where the groups' blocks live, judged once (`layout`: already judged from these groups): where
        # groups meet at other block ids, every block handed out is checked against them (nothing to do
        # on the layouts vLLM builds).
        self.layout = layout if layout is not None else layout_of(info.kv_groups)
        self.row_of = np.full(64, -1, np.int64)  # req_index -> row, -1 when not live
        self.index_of: dict[str, int] = {}  # req_id -> req_index
        self.req_id_of: dict[int, str] = {}
        self.free_rows: list[int] = []
        self.num_rows = 0
        self.computed = np.zeros(8, np.int64)  # per row: num_computed_tokens at the current step
        self.scheduled = np.zeros(8, np.int64)  # per row: tokens scheduled at the current step
        self.pending_sends: dict[str, TransferHold] = {}  # by transfer id: the blocks each reads
        self.pending_recvs: dict[str, TransferHold] = {}  # by transfer id: the blocks each writes
        # What blocks hold: each live request's prefix chains (row -> per group, packed uint64 of its full
        # prompt blocks), and the blocks this step's grants hand out only to be read, judged once the
        # step's writes are known (group, blocks, their readers' rows and positions).
        self.chains: dict[int, list[np.ndarray]] = {}
        self.chain_len = np.zeros(8, np.int64)  # per row: its longest chain (positions past it are unknown)
        self.pending_reads: list[tuple[GroupTable, np.ndarray, np.ndarray, np.ndarray]] = []
        # Every block's KV comes from this rank's own steps (no KV connector loads into it: a prefill
        # engine only sends), so what it reads can be traced to what it wrote.
        self.reads_traced = info.pd_role in (PdRole.NONE, PdRole.PREFILL)
        # A declaration under which what blocks hold is not modelled (context parallel: a block's
        # tokens spread over ranks): its reads are counted under its name (set by the Ledger).
        self.content_voided: str | None = None
        # Async scheduling's window, kept only on a rank whose inputs say what was in flight: the last
        # steps dispatched (step, req_index per request, its first and end query positions), and the
        # KV connector loads announced for the coming step (step, request, per group its blocks).
        self.dispatched: deque[Dispatched] = deque(maxlen=IN_FLIGHT_KEPT)
        self.loads: list[tuple[int, str, list[np.ndarray]]] = []

    # -- rows ---------------------------------------------------------------------------
    def _rows(self, indices: np.ndarray) -> np.ndarray:
        inside = (indices >= 0) & (indices < self.row_of.size)
        if inside.all():
            return self.row_of[indices]
        return np.where(inside, self.row_of[np.where(inside, indices, 0)], -1)

    def grow_rows(self, n: int) -> None:
        """Room for rows 0 .. n-1 in every per-row array."""
        while n > self.computed.size:
            self.computed = np.concatenate([self.computed, np.zeros_like(self.computed)])
            self.scheduled = np.concatenate([self.scheduled, np.zeros_like(self.scheduled)])
            self.chain_len = np.concatenate([self.chain_len, np.zeros_like(self.chain_len)])
        for g in self.groups:
            g.ensure_rows(n)

    def _new_row(self, req_index: int, req_id: str) -> int:
        if req_id in self.index_of:
            self._drop(req_id)
        if self.free_rows:
            row = self.free_rows.pop()
        else:
            row = self.num_rows
            self.num_rows += 1
            self.grow_rows(row + 1)
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
        self._clear_row(row)
        self.set_chains(row, None)
        self.free_rows.append(row)

    def _clear_row(self, row: int) -> None:
        for g in self.groups:
            g.clear(row)

    def _violation(self, kind, step, detail, req_id=None, group=None) -> Violation:
        return Violation.at(kind, self.key, step, detail, req_id=req_id, group=group)

    def req_id(self, req_index: int) -> str:
        return self.req_id_of.get(req_index, f"#{req_index}")

    # -- step input -----------------------------------------------------------------------
    def apply_input(self, step: int, inp: StepInput, out: list[Violation], cov: Coverage) -> None:
        if self.loads:  # before the input frees anything: the loads land while the rows stand
            self._check_in_flight(step, inp, out, cov)
        if inp.in_flight_steps is not None:
            self.note_dispatched(step, inp)
        if self.pending_reads:  # the last step's plan was never checked
            cov.unchecked[Unchecked.READ_NOT_SETTLED] += sum(r[1].size for r in self.pending_reads)
            self.pending_reads.clear()
        for req_id in inp.finished_req_ids:
            if req_id in self.index_of:
                self._drop(req_id)
        for req_id in inp.preempted_req_ids:
            if req_id in self.index_of:
                self._clear_row(int(self.row_of[self.index_of[req_id]]))

        indices = unpack_i32(inp.cached_req_indices)
        rows = self._rows(indices)
        known = rows >= 0
        if not known.all():
            cov.unchecked[Unchecked.UNKNOWN_REQUEST] += int((~known).sum())
            rows = rows[known]
        self.computed[rows] = unpack_i32(inp.cached_num_computed_tokens)[known]
        self.scheduled[rows] = unpack_i32(inp.cached_num_scheduled_tokens)[known]
        for row in self._rows(unpack_i32(inp.resumed_req_indices)).tolist():
            if row >= 0:  # resumed: its new block ids replace the row
                self._clear_row(row)
        if rows.size:  # before grants: the scheduler frees, then allocates
            for g in self.groups:
                g.release_freed(rows, self.computed[rows] + self.scheduled[rows])

        grants = self._new_requests(inp.new_reqs)
        self._appends(inp, grants, cov)
        for g, grant in zip(self.groups, grants, strict=True):
            if grant:
                self._grant(step, g, *grant, out, cov)
        zero, copies = unpack_i32(inp.block_ids_to_zero), unpack_i32(inp.block_copies).reshape(-1, 2)
        if zero.size or copies.size:
            granted = np.concatenate([np.concatenate(grant[2]) for grant in grants if grant] or [np.empty(0, np.int32)])
            self._check_overwrites(step, "zeroes", zero, None, out, cov)
            self._check_overwrites(step, "copies into", copies[:, 1], granted, out, cov)
            for g in self.groups:
                self._copied(g, copies)

    # -- async scheduling's window ----------------------------------------------------------
    def note_dispatched(self, step: int, inp: StepInput) -> None:
        """A step scheduled with steps in flight: what its requests will use, until it is out of the window."""
        columns = (inp.cached_req_indices, inp.cached_num_computed_tokens, inp.cached_num_scheduled_tokens)
        indices, first, counts = (unpack_i32(c) for c in columns)
        if inp.new_reqs:
            new = np.array([(r.req_index, r.num_computed_tokens, r.num_scheduled_tokens) for r in inp.new_reqs]).T
            indices, first, counts = (np.concatenate([indices, new[0]]), np.concatenate([first, new[1]]),
                                      np.concatenate([counts, new[2]]))  # fmt: skip
        some = counts > 0
        self.dispatched.append(Dispatched(step, indices[some], first[some], first[some] + counts[some]))

    def _check_in_flight(self, step: int, inp: StepInput, out: list[Violation], cov: Coverage) -> None:
        """KV connector loads announced for this step, against the steps still in flight when it was
        scheduled (`StepInput.in_flight_steps`: the rank's last ones): a load into a block such a step
        writes or reads for another request is `in_flight_reuse`."""
        loads, self.loads = [x for x in self.loads if x[0] == step], []
        depth = inp.in_flight_steps or 0
        if not loads or not depth:
            return
        window = [d for d in self.dispatched if d.step < step][-depth:]
        if len(window) < depth:  # steps in flight the ledger did not see dispatched (it joined later)
            cov.unchecked[Unchecked.IN_FLIGHT_UNKNOWN] += len(loads) * (depth - len(window))
        freed = set(inp.finished_req_ids) | set(inp.preempted_req_ids)
        for _, req_id, blocks in loads:
            # Block ids name one pool: a load into any group's block races a use in any group.
            dest = np.concatenate([b[g.ownable(b)] for g, b in zip(self.groups, blocks, strict=False)])
            if dest.size:
                cov.checks[Check.IN_FLIGHT_LOAD] += 1
                for d in window:
                    for g in self.groups:
                        self._in_flight_uses(step, g, d, req_id, dest, freed, out, cov)

    def _in_flight_uses(self, step, g: GroupTable, d: Dispatched, req_id, dest, freed, out, cov) -> None:
        """One load's blocks against one step in flight: its requests' blocks in group `g`."""
        if g.kind not in IN_FLIGHT_KINDS:
            cov.unchecked[Unchecked.IN_FLIGHT_UNMODELLED] += 1
            return
        rows = self._rows(d.indices)
        for k in np.flatnonzero(rows >= 0).tolist():
            holder = self.req_id(int(d.indices[k]))
            if holder == req_id:
                continue
            lo, hi = in_flight_span(int(d.first[k]), int(d.end[k]), g.block_size, g.window)
            row = g.row(int(rows[k]))
            if row.size < hi:  # the row lost blocks since (k > 1): what the step used is not known
                cov.unchecked[Unchecked.IN_FLIGHT_UNKNOWN] += 1
                continue
            bad = in_flight_reuse_failures(dest, row[lo:hi])
            if bad.any():
                block = int(dest[bad][0])
                pos = lo + int(np.flatnonzero(row[lo:hi] == block)[0])  # its place in the holder's row
                use = "writes" if (pos + 1) * g.block_size > int(d.first[k]) else "reads"
                why = ", which the scheduler freed at this step" if holder in freed else ""
                more = f" ({int(bad.sum())} such blocks)" if bad.sum() > 1 else ""
                detail = (
                    f"KV connector load into block {block} while step {d.step}, still in flight, {use} it for "
                    f"{holder}{why} (row position {pos}){more}"
                )
                out.append(self._violation(ViolationKind.IN_FLIGHT_REUSE, step, detail, req_id, g.group_id))
        _count(cov.unchecked, Unchecked.IN_FLIGHT_UNKNOWN, int((rows < 0).sum()))

    @staticmethod
    def _copied(g: GroupTable, copies: np.ndarray) -> None:
        """Whole-block copies (source, destination) of the worker: what each destination holds now."""
        inside = g.ownable(copies).all(axis=1)
        if inside.any():
            g.copy_content(copies[inside, 0], copies[inside, 1])

    def holders(self, blocks: np.ndarray) -> np.ndarray:
        """Live holders of each block, counted across groups: block ids name one pool."""
        count = np.zeros(blocks.size, np.int64)
        for g in self.groups:
            inside = g.ownable(blocks)
            count[inside] += g.hold_count[blocks[inside]]
        return count

    def holders_of(self, block: int, groups: list[GroupTable] | None = None) -> list[str]:
        """The live requests whose rows hold `block`, in any group or in `groups` (for a report: a scan of
        the rows' live cells)."""
        req_of_row = {int(self.row_of[i]): i for i in self.index_of.values()}
        rows = set()
        n = self.num_rows
        for g in self.groups if groups is None else groups:
            cols = np.arange(g.table.shape[1])
            live = (cols >= g.released[:n, None]) & (cols < g.lens[:n, None])
            rows.update(np.flatnonzero(((g.table[:n] == block) & live).any(axis=1)).tolist())
        return sorted(self.req_id(req_of_row[r]) for r in rows if r in req_of_row)

    def _check_overwrites(self, step, what: str, blocks, fresh, out, cov) -> None:
        """Blocks the worker overwrites whole this step (zeroed, or a copy's destination) must be
        read by nobody else: no pending send, at most one live holder, and for a copy's
        destination (`fresh` given) no holder that had it before this step's grants.

        Block ids name one pool shared by every group, so holders are counted across groups.
        """
        if blocks.size == 0:
            return
        cov.checks[Check.OVERWRITE_TARGET] += int(blocks.size)
        holders = self.holders(blocks)
        sending = np.zeros(blocks.size, bool)
        for g in self.groups:
            inside = g.ownable(blocks)
            sending[inside] |= g.send_hold[blocks[inside]] > 0  # a receive's blocks are its request's to zero
        outside = ~self.groups[0].in_pool(blocks) if self.groups else np.zeros(blocks.size, bool)
        bad = outside | sending | (holders > 1)
        if fresh is not None:  # a copy fills a fresh block: nobody held it before this step
            bad |= (holders == 1) & ~np.isin(blocks, fresh)
        for i in np.flatnonzero(bad)[:1].tolist():  # one violation per step and kind of overwrite
            b = int(blocks[i])
            if outside[i]:
                kind, why = ViolationKind.BLOCK_OUT_OF_RANGE, "outside the pool"
            elif sending[i]:
                kind, why = ViolationKind.FOREIGN_BLOCK_WRITE, "a pending KV send still reads it"
            elif holders[i] > 1:
                kind, why = ViolationKind.FOREIGN_BLOCK_WRITE, f"{holders[i]} live requests hold it"
            else:
                kind, why = ViolationKind.FOREIGN_BLOCK_WRITE, "a live request already held it before this step"
            more = f" ({int(bad.sum())} such blocks)" if bad.sum() > 1 else ""
            out.append(self._violation(kind, step, f"the scheduler {what} block {b}, but {why}{more}"))

    def _new_requests(self, new_reqs: list[NewRequest]) -> list[list | None]:
        """Rows for new requests; returns per group the blocks to grant: (rows, counts, blocks)."""
        grants: list[list | None] = [None] * len(self.groups)
        for req in new_reqs:
            row = self._new_row(req.req_index, req.req_id)
            self.computed[row] = req.num_computed_tokens
            self.scheduled[row] = req.num_scheduled_tokens
            self.keep_chains(row, req.prefix_chains)
            for gid, data in enumerate(req.block_ids[: len(self.groups)]):
                blocks = unpack_i32(data)
                grant = grants[gid] = grants[gid] or [[], [], []]
                grant[0].append(row)
                grant[1].append(blocks.size)
                grant[2].append(blocks)
        return grants

    def keep_chains(self, row: int, chains: list[bytes] | None) -> None:
        """A new request's prefix chains, per group (none recorded: its hits go unjudged)."""
        self.set_chains(row, self.unpack_chains(chains))

    def set_chains(self, row: int, chains: list[np.ndarray] | None) -> None:
        """The row's prefix chains, unpacked (None: none known, or the row is free)."""
        if chains is None:
            self.chains.pop(row, None)
            self.chain_len[row] = 0
        else:
            self.chains[row] = chains
            self.chain_len[row] = max(c.size for c in chains)

    def prefix_of(self, req_id: str) -> TransferPrefix | None:
        """A live request's prefix chains as a transfer's side states them (None: not on record)."""
        index = self.index_of.get(req_id)
        chains = None if index is None else self.chains.get(int(self.row_of[index]))
        return None if chains is None else self.transfer_prefix([pack_u64(c) for c in chains])

    def transfer_prefix(self, chains: list[bytes] | None) -> TransferPrefix | None:
        """Recorded prefix chains (per group, packed) as a transfer's side states them, at these tables'
        block sizes (None: none recorded)."""
        if not chains:
            return None
        return TransferPrefix([g.block_size for g in self.groups], chains[: len(self.groups)])

    def unpack_chains(self, chains: list[bytes] | None) -> list[np.ndarray] | None:
        """A request's recorded prefix chains, one array per group of these tables; None: not recorded."""
        if chains is None or len(chains) < len(self.groups):
            return None
        return [unpack_u64(c) for c in chains[: len(self.groups)]]

    def chains_at(self, gid: int, rows: np.ndarray, cols: np.ndarray, pending: dict | None = None) -> np.ndarray:
        """The prefix chain of each (row, position) in group `gid`; 0 where not known. `pending`: rows whose
        chains (unpacked, or None) are not kept yet (requests new in a run of the fast path)."""
        out = np.zeros(cols.size, np.uint64)
        if (not self.chains and not pending) or rows.size == 0:
            return out
        if pending:
            self._look_up_chains(gid, rows, cols, pending, out)
        else:  # most grants lie past their request's prompt (decode): no chain there
            inside = np.flatnonzero(cols < self.chain_len[rows])
            found = np.zeros(inside.size, np.uint64)
            self._look_up_chains(gid, rows[inside], cols[inside], {}, found)
            out[inside] = found
        return out

    def _look_up_chains(self, gid: int, rows: np.ndarray, cols: np.ndarray, pending: dict, out: np.ndarray) -> None:
        """`chains_at`'s lookup, row by row, into `out`."""
        if rows.size == 0:
            return
        order = np.argsort(rows, kind="stable")
        present, starts = np.unique(rows[order], return_index=True)
        ends = np.append(starts[1:], rows.size)
        for row, start, end in zip(present.tolist(), starts.tolist(), ends.tolist(), strict=True):
            chain = pending[row] if pending and row in pending else self.chains.get(row)
            if chain is None or chain[gid].size == 0:
                continue
            mine = order[start:end]
            at, known = cols[mine], chain[gid]
            out[mine] = np.where(at < known.size, known[np.minimum(at, known.size - 1)], 0)

    def _appends(self, inp: StepInput, grants: list[list | None], cov: Coverage) -> None:
        counts = unpack_i32(inp.append_counts)
        if counts.size == 0:
            return
        rows = self._rows(unpack_i32(inp.append_req_indices))
        gids = unpack_i32(inp.append_group_ids)
        blocks = unpack_i32(inp.append_block_ids)
        ok = (rows >= 0) & (gids < len(self.groups))
        if not ok.all():
            cov.unchecked[Unchecked.UNKNOWN_REQUEST] += int((~ok).sum())
        ends = np.cumsum(counts)
        for gid in sorted(set(gids[ok].tolist())):
            mine = ok & (gids == gid)
            grant = grants[gid] = grants[gid] or [[], [], []]
            grant[0] += rows[mine].tolist()
            grant[1] += counts[mine].tolist()
            if mine.all():
                grant[2].append(blocks)
            else:
                grant[2] += [blocks[e - c : e] for e, c in zip(ends[mine], counts[mine], strict=True)]

    def _grant(self, step: int, g: GroupTable, rows: list[int], counts: list[int], blocks: list, out, cov) -> None:
        """Hand blocks to rows; report blocks outside the pool or held by someone else."""
        flat = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        rows_arr, counts_arr = np.asarray(rows, np.int64), np.asarray(counts, np.int64)
        cols = g.append_many(rows_arr, counts_arr, flat)
        inside = g.in_pool(flat)
        real = inside & (flat != NULL_BLOCK)
        owner = np.repeat(rows_arr, counts_arr)
        # A block the grant writes is fresh: nobody held it before this step (in any group: one
        # pool), no pending send reads it, no second grant of this step writes it. Requests of
        # this step may read it at the same position: a prefix hit on a block computed now.
        # Blocks below the computed tokens are only read: shared, even with a pending send, they
        # are no reuse.
        writes = cols >= written_from(self.computed[owner], g.block_size)
        self._grant_content(step, g, flat, owner, cols, real, writes, out, cov)
        for meeting in self.layout.meetings.get(g.group_id, ()):
            self._check_layout(step, meeting, flat[real], owner[real], out, cov)
        mine = flat[real]
        written = writes[real]
        if len(set(mine.tolist())) == mine.size:  # the usual: each block handed out once in the step
            granted_now, writers = 1, written
        else:
            _, of, counts = np.unique(mine, return_inverse=True, return_counts=True)
            granted_now, writers = counts[of], np.bincount(of, weights=written, minlength=counts.size)[of]
        facts = GrantFacts(
            elsewhere=g.held_elsewhere(mine, cols[real]),
            written=written,
            prior=self.holders(mine) - granted_now,
            writers=writers,
            sending=g.in_transfer(mine),
        )
        if facts.sending.any():
            taken = facts.sending & written
            self._note_send_reuse(step, g, mine[taken], owner[real][taken])
        suspect = ~inside
        suspect[real] = grant_failures(facts)
        cov.checks[Check.EXCLUSIVITY] += int(real.sum())
        if not suspect.any():
            return
        for row in _in_order(owner[suspect]):
            mine = suspect & (owner == row)
            req_id = self._req_of_row(row)
            outside = flat[mine & ~inside]
            if outside.size:
                out.append(
                    self._violation(
                        ViolationKind.BLOCK_OUT_OF_RANGE,
                        step,
                        f"scheduler handed block ids {outside[:8].tolist()} outside the pool of {g.num_blocks} blocks",
                        req_id,
                        g.group_id,
                    )
                )
            taken = np.flatnonzero(mine & inside)
            if taken.size:
                first = int(taken[0])
                b = int(flat[first])
                if g.held_elsewhere(flat[first : first + 1], cols[first : first + 1])[0]:
                    whose = "another live request holds it at another position"
                elif g.send_hold[b] > 0:
                    whose = "a pending KV send still reads it"
                elif g.recv_hold[b] > 0:
                    whose = "a pending KV receive still writes it"
                else:
                    whose = "another live request holds it"
                out.append(
                    self._violation(
                        ViolationKind.FOREIGN_BLOCK_WRITE,
                        step,
                        f"scheduler handed block {b} to be written, but {whose}"
                        + (f" ({taken.size} such blocks)" if taken.size > 1 else ""),
                        req_id,
                        g.group_id,
                    )
                )

    def _note_send_reuse(self, step: int, g: GroupTable, blocks: np.ndarray, rows: np.ndarray) -> None:
        """Blocks a pending send reads, handed to a request to write: the first such of each send is kept
        (the grant is a foreign write now; the send ships the damage if it completes)."""
        for hold in self.pending_sends.values():
            if hold.reused is not None or g.group_id >= len(hold.blocks):
                continue
            taken = np.isin(blocks, hold.blocks[g.group_id])
            for row in _in_order(rows[taken]):
                req_id = self._req_of_row(row)
                if req_id != hold.req_id:
                    block = int(blocks[taken & (rows == row)].min())
                    hold.reused = Reuse(step=step, group=g.group_id, req_id=req_id, block=block)
                    break

    def _check_layout(self, step, meeting: Meeting, blocks, owner, out, cov) -> None:
        """Blocks handed out in one group must share no byte with another block id live in another group
        (the groups' pages meet at other block ids where they stride the allocation differently)."""
        _count(cov.checks, Check.BYTE_LAYOUT, int(blocks.size))
        h = self.groups[meeting.other]
        at, pair, others = overlapping_blocks(blocks, meeting.mine, meeting.theirs, h.num_blocks)
        bad = layout_alias_failures(blocks[at], others, h.hold_count[others] > 0)
        if not bad.any():
            return
        at, pair, others = at[bad], pair[bad], others[bad]
        for row in _in_order(owner[at]):
            mine = np.flatnonzero(owner[at] == row)
            i, p, other = int(at[mine[0]]), int(pair[mine[0]]), int(others[mine[0]])
            n = np.unique(at[mine]).size
            detail = (
                f"scheduler handed block {blocks[i]} in group {meeting.group}, whose "
                f"{_byte_span(meeting.mine, p, int(blocks[i]))} meet block {other} of group {meeting.other} "
                f"({_byte_span(meeting.theirs, p, other)}), held by {self.holders_of(other, [h])}: the groups stride "
                f"the allocation by {int(meeting.mine.stride[p])} and {int(meeting.theirs.stride[p])} bytes per "
                "block" + (f" ({n} such blocks)" if n > 1 else "")
            )
            out.append(self._violation(ViolationKind.LAYOUT_ALIAS, step, detail, self._req_of_row(row), meeting.group))

    def _grant_content(self, step, g: GroupTable, flat, owner, cols, real, writes, out, cov) -> None:
        """What granted blocks hold: none is the null block where the group's manager never places it;
        a block handed out to be written will hold its request's prefix; a block handed out only to be
        read holds the reader's own prefix, and was written to its end (judged after the step's plan)."""
        if g.kind.null_free:
            _count(cov.checks, Check.NULL_GRANT, int(flat.size))
            null = null_grant_failures(flat, True)
            for row in _in_order(owner[null]):
                cols_null = cols[null & (owner == row)]
                out.append(
                    self._violation(
                        ViolationKind.NULL_BLOCK_GRANT,
                        step,
                        f"scheduler handed the null block (block {NULL_BLOCK}) at row position(s) "
                        f"{cols_null[:8].tolist()}; a {g.kind.value.lower()} row never holds it",
                        self._req_of_row(row),
                        g.group_id,
                    )
                )
        if len(self.groups) > 1 and (real & ~writes).any():
            self._check_aliases(step, g, flat[real & ~writes], owner[real & ~writes], out)
        if not g.kind.addresses_slots:  # state groups: what their blocks hold is not written through slots
            return
        chains = self.chains_at(g.group_id, owner, cols)
        fresh = real & writes
        if fresh.any():
            g.mark_fresh(flat[fresh], chains[fresh])
        reads = real & ~writes
        if not reads.any():
            return
        if self.content_voided is not None:
            cov.unchecked[self.content_voided] += int(reads.sum())
            return
        if not self.reads_traced:
            cov.unchecked[Unchecked.READ_SOURCE_UNTRACED] += int(reads.sum())
            return  # (reads.any(): never a zero count)
        blocks, readers, at = flat[reads], owner[reads], cols[reads]
        facts = ReadFacts(g.chain[blocks], chains[reads])
        known = prefix_known(facts)
        _count(cov.checks, Check.PREFIX_IDENTITY, int(known.sum()))
        _count(cov.unchecked, Unchecked.PREFIX_UNKNOWN, int((~known).sum()))
        self._per_reader(
            step,
            ViolationKind.PREFIX_HIT_MISMATCH,
            g,
            prefix_failures(facts),
            readers,
            lambda i: (
                f"prefix hit on block {blocks[i]} at row position {at[i]}, computed from another prefix "
                f"(its tokens, LoRA adapter or multimodal items differ from this request's there)"
            ),
            out,
        )
        self.pending_reads.append((g, blocks, readers, at))

    def _per_reader(self, step, kind, g: GroupTable, bad, readers, detail, out) -> None:
        """One violation per request of `readers` with a `bad` block: `detail(i)` of its first, and how
        many it has."""
        for row in _in_order(readers[bad]):
            mine = np.flatnonzero(bad & (readers == row))
            more = f" ({mine.size} such blocks)" if mine.size > 1 else ""
            out.append(self._violation(kind, step, detail(int(mine[0])) + more, self._req_of_row(row), g.group_id))

    def _check_aliases(self, step, g: GroupTable, blocks, readers, out) -> None:
        """A block handed out to be read in one group while another group holds it: block ids name one
        pool, and vLLM's allocator gives a block to one group at a time (a written grant is checked
        with its holders in every group already; a read one only had its own group's)."""
        others = [h for h in self.groups if h is not g]
        alias = np.zeros(blocks.size, bool)
        for h in others:
            inside = h.in_pool(blocks)
            alias[inside] |= h.hold_count[blocks[inside]] > 0

        def detail(i: int) -> str:
            b = blocks[i]
            groups = [h.group_id for h in others if b < h.num_blocks and h.hold_count[b] > 0]
            return (
                f"scheduler handed block {b} to be read in group {g.group_id}, but group(s) {groups} hold it "
                f"(one pool: a block is one group's at a time)"
            )

        self._per_reader(step, ViolationKind.FOREIGN_BLOCK_WRITE, g, alias, readers, detail, out)

    def settle_reads(self, step: int, facts: list[GroupFacts], out: list[Violation], cov: Coverage) -> None:
        """After a step's plan: its correct writes mark their blocks, then the blocks its grants handed
        out only to be read must have been written to their end (this step's writes count)."""
        for f in facts:
            if f.real is None:
                continue
            g = self.groups[f.group_id]
            if f.spans is not None and (f.real == f.expected).all():  # the usual: a block at a time
                at, last, ok = f.spans.block, f.spans.last, written_spans(g, f.spans)
            else:
                at, last = f.block, f.pos
                ok = (f.real == f.expected) & f.in_row & g.ownable(at)
                if f.tok_known is not None:
                    ok &= f.tok_known
            if ok.any():
                g.mark_written(at[ok], last[ok] % g.block_size)
        for g, blocks, readers, at in self.pending_reads:
            fill = g.fill[blocks]
            known = fill != UNKNOWN_FILL
            _count(cov.checks, Check.READ_WRITTEN, int(known.sum()))
            _count(cov.unchecked, Unchecked.FILL_UNKNOWN, int((~known).sum()))
            self._per_reader(
                step,
                ViolationKind.UNWRITTEN_READ,
                g,
                unwritten_failures(fill, g.block_size),
                readers,
                lambda i, blocks=blocks, at=at, fill=fill, g=g: (
                    f"reads block {blocks[i]} at row position {at[i]} "
                    f"as computed (a prefix hit), but executed steps wrote {fill[i]} of its {g.block_size} slots since "
                    "it was handed out"
                ),
                out,
            )
        self.pending_reads.clear()

    def _req_of_row(self, row: int) -> str:
        index = np.flatnonzero(self.row_of == row)
        return self.req_id(int(index[0])) if index.size else f"row {row}"

    # -- step plan ------------------------------------------------------------------------
    def check_plan(self, step: int, plan: StepPlan, out: list[Violation], cov: Coverage) -> None:
        """The plan against the tables, by the rules of checks.py; each failure reported."""
        facts = self.plan_facts(plan, cov)
        self._report(step, facts.requests, facts.groups, facts.indices, facts.rows, plan, out)
        self.settle_reads(step, facts.groups, out, cov)
        for dp in plan.draft_writes or ():
            self._check_draft_pass(step, dp, facts.indices, facts.rows, facts.known, out, cov)

    def plan_facts(self, plan: StepPlan, cov: Coverage) -> PlanFacts:
        """The facts the rules of checks.py judge a plan by, beside these tables; what cannot be judged is
        counted in `cov` (the one place they are built for a step: the checks and `kvledger query` read them)."""
        indices = unpack_i32(plan.req_indices)
        num_tokens = unpack_i32(plan.num_tokens)
        first_pos = unpack_i32(plan.first_positions)
        rows = self._rows(indices)
        known = rows >= 0
        all_known = bool(known.all())
        if not all_known:
            cov.unchecked[Unchecked.UNKNOWN_REQUEST] += int((~known).sum())
            rows = np.where(known, rows, 0)
        n_known = int(known.sum())
        cov.checks[Check.POSITION] += n_known
        requests = RequestFacts(
            first_pos, num_tokens, self.computed[rows], self.scheduled[rows], None if all_known else known
        )
        tok_req, pos = token_positions(first_pos, num_tokens)
        total = pos.size
        tok_known = None if all_known else (known if tok_req is None else known[tok_req])

        groups: list[GroupFacts] = []
        for gp in plan.groups:
            gid = gp.group_id
            if gid >= len(self.groups):
                cov.unchecked[Unchecked.UNKNOWN_GROUP] += 1
                continue
            g = self.groups[gid]
            facts = GroupFacts(gid, g.block_size)
            if not g.kind.addresses_slots:
                cov.unchecked[group_unchecked(g.kind)] += 1
                if g.kind != KvGroupKind.MAMBA:
                    continue
                cov.checks[Check.STATE_ROWS] += n_known  # the rows its kernels index state by can be compared
            else:
                slots = expand_slot_runs(gp.slot_runs)
                num_real = gp.num_real
                if slots.size != num_real + gp.num_padding:
                    cov.unchecked[Unchecked.MALFORMED_PLAN] += 1
                    continue
                cov.checks[Check.WRITE] += n_known
                cov.checks[Check.READ] += n_known
                cov.checks[Check.PADDING] += 1
                if num_real < total:
                    cov.unchecked[Unchecked.TOKENS_WITHOUT_SLOT] += total - num_real
                n = min(num_real, total)
                # Real entries beyond the scheduled tokens are owned by nobody, like padding.
                self._token_facts(facts, g, slots[:n], rows, first_pos, num_tokens, tok_req, tok_known, pos)
                facts.padding = slots[n:]
            self._read_facts(facts, g, gp, rows, None if all_known else known, cov)
            groups.append(facts)
        return PlanFacts(indices, rows, known, requests, groups)

    def _token_facts(self, facts: GroupFacts, g: GroupTable, real, rows, first, ntok, tok_req, tok_known, pos) -> None:
        """Each token's facts from its request's (`rows`, `first`, `ntok`: per request); the first
        `real.size` tokens, those the plan gives a slot."""
        expected, in_row, block, spans = slot_targets(g.table, rows, g.lens[rows], first, ntok, g.block_size)
        n = real.size
        if n < pos.size:
            pos = pos[:n]
            tok_req = tok_req[:n] if tok_req is not None else None
            tok_known = tok_known[:n] if tok_known is not None else None
        facts.expected, facts.in_row, facts.block = expected[:n], in_row[:n], block[:n]
        facts.real, facts.tok_known, facts.tok_req, facts.pos = real, tok_known, tok_req, pos
        facts.shared = shared_tokens(g, spans)[:n]
        if n == pos.size and tok_known is None:
            facts.spans = spans

    def _read_facts(self, facts: GroupFacts, g: GroupTable, gp: GroupPlan, rows, known, cov: Coverage) -> None:
        row_lens = unpack_i32(gp.row_lens)
        digests = unpack_digests(gp.row_digests)
        if row_lens.size != rows.size or digests.size != rows.size:
            cov.unchecked[Unchecked.MALFORMED_PLAN] += 1
            return
        facts.plan_lens, facts.plan_digests = row_lens, digests
        facts.ledger_lens, facts.ledger_digests, facts.known = g.lens[rows], g.digests[rows], known

    def _report(self, step, requests: RequestFacts | None, groups: list[GroupFacts], indices, rows, plan, out) -> None:
        """Each failure the rules find, as a violation; in rule order, per group."""
        per_request, per_group = plan_failures(requests, groups)
        for name, bad in per_request.items():
            if bad.any():
                self._reporters[name](self, step, requests, bad, indices, rows, out)
        for facts, masks in zip(groups, per_group, strict=True):
            g = self.groups[facts.group_id]
            for name, bad in masks.items():
                if bad.any():
                    self._group_reporters[name](self, step, g, facts, bad, indices, rows, plan, out)

    # -- reporters: what a failing rule says (one per rule of checks.py) --------------------------
    def _report_positions(self, step, r: RequestFacts, bad, indices, rows, out) -> None:
        for i in np.flatnonzero(bad).tolist():
            out.append(
                self._violation(
                    ViolationKind.WRITE_TARGET_MISMATCH,
                    step,
                    f"plan writes {r.ntok[i]} token(s) from position {r.first[i]}; scheduler handed "
                    f"{r.scheduled[i]} token(s) from computed position {r.computed[i]}",
                    self.req_id(int(indices[i])),
                )
            )

    def _report_wrong_writes(self, step, g: GroupTable, f: GroupFacts, wrong, indices, rows, plan, out):
        bs = g.block_size
        wrong_toks = np.flatnonzero(wrong)
        reqs = wrong_toks if f.tok_req is None else f.tok_req[wrong_toks]
        for r in np.unique(reqs).tolist():
            toks = wrong_toks[reqs == r]
            t = int(toks[0])
            req_id = self.req_id(int(indices[r]))
            exp = f"slot {f.expected[t]}" if f.in_row[t] else "a slot past the end of its row"
            out.append(
                self._violation(
                    ViolationKind.WRITE_TARGET_MISMATCH,
                    step,
                    f"{toks.size} token(s) written to the wrong slot; first: expected {exp}, actual slot {f.real[t]}",
                    req_id,
                    g.group_id,
                )
            )
            actual = f.real[toks]
            blocks = actual[actual >= 0] // bs
            outside = blocks[~g.in_pool(blocks)]
            if outside.size:
                out.append(
                    self._violation(
                        ViolationKind.BLOCK_OUT_OF_RANGE,
                        step,
                        f"slot mapping writes block {int(outside[0])}, outside the pool of {g.num_blocks} blocks",
                        req_id,
                        g.group_id,
                    )
                )
            inside = blocks[g.in_pool(blocks)]
            foreign = inside[~np.isin(inside, g.row(int(rows[r])))]
            if foreign.size:
                b = int(foreign[0])
                if b == NULL_BLOCK:
                    whose = "the null block"
                elif g.send_hold[b] > 0:
                    whose = "held by a pending KV send"
                elif g.recv_hold[b] > 0:
                    whose = "held by a pending KV receive"
                elif g.hold_count[b] == 0:
                    whose = "free (no live request holds it)"
                else:
                    whose = "held by another live request"
                out.append(
                    self._violation(
                        ViolationKind.FOREIGN_BLOCK_WRITE,
                        step,
                        f"slot mapping writes block {b}, which is {whose}",
                        req_id,
                        g.group_id,
                    )
                )

    def _report_null_writes(self, step, g: GroupTable, f: GroupFacts, null, indices, rows, plan, out):
        for t in _first_token_per_request(np.flatnonzero(null), f.tok_req):
            out.append(
                self._violation(
                    ViolationKind.FOREIGN_BLOCK_WRITE,
                    step,
                    f"writes position {f.pos[t]} into the null block (the ledger's row has block 0 there)",
                    self.req_id(int(indices[_req(t, f.tok_req)])),
                    g.group_id,
                )
            )

    def _report_padding(self, step, g: GroupTable, f: GroupFacts, bad, indices, rows, plan, out) -> None:
        stray = f.padding[bad]
        out.append(
            self._violation(
                ViolationKind.UNOWNED_WRITE,
                step,
                f"{stray.size} padding slot(s) write real blocks; first slot {int(stray[0])} (block "
                f"{int(stray[0]) // g.block_size}); no scheduled token owns them",
                group=g.group_id,
            )
        )

    def _report_reads(self, step, g: GroupTable, f: GroupFacts, bad, indices, rows, plan, out) -> None:
        """`plan`'s full rows, when it carries them, name the first block that differs."""
        gp = next((gp for gp in plan.groups if gp.group_id == g.group_id), None) if plan is not None else None
        packed = gp.rows if gp is not None else None
        full = unpack_i32(packed) if packed is not None else None
        offsets = np.cumsum(f.plan_lens) - f.plan_lens
        for i in np.flatnonzero(bad).tolist():
            ledger_row = g.row(int(rows[i]))
            n = f.plan_lens[i]
            detail = f"attention reads a row of {n} block(s); the ledger has {ledger_row.size}"
            if full is not None:
                actual = full[offsets[i] : offsets[i] + n]
                diff = np.flatnonzero(actual[: ledger_row.size] != ledger_row[: actual.size])
                if diff.size:
                    j = int(diff[0])
                    detail += f"; first difference at position {j}: expected block {ledger_row[j]}, read {actual[j]}"
            elif n == ledger_row.size:
                detail += " with different block ids (digest differs)"
            out.append(
                self._violation(
                    ViolationKind.READ_TARGET_MISMATCH, step, detail, self.req_id(int(indices[i])), g.group_id
                )
            )

    def _report_shared_writes(self, step, g: GroupTable, f: GroupFacts, bad, indices, rows, plan, out) -> None:
        for t in _first_token_per_request(np.flatnonzero(bad), f.tok_req):
            b = int(f.block[t])
            holders = [r for r in self.holders_of(b) if r != self.req_id(int(indices[_req(t, f.tok_req)]))]
            out.append(
                self._violation(
                    ViolationKind.SHARED_BLOCK_WRITE,
                    step,
                    f"writes position {f.pos[t]} into block {b}, full and shared: "
                    f"{', '.join(holders[:4]) or 'another live request'} read(s) it",
                    self.req_id(int(indices[_req(t, f.tok_req)])),
                    g.group_id,
                )
            )

    _reporters: ClassVar[dict] = {"positions": _report_positions}
    _group_reporters: ClassVar[dict] = {
        "writes": _report_wrong_writes,
        "null_writes": _report_null_writes,
        "padding": _report_padding,
        "reads": _report_reads,
        "shared_writes": _report_shared_writes,
    }

    # -- drafter passes --------------------------------------------------------------------------
    def _check_draft_pass(self, step, dp: DraftPass, indices, rows, known, out, cov: Coverage) -> None:
        """A drafter pass writes the drafter's own KV through the target group's rows: the same
        slot formula, at positions the scheduler reserved (its lookahead included)."""
        gid = dp.group_id
        if gid >= len(self.groups) or not self.groups[gid].kind.addresses_slots:
            unknown = gid >= len(self.groups)
            cov.unchecked[Unchecked.DRAFT_UNKNOWN_GROUP if unknown else Unchecked.DRAFT_UNCHECKED_GROUP] += 1
            return
        g = self.groups[gid]
        slots = expand_slot_runs(dp.slot_runs)
        num_tokens, first = unpack_i32(dp.num_tokens), unpack_i32(dp.first_positions)
        n = dp.num_real
        if not (num_tokens.size == first.size and num_tokens.size in (0, indices.size)) or (
            slots.size != n + dp.num_padding or n != int(num_tokens.sum())
        ):
            cov.unchecked[Unchecked.MALFORMED_PLAN] += 1
            return
        found: list[Violation] = []
        facts = GroupFacts(gid, g.block_size, padding=slots[n:])
        cov.checks[Check.DRAFT_PADDING] += 1
        if num_tokens.size:  # else a pass serving no request (dummy run): all padding
            self._draft_facts(
                step, facts, g, dp.pass_index, indices, rows, known, num_tokens, first, slots[:n], found, cov
            )
        self._report(step, None, [facts], indices, rows, None, found)
        # The target's rules, said of the drafter's pass (its own KV, the same blocks).
        out += [msgspec.structs.replace(v, detail=f"drafter pass {dp.pass_index}: {v.detail}") for v in found]

    def _draft_facts(self, step, facts, g: GroupTable, k, indices, rows, known, num_tokens, first, real, out, cov):
        tok_req, pos = token_positions(first, num_tokens)
        if tok_req is None:
            tok_req = np.arange(num_tokens.size)
        # vLLM clamps a later pass's position past the model's length to 0 and skips its write.
        clamped = (pos == 0) & (real == -1) if k > 0 else np.zeros(real.size, bool)
        tok_known = known[tok_req] & ~clamped
        n_known = int(known.sum())
        cov.checks[Check.DRAFT_POSITION] += n_known
        cov.checks[Check.DRAFT_WRITE] += n_known
        lo, hi = self.computed[rows] + k, self.computed[rows] + self.scheduled[rows] - 1 + k
        outside = draft_position_failures(pos, lo[tok_req], hi[tok_req], tok_known)
        for t in _first_token_per_request(np.flatnonzero(outside), tok_req):
            r = int(tok_req[t])
            out.append(
                self._violation(
                    ViolationKind.WRITE_TARGET_MISMATCH,
                    step,
                    f"writes position {pos[t]}; the scheduler handed {self.scheduled[rows[r]]} token(s) from "
                    f"computed position {self.computed[rows[r]]}, so this pass may write positions {lo[r]}..{hi[r]}",
                    self.req_id(int(indices[r])),
                )
            )
        self._token_facts(facts, g, real, rows, first, num_tokens, tok_req, tok_known, pos)

    # -- connector and snapshots ---------------------------------------------------------
    def apply_connector(self, event: ConnectorEvent, cov: Coverage) -> list[Violation]:
        """A pending transfer holds its blocks from its intent to its end (one rule for both sides): a
        send reads them, a receive writes them, and a grant that writes them meanwhile is a foreign write.
        A send that completes after such a grant shipped the other request's KV: `send_block_reused`."""
        tid, kind = event.transfer_id, event.kind
        if tid is None:
            return []
        for receive, pending, starts, ends in (
            (False, self.pending_sends, ConnectorKind.SEND_INTENT, kind.ends_send),
            (True, self.pending_recvs, ConnectorKind.RECV_INTENT, kind.ends_recv),
        ):
            if kind == starts and tid not in pending:
                blocks = [unpack_i32(b).astype(np.int64) for b in event.block_ids]
                self.hold_transfer(receive, tid, TransferHold(event.req_id, event.step, blocks))
                if receive and self.dispatched:  # a load on an async rank: judged at its step's input
                    self.loads.append((event.step, event.req_id, blocks))
            elif ends and tid in pending:
                hold = pending.pop(tid)
                self._release(receive, hold)
                if kind == ConnectorKind.RECV_DONE:  # written by the transfer, from a prefix known elsewhere
                    for g, b in zip(self.groups, hold.blocks, strict=False):
                        g.mark_received(b[g.ownable(b)])
                if kind == ConnectorKind.SEND_DONE:
                    cov.checks[Check.SEND_HOLD] += 1
                    if hold.reused is not None:
                        return [self._shipped(tid, hold, event.step)]
        return []

    def hold_transfer(self, receive: bool, tid: str, hold: TransferHold) -> None:
        """A transfer now pending: its blocks are held from here to its end."""
        (self.pending_recvs if receive else self.pending_sends)[tid] = hold
        for g, b in zip(self.groups, hold.blocks, strict=False):
            g.hold_for_transfer(receive, b, +1)

    def _release(self, receive: bool, hold: TransferHold) -> None:
        for g, b in zip(self.groups, hold.blocks, strict=False):
            g.hold_for_transfer(receive, b, -1)

    def _shipped(self, tid: str, hold: TransferHold, done_step: int) -> Violation:
        reuse = hold.reused
        detail = (
            f"transfer {tid}: block {reuse.block} of its pending send (intent at step {hold.intent_step}) "
            f"was handed to request {reuse.req_id} at step {reuse.step}; the send completed at step {done_step}"
        )
        return self._violation(ViolationKind.SEND_BLOCK_REUSED, reuse.step, detail, hold.req_id, reuse.group)

    def forget_transfers(self) -> int:
        """Release every pending transfer's blocks (their ends may have been lost); how many there were."""
        n = len(self.pending_sends) + len(self.pending_recvs)
        for receive, pending in ((False, self.pending_sends), (True, self.pending_recvs)):
            for hold in pending.values():
                self._release(receive, hold)
            pending.clear()
        return n

    def load_snapshot(self, snap: Snapshot) -> None:
        """Replace the rows with a snapshot's (transfers are not in snapshots: those seen since the gap stay)."""
        for req_id in list(self.index_of):
            self._drop(req_id)
        for g in self.groups:  # events were missed: what any block holds is not known any more
            g.forget_content()
        self.pending_reads.clear()
        self.dispatched.clear()  # steps in flight before the snapshot: not known
        self.loads.clear()
        for req in snap.requests:
            row = self._new_row(req.req_index, req.req_id)
            self.computed[row] = req.num_computed_tokens
            self.scheduled[row] = 0
            for g, data in zip(self.groups, req.block_ids, strict=False):
                blocks = unpack_i32(data)
                g.append_many(np.array([row]), np.array([blocks.size]), blocks)

    def request_rows(self, req_id: str) -> list[list[int]] | None:
        """The block-table rows of a live request, per group (time-travel queries)."""
        index = self.index_of.get(req_id)
        if index is None:
            return None
        row = int(self.row_of[index])
        return [g.row(row).tolist() for g in self.groups]


def _in_order(rows: np.ndarray) -> list[int]:
    """The distinct rows of `rows` in the order they first appear, the order of the step's requests: a
    report's order never depends on the row numbers, which the fast path assigns its own way."""
    if rows.size == 0:  # the common case: nothing to report
        return []
    _, first = np.unique(rows, return_index=True)
    return rows[np.sort(first)].tolist()


def _count(counter, key, n: int) -> None:
    """Coverage counts only what happened: a reason counted zero times is not in the coverage."""
    if n:
        counter[key] += n


def shared_tokens(g: GroupTable, spans: TokenSpans) -> np.ndarray:
    """Per token: its ledger block is full and held by two live requests or more (see
    `GroupTable.sealed_and_shared`); blocks outside the pool and the null block are nobody's."""
    shared = np.zeros(spans.block.size, bool)
    inside = g.ownable(spans.block)
    shared[inside] = g.sealed_and_shared(spans.block[inside])
    return np.repeat(shared, spans.count)


def written_spans(g: GroupTable, spans: TokenSpans) -> np.ndarray:
    """The spans whose tokens land, inside their row, in a block a write fills: what a plan's writes
    mark (a clean plan's; the fast path judges its runs by the same)."""
    return spans.in_row & g.ownable(spans.block)


def _req(token: int, tok_req) -> int:
    return token if tok_req is None else int(tok_req[token])


def _first_token_per_request(tokens: np.ndarray, tok_req) -> list[int]:
    if tok_req is None:
        return tokens.tolist()
    _, first = np.unique(tok_req[tokens], return_index=True)
    return tokens[first].tolist()


def _byte_span(pages, pair: int, block: int) -> str:
    """Where a block's page of one page pair lies: `first..last` bytes of its allocation."""
    start = int(pages.start[pair] + block * pages.stride[pair])
    return f"bytes {start}..{start + int(pages.size[pair]) - 1} of allocation {int(pages.tensor[pair])}"
