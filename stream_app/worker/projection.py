"""The worker's projection of `kvledger.events`: pure, no Kafka, no clock.

The Faust app (app.py) hands over batches of raw records; this module decodes
them, feeds one `Ledger` per engine (the same core `kvledger check` runs) and
says what to publish: violations with their idempotent ids, dead letters,
connector events and rank progress for the transfer stream (joined in
join.py), producer health. It also turns an engine's state into a checkpoint
and back.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from kvledger.schemas import (
    LEDGER_EVENT,
    LEDGER_EVENT_BATCH,
    BatchCodec,
    DecodeError,
    UnknownSchemaError,
    checkpoint,
)
from kvledger.schemas.checkpoint import Body, EngineCheckpoint, IssuedCount
from kvledger.schemas.codec import Lookup
from kvledger.schemas.events import ConnectorEvent, Health, LedgerEvent, Step, event_of
from kvledger.schemas.kinds import PdRole, StepKind
from kvledger.stream_app.core import Ledger, Violation
from kvledger.stream_app.core.checkpoints import StateError, ledger_checkpoint, ledger_of
from kvledger.stream_app.core.violations import RankKey

WAYPOINTS = 8  # checkpoints an engine keeps in memory for time travel ...
WAYPOINT_EVERY = 512  # ... at least this many steps apart
SETTLE = None  # marks, in an engine's replay log, where the watermark settled held steps


@dataclass(frozen=True, slots=True)
class Record:
    """One message of the events topic, as the Kafka edge hands it over."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    record: Record
    reason: str  # undecodable, unknown_schema, wrong_key, rejected_by_ledger
    detail: str
    index: int | None = None  # the event's place in its message, when only that event was set aside


@dataclass(frozen=True, slots=True)
class IssuedViolation:
    """A violation and its id: the same fact always gets the same id, so re-sends are duplicates by key."""

    id: str
    violation: Violation


@dataclass(frozen=True, slots=True)
class Waypoint:
    """An engine's checkpoint kept for time travel: no rank of the engine was past `step`."""

    step: int
    next_offset: int
    blob: bytes


@dataclass(frozen=True, slots=True)
class ProducerHealth:
    engine_id: str
    rank: str  # dp<D>-tp<T>-pp<P>
    events_dropped: int


