"""Encoded ledger events through a real Kafka broker, replayed by the core."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from kvledger.schemas import LEDGER_EVENT, SingleObjectCodec
from kvledger.schemas.events import event_of
from kvledger.stream_app.core import Ledger
from tests.synthetic.engine import FaultSpec, GroupSpec, SimConfig, simulate

pytestmark = pytest.mark.integration

CONFIG = SimConfig(
    seed=4,
    steps=150,
    tp_size=2,
    groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 48)),
    num_blocks=90,
    max_num_seqs=10,
    max_batched_tokens=96,
    snapshot_interval=40,
)


def _replay(events):
    ledger = Ledger()
    return [v for e in events for v in ledger.apply(event_of(e))] + ledger.finish()


def _round_trip(bootstrap: str, events: list[dict]) -> list[dict]:
    topic = f"kvledger.events.{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(timeout=30)
    codec = SingleObjectCodec(LEDGER_EVENT)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "compression.type": "lz4",
            "linger.ms": 5,
            "partitioner": "murmur2_random",
        }
    )
    for event in events:
        # Key = engine id: every rank of an engine lands in one partition, in order.
        producer.produce(topic, key=event["engine_id"].encode(), value=codec.encode(event))
    assert producer.flush(30) == 0
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    received = []
    try:
        while len(received) < len(events):
            message = consumer.poll(10)
            assert message is not None, f"timed out after {len(received)} of {len(events)} events"
            assert message.error() is None, message.error()
            received.append(codec.decode(message.value()))
    finally:
        consumer.close()
    return received


def test_events_survive_the_broker_and_replay_identically(kafka_bootstrap):
    faulty = dataclasses.replace(
        CONFIG, faults=(FaultSpec("slot_shift", 60), FaultSpec("rank_divergence", 90, tp_rank=1))
    )
    sim = simulate(faulty)
    received = _round_trip(kafka_bootstrap, sim.events)
    assert received == sim.events
    violations = _replay(received)
    assert {v.kind for v in violations} >= {"write_target_mismatch", "rank_divergence"}
    assert violations == _replay(sim.events)


def test_two_engines_share_a_topic_without_crosstalk(kafka_bootstrap):
    a = simulate(dataclasses.replace(CONFIG, engine_id="prefill-0")).events
    b = simulate(dataclasses.replace(CONFIG, engine_id="decode-0", seed=8)).events
    interleaved = [e for pair in zip(a, b, strict=False) for e in pair] + a[len(b) :] + b[len(a) :]
    received = _round_trip(kafka_bootstrap, interleaved)
    assert _replay(received) == []
    assert sorted(received, key=lambda e: (e["engine_id"], e["tp_rank"], e["seq"])) == sorted(
        interleaved, key=lambda e: (e["engine_id"], e["tp_rank"], e["seq"])
    )
