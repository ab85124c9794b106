"""The stream worker's Kafka client (aiokafka, as the worker patches it) while its broker is gone.

A real broker of its own is stopped while a producer writes to it a message a millisecond, as a
worker writes its checkpoints and violations. The broker's controlled shutdown answers the last
writes "not the leader", and the producer is left with writes for a partition whose leader it
does not know. Unpatched, aiokafka's sender then asks for metadata again as soon as the last
request failed, and with the broker gone each fails at once: the process spun a whole core
(1.0 core, 3,600-8,300 failed requests a second here), for as long as the broker was away, taking
the core from the engine beside the worker. Patched (`faust_fixes`, hole 6), it asks at most once
per `retry_backoff_ms`, and once the broker is back every write is delivered.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.structs import TopicPartition
from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KafkaPartition

from kvledger.stream_app.worker.faust_fixes import close_faust_holes
from tests.conftest import OutageBroker

pytestmark = pytest.mark.integration

TOPIC = "outage-client"
BACKOFF_S = 0.1  # aiokafka's retry_backoff_ms, which Faust leaves at its default
WINDOW_S = 5.0  # the broker gone: the client's CPU and its metadata requests counted over this
CORES = 0.2  # patched: 0.005-0.009 cores here; unpatched: 1.0
# Failed metadata requests a second: one per backoff, with slack for the fetcher's and the
# coordinator's own (unpatched: thousands).
FAILED_PER_S = 1.5 / BACKOFF_S


class Failures:
    """Counts the client's failed metadata requests, around its (patched) request."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        request = AIOKafkaClient._metadata_update

        async def counted(client, *args) -> bool:
            updated = await request(client, *args)
            self.count += not updated
            return updated

        monkeypatch.setattr(AIOKafkaClient, "_metadata_update", counted)


@pytest.fixture
def broker(tmp_path):
    with OutageBroker.running(tmp_path / "kafka") as broker:
        yield broker


def test_a_write_waiting_for_an_unknown_leader_backs_off_and_is_delivered_after_the_outage(broker, monkeypatch):
    close_faust_holes()  # as the worker does when it is built
    failures = Failures(monkeypatch)
    seen = asyncio.run(outage(broker, failures))
    print(
        f"broker gone: leader {seen['leader']}, {seen['cores']:.3f} cores, {seen['failed_per_s']:.1f} failed "
        f"metadata requests/s; {seen['sent']} writes, {seen['waiting']} of them waiting while it was gone; "
        f"{seen['on_topic']} on the topic"
    )
    # The state the spin came from was reached: writes waiting for a partition without a leader.
    assert seen["leader"] in (None, -1) and seen["waiting"] > 0, seen
    assert seen["cores"] <= CORES
    assert 0 < seen["failed_per_s"] <= FAILED_PER_S
    # Nothing lost: every write delivered after the broker's return, each once.
    assert seen["on_topic"] == seen["sent"] + 1  # and the first, written before the pump


async def outage(broker: OutageBroker, failures: Failures) -> dict:
    loop = asyncio.get_running_loop()
    # No write may expire in the queue while the broker restarts (aiokafka's default: 40 s); a batch the
    # stopping broker took but whose answer was lost is sent again, and only idempotence keeps it once.
    producer = AIOKafkaProducer(
        bootstrap_servers=broker.bootstrap, acks=-1, linger_ms=2, request_timeout_ms=300_000, enable_idempotence=True
    )
    await producer.start()
    try:
        await producer.send_and_wait(TOPIC, b"first")
        sent: list[asyncio.Future] = []

        async def pump() -> None:  # blocks in send() once a batch waits for the unknown leader
            while True:
                sent.append(await producer.send(TOPIC, b"x" * 100))
                await asyncio.sleep(0.001)

        pumping = asyncio.create_task(pump())
        await asyncio.sleep(1.0)
        await loop.run_in_executor(None, broker.down)
        await asyncio.sleep(0.5)  # past the last answers of the shutdown
        leader = producer.client.cluster.leader_for_partition(TopicPartition(TOPIC, 0))
        waiting = sum(not f.done() for f in sent)
        cpu, failed, t0 = time.process_time(), failures.count, time.monotonic()
        await asyncio.sleep(WINDOW_S)
        elapsed = time.monotonic() - t0
        cores, failed_per_s = (time.process_time() - cpu) / elapsed, (failures.count - failed) / elapsed
        pumping.cancel()
        await loop.run_in_executor(None, broker.up)
        await asyncio.wait_for(asyncio.gather(*sent), timeout=180)
    finally:
        await producer.stop()
    return {
        "leader": leader, "cores": cores, "failed_per_s": failed_per_s, "sent": len(sent), "waiting": waiting,
        "on_topic": await loop.run_in_executor(None, end_offset, broker.bootstrap),
    }  # fmt: skip


def end_offset(bootstrap: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "outage-client-check"})
    try:
        return consumer.get_watermark_offsets(KafkaPartition(TOPIC, 0), timeout=30)[1]
    finally:
        consumer.close()
