"""The fast path: prove a run of one rank's steps clean in a few array passes.

Checking step by step costs a fixed number of numpy calls per step, which
bounds replay speed. Here a run of consecutive steps is checked at once: rows
are append-only inside the run (a finished request's row is only recycled
after it), so what a row held at step b is "its blocks before the run plus
those appended at steps <= b", found with one sorted search for all tokens.

All or nothing: `plan_run` either proves that the step-by-step path would
report no violation and count exactly the coverage returned, and hands back a
commit, or returns None and has changed nothing that path reads. Anything
unusual (a violation, preemption, resume, sliding window, an unknown
request, a drafter's KV writes) sends the run down the step-by-step path,
the reference.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from kvledger.schemas.events import Step
from kvledger.schemas.kinds import Check, KvGroupKind, StepKind, Unchecked
from kvledger.schemas.packing import (
    block_terms,
    expand_slot_runs,
    length_terms,
    unpack_digests,
    unpack_i32,
    unpack_i64,
)
from kvledger.stream_app.core.checks import (
    GrantFacts,
    GroupFacts,
    ReadFacts,
    RequestFacts,
    grant_failures,
    null_grant_failures,
    plan_clean,
    prefix_failures,
    prefix_known,
    slot_targets,
    unwritten_failures,
)
from kvledger.stream_app.core.rank_tables import IN_FLIGHT_KEPT, RankTables, shared_tokens, written_spans
from kvledger.stream_app.core.tables import NULL_BLOCK, UNKNOWN_FILL, last_of_runs, positions_differ, written_from
from kvledger.stream_app.core.violations import Coverage

_FAST_KINDS = (KvGroupKind.FULL_ATTENTION, KvGroupKind.MLA)


def reads_blocks(step: Step) -> bool:
    """The step hands a new request blocks only to read (a prefix hit, received KV): when a run holding
    such steps is declined, they go step by step alone and their neighbours again in runs."""
    return step.input is not None and any(r.num_computed_tokens for r in step.input.new_reqs)


def eligible(state: RankTables) -> bool:
    # One group: a written block's holders are counted across groups step by step (one pool). A KV
    # connector load announced on an async rank is judged against the steps in flight step by step.
    return len(state.groups) == 1 and state.groups[0].kind in _FAST_KINDS and not state.loads


# Per-run matrices are rows x steps: bound them (a long run over many rows goes in pieces).
_MAX_CELLS = 1 << 21


class _Run:
    """Columns of a run, each concatenated over its steps (b = step index in the run)."""

    steps: int
    in_row: np.ndarray  # inputs: row, b, num_computed_tokens, num_scheduled_tokens
    in_b: np.ndarray
    in_comp: np.ndarray
    in_sched: np.ndarray
    g_row: list[np.ndarray]  # grants per group: row, b, count; blocks in entry order
    g_b: list[np.ndarray]
    g_cnt: list[np.ndarray]
    g_blocks: list[np.ndarray]
    rel_row: np.ndarray  # rows of requests finished in the run, and when
    rel_b: np.ndarray
    new_chains: dict[int, list[np.ndarray] | None]  # rows of requests new in the run -> their prefix chains
    dispatched: list[Step]  # its last steps scheduled with steps in flight (RankTables.note_dispatched)
    p_rows: np.ndarray  # plan: row, b, tokens, first position, per request
    p_b: np.ndarray
    p_ntok: np.ndarray
    p_first: np.ndarray
    p_real: list[np.ndarray]  # per group: slots of the scheduled tokens, row lengths, digests, padding
    p_lens: list[np.ndarray]
    p_digests: list[np.ndarray]
    padding: list[np.ndarray]


def _join(parts: list[bytes], unpack=unpack_i32) -> np.ndarray:
    return unpack(b"".join(parts))


def _step_of(sizes: list[int]) -> np.ndarray:
    """The step index of each element of a column whose steps contributed `sizes` elements."""
    return np.repeat(np.arange(len(sizes)), sizes)


def plan_run(state: RankTables, steps: list[Step]) -> tuple[Callable[[], None], Coverage] | None:
    """Check `steps` (consecutive, all with a plan) of one rank; a commit and the coverage counted, or None."""
    ng = len(state.groups)
    if state.pending_reads:  # a step path's reads wait for a plan the run does not have
        return None
    row_of = state.row_of.copy()  # req_index -> row; indices finished in the run keep theirs until commit
    index_of = dict(state.index_of)
    req_id_of = dict(state.req_id_of)
    free = list(state.free_rows)
    num_rows = state.num_rows
    born: dict[int, int] = {}  # req_index -> step index it arrived at
    died: dict[int, int] = {}  # req_index -> step index it finished at
    new_in: list[tuple[int, int, int, int]] = []  # row, b, computed, scheduled
    new_chains: dict[int, list[np.ndarray] | None] = {}  # row -> the new request's prefix chains
    new_grants: list[list[tuple[int, int, np.ndarray]]] = [[] for _ in range(ng)]  # row, b, blocks
    in_cols: list[tuple] = []  # per step, _INPUT_COLUMNS
    plan_cols: list[tuple] = []  # per step, _PLAN_COLUMNS
    group_cols: list[list[tuple]] = [[] for _ in range(ng)]  # per group and step, _GROUP_COLUMNS

    # One pass in Python over what is not an array: request arrivals and departures.
    for b, step in enumerate(steps):
        inp, plan = step.input, step.plan
        if plan is None or len(plan.groups) != ng:
            return None
        if plan.draft_writes:  # a drafter's passes: checked step by step (RankTables.check_plan)
            return None
        if inp is None:
            if step.kind == StepKind.REAL:
                return None
        else:
            if inp.preempted_req_ids or inp.resumed_req_indices:
                return None
            if inp.block_ids_to_zero or inp.block_copies:  # overwrites: checked step by step
                return None
            for req_id in inp.finished_req_ids:
                index = index_of.pop(req_id, None)
                if index is not None:
                    del req_id_of[index]
                    died[index] = b
            for req in inp.new_reqs:
                index, req_id = req.req_index, req.req_id
                if req_id in index_of or len(req.block_ids) != ng:
                    return None  # re-added request: step by step
                if index >= row_of.size:
                    row_of = np.concatenate([row_of, np.full(max(index + 1, row_of.size), -1, np.int64)])
                if row_of[index] >= 0:
                    return None
                row = free.pop() if free else num_rows
                num_rows += row == num_rows
                row_of[index], index_of[req_id], req_id_of[index], born[index] = row, index, req_id, b
                new_in.append((row, b, req.num_computed_tokens, req.num_scheduled_tokens))
                new_chains[row] = state.unpack_chains(req.prefix_chains)
                for gid, data in enumerate(req.block_ids):
                    new_grants[gid].append((row, b, unpack_i32(data)))
            in_cols.append(_input_columns(inp))
        plan_cols.append(_plan_columns(plan))
        for gid, gp in enumerate(plan.groups):
            group_cols[gid].append(_group_columns(gp))

    cols = dict(zip(_INPUT_COLUMNS, zip(*in_cols, strict=True), strict=False)) if in_cols else {}
    cols.update(zip(_PLAN_COLUMNS, zip(*plan_cols, strict=True), strict=True))
    for k in _INPUT_COLUMNS:
        cols.setdefault(k, ())
    groups = [dict(zip(_GROUP_COLUMNS, zip(*gc, strict=True), strict=True)) for gc in group_cols]
    if any(set(gc["group_id"]) != {gid} for gid, gc in enumerate(groups)):
        return None
    size = row_of.size
    born_at = np.full(size, -1, np.int64)
    died_at = np.full(size, len(steps) + 1, np.int64)
    born_at[list(born)] = list(born.values())
    died_at[list(died)] = list(died.values())

    def rows_at(indices: np.ndarray, b: np.ndarray) -> np.ndarray | None:
        """Rows of requests referenced at steps b, or None if one was not live then."""
        if indices.size == 0:
            return indices.astype(np.int64)
        if indices.min() < 0 or indices.max() >= size:
            return None
        rows = row_of[indices]
        if ((rows < 0) | (born_at[indices] > b) | (b >= died_at[indices])).any():
            return None
        return rows

    run = _Run()
    run.dispatched = [s for s in steps[-IN_FLIGHT_KEPT:] if s.input is not None and s.input.in_flight_steps is not None]
    # Inputs of cached requests, then of new ones.
    cached = _join(cols["cached_req_indices"])
    c_b = _step_of([len(x) >> 2 for x in cols["cached_req_indices"]]) if cached.size else cached
    c_rows = rows_at(cached, c_b)
    if c_rows is None:
        return None
    new_arr = np.array(new_in, np.int64).reshape(-1, 4)
    run.in_row = np.concatenate([c_rows, new_arr[:, 0]])
    run.in_b = np.concatenate([c_b, new_arr[:, 1]])
    run.in_comp = np.concatenate([_join(cols["cached_num_computed_tokens"]), new_arr[:, 2]])
    run.in_sched = np.concatenate([_join(cols["cached_num_scheduled_tokens"]), new_arr[:, 3]])

    # Blocks handed out: new requests' rows, then appends.
    a_cnt = _join(cols["append_counts"])
    a_idx = _join(cols["append_req_indices"])
    a_gid = _join(cols["append_group_ids"])
    a_blocks = _join(cols["append_block_ids"])
    a_b = _step_of([len(x) >> 2 for x in cols["append_counts"]]) if a_cnt.size else a_cnt
    a_rows = rows_at(a_idx, a_b)
    if a_rows is None or (a_gid.size and (a_gid.min() < 0 or a_gid.max() >= ng)) or a_cnt.sum() != a_blocks.size:
        return None
    run.g_row, run.g_b, run.g_cnt, run.g_blocks = [], [], [], []
    for gid in range(ng):
        grants = new_grants[gid]
        mine = a_gid == gid
        run.g_row.append(np.concatenate([np.array([r for r, _, _ in grants], np.int64), a_rows[mine]]))
        run.g_b.append(np.concatenate([np.array([b for _, b, _ in grants], np.int64), a_b[mine]]))
        run.g_cnt.append(np.concatenate([np.array([x.size for _, _, x in grants], np.int64), a_cnt[mine]]))
        run.g_blocks.append(np.concatenate([*(x for _, _, x in grants), a_blocks[np.repeat(mine, a_cnt)]]))
    run.new_chains = new_chains
    run.rel_row = row_of[list(died)].astype(np.int64) if died else np.empty(0, np.int64)
    run.rel_b = np.array(list(died.values()), np.int64)

    # The plan.
    indices = _join(cols["req_indices"])
    sizes = [len(x) >> 2 for x in cols["req_indices"]]
    run.p_b = _step_of(sizes)
    run.p_rows = rows_at(indices, run.p_b)
    if run.p_rows is None:
        return None
    run.p_ntok = _join(cols["num_tokens"])
    run.p_first = _join(cols["first_positions"])
    if run.p_ntok.size != indices.size or run.p_first.size != indices.size:
        return None
    tokens_per_step = np.bincount(run.p_b, weights=run.p_ntok, minlength=len(steps)).astype(np.int64)
    run.p_real, run.p_lens, run.p_digests, run.padding = [], [], [], []
    for gc in groups:
        real = np.array(gc["num_real"], np.int64)
        width = real + np.array(gc["num_padding"], np.int64)
        runs = _join(gc["slot_runs"], unpack_i64).reshape(-1, 2)
        run_b = _step_of([len(x) >> 4 for x in gc["slot_runs"]])
        if (real != tokens_per_step).any() or (np.bincount(run_b, runs[:, 1], len(steps)) != width).any():
            return None
        slots = expand_slot_runs(b"".join(gc["slot_runs"]))
        offset = np.arange(slots.size) - np.repeat(np.cumsum(width) - width, width)
        is_real = offset < np.repeat(real, width)
        run.p_real.append(slots[is_real])
        run.padding.append(slots[~is_real])
        run.p_lens.append(_join(gc["row_lens"]))
        run.p_digests.append(_join(gc["row_digests"], unpack_digests))
        if run.p_lens[-1].size != indices.size or run.p_digests[-1].size != indices.size:
            return None

    n, padded = indices.size, len(steps) * ng
    cov = Coverage(Counter({Check.POSITION: n, Check.WRITE: n * ng, Check.READ: n * ng, Check.PADDING: padded}))
    state.grow_rows(num_rows)  # room for rows opened in the run; unused cells are invisible
    final_row_of = row_of.copy()
    final_row_of[list(died)] = -1
    run.steps = len(steps)
    if num_rows * run.steps > _MAX_CELLS:
        return None
    return _check_and_commit(state, run, cov, final_row_of, index_of, req_id_of, free, num_rows)


_INPUT_COLUMNS = (
    "cached_req_indices",
    "cached_num_computed_tokens",
    "cached_num_scheduled_tokens",
    "append_req_indices",
    "append_group_ids",
    "append_counts",
    "append_block_ids",
)
_PLAN_COLUMNS = ("req_indices", "num_tokens", "first_positions")
_GROUP_COLUMNS = ("group_id", "slot_runs", "num_real", "num_padding", "row_lens", "row_digests")
_input_columns = attrgetter(*_INPUT_COLUMNS)
_plan_columns = attrgetter(*_PLAN_COLUMNS)
_group_columns = attrgetter(*_GROUP_COLUMNS)


def _latest_per_cell(rows: np.ndarray, steps: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """For every (row, b): the last step <= b at which `rows`/`steps` has an entry, or -1."""
    last = np.full(shape, -1, np.int64)
    last[rows, steps] = steps
    return np.maximum.accumulate(last, axis=1, out=last)


def _check_and_commit(state, run, cov, row_of, index_of, req_id_of, free, num_rows):
    shape = (num_rows, run.steps)
    # -- positions: plan vs the latest input of each row ------------------------------------------
    p_rows, p_b = run.p_rows, run.p_b
    last_in = _latest_per_cell(run.in_row, run.in_b, shape)
    last = last_in[p_rows, p_b]
    seen, last = last >= 0, np.maximum(last, 0)
    comp_m, sched_m = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    comp_m[run.in_row, run.in_b] = run.in_comp
    sched_m[run.in_row, run.in_b] = run.in_sched
    comp = np.where(seen, comp_m[p_rows, last], state.computed[p_rows])
    sched = np.where(seen, sched_m[p_rows, last], state.scheduled[p_rows])
    requests = RequestFacts(run.p_first, run.p_ntok, comp, sched)

    commits, groups = [], []
    for gid, g in enumerate(state.groups):
        result = _check_group(state, g, run, gid, shape, comp_m, cov)
        if result is None:
            return None
        facts, apply = result
        groups.append(facts)
        commits.append(apply)
    if not plan_clean(requests, groups):
        return None

    def commit() -> None:
        for row, chains in run.new_chains.items():
            state.set_chains(row, chains)
        for apply in commits:
            apply()
        for row in run.rel_row.tolist():
            state.set_chains(row, None)
        # Each row's last input wins: the latest step of every row that had one.
        touched = np.flatnonzero(last_in[:, -1] >= 0)
        state.computed[touched] = comp_m[touched, last_in[touched, -1]]
        state.scheduled[touched] = sched_m[touched, last_in[touched, -1]]
        state.row_of, state.index_of, state.req_id_of = row_of, index_of, req_id_of
        state.free_rows = free + run.rel_row.tolist()  # rows of finished requests: free after the run
        state.num_rows = num_rows
        for step in run.dispatched:  # async scheduling's window: the run's last steps, as the step path keeps them
            state.note_dispatched(step.step, step.input)

    return commit, cov


def _check_group(state, g, run, gid, shape, comp_m, cov):
    """One group over the run: its plan facts (the rows as they stood at each step) and the commit of
    its grants, or None when a grant breaks a rule (or the run is one the fast path does not take)."""
    bs = g.block_size
    # -- grants: rows are append-only inside the run, one entry per (row, step) -------------------
    rows_e, b_e, cnt = run.g_row[gid], run.g_b[gid], run.g_cnt[gid].astype(np.int64)
    blocks = run.g_blocks[gid].astype(np.int64)
    if blocks.size and ((blocks < 0).any() or (blocks >= g.num_blocks).any()):
        return None
    if null_grant_failures(blocks, g.kind.null_free).any():
        return None
    if g.kind.null_free and blocks.size:
        cov.checks[Check.NULL_GRANT] += int(blocks.size)
    if rows_e.size and np.unique(rows_e * shape[1] + b_e).size != rows_e.size:
        return None
    appended = np.zeros(shape, np.int64)
    appended[rows_e, b_e] = cnt
    np.cumsum(appended, axis=1, out=appended)  # blocks appended to the row at steps <= b
    entry_start = np.cumsum(cnt) - cnt  # offset of each entry's blocks in `blocks`
    cols = np.repeat(g.lens[rows_e] + appended[rows_e, b_e] - cnt - entry_start, cnt) + np.arange(blocks.size)
    blk_rows = np.repeat(rows_e, cnt)
    # Cells past a row's end are never read: writing them now is invisible to the step-by-step path.
    g.place(blk_rows, cols, blocks)
    with np.errstate(over="ignore"):
        terms = np.append(block_terms(blocks, cols), np.uint64(0))
        inc = np.add.reduceat(terms, entry_start, dtype=np.uint64) if cnt.size else np.empty(0, np.uint64)
        inc = np.where(cnt > 0, inc, np.uint64(0)) + length_terms(cnt)
        digest_inc = np.zeros(shape, np.uint64)
        digest_inc[rows_e, b_e] = inc
        np.cumsum(digest_inc, axis=1, dtype=np.uint64, out=digest_inc)

    # -- the plan's facts: every token and row against its row as it stood at its step ----------------
    p_rows, p_b = run.p_rows, run.p_b
    p_lens = g.lens[p_rows] + appended[p_rows, p_b]
    expected, in_row, block, spans = slot_targets(g.table, p_rows, p_lens, run.p_first, run.p_ntok, bs)
    with np.errstate(over="ignore"):
        digest_at = g.digests[p_rows] + digest_inc[p_rows, p_b]
    facts = GroupFacts(
        gid,
        bs,
        real=run.p_real[gid],
        expected=expected,
        in_row=in_row,
        block=block,
        padding=run.padding[gid],
        plan_lens=run.p_lens[gid],
        plan_digests=run.p_digests[gid],
        ledger_lens=p_lens,
        ledger_digests=digest_at,
        # As the blocks stood before the run; a block two requests or more held then and the run writes
        # goes step by step (below: whether it was full at the write is known only there), as does one
        # handed out to be read in the run and written after (_reads_clean).
        shared=shared_tokens(g, spans),
    )
    # The blocks the run writes, a span (its tokens in one block) at a time.
    wrote = np.flatnonzero(written_spans(g, spans))
    if (g.hold_count[spans.block[wrote]] >= 2).any():
        return None

    # -- exclusivity: holders of each granted block right after its step's grants -------------------
    rel_blocks, rel_cols, rel_time = _released_blocks(g, run.rel_row, run.rel_b, appended)
    real_block = blocks > NULL_BLOCK
    cov.checks[Check.EXCLUSIVITY] += int(real_block.sum())
    ev_block = np.concatenate([rel_blocks, blocks[real_block]])
    ev_col = np.concatenate([rel_cols, cols[real_block]])
    ev_time = np.concatenate([rel_time, 2 * np.repeat(b_e, cnt)[real_block] + 1])
    ev_sign = np.concatenate([np.full(rel_blocks.size, -1), np.ones(int(real_block.sum()), np.int64)])
    # Which granted blocks the grant writes (at or past its request's computed tokens, as in RankTables._grant).
    written = cols >= np.repeat(written_from(comp_m[rows_e, b_e], bs), cnt)
    ev_written = np.concatenate([np.zeros(rel_blocks.size, bool), written[real_block]])
    if real_block.any() and grant_failures(_grant_facts(g, ev_block, ev_col, ev_time, ev_sign, ev_written)).any():
        return None

    # -- what blocks hold: fresh grants take their request's prefix; reads are judged at their step ----------
    grant_b = np.repeat(b_e, cnt)
    fresh = real_block & written
    # The run's writes, the last (highest) of each run of one block in one row and step: how far it filled it.
    w_req = spans.req[wrote]
    w_block, w_b = spans.block[wrote], p_b[w_req]
    last = last_of_runs(w_block, w_b, p_rows[w_req])
    content = _Content(
        fresh_blocks=blocks[fresh],
        fresh_b=grant_b[fresh],
        fresh_chains=state.chains_at(gid, blk_rows[fresh], cols[fresh], run.new_chains),
        w_block=w_block[last],
        w_b=w_b[last],
        w_offset=spans.last[wrote[last]] % bs,
    )
    reads = real_block & ~written
    if reads.any():
        chains = state.chains_at(gid, blk_rows[reads], cols[reads], run.new_chains)
        if not _reads_clean(state, g, run.steps, content, _ReadRun(blocks[reads], grant_b[reads], chains), cov):
            return None

    touched = np.unique(rows_e)

    def commit() -> None:
        g.hold(rel_blocks, rel_cols, -1)
        g.hold(blocks, cols, +1)
        g.extend(touched, appended[touched, -1], digest_inc[touched, -1])
        _commit_content(g, content)
        if run.rel_row.size:
            g.reset(run.rel_row)

    return facts, commit


class _Content(NamedTuple):
    """What a run does to what blocks hold, in one group."""

    fresh_blocks: np.ndarray  # blocks handed out to be computed anew, in grant order
    fresh_b: np.ndarray  # the step index of each
    fresh_chains: np.ndarray  # the prefix each is computed from (0: unknown)
    w_block: np.ndarray  # writes into real blocks: the last of each run of one block in one row and step
    w_b: np.ndarray  # the step index of each
    w_offset: np.ndarray  # its offset in the block (the highest of its run)


class _ReadRun(NamedTuple):
    """Blocks handed out in a run only to be read (below their request's computed tokens)."""

    blocks: np.ndarray
    b: np.ndarray  # the step index of each
    reader_chains: np.ndarray  # the reader's own prefix chain there (0: unknown)


def _epochs(content: _Content, blocks: np.ndarray, b: np.ndarray, steps: int) -> np.ndarray:
    """For each (block, step index): the index into the fresh grants of the block's last one at or before
    that step, or -1: the block holds what it held before the run."""
    if content.fresh_blocks.size == 0 or blocks.size == 0:
        return np.full(blocks.size, -1, np.int64)
    key = content.fresh_blocks * (steps + 1) + content.fresh_b
    order = np.argsort(key, kind="stable")
    at = np.searchsorted(key[order], blocks * (steps + 1) + b, side="right") - 1
    hit = at >= 0
    hit[hit] = content.fresh_blocks[order[at[hit]]] == blocks[hit]
    return np.where(hit, order[np.maximum(at, 0)], -1)


def _reads_clean(state, g, steps: int, content: _Content, read: _ReadRun, cov: Coverage) -> bool:
    """The run's reads, judged as the step path judges each at its step (RankTables._grant_content,
    settle_reads): the prefix the block was handed out to compute, and how far the steps since, up to
    the reader's own, wrote it. False where the step path would report or count something unknown."""
    if state.content_voided is not None or not state.reads_traced:
        return False
    # Only writes into blocks read in the run matter here. One at or after a step that handed its block
    # out to be read: whether the block was shared and full then is judged step by step.
    read_blocks, of = np.unique(read.blocks, return_inverse=True)
    first_read = np.full(read_blocks.size, steps, np.int64)
    np.minimum.at(first_read, of, read.b)
    at = np.minimum(np.searchsorted(read_blocks, content.w_block), read_blocks.size - 1)
    into = read_blocks[at] == content.w_block
    if (content.w_b[into] >= first_read[at[into]]).any():
        return False
    epoch = _epochs(content, read.blocks, read.b, steps)
    fresh = epoch >= 0
    facts = ReadFacts(np.where(fresh, content.fresh_chains[epoch], g.chain[read.blocks]), read.reader_chains)
    if prefix_failures(facts).any():
        return False
    fill = np.where(fresh, 0, g.fill[read.blocks])
    if (fill == UNKNOWN_FILL).any():
        return False
    # The highest offset written in each (block, epoch): every such write precedes the block's first read.
    wb, w_epoch = content.w_block[into], _epochs(content, content.w_block[into], content.w_b[into], steps)
    span = content.fresh_blocks.size + 1
    seg = wb * span + (w_epoch + 1)
    segs, of = np.unique(seg, return_inverse=True)
    highest = np.zeros(segs.size, np.int64)
    np.maximum.at(highest, of, content.w_offset[into] + 1)
    if segs.size:
        read_seg = read.blocks * span + (epoch + 1)
        at = np.minimum(np.searchsorted(segs, read_seg), segs.size - 1)
        fill = np.maximum(fill, np.where(segs[at] == read_seg, highest[at], 0))
    if unwritten_failures(fill, g.block_size).any():
        return False
    known = int(prefix_known(facts).sum())  # as RankTables._grant_content counts them
    if known:
        cov.checks[Check.PREFIX_IDENTITY] += known
    if known < read.blocks.size:
        cov.unchecked[Unchecked.PREFIX_UNKNOWN] += int(read.blocks.size) - known
    cov.checks[Check.READ_WRITTEN] += int(read.blocks.size)
    return True


def _commit_content(g, content: _Content) -> None:
    """What the run's blocks hold, as the step path leaves it: the fresh grants in step order, then the
    writes of the run, each after its block's last fresh grant."""
    order = np.argsort(content.fresh_b, kind="stable")
    fresh = content.fresh_blocks[order]
    keep = np.ones(content.w_block.size, bool)
    if fresh.size:
        g.mark_fresh(fresh, content.fresh_chains[order])
        granted, of = np.unique(fresh, return_inverse=True)
        last = np.full(granted.size, -1, np.int64)
        np.maximum.at(last, of, content.fresh_b[order])
        at = np.minimum(np.searchsorted(granted, content.w_block), granted.size - 1)
        keep = (granted[at] != content.w_block) | (content.w_b >= last[at])
    if keep.any():
        g.mark_written(content.w_block[keep], content.w_offset[keep])


def _grant_facts(g, ev_block, ev_col, ev_time, ev_sign, ev_written) -> GrantFacts:
    """The facts of every grant of the run, from the holder events (grants and releases, in time
    order) of each block: the block's holders as they stood right after its step's grants."""
    order = np.lexsort((ev_time, ev_block))
    eb, et, ec, es, ew = ev_block[order], ev_time[order], ev_col[order], ev_sign[order], ev_written[order]
    grant = es > 0
    # Running totals within each block, read at the end of each (block, time) group.
    n = eb.size
    new_block = np.r_[True, eb[1:] != eb[:-1]]
    group_end = np.r_[(eb[1:] != eb[:-1]) | (et[1:] != et[:-1]), True]
    start = np.maximum.accumulate(np.where(new_block, np.arange(n), 0))
    end_idx = np.minimum.accumulate(np.where(group_end, np.arange(n), n)[::-1])[::-1]
    totals = []
    for base, delta in ((g.hold_count, es), (g.hold_sum, es * ec), (g.hold_sumsq, es * ec * ec)):
        running = np.cumsum(delta)
        within = running - (running[start] - delta[start])
        totals.append((base[eb] + within[end_idx])[grant])
    count, s1, s2 = totals
    # A (block, time) group holds only grants or only releases (releases come at even times).
    group_of = np.cumsum(group_end[::-1])[::-1]  # groups numbered from the end; any numbering will do
    granted_now = np.bincount(group_of, weights=grant)[group_of][grant]
    return GrantFacts(
        elsewhere=positions_differ(count, s1, s2, ec[grant]),
        written=ew[grant],
        prior=count - granted_now,
        writers=np.bincount(group_of, weights=grant & ew)[group_of][grant],
        sending=g.in_transfer(eb[grant]),
    )


def _released_blocks(g, rel_rows, rel_b, appended):
    """Blocks (with positions and event times) held by rows finished in the run, as they stood then."""
    if rel_rows.size == 0:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    lens = g.lens[rel_rows] + appended[rel_rows, rel_b]
    starts = g.released[rel_rows]
    n = np.maximum(lens - starts, 0)
    row_of_blk = np.repeat(rel_rows, n)
    cols = np.repeat(starts, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    blocks = g.table[row_of_blk, cols]
    held = g.ownable(blocks)  # as GroupTable.hold counts them
    return blocks[held], cols[held], np.repeat(2 * rel_b, n)[held]
