"""Offline replay of a file ledger through the ledger core.

I/O lives here, at the edge: discover the rank streams, read them in step
order (so ranks of one engine stay side by side, as the cross-rank checks
want), feed the core, and account for whatever could not be read.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvledger.schemas.events import LedgerEvent, RankInfo, Step, StepPlan, event_of
from kvledger.schemas.files import LedgerPathError, RankStream, ReadProblem, discover, read_stream, unread_peers
from kvledger.schemas.kinds import LOST_INPUT, Unchecked
from kvledger.schemas.packing import unpack_i32, wire_digests
from kvledger.stream_app.core import Coverage, Ledger, RankKey, Violation
from kvledger.stream_app.core.checks import (
    position_failures,
    read_failures,
    write_failures,
)
from kvledger.stream_app.core.rank_tables import RankTables

# Events handed to the core at once (its fast path checks runs of steps together).
_CHUNK = 512


class UnusableLedger(Exception):
    """Nothing in the input can be replayed (exit status 2)."""


@dataclass
class Replay:
    """What a replay found."""

    ledger: Ledger
    streams: list[RankStream]
    violations: list[Violation] = field(default_factory=list)
    problems: list[ReadProblem] = field(default_factory=list)

    @property
    def unchecked(self) -> Counter:
        out = Counter(self.ledger.coverage.unchecked)
        for problem in self.problems:
            out[problem.reason.unchecked] += 1
        if self.ledger.producer_dropped:
            out[Unchecked.DROPPED_BY_PRODUCER] += self.ledger.producer_dropped
        return out

    @property
    def lost(self) -> Counter:
        """What of `unchecked` is input lost before any check (LOST_INPUT): never clean."""
        return Counter({reason: n for reason, n in self.unchecked.items() if reason in LOST_INPUT})

    def summary(self) -> dict:
        return {
            "type": "summary",
            "events": self.ledger.events,
            "steps": self.ledger.steps,
            "ranks": len(self.streams),
            "checks": dict(sorted(self.ledger.coverage.checks.items())),
            "unchecked": dict(sorted(self.unchecked.items())),
            "violations": dict(sorted(Counter(v.kind for v in self.violations).items())),
            "problems": [
                {"path": p.path, "reason": p.reason, "detail": p.detail, "events_read": p.events_read}
                for p in self.problems
            ],
            "renamed": renamed(self.streams),
        }


def renamed(streams: list[RankStream]) -> list[dict]:
    """The rank directories whose events name another engine or rank than their path (renamed or
    copied): read as the events say, each with what its path names."""
    return [
        {
            "path": str(Path(s.segments[0]).parent),
            **_rank_json(*s.identity),
            "path_names": _rank_json(*s.laid_out_as),
        }
        for s in streams
        if s.laid_out_as is not None and s.segments
    ]


def _rank_json(engine_id: str, dp: int, tp: int, pp: int) -> dict:
    return {"engine_id": engine_id, "dp_rank": dp, "tp_rank": tp, "pp_rank": pp}


@dataclass(frozen=True)
class StreamLost:
    """Marker in the merged stream: the rest of this rank stream could not be read."""

    stream: RankStream


def _stream_events(stream: RankStream, problems: list[ReadProblem], done: dict) -> Iterator[tuple]:
    """(sort step, event) of one rank stream, segments in order; StreamLost after a lost tail
    (a torn or corrupt last segment, or a stream whose writer died before confirming its end)."""
    last_step = -1
    known = len(problems)
    for event in read_stream(stream, problems, progress=done):
        body = event["body"][1]
        last_step = body.get("step", last_step)
        yield last_step, event
    if any(p.path == str(stream.segments[-1]) for p in problems[known:]):
        yield last_step, StreamLost(stream)


def _discover(roots: Sequence[str | Path]) -> list[RankStream]:
    """Rank streams under every root; a root that holds ledger roots (one per engine of a
    prefill/decode pair, say) is read as all of them, so transfers are joined across engines."""
    streams: list[RankStream] = []
    for root in roots:
        found = discover(root)
        if not found and Path(root).is_dir():
            found = [s for sub in sorted(p for p in Path(root).iterdir() if p.is_dir()) for s in discover(sub)]
        streams += found
    return streams


def iter_ledger(
    root: str | Path | Sequence[str | Path],
    problems: list[ReadProblem],
    *,
    engine_id: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[RankStream], Iterator[tuple]]:
    """Rank streams under `root` (one path or several) and an iterator of (step, event), merged by step."""
    roots = [root] if isinstance(root, str | Path) else list(root)
    try:
        streams = _discover(roots)
    except LedgerPathError as exc:
        raise UnusableLedger(str(exc)) from exc
    if engine_id is not None:
        streams = [s for s in streams if s.engine_id == engine_id]
    if not streams:
        what = f"no rank streams of engine {engine_id!r}" if engine_id else "no ledger segments (*.avro)"
        raise UnusableLedger(f"{what} under {', '.join(map(str, roots))}")
    total = sum(_size(p) for s in streams for p in s.segments)
    done: dict[Path, int] = {}

    def events() -> Iterator[tuple]:
        sources = [_stream_events(s, problems, done) for s in streams]
        merged = sources[0] if len(sources) == 1 else heapq.merge(*sources, key=lambda item: item[0])
        for n, item in enumerate(merged):
            if progress is not None and n % 4096 == 0:
                progress(sum(done.values()), total)
            yield item
        if progress is not None:
            progress(total, total)

    return streams, events()


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):  # deleted since it was listed (a writer's retention)
        return path.stat().st_size
    return 0


def replay(
    root: str | Path | Sequence[str | Path],
    *,
    on_violation: Callable[[Violation], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Replay:
    """Replay a whole file ledger (or several, e.g. both engines of a pair). Raises UnusableLedger
    when nothing is readable."""
    problems: list[ReadProblem] = []
    streams, events = iter_ledger(root, problems, progress=progress)
    result = Replay(Ledger(), streams, problems=problems)
    unread = unread_peers(streams)  # a rank read without its group's other ranks (its directory given)

    def report(found: list[Violation]) -> None:
        result.violations += found
        if on_violation is not None:
            for v in found:
                on_violation(v)

    chunk: list[LedgerEvent] = []
    typed_for = result.ledger.key_of
    for _, event in events:
        if isinstance(event, StreamLost):
            report(result.ledger.apply_many(chunk))
            chunk = []
            s = event.stream
            result.ledger.stream_lost(s.engine_id, s.dp, s.tp, s.pp)
            continue
        event = event_of(event, typed_for)  # decoded once, here at the edge
        chunk.append(event)
        if unread and isinstance(event.body, RankInfo):
            # Its group is known from here: the ranks left unread are lost to it, not missing from it.
            report(result.ledger.apply_many(chunk))
            chunk = []
            rank = event.rank
            for tp, pp in unread.get((rank.engine_id, rank.dp), ()):
                result.ledger.stream_lost(rank.engine_id, rank.dp, tp, pp)
        elif len(chunk) == _CHUNK:
            report(result.ledger.apply_many(chunk))
            chunk = []
    report(result.ledger.apply_many(chunk))
    report(result.ledger.finish())
    if result.ledger.events == 0:
        reasons = "; ".join(f"{Path(p.path).name}: {p.detail}" for p in problems[:3])
        raise UnusableLedger(f"no readable events under {root}" + (f" ({reasons})" if reasons else ""))
    return result


@dataclass
class GroupWrites:
    """One KV cache group's part of a step plan for one request, beside what the ledger's row gives.
    Every list is per token the plan writes for the request, in slot-mapping order."""

    group_id: int  # the KV cache group
    block_size: int  # tokens per block: slot // block_size is a slot's block
    positions: list[int]  # the token positions the plan writes
    written: list[int]  # the slot the plan wrote each position to
    expected: list[int]  # the slot the ledger's row gives each position (checks.slot_targets)
    in_row: list[bool]  # the position lies inside the ledger's row (else `expected` names no slot)
    wrong: list[bool]  # the write rule fails for the token (checks.write_failures)
    read_len: int | None  # blocks of the row attention read, as the plan says; None: not recorded
    ledger_len: int  # blocks of the ledger's row
    read_digest: int | None  # the plan's digest of the row it read, as the wire carries it
    ledger_digest: int  # the digest of the ledger's row, cut to what the wire carries
    read_row: list[int] | None  # the row attention read, when the plan carries full rows
    read_wrong: bool  # the read rule fails for the request (checks.read_failures)


@dataclass
class PlanWrites:
    """What the runner's plan of one step did for one request, beside what the ledger expected."""

    step: int  # the step of the plan
    first_position: int  # the plan: the first position it writes
    num_tokens: int  # the plan: how many tokens it writes
    computed: int  # the ledger: num_computed_tokens the scheduler handed
    scheduled: int  # the ledger: tokens the scheduler handed
    position_wrong: bool  # the position rule fails (checks.position_failures)
    groups: list[GroupWrites]  # per KV cache group with token -> slot addressing


