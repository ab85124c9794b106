"""The Faust app: the Kafka edge around the pure projections (projection.py, join.py).

One agent reads `<prefix>.events` in batches and, per engine, feeds the
engine's `Ledger`. Everything a batch reveals is sent at once: violations to
`<prefix>.violations`, dead letters to `<prefix>.deadletter`, connector events
with a transfer id to `<prefix>.transfers` (keyed by transfer id). At each
checkpoint every rank that moved sends its progress to every partition of
`<prefix>.transfers`. A second agent reads that topic and joins both sides of
every transfer (prefill/decode pairs), one `TransferJoin` per partition.

State lives in Faust tables (RocksDB, or memory in tests): `checkpoints`, one
entry per engine, and `transfer-joins`, one per transfers partition; see the
package docstring for why that, with violation ids, makes a crash lose and
duplicate nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from faust import streams as faust_streams
from faust.events import Event
from faust.types import TP, Message

from kvledger.schemas import LEDGER_EVENT, VIOLATION, ConfluentCodec, SingleObjectCodec
from kvledger.schemas.confluent import SchemaRegistry, value_subject
from kvledger.schemas.events import avro_datum, event_record
from kvledger.schemas.kinds import Unchecked
from kvledger.schemas.registry import raw_schema
from kvledger.stream_app.kafka_security import KafkaSecurity
from kvledger.stream_app.worker.client_logs import START_GRACE_S, hold_repeated_client_logs
from kvledger.stream_app.worker.faust_fixes import close_faust_holes
from kvledger.stream_app.worker.join import JoinProjection
from kvledger.stream_app.worker.metrics import WorkerMetrics
from kvledger.stream_app.worker.projection import (
    CheckpointError,
    DeadLetter,
    Decoder,
    EngineProjection,
    Outcome,
    Record,
    Waypoint,
    chunk_count,
    join_chunks,
    split_checkpoint,
)
from kvledger.stream_app.worker.topics import Topics
from kvledger.stream_app.worker.views import register_views

RECENT_VIOLATIONS = 200
RETIRED_KEPT = 256  # retired engines listed in /engines
RETIRED_TRAVEL = 16  # retired engines whose time travel stays possible (a crashed engine's findings too)
log = logging.getLogger("kvledger.worker")


@dataclass(frozen=True)
class WorkerSettings:
    bootstrap: str
    partitions: int = 4  # of the events topic (and so of the table's changelog)
    state_dir: Path = Path("kvledger-state")
    web_port: int = 6066
    store: str = "rocksdb"  # or "memory" (tests): then state is rebuilt from the changelog on start
    group: str = "kvledger"  # consumer group and app id
    topic_prefix: str = "kvledger"
    replication: int = 1
    settle_after: float = 5.0  # watermark: an engine silent this long has its held steps settled
    retire_after: float = 3600.0  # an engine silent this long is retired (one whose ranks all closed: at once)
    checkpoint_every: float = 1.0  # seconds between checkpoints (and so between offset commits)
    checkpoint_events: int = 8192  # ... or events, whichever comes first
    checkpoint_share: float = 0.1  # ... but checkpoints take at most this share of the time
    batch_size: int = 2048
    session_timeout: float = 10.0  # how soon the group notices a dead worker
    rocksdb_memory_mb: int = 64  # per table and partition: RocksDB's block cache and write buffers
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # how every client authenticates (--kafka-config)
    # A Schema Registry (its Confluent API URL): Confluent-framed events are read, violations published so.
    schema_registry: str | None = None
    # Start even on Faust/mode/aiokafka versions the fixes were not tested with (faust_fixes.py).
    untested_client_libraries: bool = False
    # Seconds after start during which the client's known start-up errors (a broker still starting:
    # no group coordinator yet) are logged as warnings (client_logs.py).
    client_start_grace: float = START_GRACE_S

    def rocksdb_options(self) -> dict[str, int]:
        """Bounded RocksDB memory (Faust's defaults allow 2.7 GB per table and partition): half for
        the block cache, half for two write buffers. Checkpoints are read back only at a rebalance."""
        mb = 1 << 20
        return {
            "block_cache_size": self.rocksdb_memory_mb * mb // 2,
            "block_cache_compressed_size": self.rocksdb_memory_mb * mb // 8,  # python-rocksdb only
            "write_buffer_size": self.rocksdb_memory_mb * mb // 4,
            "max_write_buffer_number": 2,
        }


@contextlib.contextmanager
def in_partition_of(event: faust.EventT):
    """Faust tables shard by the partition of the event being processed. Checkpoints are
    written between events, so they name the event whose partition they belong to."""
    token = faust_streams._current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        faust_streams._current_event.reset(token)


class StreamWorker:
    """Builds the Faust app and holds the engines it projects."""

    def __init__(self, settings: WorkerSettings):
        close_faust_holes(settings.untested_client_libraries)  # or UntestedClientLibraries (one line)
        hold_repeated_client_logs(start_grace=settings.client_start_grace)
        self.settings = s = settings
        self.topics = Topics(s.topic_prefix)
        self.metrics = WorkerMetrics()
        # RegistryError, before the app starts, if the registry does not answer or refuses the schema.
        self.registry = SchemaRegistry(s.schema_registry) if s.schema_registry else None
        self.decoder = Decoder(self.registry.writer_schema if self.registry else None)
        self.violation_codec = self._violation_codec()
        self.event_codec = SingleObjectCodec(LEDGER_EVENT)
        self.engines: dict[str, EngineProjection] = {}
        self.anchors: dict[str, faust.EventT] = {}  # engine -> its latest event (names its partition)
        self.last_active: dict[str, float] = {}  # engine -> monotonic time of its latest event
        self.dirty: set[str] = set()
        self.joins: dict[int, JoinProjection] = {}  # transfers partition -> its join
        self.join_anchors: dict[int, faust.EventT] = {}
        self.dirty_joins: set[int] = set()
        self.pieces: dict[bytes, int] = {}  # table key -> entries its checkpoint spans
        self.retiring: dict[str, str] = {}  # engine -> why: dropped at the next checkpoint
        self.retired: deque[dict] = deque(maxlen=RETIRED_KEPT)
        # engine -> (its events partition, the offset after its last record, its waypoints), newest last
        self.retired_travel: dict[str, tuple[int, int, list[Waypoint]]] = {}
        self.unacked: list[tuple[faust.StreamT, faust.EventT]] = []
        self.positions: dict[Any, int] = {}  # events tp -> next offset to process
        self.recent: deque = deque(maxlen=RECENT_VIOLATIONS)
        self.last_checkpoint = time.monotonic()
        self.checkpoint_cost = 0.0  # seconds the last checkpoint took
        self.lock = asyncio.Lock()
        self.app = self._make_app()

    def _violation_codec(self) -> SingleObjectCodec | ConfluentCodec:
        """Violations go out single-object encoded, or with a registry in the Confluent wire format,
        their schema registered under `<prefix>.violations-value`."""
        if self.registry is None:
            return SingleObjectCodec(VIOLATION)
        subject = value_subject(self.topics.violations)
        return ConfluentCodec(VIOLATION, self.registry.register(subject, raw_schema("violation")))

    # -- the app ---------------------------------------------------------------------------
    def _make_app(self) -> faust.App:
        s = self.settings
        store = "memory://" if s.store == "memory" else "rocksdb://"
        app = faust.App(
            s.group,
            broker=f"kafka://{s.bootstrap}",
            broker_credentials=s.kafka.faust_credentials(),
            store=store,
            datadir=str(s.state_dir),
            web_enabled=True,
            web_bind="127.0.0.1",
            web_port=s.web_port,
            web_host="127.0.0.1",
            topic_partitions=s.partitions,
            topic_replication_factor=s.replication,
            consumer_auto_offset_reset="earliest",
            processing_guarantee="at_least_once",
            producer_acks=-1,
            producer_linger=0.002,
            broker_session_timeout=s.session_timeout,
            broker_heartbeat_interval=min(3.0, s.session_timeout / 4),
            broker_commit_interval=s.checkpoint_every,
            stream_buffer_maxsize=4 * s.batch_size,
            # Events are acked only once a checkpoint covers them (see _checkpoint); a rebalance or a
            # shutdown need not wait for that: what is not acked is re-read, under the same ids.
            stream_wait_empty=False,
            # Step events are a few KB: the 1 MB default fetch caps a partition at a few thousand per second.
            consumer_max_fetch_size=32 << 20,
            broker_max_poll_records=4 * s.batch_size,
            table_standby_replicas=0,
        )
        raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
        self.events_topic = app.topic(self.topics.events, partitions=s.partitions, **raw)
        self.violations_topic = app.topic(self.topics.violations, **raw)
        self.deadletter_topic = app.topic(self.topics.deadletter, **raw)
        self.transfers_topic = app.topic(self.topics.transfers, partitions=s.partitions, **raw)

        def table(name: str) -> faust.Table:  # options of its own: Faust's store edits the dict it is given
            options = s.rocksdb_options() if s.store == "rocksdb" else None
            return app.Table(name, partitions=s.partitions, key_type=bytes, value_type=bytes, options=options)

        self.table = table("checkpoints")
        self.join_table = table("transfer-joins")

        @app.agent(self.events_topic, name="project")
        async def project(stream: faust.StreamT) -> None:
            async for events in stream.noack_take(s.batch_size, within=0.01):
                async with self.lock:
                    await self._handle(stream, events)

        @app.agent(self.transfers_topic, name="join")
        async def join(stream: faust.StreamT) -> None:
            async for events in stream.noack_take(s.batch_size, within=0.01):
                async with self.lock:
                    await self._join(stream, events)

        @app.timer(interval=min(0.5, s.checkpoint_every))
        async def housekeeping() -> None:
            await self._seed_positions()
            async with self.lock:
                await self._settle_silent_engines()
                await self._mark_retiring()
                if self._checkpoint_due(s.checkpoint_every) or self.retiring:
                    await self._checkpoint()
            self._update_lag()

        @app.on_partitions_assigned.connect
        async def on_assigned(app: faust.App, assigned, **kwargs) -> None:
            # A rebalance revokes everything, then assigns: keep what came back to us
            # (nobody else processed it in between), drop what went to another worker.
            self._forget_all_but(assigned)

        @self.table.on_recover
        async def adopt() -> None:
            async with self.lock:
                self._adopt_engines()

        register_views(app, self)
        return app

    # -- one batch --------------------------------------------------------------------------
    async def _handle(self, stream: faust.StreamT, events: list[faust.EventT]) -> None:
        records = []
        for event in events:
            m = event.message
            records.append(Record(m.partition, m.offset, m.key, m.value))
            self.positions[m.tp] = m.offset + 1
        by_record = {id(r): e for r, e in zip(records, events, strict=True)}
        per_engine, dead = self.decoder.split(records)
        outcome, refused = Outcome(dead_letters=dead), Outcome()
        now = time.monotonic()
        for engine_id, items in per_engine.items():
            anchor = by_record[id(items[-1][0])]
            projection = self._projection(engine_id, anchor, refused)
            self.retiring.pop(engine_id, None)  # it speaks again: not retired
            self.anchors[engine_id] = anchor
            self.last_active[engine_id] = now
            outcome.merge(projection.apply(items))
            self.dirty.add(engine_id)
        await self._publish(refused, source=self.changelog(self.table))
        await self._publish(outcome)
        await self._taken(stream, events)

    async def _join(self, stream: faust.StreamT, events: list[faust.EventT]) -> None:
        per_partition: dict[int, list[Record]] = {}
        for event in events:
            m = event.message
            per_partition.setdefault(m.partition, []).append(Record(m.partition, m.offset, m.key, m.value))
            self.join_anchors[m.partition] = event
        outcome, refused = Outcome(), Outcome()
        for partition, records in per_partition.items():
            outcome.merge(self._join_projection(partition, refused).apply(records))
            self.dirty_joins.add(partition)
        await self._publish(refused, source=self.changelog(self.join_table))
        await self._publish(outcome, source=self.topics.transfers)
        await self._taken(stream, events)

    async def _taken(self, stream: faust.StreamT, events: list[faust.EventT]) -> None:
        """Events applied and published: acked at the checkpoint that covers them."""
        self.unacked += [(stream, e) for e in events]
        if len(self.unacked) >= self.settings.checkpoint_events and self._checkpoint_due(0.0):
            await self._checkpoint()

    # -- checkpoints in the tables -----------------------------------------------------------
    @staticmethod
    def changelog(table) -> str:
        return table.changelog_topic.get_topic_name()

    def _read_checkpoint(self, table, key: bytes) -> bytes | None:
        """A checkpoint, put back together from its entries; CheckpointError if it cannot be."""
        head = table.get(key)
        if head is None:
            return None
        n = chunk_count(head)
        self.pieces[key] = n
        return join_chunks([head, *(table.get(_piece_key(key, i)) for i in range(1, n))])

    def _write_checkpoint(self, table, key: bytes, blob: bytes) -> None:
        """Entries under the broker's message limit: the other pieces first, the head (which counts
        them) last, then stale pieces of a longer predecessor dropped."""
        pieces = split_checkpoint(blob)
        for i in range(1, len(pieces)):
            table[_piece_key(key, i)] = pieces[i]
        table[key] = pieces[0]
        for i in range(len(pieces), self.pieces.get(key, 1)):
            del table[_piece_key(key, i)]
        self.pieces[key] = len(pieces)

    def _restore(self, table, key: bytes, restore, partition: int, refused: Outcome | None):
        """The state a table entry holds, None when there is none, or when it cannot be read: then it is
        dead-lettered with its reason (its bytes kept as data, never run) and the state starts anew.
        Without `refused` (no record of it read yet) it is left for the next record, which does that."""
        try:
            blob = self._read_checkpoint(table, key)
            return restore(blob) if blob is not None else None
        except CheckpointError as exc:
            if refused is None:
                log.warning("%s %r: checkpoint not loaded (%s); its next record rebuilds it", table.name, key, exc)
                return None
            log.warning("%s %r: checkpoint refused (%s); starting anew", table.name, key, exc)
            record = Record(partition, -1, key, table.get(key))
            refused.dead_letters.append(DeadLetter(record, "checkpoint_refused", str(exc)))
            return None

    def _join_projection(self, partition: int, refused: Outcome) -> JoinProjection:
        projection = self.joins.get(partition)
        if projection is None:
            key = str(partition).encode()
            with in_partition_of(self.join_anchors[partition]):
                restored = self._restore(
                    self.join_table, key, lambda b: JoinProjection.restore(b, partition), partition, refused
                )
            projection = restored if restored is not None else JoinProjection(partition)
            self.joins[partition] = projection
            log.info("transfers partition %d: %s", partition, "restored" if restored else "new")
        return projection

    def _projection(self, engine_id: str, anchor: faust.EventT, refused: Outcome) -> EngineProjection:
        projection = self.engines.get(engine_id)
        if projection is None:
            key = engine_id.encode()
            partition, before = anchor.message.tp.partition, len(refused.dead_letters)
            with in_partition_of(anchor):
                restored = self._restore(
                    self.table, key, lambda b: EngineProjection.restore(b, engine_id), partition, refused
                )
            projection = restored if restored is not None else EngineProjection(engine_id)
            projection.partition = partition
            if len(refused.dead_letters) > before:
                # Rebuilt from the topic: from the committed offset on, the engine resyncs at its next snapshot.
                projection.ledger.coverage.unchecked[Unchecked.CHECKPOINT_REFUSED] += 1
            self.engines[engine_id] = projection
            log.info(
                "engine %s: %s, in a batch up to %s/%d",
                engine_id,
                f"restored, offsets < {projection.next_offset} covered" if restored else "new",
                partition,
                anchor.message.offset,
            )
        return projection

    def _adopt_engines(self) -> None:
        """Load every engine checkpointed in an assigned partition, once the table is recovered.

        An engine is otherwise loaded when its next record is read: one whose
        records were all committed before a restart or a rebalance would never
        be, and the steps it held would never be settled nor the engine retired.
        Its silence counts from now. A checkpoint that cannot be read is left
        for its engine's next record, which dead-letters it (see _restore).
        """
        assigned = self.app.consumer.assignment()
        now, adopted = time.monotonic(), 0
        for key in list(self.table.keys()):
            engine_id = key.decode(errors="replace")
            if _PIECE in key or engine_id in self.engines:
                continue
            restore = functools.partial(EngineProjection.restore, engine_id=engine_id)
            projection = self._restore(self.table, key, restore, -1, None)
            if projection is None or projection.partition is None:
                continue  # written before checkpoints named their partition: loaded at its next record
            tp = TP(self.topics.events, projection.partition)
            if tp not in assigned:
                continue
            self.engines[engine_id] = projection
            self.anchors[engine_id] = _anchor_of(self.app, tp)
            self.last_active[engine_id] = now
            adopted += 1
        if adopted:
            log.info("adopted %d engine(s) from their checkpoints, none of their records left to read", adopted)

    async def _publish(self, outcome: Outcome, source: str | None = None) -> None:
        m = self.metrics
        for issued in outcome.violations:
            v = issued.violation
            await self.violations_topic.send(
                key=issued.id.encode(),
                value=self.violation_codec.encode(v.to_record()),
                headers=[("kvledger.engine_id", v.engine_id.encode())],
            )
            m.violations.labels(v.engine_id, v.kind).inc()
            self.recent.append(issued)
        for dead in outcome.dead_letters:
            r = dead.record
            headers = [
                ("kvledger.reason", dead.reason.encode()),
                ("kvledger.detail", dead.detail.encode(errors="replace")),
                ("kvledger.source", f"{source or self.topics.events}/{r.partition}/{r.offset}".encode()),
            ]
            if dead.index is not None:  # one event of a batch: the message is kept whole, this names the event
                headers.append(("kvledger.event_index", str(dead.index).encode()))
            await self.deadletter_topic.send(key=r.key, value=r.value, headers=headers)
            m.deadletters.labels(dead.reason).inc()
        for transfer_id, event in outcome.transfers:
            value = self.event_codec.encode(avro_datum(event_record(event)))
            await self.transfers_topic.send(key=transfer_id.encode(), value=value)
        for health in outcome.health:
            m.producer_dropped.labels(health.engine_id, health.rank).set(health.events_dropped)
        for engine_id, n in outcome.events.items():
            m.engine_events(engine_id, n)
            if (projection := self.engines.get(engine_id)) is not None:
                m.ranks_out_of_sync.labels(engine_id).set(projection.ledger.ranks_out_of_sync)
        for reason, n in outcome.unchecked.items():
            m.unchecked.labels(reason).inc(n)

    # -- watermark, checkpoints, rebalance ---------------------------------------------------
    async def _settle_silent_engines(self) -> None:
        """A rank still missing once its engine went quiet is reported (rank_missing), never held forever.

        Quiet means: nothing of the engine for `settle_after` seconds while the
        worker was consuming (a rebalance restarts the count) and nothing of its
        partition left to read, so a worker that is behind never blames a rank.
        """
        if not self.app.flow_control.is_active():
            return  # a rebalance: nothing is being read, so no engine can be called silent
        now = time.monotonic()
        assigned = self.app.consumer.assignment()
        outcome = Outcome()
        for engine_id, projection in self.engines.items():
            tp = self.anchors[engine_id].message.tp
            silent = now - self.last_active.get(engine_id, now) >= self.settings.settle_after
            if silent and projection.holding and tp in assigned and self.lag(tp) == 0:
                outcome.merge(projection.settle())
                self.dirty.add(engine_id)
        await self._publish(outcome)

    async def _mark_retiring(self) -> None:
        """Engines whose ranks all shut down, or silent for `retire_after` while the worker was
        consuming and caught up: their held steps are settled now, their state dropped at the next
        checkpoint (after what the settling found is on the broker)."""
        if not self.app.flow_control.is_active():
            return
        now = time.monotonic()
        assigned = self.app.consumer.assignment()
        outcome = Outcome()
        for engine_id, projection in self.engines.items():
            tp = self.anchors[engine_id].message.tp
            if engine_id in self.retiring or tp not in assigned:
                continue
            # Closed: nothing more comes of its ranks, however far behind the worker is. Silent: only
            # once its partition is read to the end (a worker that is behind never calls one silent).
            silent = self.lag(tp) == 0 and now - self.last_active.get(engine_id, now) >= self.settings.retire_after
            reason = "closed" if projection.ledger.closed else "silent" if silent else None
            if reason is not None:
                outcome.merge(projection.settle())
                self.retiring[engine_id] = reason
        await self._publish(outcome)

    def _retire(self, engine_id: str, reason: str) -> None:
        """Drop an engine's state and its checkpoint (a tombstone: compaction forgets it)."""
        projection = self.engines.pop(engine_id)
        key = engine_id.encode()
        with in_partition_of(self.anchors.pop(engine_id)):
            for i in range(1, self.pieces.pop(key, 1)):
                del self.table[_piece_key(key, i)]
            if key in self.table:
                del self.table[key]
        self.last_active.pop(engine_id, None)
        self.dirty.discard(engine_id)
        ledger = projection.ledger
        self.retired.append({"engine_id": engine_id, "reason": reason, "events": ledger.events, "steps": ledger.steps})
        if projection.partition is not None:
            self.retired_travel.pop(engine_id, None)
            self.retired_travel[engine_id] = (projection.partition, projection.next_offset, list(projection.waypoints))
            while len(self.retired_travel) > RETIRED_TRAVEL:
                del self.retired_travel[next(iter(self.retired_travel))]
        self.metrics.retired.labels(reason).inc()
        self.metrics.forget_engine(engine_id, [k.label for k in ledger.ranks])
        log.info("engine %s: retired (%s) after %d events", engine_id, reason, ledger.events)

    async def _seed_positions(self) -> None:
        """An assigned events partition nothing was read of since: its lag counts from the consumer's
        position (else an engine adopted from its checkpoint could never be found caught up)."""
        for tp in self.app.consumer.assignment():
            if tp.topic != self.topics.events or tp in self.positions:
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                position = await asyncio.wait_for(self.app.consumer.position(tp), timeout=1.0)
                if position is not None and tp not in self.positions:  # no record processed meanwhile
                    self.positions[tp] = position

    def lag(self, tp) -> int | None:
        """Records of an events partition not processed yet; None before its first fetch."""
        try:
            highwater = self.app.consumer.highwater(tp)
        except Exception:  # not fetched since the assignment
            return None
        done = self.positions.get(tp)
        return max(highwater - done, 0) if highwater is not None and done is not None else None

    def _checkpoint_due(self, interval: float) -> bool:
        """`interval` seconds passed since the last checkpoint, and enough for its cost to stay a small
        share of the time: with many engines per partition a checkpoint encodes many ledgers."""
        since = time.monotonic() - self.last_checkpoint
        return since >= max(interval, self.checkpoint_cost / self.settings.checkpoint_share)

    async def _checkpoint(self) -> None:
        """Publish, then record state, then let the offsets go.

        Order matters: every violation of the covered events is on the broker
        before the checkpoint that covers them is written, and events are acked
        (so their offsets may be committed) only once a checkpoint covers them.
        """
        started = self.last_checkpoint = time.monotonic()
        if not self.dirty and not self.dirty_joins and not self.unacked and not self.retiring:
            return
        await self._flush()
        assigned = self.app.consumer.assignment()
        # After the flush: a rank's transfer events are on the topic before its clock passes them.
        await self._send_progress(assigned)
        for engine_id, reason in sorted(self.retiring.items()):
            if self.anchors[engine_id].message.tp in assigned:
                self._retire(engine_id, reason)
        self.retiring.clear()
        self.metrics.engines.set(len(self.engines))
        for engine_id in sorted(self.dirty):
            anchor = self.anchors[engine_id]
            if anchor.message.tp not in assigned:
                continue  # revoked: the partition's new owner checkpoints it now
            with in_partition_of(anchor):
                self._write_checkpoint(self.table, engine_id.encode(), self.engines[engine_id].mark_checkpointed())
            log.debug("engine %s: checkpoint, offsets < %d", engine_id, self.engines[engine_id].next_offset)
        for partition in sorted(self.dirty_joins):
            anchor = self.join_anchors[partition]
            if anchor.message.tp in assigned:
                with in_partition_of(anchor):
                    self._write_checkpoint(self.join_table, str(partition).encode(), self.joins[partition].checkpoint())
        self.dirty.clear()
        self.dirty_joins.clear()
        await self._flush()  # the checkpoints themselves, before the offsets they cover may be committed
        unacked, self.unacked = self.unacked, []
        log.debug("acking %d events, last offsets %s", len(unacked), dict(self.positions))
        for stream, event in unacked:
            # An event of a revoked partition is not acked: no checkpoint of ours covers it, and an ack
            # would stay with the consumer and be committed if the partition came back to us.
            if event.message.tp in assigned:
                await stream.ack(event)
        self.checkpoint_cost = time.monotonic() - started

    async def _send_progress(self, assigned) -> None:
        """Each rank that moved tells every transfers partition its step (the joins' clock)."""
        for engine_id in sorted(self.dirty):
            if self.anchors[engine_id].message.tp not in assigned:
                continue
            for event in self.engines[engine_id].progress():
                value = self.event_codec.encode(avro_datum(event_record(event)))
                for partition in range(self.settings.partitions):
                    await self.transfers_topic.send(key=engine_id.encode(), value=value, partition=partition)

    async def _flush(self) -> None:
        """Wait until everything sent so far is on the broker.

        Table writes go through Faust's producer buffer, whose own flush gives
        up once no message left it for 0.1 s: drained here until empty, then
        the Kafka producer is flushed.
        """
        producer = self.app.producer
        while producer.buffer.size:
            await producer.buffer.flush()
        await producer.flush()

    def _forget_all_but(self, assigned) -> None:
        for engine_id in [e for e, a in self.anchors.items() if a.message.tp not in assigned]:
            for held in (self.engines, self.anchors, self.last_active, self.retiring):
                held.pop(engine_id, None)
            self.dirty.discard(engine_id)
        now = time.monotonic()
        for engine_id in self.last_active:  # kept: silence counts from now, the rebalance was no engine's
            self.last_active[engine_id] = now
        for partition in [p for p, a in self.join_anchors.items() if a.message.tp not in assigned]:
            for held in (self.joins, self.join_anchors):
                held.pop(partition, None)
            self.dirty_joins.discard(partition)
        for tp in [tp for tp in self.positions if tp not in assigned]:
            if self.positions.pop(tp, None) is not None:
                with contextlib.suppress(KeyError):
                    self.metrics.consumer_lag.remove(tp.topic, str(tp.partition))

    def _update_lag(self) -> None:
        for tp in self.app.consumer.assignment():
            lag = self.lag(tp) if tp.topic == self.topics.events else None
            if lag is not None:
                self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(lag)


_PIECE = b"\x00"  # separates a checkpoint's key from its piece number (never in an engine id)


def _piece_key(key: bytes, i: int) -> bytes:
    """The table key of piece i (>= 1) of a chunked checkpoint."""
    return key + _PIECE + str(i).encode()


def _anchor_of(app: faust.App, tp: TP) -> faust.EventT:
    """An event that only names a partition: the anchor of an engine adopted before any record of it is read."""
    message = Message(tp.topic, tp.partition, -1, 0.0, 0, {}, None, None, None, tp=tp)
    return Event(app, None, None, {}, message)


def run_worker(settings: WorkerSettings, loglevel: str = "warning") -> None:
    """Run a worker in the foreground until SIGTERM/SIGINT."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    worker = StreamWorker(settings)
    faust.Worker(worker.app, loglevel=loglevel, quiet=True, redirect_stdouts=False).execute_from_commandline()
