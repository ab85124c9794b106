"""Faust's livelock detector against aiokafka's real partition state: a partition whose position
is being reset is skipped (it crashed the worker), one with a position is still checked.

The consumer thread is a stand-in that holds a real aiokafka SubscriptionState; the detector's
own code (Faust's verify_event_path, as kvledger's worker patches it) runs unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from aiokafka.structs import TopicPartition
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.types import TP

from kvledger.stream_app.worker.faust_fixes import close_faust_holes

TOPIC = "kvledger.events"
STARTED_LONG_AGO = 10_000.0  # seconds since the worker started: past every Faust timeout


class Thread:
    """What verify_event_path reads of AIOKafkaConsumerThread, around a real SubscriptionState."""

    def __init__(self, subscriptions, log: logging.Logger) -> None:
        self._consumer = SimpleNamespace(_fetcher=SimpleNamespace(_subscriptions=subscriptions))
        self.time_started = 0.0
        self.tp_fetch_request_timeout_secs = 60.0
        self.tp_stream_timeout_secs = 60.0
        self.log = log
        monitor = SimpleNamespace(stream_inbound_time={})
        self.consumer = SimpleNamespace(app=SimpleNamespace(monitor=monitor, topics=SimpleNamespace(
            acks_enabled_for=lambda topic: True)))  # fmt: skip

    def _ensure_consumer(self):
        return self._consumer

    def verify_event_path(self, now: float, tp: TP) -> None:
        return AIOKafkaConsumerThread.verify_event_path(self, now, tp)  # as the worker patched it

    def _verify_aiokafka_event_path(self, now: float, tp: TP) -> bool:
        return AIOKafkaConsumerThread._verify_aiokafka_event_path(self, now, tp)


async def _assigned(*partitions: int):
    from aiokafka.consumer.subscription_state import SubscriptionState

    subscriptions = SubscriptionState()
    subscriptions.subscribe({TOPIC})
    subscriptions.assign_from_subscribed({TopicPartition(TOPIC, p) for p in partitions})
    return subscriptions


def _state(subscriptions, partition: int):
    return subscriptions.subscription.assignment.state_value(TopicPartition(TOPIC, partition))


def test_a_partition_being_reset_is_skipped_and_one_with_a_position_is_still_checked(caplog):
    close_faust_holes()  # as the worker does when it is built

    async def run() -> None:
        subscriptions = await _assigned(0, 1)
        for p in (0, 1):  # both fetched once (a highwater), long ago
            _state(subscriptions, p).highwater = 42
            _state(subscriptions, p).timestamp = 1_000
        _state(subscriptions, 0).await_reset(strategy=0)  # seek_to_beginning, not yet carried out
        _state(subscriptions, 1).seek(7)
        thread = Thread(subscriptions, logging.getLogger("faust-detector"))
        with caplog.at_level(logging.ERROR, logger="faust-detector"):
            assert thread.verify_event_path(STARTED_LONG_AGO, TP(TOPIC, 0)) is None  # raised AssertionError
            assert not caplog.records
            thread.verify_event_path(STARTED_LONG_AGO, TP(TOPIC, 1))
        # The partition with a position still meets Faust's check: its last fetch is stale.
        assert [r.args[0] for r in caplog.records] == [TP(TOPIC, 1)], caplog.text

    asyncio.run(run())
