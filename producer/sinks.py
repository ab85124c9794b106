"""Where captured events go: the file ledger (the embedded default) or Kafka.

Sinks run in a rank's recorder process (its drain thread), never in the engine's. `lost` counts events a
sink accepted but could not deliver (Kafka delivery failures, undelivered at
close), so a rank's loss is counted exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.producer.config import RegistrySpec, SinkSpec
from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
from kvledger.schemas.events import avro_datum
from kvledger.schemas.files import Retention, SegmentWriter
from kvledger.schemas.registry import batch_raw

log = logging.getLogger("kvledger.producer")


# A block of the file ledger waits at most this long for more steps before it is written
# (its linger): with the drain thread's period, a killed rank loses at most its last ~0.15 s.
FILE_LINGER_S = 0.1


class FileSink:
    """Appends events to a file ledger, one segment stream per rank incarnation.

    Blocks of up to ~64 KiB compress several steps together; a block reaches the
    file, whole, within `flush_interval` seconds of its first event, like a Kafka
    producer's linger; at once, with the stream confirmed complete, when the
    recorder finds its rank idle or is asked to (`flush`); and at close. One
    recorder per sink: `flush` confirms every stream it writes. With `retention`,
    each rank directory is bounded (`schemas.files.Retention`): segments are cut
    at snapshots and the oldest deleted on the drain thread, counted in
    `deleted_segments` and `deleted_bytes`.
    """

    lost = 0  # a write either lands or raises

    def __init__(
        self,
        root: str | Path,
        *,
        max_segment_bytes: int = 64 << 20,
        codec: str = "deflate",
        flush_interval: float = FILE_LINGER_S,
        retention: Retention | None = None,
    ):
        self.root = Path(root)
        self.max_segment_bytes = max_segment_bytes
        self.codec = codec
        self.flush_interval = flush_interval
        self.retention = retention
        self._writers: dict[tuple, SegmentWriter] = {}
        self._deleted_by_closed = (0, 0)  # (segments, bytes) of writers already closed

    @property
    def deleted_segments(self) -> int:
        return self._deleted_by_closed[0] + sum(w.deleted_segments for w in self._writers.values())

    @property
    def deleted_bytes(self) -> int:
        return self._deleted_by_closed[1] + sum(w.deleted_bytes for w in self._writers.values())

    def write(self, events: Iterable[dict]) -> None:
        batches: dict[tuple, list[dict]] = {}
        for event in events:
            key = (event["engine_id"], event["dp_rank"], event["tp_rank"], event["pp_rank"], event["incarnation"])
            batches.setdefault(key, []).append(avro_datum(event))
        for key, batch in batches.items():
            writer = self._writers.get(key)
            if writer is None:
                writer = self._writers[key] = SegmentWriter(
                    self.root,
                    *key,
                    max_segment_bytes=self.max_segment_bytes,
                    codec=self.codec,
                    flush_interval=self.flush_interval,
                    retention=self.retention,
                )
            writer.write(batch)

    def tick(self) -> None:
        """Called by the drain thread now and then: blocks due for the file go there, even when idle."""
        for writer in self._writers.values():
            writer.flush_if_due()

    def flush(self) -> None:
        """Everything captured is here (the rank is idle, or a signal came): write it and say so."""
        for writer in self._writers.values():
            writer.confirm()

    def close(self, timeout: float = 0.0) -> None:
        for writer in self._writers.values():
            writer.close()
        self._deleted_by_closed = (self.deleted_segments, self.deleted_bytes)
        self._writers.clear()

    def __enter__(self) -> FileSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


KAFKA_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "compression.type": "lz4",
    "linger.ms": 20,
    "batch.size": 1 << 20,
    # Bound how long an unreachable broker can hold events before they count as lost.
    "message.timeout.ms": 30_000,
    "queue.buffering.max.messages": 100_000,
    # Java's key hashing, so consumers in any language agree on the partition of an engine.
    "partitioner": "murmur2_random",
}
# A sink whose registry did not answer asks again this often (on the drain thread); meanwhile
# every event counts as lost.
REGISTRY_RETRY_S = 30.0


@dataclass
class _Pending:
    """Event bodies waiting to leave as one message."""

    bodies: list[bytes] = field(default_factory=list)
    size: int = 0
    since: float = 0.0


class KafkaSink:
    """Produces events to a Kafka topic, keyed by engine id (all ranks of an engine in one partition).

    Several events travel as one message (`kvledger.LedgerEventBatch`, up to
    `batch_events` events or `batch_bytes`, sent at the latest `linger`
    seconds after its first event): a consumer's cost is per message, and a
    step is one event. Idempotent and compressed; `settings` (security
    protocol, SASL, TLS, ...) pass through to the client and win over the
    defaults.

    With a `registry`, the batch schema is registered under `<topic>-value`
    as the sink starts and messages are in the Confluent wire format. A
    registry that cannot be reached or refuses the schema is said once, in
    the log; the sink then sends nothing and counts every event lost, asking
    an unreachable registry again every REGISTRY_RETRY_S.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        settings: dict[str, Any] | None = None,
        *,
        batch_events: int = 128,
        batch_bytes: int = 512 << 10,
        linger: float = 0.1,
        registry: RegistrySpec | None = None,
    ):
        from confluent_kafka import Producer  # only engines that trace to Kafka need the client

        self.topic = topic
        self.registry = registry
        self.schema_id: int | None = None  # the batch schema's registry id, once registered
        self._registry_retry_at: float | None = None  # when to ask an unreachable registry again
        self.codec: BatchCodec | None = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH) if registry is None else None
        self.batch_events, self.batch_bytes, self.linger = batch_events, batch_bytes, linger
        self.delivered = 0  # events, not messages
        self.failed = 0
        self.messages = 0  # messages the client took
        self._accepted = 0  # events in them
        self._unsent = 0
        self._pending: dict[bytes, _Pending] = {}  # engine id -> its next message
        self._errors_seen: set[int] = set()
        config = {**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap, **(settings or {}), "error_cb": self._on_error}
        self._producer = Producer(config)
        if registry is not None:
            self._register()

    def _register(self) -> None:
        """Register the batch schema; the codec frames with its id. A failure is said once."""
        from kvledger.schemas.confluent import RegistryError, RegistryUnreachable, SchemaRegistry, value_subject

        retrying = self._registry_retry_at is not None
        self._registry_retry_at = None
        subject = value_subject(self.topic)
        try:
            self.schema_id = SchemaRegistry(self.registry.url, self.registry.settings).register(subject, batch_raw())
        except RegistryError as exc:
            if not retrying:
                log.error("kv_trace: Kafka sink: %s; no event is sent, every one counts as lost", exc)
            if isinstance(exc, RegistryUnreachable):  # a refusal stays a refusal
                self._registry_retry_at = time.monotonic() + REGISTRY_RETRY_S
            return
        self.codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH, schema_id=self.schema_id)
        if retrying:
            log.warning("kv_trace: Kafka sink: the Schema Registry answered; events are sent again")

    @property
    def lost(self) -> int:
        return self.failed + self._unsent

    def _on_error(self, err) -> None:
        """The client's own errors (the broker unreachable, credentials refused): said once per kind,
        in words an operator can act on; the events they cost are counted as their deliveries fail."""
        from confluent_kafka import KafkaError

        causes = {KafkaError._AUTHENTICATION, KafkaError._SSL}
        if err.code() in self._errors_seen or (
            err.code() == KafkaError._ALL_BROKERS_DOWN and causes & self._errors_seen
        ):
            return  # said already, or the consequence of what was
        self._errors_seen.add(err.code())
        hint = {
            KafkaError._AUTHENTICATION: "authentication failed: check kv_trace.kafka's sasl.* settings",
            KafkaError._SSL: "TLS failed: check kv_trace.kafka's ssl.* settings (ssl.ca.location)",
            KafkaError._ALL_BROKERS_DOWN: "no broker reachable",
        }.get(err.code(), "client error")
        log.error("kv_trace: Kafka sink: %s (%s); events count as lost until it recovers", hint, err.str())

    def _on_delivery(self, events: int, err) -> None:
        if err is None:
            self.delivered += events
        else:
            if not self.failed:
                log.warning("kv_trace: Kafka delivery failed: %s (further failures counted only)", err)
            self.failed += events

    def write(self, events: list[dict]) -> None:
        if self.codec is None:  # no registry id to frame them with
            self.failed += len(events)
            self.tick()
            return
        now = time.monotonic()
        for event in events:
            key = event["engine_id"].encode()
            body = self.codec.body(avro_datum(event))
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = _Pending(since=now)
            elif len(pending.bodies) >= self.batch_events or pending.size + len(body) > self.batch_bytes:
                self._send(key)
                pending = self._pending[key] = _Pending(since=now)
            pending.bodies.append(body)
            pending.size += len(body)
        self.tick()

    def tick(self) -> None:
        """Send what has waited `linger` seconds; called by the drain thread even when idle."""
        now = time.monotonic()
        if self._registry_retry_at is not None and now >= self._registry_retry_at:
            self._register()
        for key in [k for k, p in self._pending.items() if now - p.since >= self.linger]:
            self._send(key)
        self._producer.poll(0)

    def flush(self) -> None:
        """The rank is idle: send what waits now, without its linger."""
        for key in list(self._pending):
            self._send(key)
        self._producer.poll(0)

    def _send(self, key: bytes) -> None:
        pending = self._pending.pop(key)
        n = len(pending.bodies)
        try:
            self._producer.produce(
                self.topic,
                key=key,
                value=self.codec.join(pending.bodies),
                on_delivery=lambda err, _msg: self._on_delivery(n, err),
            )
        except BufferError:  # the client's own queue is full: the broker is not keeping up
            self.failed += n
        else:
            self.messages += 1
            self._accepted += n

    def close(self, timeout: float = 5.0) -> None:
        for key in list(self._pending):
            self._send(key)
        self._unsent = 0
        if self._producer.flush(timeout):
            # Messages still queued hold several events each: count events, from what was delivered.
            self._unsent = self._accepted - self.delivered - self.failed


def open_sink(spec: SinkSpec, kafka_settings: dict[str, Any] | None = None, registry: RegistrySpec | None = None):
    if spec.kind == "file":
        retention = None
        if spec.retain_bytes or spec.retain_hours:
            retention = Retention(max_bytes=spec.retain_bytes, max_age_s=spec.retain_hours * 3600)
        return FileSink(spec.path, max_segment_bytes=spec.segment_bytes, retention=retention)
    return KafkaSink(spec.bootstrap, spec.topic, kafka_settings, registry=registry)
