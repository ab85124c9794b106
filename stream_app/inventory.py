"""What a ledger holds: its engines, their ranks, incarnations, steps and requests (`kvledger ls`).

An `Inventory` is folded from ledger events, wherever they come from: a file
ledger (`ledger_inventory`), or the events topic of a cluster
(`kafka_inventory`). `travel` is `kvledger query`'s pass over a file ledger:
the request's block table at a step, and the inventory of the engine, so that
an out-of-range step or an unknown request is named beside what exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.schemas.events import Body, ConnectorEvent, Health, LedgerEvent, Snapshot, Step, event_of
from kvledger.schemas.files import LedgerPathError, RankStream, ReadProblem, discover, read_stream
from kvledger.schemas.ranks import rank_label
from kvledger.stream_app.replay import RequestTrace, RequestView, StreamLost, UnusableLedger, iter_ledger, renamed


def _span(lo: int | None, hi: int | None, value: int) -> tuple[int, int]:
    return (value if lo is None else min(lo, value), value if hi is None else max(hi, value))


@dataclass
class IncarnationSeen:
    """One run of a rank's worker process, as its events show it."""

    incarnation: int
    events: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    closed: bool = False  # its last Health said the worker shut down

    def to_json(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "events": self.events,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "closed": self.closed,
        }


@dataclass
class RankSeen:
    dp: int
    tp: int
    pp: int
    incarnations: dict[int, IncarnationSeen] = field(default_factory=dict)
    segments: int | None = None  # files of a file ledger (None: from Kafka)
    bytes: int | None = None

    @property
    def name(self) -> str:
        return rank_label(self.dp, self.tp, self.pp)

    @property
    def events(self) -> int:
        return sum(i.events for i in self.incarnations.values())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.name, "dp_rank": self.dp, "tp_rank": self.tp, "pp_rank": self.pp}
        if self.segments is not None:
            out |= {"segments": self.segments, "bytes": self.bytes}
        out["events"] = self.events
        out["incarnations"] = [self.incarnations[i].to_json() for i in sorted(self.incarnations)]
        return out


@dataclass
class EngineSeen:
    engine_id: str
    ranks: dict[tuple[int, int, int], RankSeen] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)  # request id -> the first step it appears at
    first_step: int | None = None
    last_step: int | None = None

    def rank(self, dp: int, tp: int, pp: int) -> RankSeen:
        key = (dp, tp, pp)
        if key not in self.ranks:
            self.ranks[key] = RankSeen(dp, tp, pp)
        return self.ranks[key]

    @property
    def steps(self) -> str:
        return "no steps" if self.first_step is None else f"steps {self.first_step}..{self.last_step}"

    def request_ids(self, limit: int | None = None) -> list[str]:
        """Request ids in the order they first appear (by step); the first `limit` of them."""
        ids = sorted(self.requests, key=self.requests.__getitem__)  # stable: ties keep their order
        return ids if limit is None else ids[:limit]

    def to_json(self, request_limit: int | None) -> dict[str, Any]:
        ids = self.request_ids(request_limit)
        return {
            "engine_id": self.engine_id,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "ranks": [self.ranks[k].to_json() for k in sorted(self.ranks)],
            "requests": {"count": len(self.requests), "ids": ids, "complete": len(ids) == len(self.requests)},
        }


def _requests_of(body: Body) -> Iterable[str]:
    if isinstance(body, Step):
        return [r.req_id for r in body.input.new_reqs] if body.input is not None else []
    if isinstance(body, Snapshot):
        return [r.req_id for r in body.requests]
    if isinstance(body, ConnectorEvent) and body.req_id:  # a connector event's, when known
        return [body.req_id]
    return []


@dataclass
class Inventory:
    engines: dict[str, EngineSeen] = field(default_factory=dict)
    events: int = 0
    undecodable: int = 0  # records of the events topic that are no ledger events
    problems: list[ReadProblem] = field(default_factory=list)
    streams: list[RankStream] = field(default_factory=list)  # of a file ledger: its rank streams found

    def engine(self, engine_id: str) -> EngineSeen:
        if engine_id not in self.engines:
            self.engines[engine_id] = EngineSeen(engine_id)
        return self.engines[engine_id]

    def add_stream(self, stream: RankStream) -> None:
        """A rank stream found on disk, with its files (listed even when no event of it can be read)."""
        self.streams.append(stream)
        rank = self.engine(stream.engine_id).rank(stream.dp, stream.tp, stream.pp)
        rank.segments = (rank.segments or 0) + len(stream.segments)
        rank.bytes = (rank.bytes or 0) + sum(_size(p) for p in stream.segments)

    def add(self, event: LedgerEvent) -> None:
        self.events += 1
        body, key = event.body, event.rank
        engine = self.engine(key.engine_id)
        rank = engine.rank(key.dp, key.tp, key.pp)
        inc = rank.incarnations.get(event.incarnation)
        if inc is None:
            inc = rank.incarnations[event.incarnation] = IncarnationSeen(event.incarnation)
        inc.events += 1
        inc.first_seq, inc.last_seq = _span(inc.first_seq, inc.last_seq, event.seq)
        step = getattr(body, "step", None)  # RankInfo has none
        if step is not None:
            inc.first_step, inc.last_step = _span(inc.first_step, inc.last_step, step)
            engine.first_step, engine.last_step = _span(engine.first_step, engine.last_step, step)
        if isinstance(body, Health) and body.closing:
            inc.closed = True
        for req_id in _requests_of(body):
            first = engine.requests.get(req_id)
            at = step if step is not None else -1
            if first is None or at < first:
                engine.requests[req_id] = at

    def to_json(self, request_limit: int | None) -> dict[str, Any]:
        return {
            "type": "ledger",
            "events": self.events,
            "engines": [self.engines[e].to_json(request_limit) for e in sorted(self.engines)],
            "undecodable": self.undecodable,
            "problems": [
                {"path": p.path, "reason": p.reason, "detail": p.detail, "events_read": p.events_read}
                for p in self.problems
            ],
            "renamed": renamed(self.streams),
        }


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0


