"""The local broker works for real: admin, idempotent producer, consumer group."""

import time
import uuid
from collections import defaultdict

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

pytestmark = pytest.mark.integration

# Binary keys and values (NUL and non-UTF-8 bytes), several messages per key.
MESSAGES = [(b"engine-\x00\xff" + bytes([i % 6]), bytes([i]) * (i + 1) + b"\x00\x80\xfe") for i in range(24)]


def test_roundtrip_keeps_keys_values_and_partition_by_key(kafka_bootstrap):
    topic = f"it-roundtrip-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(30)

    reports = []
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for key, value in MESSAGES:
        producer.produce(topic, value=value, key=key, on_delivery=lambda err, msg: reports.append((err, msg)))
    assert producer.flush(30) == 0
    assert [err for err, _ in reports if err is not None] == []
    delivered = [(msg.key(), msg.value(), msg.partition()) for _, msg in reports]

    partitions_of = defaultdict(set)
    for key, _, partition in delivered:
        partitions_of[key].add(partition)
    assert all(len(p) == 1 for p in partitions_of.values()), partitions_of  # one partition per key
    assert len(set().union(*partitions_of.values())) > 1  # and the keys do spread

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"it-{uuid.uuid4().hex[:12]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumed = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while len(consumed) < len(MESSAGES) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error():
                raise KafkaException(msg.error())
            consumed.append((msg.key(), msg.value(), msg.partition()))
    finally:
        consumer.close()

    assert sorted((k, v) for k, v, _ in delivered) == sorted(MESSAGES)
    assert sorted(consumed) == sorted(delivered)  # same bytes, same partitions
    # Per key, the consumer sees the values in the order they were produced.
    by_key = defaultdict(list)
    for key, value, _ in consumed:
        by_key[key].append(value)
    assert by_key == {k: [v for kk, v in MESSAGES if kk == k] for k in by_key}


def test_status_reports_the_running_broker(kafka_bootstrap, local_kafka):
    status = local_kafka("status")
    assert status.returncode == 0, status.stderr
    assert status.stdout.strip() == f"running bootstrap={kafka_bootstrap}"