def plan_writes(state: RankTables, req_id: str, step: int, plan: StepPlan) -> PlanWrites | None:
    """`plan` for `req_id` beside `state`'s tables (as they stood when the plan was checked): the facts
    the core's checks judge the plan by (`RankTables.plan_facts`), this request's share of them."""
    index = state.index_of.get(req_id)
    facts = state.plan_facts(plan, Coverage())
    at = np.flatnonzero(facts.indices == index) if index is not None else np.empty(0, np.int64)
    r = facts.requests
    if not at.size or r.ntok.size != facts.indices.size or r.first.size != facts.indices.size:
        return None
    i = int(at[0])
    row = int(facts.rows[i])
    groups = []
    for g in facts.groups:
        if g.real is None:
            continue  # no token -> slot addressing to draw (the core leaves it unchecked too)
        mine = np.flatnonzero((g.tok_req if g.tok_req is not None else np.arange(g.real.size)) == i)
        wrong = write_failures(g)
        read_bad = read_failures(g)
        table = state.groups[g.group_id]
        has_read = g.plan_lens is not None
        read_len = int(g.plan_lens[i]) if has_read else None
        read_row = None
        rows_part = next(gp.rows for gp in plan.groups if gp.group_id == g.group_id)
        if has_read and rows_part is not None:
            offset = int(g.plan_lens[:i].sum())
            read_row = unpack_i32(rows_part)[offset : offset + read_len].tolist()
        groups.append(
            GroupWrites(
                g.group_id,
                g.block_size,
                positions=g.pos[mine].tolist(),
                written=g.real[mine].tolist(),
                expected=g.expected[mine].tolist(),
                in_row=g.in_row[mine].tolist(),
                wrong=wrong[mine].tolist(),
                read_len=read_len,
                ledger_len=int(table.lens[row]),
                read_digest=int(g.plan_digests[i]) if has_read else None,
                ledger_digest=int(wire_digests(table.digests[row : row + 1])[0]),
                read_row=read_row,
                read_wrong=bool(read_bad[i]) if read_bad is not None else False,
            )
        )
    return PlanWrites(
        step,
        int(r.first[i]),
        int(r.ntok[i]),
        int(r.computed[i]),
        int(r.scheduled[i]),
        bool(position_failures(r)[i]),
        groups,
    )


