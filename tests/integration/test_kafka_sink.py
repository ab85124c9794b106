"""The Kafka sink against the real local broker, and against a broker that is down."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
from confluent_kafka import Consumer

from kvledger.producer.delivery import Delivery
from kvledger.producer.records import RankIdentity
from kvledger.producer.sinks import KafkaSink
from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
from kvledger.schemas.events import body_of, event_of
from kvledger.stream_app.core import Ledger
from tests.synthetic.engine import SimConfig, simulate

pytestmark = pytest.mark.integration


def consume(bootstrap: str, topic: str, n: int) -> tuple[list[dict], int]:
    """The first `n` events on the topic, and how many messages carried them."""
    codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH)
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    out, messages = [], 0
    try:
        while len(out) < n:
            message = consumer.poll(15)
            assert message is not None, f"timed out after {len(out)} of {n} events"
            assert message.error() is None, message.error()
            out += codec.decode(message.value())
            messages += 1
    finally:
        consumer.close()
    return out, messages


def test_two_ranks_trace_to_kafka(kafka_bootstrap):
    topic = f"kvledger.events.{uuid.uuid4().hex[:8]}"
    sim = simulate(SimConfig(seed=6, steps=150, tp_size=2, snapshot_interval=40))
    recorders = {
        tp: Delivery(RankIdentity("sim-engine", 0, tp, 0, 1), KafkaSink(kafka_bootstrap, topic)) for tp in (0, 1)
    }
    for event in sim.events:
        recorders[event["tp_rank"]].capture(body_of(*event["body"]))
    for recorder in recorders.values():
        recorder.close(step=149, timeout=30)
        assert recorder.dropped == 0
        assert recorder.sink.delivered == recorder.captured
    received, messages = consume(kafka_bootstrap, topic, len(sim.events) + 2)
    assert messages < len(received) / 4, "events travel several to a message"
    # Each rank's events arrive in order (one partition per engine); ranks interleave as they like.
    for tp in (0, 1):
        mine = [e for e in received if e["tp_rank"] == tp]
        assert [e["seq"] for e in mine] == list(range(len(mine)))
        assert [e["body"] for e in mine[:-1]] == [e["body"] for e in sim.events if e["tp_rank"] == tp]
    ledger = Ledger()
    assert [v for e in received for v in ledger.apply(event_of(e))] + ledger.finish() == []
    assert ledger.coverage.checks["rank_compare"] == 150


def test_broker_down_loses_exactly_what_was_captured():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = KafkaSink(f"127.0.0.1:{port}", "kvledger.events", {"message.timeout.ms": 1500})
    recorder = Delivery(RankIdentity("eng-down"), sink)
    started = time.monotonic()
    for event in simulate(SimConfig(seed=7, steps=50, snapshot_interval=0, health_interval=0)).events:
        recorder.capture(body_of(*event["body"]))
    capture_seconds = time.monotonic() - started
    recorder.close(step=49, timeout=10)
    assert sink.delivered == 0
    assert recorder.dropped == recorder.captured == 52  # RankInfo, 50 steps, the closing Health
    assert capture_seconds < 1.0, "capture must not wait for the broker"
