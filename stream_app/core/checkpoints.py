"""The core's state as plain data: the typed checkpoint records (`kvledger.schemas.checkpoint`) and back.

A checkpoint holds what cannot be recomputed: each rank's sequence, its live
rows and pending sends, the steps waiting for ranks, the transfers. Who holds
each block and every row's digest are rebuilt from the rows, so a checkpoint
grows with the live requests, not with the pool. Ranks of one TP/PP group get
the same scheduler output: a rank whose tables equal an earlier rank's is
stored as a reference to it.

Reading a record builds the state field by field; nothing named in it is ever
looked up or run. A record that does not describe a consistent state raises
`StateError`. The records are encoded and decoded at the edge
(`kvledger.schemas.checkpoint.encode`, `decode`): none of the Avro dicts comes
here.
"""

from __future__ import annotations

import numpy as np

from kvledger.schemas import checkpoint as ck
from kvledger.schemas.events import RankInfo, TransferPrefix
from kvledger.schemas.packing import pack_i32, unpack_i32
from kvledger.stream_app.core.declarations import Declared, content_voided
from kvledger.stream_app.core.ledger import Ledger, TrackedRank
from kvledger.stream_app.core.rank_tables import RankTables, TransferHold
from kvledger.stream_app.core.step_groups import LeadStep, StepGroup
from kvledger.stream_app.core.transfers import (
    PendingRecv,
    PendingTransfers,
    Side,
    Transfer,
    TransferJoin,
)
from kvledger.stream_app.core.violations import Coverage, RankKey


class StateError(ValueError):
    """A checkpoint record that does not describe a state the core can hold."""


# -- small pieces ---------------------------------------------------------------------------------
def coverage_record(cov: Coverage) -> ck.Coverage:
    return ck.Coverage(checks=dict(cov.checks), unchecked=dict(cov.unchecked))


def _coverage_into(cov: Coverage, rec: ck.Coverage) -> None:
    cov.checks.update(rec.checks)
    cov.unchecked.update(rec.unchecked)


def _i32(values) -> bytes:
    return pack_i32(np.asarray(values, np.int64))


