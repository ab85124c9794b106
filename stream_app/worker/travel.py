"""Time travel in the worker: a request's block table at any step, rebuilt from the events topic.

The state at step S is the engine's state at a waypoint at or before S (a
checkpoint the projection kept) plus the engine's events after it, each rank
up to S; with no such waypoint, the partition's events from its start. It is
the offline `kvledger query` (replay.RequestTrace) over Kafka instead of
files: a blocking consumer, run off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from confluent_kafka import TopicPartition

from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
from kvledger.schemas.events import event_of
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.kafka_security import PLAINTEXT, KafkaSecurity
from kvledger.stream_app.replay import RequestTrace, RequestView
from kvledger.stream_app.worker.projection import EngineProjection, Waypoint
from kvledger.stream_app.worker.topics import assigned_consumer

POLL_BATCH = 1024
READ_TIMEOUT = 30.0  # seconds without a record before a replay gives up


@dataclass(frozen=True)
class Journey:
    start_offset: int  # where the replay began: a waypoint's offset, or the partition's first
    from_waypoint: int | None  # the waypoint's step, if one was used
    views: list[RequestView]


def partition_events(
    bootstrap: str,
    topic: str,
    partition: int,
    engine_id: str,
    start: int,
    end: int,
    security: KafkaSecurity = PLAINTEXT,
    codec: BatchCodec | None = None,
) -> Iterator[dict]:
    """The engine's events of one partition, offsets [start, end), decoded (batches unpacked) with
    `codec` (the worker's, which reads Confluent-framed records through its registry)."""
    codec, key = codec or BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH), engine_id.encode()
    consumer = assigned_consumer(bootstrap, "kvledger-time-travel", security)
    try:
        low, _ = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        offset = max(start, low)
        consumer.assign([TopicPartition(topic, partition, offset)])
        while offset < end:
            # Never ask for more than is there: consume() waits for the count or the timeout.
            messages = consumer.consume(min(POLL_BATCH, end - offset), timeout=READ_TIMEOUT)
            if not messages:
                raise TimeoutError(f"no records from {topic}/{partition} at offset {offset} (up to {end})")
            for m in messages:
                if m.error() is not None:
                    continue
                offset = m.offset() + 1
                if m.offset() >= end:
                    return
                if m.key() == key:
                    try:
                        events = codec.decode(m.value())
                    except Exception:  # a dead letter: the projection left it out too
                        continue
                    yield from events
    finally:
        consumer.close()


def travel(
    bootstrap: str,
    topic: str,
    partition: int,
    engine_id: str,
    req_id: str,
    step: int,
    waypoints: list[Waypoint],
    end: int,
    security: KafkaSecurity = PLAINTEXT,
    codec: BatchCodec | None = None,
) -> Journey:
    """`req_id`'s rows on every rank of the engine at `step`."""
    base = max((w for w in waypoints if w.step <= step), key=lambda w: w.step, default=None)
    ledger = EngineProjection.restore(base.blob).ledger if base is not None else Ledger(join_transfers=False)
    start = base.next_offset if base is not None else 0
    trace = RequestTrace(engine_id, req_id, ledger)
    past: set[tuple[int, int, int]] = set()  # ranks whose stream went beyond `step`: the rest of it too
    for record in partition_events(bootstrap, topic, partition, engine_id, start, end, security, codec):
        event = event_of(record, ledger.key_of)  # decoded once, here at the edge
        rank = (event.rank.dp, event.rank.tp, event.rank.pp)
        at = getattr(event.body, "step", None)  # RankInfo has none
        if rank in past or (at is not None and at > step):
            past.add(rank)
            continue
        trace.apply(at if at is not None else step, event)
    return Journey(start, base.step if base is not None else None, trace.views())