@dataclass
class Outcome:
    """What one batch (or one watermark) asks the edge to publish and count."""

    violations: list[IssuedViolation] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    transfers: list[tuple[str, LedgerEvent]] = field(default_factory=list)  # (transfer id, connector event)
    health: list[ProducerHealth] = field(default_factory=list)
    events: Counter = field(default_factory=Counter)  # engine -> events applied
    unchecked: Counter = field(default_factory=Counter)  # reason -> newly unchecked

    def merge(self, other: Outcome) -> None:
        self.violations += other.violations
        self.dead_letters += other.dead_letters
        self.transfers += other.transfers
        self.health += other.health
        self.events.update(other.events)
        self.unchecked.update(other.unchecked)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read back: it is set aside, never run, and the engine rebuilt."""


def decode_checkpoint(blob: bytes, kind: type[Body]) -> Body:
    """The typed body of a checkpoint of `kind` (decoded here, once); CheckpointError for anything else."""
    try:
        body = checkpoint.decode(blob)
    except DecodeError as exc:
        raise CheckpointError(f"not a checkpoint record: {exc}") from exc
    except ValueError as exc:
        raise CheckpointError(f"not a checkpoint of this schema's shape: {exc}") from exc
    if not isinstance(body, kind):
        raise CheckpointError(f"a {checkpoint.BODY_NAMES[type(body)]} where a {checkpoint.BODY_NAMES[kind]} belongs")
    return body


# A checkpoint larger than this goes in several table entries (Kafka's default limit is ~1 MB).
CHUNK_BYTES = 512 << 10
_CHUNKED = b"KVCK"  # head of a chunked checkpoint: magic, chunk count (u32), blake2b-16 of the whole


def split_checkpoint(blob: bytes, limit: int = CHUNK_BYTES) -> list[bytes]:
    """One entry when it fits, else a head (magic, count, digest, first piece) and the other pieces."""
    if len(blob) <= limit:
        return [blob]
    room = limit - 24
    pieces = [blob[i : i + room] for i in range(0, len(blob), room)]
    head = _CHUNKED + len(pieces).to_bytes(4, "little") + hashlib.blake2b(blob, digest_size=16).digest()
    return [head + pieces[0], *pieces[1:]]


def chunk_count(head: bytes) -> int:
    """How many table entries the checkpoint whose first entry this is spans."""
    return int.from_bytes(head[4:8], "little") if head[:4] == _CHUNKED and len(head) >= 24 else 1


def join_chunks(entries: list[bytes | None]) -> bytes:
    """The checkpoint from its entries (head first); CheckpointError if one is missing or damaged."""
    head = entries[0]
    if len(entries) == 1:
        return head
    if any(e is None for e in entries):
        raise CheckpointError(f"{sum(e is None for e in entries)} of its {len(entries)} pieces are missing")
    blob = head[24:] + b"".join(entries[1:])
    if hashlib.blake2b(blob, digest_size=16).digest() != head[8:24]:
        raise CheckpointError(f"its {len(entries)} pieces do not add up to the checkpoint they were cut from")
    return blob


def violation_digest(v: Violation) -> str:
    content = json.dumps(v.to_record(), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(content.encode(), digest_size=10).hexdigest()


class ViolationIds:
    """Violation id = engine id / digest of the violation's content / how many identical
    violations were issued before. The core is deterministic, so replaying the same events
    from the same checkpoint issues the same ids, whatever the batching or the timing of
    checkpoints.

    Only the `limit` most recently issued digests are remembered: a violation's content names
    its rank and step, so one identical to a fact that many others ago is that fact again.
    """

    LIMIT = 4096

    def __init__(self, issued: dict[str, int] | None = None, *, limit: int = LIMIT) -> None:
        self.limit = limit
        self.issued: OrderedDict[str, int] = OrderedDict(issued or {})  # digest -> times issued, oldest first

    def issue(self, violations: list[Violation]) -> list[IssuedViolation]:
        out = []
        for v in violations:
            digest = violation_digest(v)
            n = self.issued.pop(digest, 0)
            self.issued[digest] = n + 1
            out.append(IssuedViolation(f"{v.engine_id}/{digest}/{n}", v))
        while len(self.issued) > self.limit:
            self.issued.popitem(last=False)
        return out

    def counts(self) -> list[IssuedCount]:
        """As a checkpoint keeps them, oldest first."""
        return [IssuedCount(digest=d, count=n) for d, n in self.issued.items()]

    @classmethod
    def from_counts(cls, items: list[IssuedCount]) -> ViolationIds:
        return cls({item.digest: item.count for item in items})


def progress_event(key: RankKey, incarnation: int, step: int) -> LedgerEvent:
    """A rank's clock for the transfer join: a Step event with neither input nor plan (its seq -1: not an
    event of the rank's own sequence)."""
    return LedgerEvent(key, incarnation, -1, 0, Step(step, StepKind.REAL))