def _ints(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise StateError(f"a packed int32 column of {len(data)} bytes")
    return unpack_i32(data).astype(np.int64)


# -- a rank's tables ------------------------------------------------------------------------------
def _same_tables(a: RankTables, b: RankTables) -> bool:
    if a.index_of != b.index_of or a.num_rows != b.num_rows or a.free_rows != b.free_rows:
        return False
    if (
        a.pending_sends.keys() != b.pending_sends.keys()
        or a.pending_recvs.keys() != b.pending_recvs.keys()
        or len(a.groups) != len(b.groups)
    ):
        return False
    rows = np.asarray([a.row_of[i] for i in a.index_of.values()], np.int64)
    if not (
        np.array_equal(a.computed[rows], b.computed[rows]) and np.array_equal(a.scheduled[rows], b.scheduled[rows])
    ):
        return False
    n = a.num_rows
    for ga, gb in zip(a.groups, b.groups, strict=True):
        if not (np.array_equal(ga.lens[:n], gb.lens[:n]) and np.array_equal(ga.released[:n], gb.released[:n])):
            return False
        width = int(ga.lens[:n].max(initial=0))
        if not np.array_equal(ga.table[:n, :width], gb.table[:n, :width]):
            return False
    return all(
        _same_hold(pending[t], b_pending[t])
        for pending, b_pending in ((a.pending_sends, b.pending_sends), (a.pending_recvs, b.pending_recvs))
        for t in pending
    )


def _same_hold(a: TransferHold, b: TransferHold) -> bool:
    return (
        (a.req_id, a.intent_step, a.reused) == (b.req_id, b.intent_step, b.reused)
        and len(a.blocks) == len(b.blocks)
        and all(np.array_equal(x, y) for x, y in zip(a.blocks, b.blocks, strict=True))
    )


def pack_ids(blocks: np.ndarray) -> tuple[bytes, int]:
    """Block ids as little-endian unsigned integers of the fewest bytes (1 to 4) that hold the largest;
    8-byte signed ones when some id is negative or wider (a faulty scheduler's, kept as handed out)."""
    top = int(blocks.max(initial=0))
    width = max(1, (top.bit_length() + 7) // 8)
    if (blocks.size and int(blocks.min()) < 0) or width > 4:
        return blocks.astype("<i8").tobytes(), 8
    return np.ascontiguousarray(blocks.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :width]).tobytes(), width


def unpack_ids(data: bytes, width: int) -> np.ndarray:
    if width not in (1, 2, 3, 4, 8) or len(data) % width:
        raise StateError(f"{len(data)} bytes of block ids, {width} bytes each")
    if width == 8:
        return np.frombuffer(data, "<i8").astype(np.int64)
    wide = np.zeros((len(data) // width, 4), np.uint8)
    wide[:, :width] = np.frombuffer(data, np.uint8).reshape(-1, width)
    return wide.view("<u4").ravel().astype(np.int64)


def table_record(state: RankTables) -> ck.Table:
    n = state.num_rows
    ids = list(state.index_of)
    indices = np.fromiter(state.index_of.values(), np.int64, len(ids))
    rows = state.row_of[indices]
    requests = ck.LiveRequests(
        req_ids=ids,
        req_indices=_i32(indices),
        rows=_i32(rows),
        num_computed_tokens=_i32(state.computed[rows]),
        num_scheduled_tokens=_i32(state.scheduled[rows]),
    )
    groups = []
    for g in state.groups:
        lens = g.lens[:n]
        # Row after row: a boolean mask of the filled cells keeps the order of the rows.
        filled = np.arange(g.table.shape[1]) < lens[:, None]
        blocks, width = pack_ids(g.table[:n][filled])
        groups.append(ck.GroupRows(lens=_i32(lens), released=_i32(g.released[:n]), blocks=blocks, id_bytes=width))
    sends, recvs = (
        [_hold_record(t, hold) for t, hold in pending.items()] for pending in (state.pending_sends, state.pending_recvs)
    )
    return ck.Table(
        requests=requests,
        num_rows=n,
        free_rows=_i32(state.free_rows),
        groups=groups,
        pending_sends=sends,
        pending_recvs=recvs,
    )


def _hold_record(tid: str, hold: TransferHold) -> ck.PendingSend:
    blocks = [_i32(b) for b in hold.blocks]
    return ck.PendingSend(tid, blocks, req_id=hold.req_id, intent_step=hold.intent_step, reused=hold.reused)


def _hold_from_record(rec: ck.PendingSend) -> TransferHold:
    return TransferHold(rec.req_id, rec.intent_step, [_ints(b) for b in rec.block_ids], rec.reused)


def table_from_record(key: RankKey, info: RankInfo, rec: ck.Table) -> RankTables:
    state = RankTables(key, info)
    state.content_voided = content_voided(info)
    if len(rec.groups) != len(state.groups):
        raise StateError(f"{key}: tables of {len(rec.groups)} groups for a rank of {len(state.groups)}")
    n = rec.num_rows
    state.num_rows = n
    state.grow_rows(n)
    state.free_rows = _ints(rec.free_rows).tolist()
    reqs = rec.requests
    ids = reqs.req_ids
    columns = [_ints(c) for c in (reqs.req_indices, reqs.rows, reqs.num_computed_tokens, reqs.num_scheduled_tokens)]
    if any(c.size != len(ids) for c in columns):
        raise StateError(f"{key}: request columns of different lengths")
    indices, rows, computed, scheduled = columns
    if ((rows < 0) | (rows >= n) | (indices < 0)).any() or len(set(ids)) != len(ids):
        raise StateError(f"{key}: requests outside the {n} rows, or named twice")
    size = max(state.row_of.size, int(indices.max(initial=0)) + 1)
    state.row_of = np.full(size, -1, np.int64)
    state.row_of[indices] = rows
    state.index_of = dict(zip(ids, indices.tolist(), strict=True))
    state.req_id_of = dict(zip(indices.tolist(), ids, strict=True))
    state.computed[rows], state.scheduled[rows] = computed, scheduled
    for g, grec in zip(state.groups, rec.groups, strict=True):
        lens, released = _ints(grec.lens), _ints(grec.released)
        blocks = unpack_ids(grec.blocks, grec.id_bytes)
        if lens.size != n or released.size != n or int(lens.sum()) != blocks.size or (lens < 0).any():
            raise StateError(f"{key}: group {g.group_id} rows do not match their lengths")
        if ((released < 0) | (released > lens)).any():
            raise StateError(f"{key}: group {g.group_id} releases more than a row holds")
        g.load_rows(lens, released, blocks)
    for receive, transfers in ((False, rec.pending_sends), (True, rec.pending_recvs)):
        for transfer in transfers:
            state.hold_transfer(receive, transfer.transfer_id, _hold_from_record(transfer))
    return state


# -- the ledger -----------------------------------------------------------------------------------
def _rank_steps(values: dict[tuple[int, int], int]) -> list[ck.RankStep]:
    return [ck.RankStep(tp=tp, pp=pp, step=step) for (tp, pp), step in values.items()]


def _step_group_record(dp: int, group: StepGroup) -> ck.StepGroup:
    return ck.StepGroup(
        dp=dp,
        expected=[ck.RankStep(tp=tp, pp=pp, step=-1) for tp, pp in sorted(group.expected)],
        pending=[
            ck.PendingStep(
                step=step,
                reports=[
                    ck.RankReport(tp=tp, pp=pp, input_fingerprint=fi, plan_fingerprint=fp, clean=clean)
                    for (tp, pp), (fi, fp, clean) in entry.items()
                ],
            )
            for step, entry in group.pending.items()
        ],
        last_step=_rank_steps(group.last_step),
        missing_since=_rank_steps(group.missing_since),
        lost=[
            ck.LostSteps(tp=tp, pp=pp, after=after, before=None if before == float("inf") else int(before))
            for (tp, pp), spans in group.lost.items()
            for after, before in spans
        ],
        settled_through=group.settled_through,
        lead_steps=[
            ck.LeadStep(
                step=step,
                input_fingerprint=ls.input_fp,
                plan_fingerprint=ls.plan_fp,
                checked=ls.checked,
                found_input=list(ls.found_input),
                found_plan=list(ls.found_plan),
            )
            for step, ls in group.lead_steps.items()
        ],
        early=[
            ck.EarlyPlan(step=step, tp=tp, pp=pp, plan=plan)
            for step, plans in group.early.items()
            for (tp, pp), plan in plans.items()
        ],
    )


def _step_group_from_record(rec: ck.StepGroup) -> StepGroup:
    group = StepGroup(frozenset((r.tp, r.pp) for r in rec.expected))
    for pending in rec.pending:
        group.pending[pending.step] = {
            (r.tp, r.pp): (r.input_fingerprint, r.plan_fingerprint, r.clean) for r in pending.reports
        }
    group.last_step = {(r.tp, r.pp): r.step for r in rec.last_step}
    group.missing_since = {(r.tp, r.pp): r.step for r in rec.missing_since}
    for r in rec.lost:
        before = float("inf") if r.before is None else r.before
        group.lost.setdefault((r.tp, r.pp), []).append((r.after, before))
    group.settled_through = rec.settled_through
    for r in rec.lead_steps:
        ls = LeadStep(r.input_fingerprint, r.plan_fingerprint, r.checked, list(r.found_input), list(r.found_plan))
        group.lead_steps[r.step] = ls
    for r in rec.early:
        group.early.setdefault(r.step, {})[(r.tp, r.pp)] = r.plan
    return group


def _slot_record(key: RankKey, slot: TrackedRank, table: ck.Table | None) -> ck.RankSlot:
    return ck.RankSlot(
        rank=ck.Rank.of(key),
        incarnation=slot.incarnation,
        next_seq=slot.next_seq,
        info=slot.info,
        desynced=slot.desynced,
        last_step=slot.last_step,
        events_dropped=slot.events_dropped,
        gap_after_step=slot.gap_after_step,
        closed=slot.closed,
        closed_step=slot.closed_step,
        table=table,
    )


def _transfers_record(key: RankKey, state: PendingTransfers) -> ck.RankTransfers:
    return ck.RankTransfers(
        rank=ck.Rank.of(key),
        block_sizes=list(state.block_sizes),
        recvs=[
            ck.PendingRecv(
                req_id=req_id,
                transfer_id=r.transfer_id,
                intent_step=r.intent_step,
                blocks=[_i32(b) for b in r.blocks],
                done_step=r.done_step,
                failed_step=r.failed_step,
            )
            for req_id, r in state.recvs.items()
        ],
    )


def _transfers_from_record(rec: ck.RankTransfers) -> PendingTransfers:
    state = PendingTransfers(block_sizes=list(rec.block_sizes))
    for r in rec.recvs:
        blocks = [_ints(b).tolist() for b in r.blocks]
        state.recvs[r.req_id] = PendingRecv(r.transfer_id, r.intent_step, blocks, r.done_step, r.failed_step)
    return state


def ledger_checkpoint(
    ledger: Ledger,
    engine_id: str,
    *,
    next_offset: int = 0,
    partition: int | None = None,
    issued: list[ck.IssuedCount] | None = None,
) -> ck.EngineCheckpoint:
    """The EngineCheckpoint of `ledger` (one engine's: the worker's ledgers are), with what the worker
    keeps beside it: the offset it covers, its partition, the violation ids it issued."""
    if ledger.transfer_join is not None:
        raise StateError("a ledger that joins transfers itself is not checkpointed (the worker's never does)")
    slots, written = [], []  # written: (slot index, rank state) of the tables stored in full
    for key, slot in ledger.ranks.items():
        table = None
        if slot.state is not None:
            same = next((i for i, state in written if _same_tables(state, slot.state)), None)
            if same is None:
                written.append((len(slots), slot.state))
                table = table_record(slot.state)
            else:
                table = _same_as(same)
        slots.append(_slot_record(key, slot, table))
    return ck.EngineCheckpoint(
        engine_id=engine_id,
        next_offset=next_offset,
        partition=partition,
        issued=issued if issued is not None else [],
        events=ledger.events,
        steps=ledger.steps,
        coverage=coverage_record(ledger.coverage),
        rank_window=ledger.rank_window,
        ranks=slots,
        step_groups=[_step_group_record(dp, group) for (_, dp), group in ledger.step_groups.items()],
        transfer_use=[_transfers_record(k, s) for k, s in ledger.transfer_use.ranks.items()],
    )


def _same_as(index: int) -> ck.Table:
    """Tables stored as those of the rank at `index` in `ranks`: every other field empty."""
    empty = ck.LiveRequests(req_ids=[], req_indices=b"", rows=b"", num_computed_tokens=b"", num_scheduled_tokens=b"")
    return ck.Table(same_as=index, requests=empty, num_rows=0, free_rows=b"", groups=[], pending_sends=[])


def ledger_of(rec: ck.EngineCheckpoint) -> Ledger:
    """The ledger an EngineCheckpoint describes; StateError if it describes none."""
    engine_id = rec.engine_id
    ledger = Ledger(rank_window=rec.rank_window, join_transfers=False)
    ledger.events, ledger.steps = rec.events, rec.steps
    _coverage_into(ledger.coverage, rec.coverage)
    states: list[RankTables | None] = []
    for srec in rec.ranks:
        key = srec.rank.key
        if key.engine_id != engine_id:
            raise StateError(f"rank {key} in the checkpoint of engine {engine_id}")
        slot = TrackedRank(srec.incarnation, srec.next_seq, info=srec.info)
        slot.desynced, slot.last_step = srec.desynced, srec.last_step
        slot.events_dropped, slot.gap_after_step = srec.events_dropped, srec.gap_after_step
        slot.closed_step = srec.closed_step  # `closed` is written for readers; it follows from this
        slot.declared = Declared.of(slot.info) if slot.info is not None else None
        table = srec.table
        if table is not None and slot.info is None:
            raise StateError(f"{key}: tables without a RankInfo")
        if table is None:
            slot.state = None
        elif table.same_as is None:
            slot.state = table_from_record(key, slot.info, table)
        else:
            same = table.same_as
            if not (0 <= same < len(states)) or states[same] is None:
                raise StateError(f"{key}: tables the same as rank #{same}, which has none")
            slot.state = _copy_tables(states[same], key, slot.info)
        states.append(slot.state)
        ledger.ranks[key] = slot
    ledger._keys = {(k.engine_id, k.dp, k.tp, k.pp): k for k in ledger.ranks}
    for grec in rec.step_groups:
        ledger.step_groups[(engine_id, grec.dp)] = _step_group_from_record(grec)
    for trec in rec.transfer_use:
        ledger.transfer_use.ranks[trec.rank.key] = _transfers_from_record(trec)
    return ledger


def _copy_tables(source: RankTables, key: RankKey, info: RankInfo) -> RankTables:
    """Another rank's own copy of identical tables (each rank's evolve on their own afterwards)."""
    return table_from_record(key, info, table_record(source))


# -- the transfer join ----------------------------------------------------------------------------
def _side_record(side: Side) -> ck.Side:
    return ck.Side(
        rank=ck.Rank.of(side.rank),
        role=side.role,
        req_id=side.req_id,
        first_step=side.first_step,
        intent_step=side.intent_step,
        blocks=None if side.blocks is None else [_i32(b) for b in side.blocks],
        num_tokens=side.num_tokens,
        remote_engine_id=side.remote_engine_id,
        outcome=side.outcome,
        done_step=side.done_step,
        digest=side.digest,
        stuck=side.stuck,
        open_counted=side.open_counted,
        peer_clock=side.peer_clock,
        seen=[ck.SeenEvent(kind=kind, step=step) for kind, step in sorted(side.seen)],
        prefix_block_sizes=None if side.prefix is None else list(side.prefix.block_sizes),
        prefix_chains=None if side.prefix is None else list(side.prefix.chains),
        prefix_step=side.prefix_step,
    )


def _side_from_record(rec: ck.Side) -> Side:
    return Side(
        rec.rank.key,
        rec.role,
        req_id=rec.req_id,
        first_step=rec.first_step,
        intent_step=rec.intent_step,
        blocks=None if rec.blocks is None else [_ints(b).tolist() for b in rec.blocks],
        num_tokens=rec.num_tokens,
        remote_engine_id=rec.remote_engine_id,
        outcome=rec.outcome,
        done_step=rec.done_step,
        digest=rec.digest,
        stuck=rec.stuck,
        open_counted=rec.open_counted,
        peer_clock=rec.peer_clock,
        seen={(s.kind, s.step) for s in rec.seen},
        prefix=None if rec.prefix_chains is None else TransferPrefix(rec.prefix_block_sizes or [], rec.prefix_chains),
        prefix_step=rec.prefix_step,
    )


def join_checkpoint(
    join: TransferJoin, partition: int, *, next_offset: int = 0, issued: list[ck.IssuedCount] | None = None
) -> ck.JoinCheckpoint:
    """The JoinCheckpoint of `join`, the join of `partition`, with the offset it covers and the violation
    ids it issued."""
    transfers = []
    for tid, t in join.transfers.items():
        sides = [_side_record(s) for role in t.sides.values() for s in role.values()]
        transfers.append(
            ck.Transfer(
                transfer_id=tid,
                sides=sides,
                joined=t.joined,
                shape_checked=t.shape_checked,
                compared=[ck.Rank.of(k) for k in t.compared],
                orphan_settled=t.orphan_settled,
                retiring=t.retiring,
                prefix_checked=t.prefix_checked,
            )
        )
    return ck.JoinCheckpoint(
        partition=partition,
        next_offset=next_offset,
        issued=issued if issued is not None else [],
        deadline_steps=join.deadline_steps,
        coverage=coverage_record(join.coverage),
        transfers=transfers,
        clock=[ck.RankClock(rank=ck.Rank.of(k), step=s) for k, s in join.clock.items()],
        engine_clock=dict(join.engine_clock),
        pulled_from={e: sorted(peers) for e, peers in join.pulled_from.items()},
        retired=sorted(join.retired),
        due=[
            ck.RankDue(rank=ck.Rank.of(k), entries=[ck.Due(step=s, transfer_id=t, what=w) for s, t, w in heap])
            for k, heap in join._due.items()
        ],
    )


def join_of(rec: ck.JoinCheckpoint) -> TransferJoin:
    """The transfer join a JoinCheckpoint describes; StateError if it describes none."""
    join = TransferJoin(deadline_steps=rec.deadline_steps, coverage=Coverage())
    _coverage_into(join.coverage, rec.coverage)
    for trec in rec.transfers:
        t = Transfer(joined=trec.joined, shape_checked=trec.shape_checked, prefix_checked=trec.prefix_checked)
        t.compared = {r.key for r in trec.compared}
        t.orphan_settled, t.retiring = trec.orphan_settled, trec.retiring
        for srec in trec.sides:
            if srec.role not in t.sides:
                raise StateError(f"transfer {trec.transfer_id}: a side of role {srec.role!r}")
            side = _side_from_record(srec)
            t.sides[side.role][side.rank] = side
        join.transfers[trec.transfer_id] = t
    join.clock = {r.rank.key: r.step for r in rec.clock}
    join.engine_clock = dict(rec.engine_clock)
    join.pulled_from = {e: set(peers) for e, peers in rec.pulled_from.items()}
    join.retired = set(rec.retired)
    join._due = {r.rank.key: [(e.step, e.transfer_id, e.what) for e in r.entries] for r in rec.due}
    return join