def discover_all(paths: Sequence[str | Path]) -> list[RankStream]:
    """The rank streams at every path (any directory inside a ledger, or a segment); UnusableLedger,
    one line, where a path is unusable or none holds a segment."""
    streams: list[RankStream] = []
    try:
        for path in paths:
            streams += discover(path)
    except LedgerPathError as exc:
        raise UnusableLedger(str(exc)) from exc
    if not streams:
        raise UnusableLedger(f"no ledger segments (*.avro) under {', '.join(map(str, paths))}")
    return streams


def ledger_inventory(paths: Sequence[str | Path]) -> Inventory:
    """What the file ledger(s) at `paths` hold, every event read."""
    inventory = Inventory()
    for stream in discover_all(paths):
        inventory.add_stream(stream)
        for event in read_stream(stream, inventory.problems):
            inventory.add(event_of(event))
    return inventory


def kafka_inventory(bootstrap: str, topic: str, security, registry=None, timeout: float = 30.0) -> Inventory:
    """What the events topic holds, read from each partition's first offset to its end as it
    stood at the start. Raises BrokerUnavailable (one line) for a broker or topic not there."""
    from confluent_kafka import TopicPartition

    from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
    from kvledger.stream_app.worker.topics import BrokerUnavailable, admin, assigned_consumer, partitions_of

    partitions = partitions_of(admin(bootstrap, security=security), topic)
    if partitions is None:
        raise BrokerUnavailable(f"topic {topic} does not exist at {bootstrap} (no engine has sent events there)")
    lookup = registry.writer_schema if registry is not None else None
    codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH, lookup=lookup)
    inventory = Inventory()
    consumer = assigned_consumer(bootstrap, "kvledger-ls", security)
    try:
        for partition in range(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            offset = low
            if offset >= high:
                continue
            consumer.assign([TopicPartition(topic, partition, offset)])
            while offset < high:
                messages = consumer.consume(min(1024, high - offset), timeout=timeout)
                if not messages:
                    raise BrokerUnavailable(f"no records from {topic}/{partition} at offset {offset} (up to {high})")
                for m in messages:
                    if m.error() is not None:
                        continue
                    offset = m.offset() + 1
                    try:
                        events = [event_of(e) for e in codec.decode(m.value())]
                    except Exception:  # a dead letter: no ledger event
                        inventory.undecodable += 1
                        continue
                    for event in events:
                        inventory.add(event)
    finally:
        consumer.close()
    return inventory


@dataclass
class Travel:
    """`kvledger query`'s answer: the request's rows at the step, and what the engine holds."""

    views: list[RequestView]
    engine: EngineSeen
    problems: list[ReadProblem]


def travel(paths: Sequence[str | Path], engine_id: str, req_id: str, step: int | None) -> Travel:
    """The block table of `req_id` at `step` (default: the end) on every rank of the engine, and the
    engine's inventory: read to the end where the step or the request is not there yet (to say
    what exists), else only as far as the step."""
    problems: list[ReadProblem] = []
    roots = paths[0] if len(paths) == 1 else list(paths)
    _, events = iter_ledger(roots, problems, engine_id=engine_id)
    trace = RequestTrace(engine_id, req_id)
    inventory = Inventory()
    for at, record in events:
        if isinstance(record, StreamLost):
            continue
        event = event_of(record, trace.ledger.key_of)  # decoded once, here at the edge
        if step is not None and at > step:
            engine = inventory.engine(engine_id)
            if req_id in engine.requests and engine.first_step is not None and engine.first_step <= step:
                # Merged by step: everything after is later; the step and the request are known to exist.
                break
        else:
            trace.apply(at, event)
        inventory.add(event)
    return Travel(trace.views(), inventory.engine(engine_id), problems)