class EngineProjection:
    """One engine's ledger, the offsets it covers, and the ids it has issued.

    The ledger checks the engine's own ranks (transfers included, as far as a
    rank sees them alone); joining both sides of a transfer is the transfer
    stream's job, so the ledger leaves it out (`join_transfers=False`).
    """

    def __init__(
        self,
        engine_id: str,
        ledger: Ledger | None = None,
        *,
        partition: int | None = None,
        next_offset: int = 0,
        ids=None,
        base=None,
    ):
        self.engine_id = engine_id
        self.ledger = ledger if ledger is not None else Ledger(join_transfers=False)
        self.partition = partition  # the events partition its records come from (None: not known yet)
        self.next_offset = next_offset  # first offset of that partition not yet applied
        self.ids: ViolationIds = ids if ids is not None else ViolationIds()
        self.reported_unchecked: Counter = Counter(self.ledger.coverage.unchecked)
        self.progress_sent: dict[RankKey, int] = {}  # rank -> last step forwarded to the join
        self.forwarded_transfers = False  # a connector event of it went to the join (since this process began)
        self.waypoints: deque[Waypoint] = deque(maxlen=WAYPOINTS)
        # Since the last checkpoint: its bytes and the events applied after it, to
        # rebuild the state when a record makes the core raise.
        self._base: bytes = base if base is not None else self.checkpoint()
        self._log: list[tuple[Record, LedgerEvent] | None] = []

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint(self) -> bytes:
        """The whole state as an Avro record (schemas/avro/checkpoint.avsc)."""
        return checkpoint.encode(
            ledger_checkpoint(
                self.ledger,
                self.engine_id,
                next_offset=self.next_offset,
                partition=self.partition,
                issued=self.ids.counts(),
            )
        )

    @classmethod
    def restore(cls, blob: bytes, engine_id: str | None = None) -> EngineProjection:
        """The projection a checkpoint describes (of `engine_id`, when given); CheckpointError otherwise."""
        body = decode_checkpoint(blob, EngineCheckpoint)
        if engine_id is not None and body.engine_id != engine_id:
            raise CheckpointError(f"the checkpoint of engine {body.engine_id!r} under the key of {engine_id!r}")
        try:
            ledger = ledger_of(body)
        except (StateError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the checkpoint does not describe a ledger: {exc}") from exc
        ids = ViolationIds.from_counts(body.issued)
        return cls(body.engine_id, ledger, partition=body.partition, next_offset=body.next_offset, ids=ids, base=blob)

    def mark_checkpointed(self) -> bytes:
        blob = self.checkpoint()
        self._base, self._log = blob, []
        steps = [slot.last_step for slot in self.ledger.ranks.values()]
        step = max(steps, default=-1)
        if step >= 0 and (not self.waypoints or step - self.waypoints[-1].step >= WAYPOINT_EVERY):
            self.waypoints.append(Waypoint(step, self.next_offset, blob))
        return blob

    # -- applying -----------------------------------------------------------------------
    def apply(self, items: list[tuple[Record, LedgerEvent]]) -> Outcome:
        """Apply decoded events of this engine, in offset order; skip what the state already covers.

        A rebalance makes the consumer seek back to the committed offset, so
        records it had already delivered come again, possibly in the same
        batch as their first delivery: an offset at or below one just taken is
        a repeat, and is skipped like one the checkpoint covers. A message
        carries one event or several (a batch): its events come together.
        """
        fresh, next_offset, taken = [], self.next_offset, None
        for record, event in items:
            if record is taken or record.offset >= next_offset:
                fresh.append((record, event))
                next_offset, taken = record.offset + 1, record
        items = fresh
        out = Outcome()
        if not items:
            return out
        self.next_offset = next_offset
        try:
            found = self.ledger.apply_many([e for _, e in items])
        except Exception:  # an event the core cannot take: find it, set it aside, keep the rest
            found, rejected = self._apply_one_by_one(items)
            out.dead_letters += rejected.values()
            items = [item for i, item in enumerate(items) if i not in rejected]
        self._log += items
        out.violations += self.ids.issue(found)
        out.events[self.engine_id] += len(items)
        for _, event in items:
            body = event.body
            if isinstance(body, ConnectorEvent) and body.transfer_id:
                out.transfers.append((body.transfer_id, event))
                self.forwarded_transfers = True
            elif isinstance(body, Health):
                out.health.append(ProducerHealth(self.engine_id, event.rank.label, body.events_dropped))
        # What the join needs from this engine's tables (each side's prefix), after what revealed it.
        out.transfers += [(e.body.transfer_id, e) for e in self.ledger.transfer_use.take_derived()]
        out.unchecked += self._new_unchecked()
        return out

    def settle(self) -> Outcome:
        """The watermark passed: steps still held for missing ranks are settled (rank_missing)."""
        out = Outcome()
        out.violations += self.ids.issue(self.ledger.settle_held())
        self._log.append(SETTLE)
        out.unchecked += self._new_unchecked()
        return out

    @property
    def holding(self) -> bool:
        """Steps are waiting for ranks that have not reported them yet."""
        return any(group.pending for group in self.ledger.step_groups.values())

    def progress(self) -> list[LedgerEvent]:
        """Progress events of the ranks that moved since the last call (the join's clock).

        Forward them only once every connector event up to those steps was
        sent: the join must see a rank's transfer events before its clock
        passes them.
        """
        out: list[LedgerEvent] = []
        if not self.joins_transfers:
            return out
        for key, slot in self.ledger.ranks.items():
            if slot.last_step > self.progress_sent.get(key, -1):
                self.progress_sent[key] = slot.last_step
                out.append(progress_event(key, slot.incarnation, slot.last_step))
        return out

    @property
    def joins_transfers(self) -> bool:
        """Whether the join needs this engine's clock: a rank declared a PD role (or has not said yet), or
        it forwarded a transfer. An engine outside every PD pair is no transfer's side and no side's peer;
        at TP=8 and 4 partitions its progress would be 32 messages per checkpoint for nothing."""
        return self.forwarded_transfers or any(
            slot.info is None or slot.info.pd_role != PdRole.NONE for slot in self.ledger.ranks.values()
        )

    def _new_unchecked(self) -> Counter:
        now = self.ledger.coverage.unchecked
        delta = Counter({k: n - self.reported_unchecked[k] for k, n in now.items() if n > self.reported_unchecked[k]})
        self.reported_unchecked = Counter(now)
        return delta

    def _apply_one_by_one(
        self, items: list[tuple[Record, LedgerEvent]]
    ) -> tuple[list[Violation], dict[int, DeadLetter]]:
        """Rebuild from the last checkpoint, event by event, leaving out every event the core raises on
        (by its place in `items`)."""
        rejected: dict[int, DeadLetter] = {}
        while True:
            base = EngineProjection.restore(self._base)
            ledger = base.ledger
            for entry in self._log:
                if entry is SETTLE:
                    ledger.settle_held()
                else:
                    ledger.apply(entry[1])
            found: list[Violation] = []
            failed = None
            for i, (record, event) in enumerate(items):
                if i in rejected:
                    continue
                try:
                    found += ledger.apply(event)
                except Exception as exc:
                    failed = i
                    index = sum(1 for r, _ in items[:i] if r is record)
                    detail = f"{type(exc).__name__}: {exc}"
                    rejected[i] = DeadLetter(record, "rejected_by_ledger", detail, index)
                    break
            if failed is None:
                self.ledger = ledger
                return found, rejected


class Decoder:
    """Raw records -> (record, event) per engine, or dead letters. A record holds one event or a batch.

    With a `lookup` (a Schema Registry's, by id) Confluent-framed records are read too, beside
    single-object ones: an id the registry does not know, or cannot be asked about, is an
    `unknown_schema` dead letter, as an unknown fingerprint is.
    """

    def __init__(self, lookup: Lookup | None = None) -> None:
        self.codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH, lookup=lookup)

    def decode(self, record: Record) -> list[LedgerEvent] | DeadLetter:
        """The record's events, typed (decoded once, here at the worker's edge)."""
        if record.value is None:
            return DeadLetter(record, "undecodable", "record without a value")
        try:
            events = self.codec.decode(record.value)
        except UnknownSchemaError as exc:
            return DeadLetter(record, "unknown_schema", str(exc))
        except DecodeError as exc:
            return DeadLetter(record, "undecodable", str(exc))
        if not events:
            return DeadLetter(record, "undecodable", "an empty batch")
        try:
            typed = [event_of(event) for event in events]
        except ValueError as exc:  # readable Avro, not a ledger event this reader can type
            return DeadLetter(record, "undecodable", str(exc))
        for event in typed:
            if record.key != event.engine_id.encode():
                # Keyed otherwise, the engine's ranks may sit in several partitions, out of order.
                detail = f"key {record.key!r} is not the engine id {event.engine_id!r}"
                return DeadLetter(record, "wrong_key", detail)
        return typed

    def split(self, records: list[Record]) -> tuple[dict[str, list[tuple[Record, LedgerEvent]]], list[DeadLetter]]:
        per_engine: dict[str, list[tuple[Record, LedgerEvent]]] = {}
        dead: list[DeadLetter] = []
        for record in records:
            decoded = self.decode(record)
            if isinstance(decoded, DeadLetter):
                dead.append(decoded)
                continue
            for event in decoded:
                per_engine.setdefault(event.engine_id, []).append((record, event))
        return per_engine, dead