@dataclass
class RequestView:
    """A request's block table on one rank at one step (time travel)."""

    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    step: int
    rows: list[list[int]] | None  # per KV cache group; None when not live on the rank
    first_seen: int | None
    last_seen: int | None
    # What the rank's plan of `step` wrote and read for the request, beside the row; None when the
    # request was not in that plan (or the plan is not in what was replayed).
    plan: PlanWrites | None = None


class RequestTrace:
    """Follows one request through one engine's events: its rows on every rank, at the end."""

    def __init__(self, engine_id: str, req_id: str, ledger: Ledger | None = None):
        self.engine_id, self.req_id = engine_id, req_id
        self.ledger = ledger if ledger is not None else Ledger()
        self.seen: dict[RankKey, tuple[int, int]] = {}  # rank -> first and last step the request was live
        # rank -> its latest step plan and that step: drawn if the tables still stand at that step
        self.plans: dict[RankKey, tuple[int, StepPlan]] = {}

    def apply(self, at: int, event: LedgerEvent) -> None:
        self.ledger.apply(event)
        key, body = event.rank, event.body
        if isinstance(body, Step) and body.plan is not None:
            self.plans[key] = (body.step, body.plan)
        state = self.ledger.tables_of(key)
        if state is not None and self.req_id in state.index_of:
            self.seen[key] = (self.seen.get(key, (at, at))[0], at)

    def views(self) -> list[RequestView]:
        views = []
        for key, slot in sorted(self.ledger.ranks.items(), key=lambda kv: (kv[0].dp, kv[0].pp, kv[0].tp)):
            state = self.ledger.tables_of(key)
            rows = state.request_rows(self.req_id) if state is not None else None
            first, last = self.seen.get(key, (None, None))
            plan = None
            planned = self.plans.get(key)
            # A plan is checked against the tables after its own step's input, which checking leaves
            # as they are: drawn only while the rank's last step is that plan's.
            if state is not None and planned is not None and planned[0] == slot.last_step:
                plan = plan_writes(state, self.req_id, *planned)
            view = RequestView(self.engine_id, key.dp, key.tp, key.pp, slot.last_step, rows, first, last, plan)
            views.append(view)
        return views


def query(root: str | Path, engine_id: str, req_id: str, step: int | None = None) -> list[RequestView]:
    """The block table of `req_id` at `step` (default: the last step) on every rank of the engine."""
    problems: list[ReadProblem] = []
    _, events = iter_ledger(root, problems, engine_id=engine_id)
    trace = RequestTrace(engine_id, req_id)
    for at, event in events:
        if step is not None and at > step:
            break  # merged by step: everything after is later too
        if not isinstance(event, StreamLost):
            trace.apply(at, event_of(event, trace.ledger.key_of))
    return trace.views()
