"""Where captured events go: the file ledger (the embedded default) or Kafka.

Sinks run on the drain thread, never on the engine's. `lost` counts events a
sink accepted but could not deliver (Kafka delivery failures, undelivered at
close), so a rank's loss is counted exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvledger.producer.config import SinkSpec
from kvledger.schemas import LEDGER_EVENT, SingleObjectCodec
from kvledger.schemas.files import SegmentWriter

log = logging.getLogger("kvledger.producer")


class FileSink:
    """Appends events to a file ledger, one segment stream per rank incarnation.

    Blocks of ~64 KiB compress several steps together; a block reaches the file
    within `flush_interval` seconds (and at close), like a Kafka producer's linger.
    """

    lost = 0  # a write either lands or raises

    def __init__(
        self,
        root: str | Path,
        *,
        max_segment_bytes: int = 64 << 20,
        codec: str = "deflate",
        flush_interval: float = 1.0,
    ):
        self.root = Path(root)
        self.max_segment_bytes = max_segment_bytes
        self.codec = codec
        self.flush_interval = flush_interval
        self._writers: dict[tuple, SegmentWriter] = {}

    def write(self, events: Iterable[dict]) -> None:
        batches: dict[tuple, list[dict]] = {}
        for event in events:
            key = (event["engine_id"], event["dp_rank"], event["tp_rank"], event["pp_rank"], event["incarnation"])
            batches.setdefault(key, []).append(event)
        for key, batch in batches.items():
            writer = self._writers.get(key)
            if writer is None:
                writer = self._writers[key] = SegmentWriter(
                    self.root,
                    *key,
                    max_segment_bytes=self.max_segment_bytes,
                    codec=self.codec,
                    flush_interval=self.flush_interval,
                )
            writer.write(batch)

    def close(self, timeout: float = 0.0) -> None:
        for writer in self._writers.values():
            writer.close()
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


class KafkaSink:
    """Produces events to a Kafka topic, keyed by engine id (all ranks of an engine in one partition).

    Idempotent, compressed and batched; `settings` (security protocol, SASL,
    TLS, ...) pass through to the client and win over the defaults.
    """

    def __init__(self, bootstrap: str, topic: str, settings: dict[str, Any] | None = None):
        from confluent_kafka import Producer  # only engines that trace to Kafka need the client

        self.topic = topic
        self.codec = SingleObjectCodec(LEDGER_EVENT)
        self.delivered = 0
        self.failed = 0
        self._unsent = 0
        self._producer = Producer({**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap, **(settings or {})})

    @property
    def lost(self) -> int:
        return self.failed + self._unsent

    def _on_delivery(self, err, _msg) -> None:
        if err is None:
            self.delivered += 1
        else:
            if not self.failed:
                log.warning("kv_trace: Kafka delivery failed: %s (further failures counted only)", err)
            self.failed += 1

    def write(self, events: list[dict]) -> None:
        for i, event in enumerate(events):
            try:
                self._producer.produce(
                    self.topic,
                    key=event["engine_id"].encode(),
                    value=self.codec.encode(event),
                    on_delivery=self._on_delivery,
                )
            except BufferError:  # the client's own queue is full: the broker is not keeping up
                self.failed += len(events) - i
                break
        self._producer.poll(0)

    def close(self, timeout: float = 5.0) -> None:
        self._unsent = self._producer.flush(timeout)


def open_sink(spec: SinkSpec, kafka_settings: dict[str, Any] | None = None):
    if spec.kind == "file":
        return FileSink(spec.path)
    return KafkaSink(spec.bootstrap, spec.topic, kafka_settings)
