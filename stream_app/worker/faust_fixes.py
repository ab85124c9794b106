"""Holes in Faust (faust-streaming 0.15, aiokafka 0.14) closed here, when the worker is imported:
three in its fetching around a rebalance, through which records were skipped for good, two
that crashed a worker, and one that spun a core while the broker was gone.

Found by the two-workers takeover test (tests/integration/test_stream_worker.py),
which lost records about one run in seven before:

1. Faust hands its *live* set of active partitions to the consumer thread, and
   aiokafka reads an empty set as "every partition". A fetch still pending when a
   rebalance pauses every partition (or recovery pauses the changelogs) returns the
   records of all assigned partitions, paused stream partitions included, and moves
   their positions past records Faust then drops (or yields only once the partition
   is resumed, mid-batch: the first records lost, the rest ahead of them). The
   thread gets a copy, and an empty set fetches nothing.
2. Faust undoes such drops by seeking to the committed offsets, and aiokafka's
   `seek_to_committed` leaves a partition without a committed offset where it is:
   the partition of a worker that died before its first commit stayed at its end,
   unread. Such partitions go back to their beginning, as
   `consumer_auto_offset_reset="earliest"` says (re-reading is harmless: the
   projections skip the offsets their checkpoints cover).
3. Recovery resumes the stream partitions and seeks them while the flow is already
   on (it was turned on to read the changelogs), then resumes the flow again, which
   empties the agents' queues: records of the new assignment already handed over
   were thrown away, and their re-fetch dropped as already read. Only a suspended
   flow is resumed now (suspending clears the queues anyway).
4. aiokafka's metadata snapshot lists a topic whose partitions it does not know yet
   (a changelog just created, its leader not elected) with 0 partitions, and Faust
   takes that 0 as a count where it means "unknown" (None): a table's first write
   compared it with its source topic's and refused the table for good
   (PartitionsMismatch). It reads as unknown now, as Faust's own check expects.
5. Faust's livelock detector reads each assigned partition's position, and aiokafka
   asserts on a position that is being reset (a partition just assigned, or sought to
   its beginning as in 2, that the fetcher has not reset yet): a tick in that window
   crashed the worker (AssertionError). Found by the dev stack's demo
   (tests/e2e/test_dev_stack.py: once in CI, once in six runs here). Such a partition
   has nothing to verify until it has a position again; the next tick checks it.
6. aiokafka's producer asks for new metadata as soon as the last request ended while a
   batch waits for a partition whose leader it does not know, and waits for nothing
   else: a broker that is gone refuses at once, so the worker spun a whole core (4,000
   failed requests and 8,000 log lines a second, 50 MB of log in a minute) for as long
   as the broker was away. A batch is left in that state by a broker that stops while
   a write is in flight (its last answer: not the leader), and the core was taken from
   the engine beside the worker (tests/e2e/test_broker_outage.py: its tokens/s fell to
   a third in CI). Metadata is now requested at most once per `retry_backoff_ms`
   (100 ms), as Kafka's own clients do (`retry.backoff.ms`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka.client import AIOKafkaClient
from aiokafka.consumer.subscription_state import TopicPartitionState
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from mode.utils.queues import FlowControlEvent

log = logging.getLogger("kvledger.worker")
_PATCHED = False


def close_faust_holes() -> None:
    global _PATCHED
    if _PATCHED:
        return
    needed = [
        (faust_aiokafka.AIOKafkaConsumerThread, "getmany"),
        (faust_aiokafka.AIOKafkaConsumerThread, "topic_partitions"),
        (faust_aiokafka.AIOKafkaConsumerThread, "verify_event_path"),
        (TopicPartitionState, "has_valid_position"),
        (faust_aiokafka, "ensure_aiokafka_TP"),
        (faust_consumer.Consumer, "perform_seek"),
        (faust_consumer.Consumer, "_is_changelog_tp"),
        (FlowControlEvent, "resume"),
        (FlowControlEvent, "is_active"),
        (AIOKafkaClient, "_metadata_update"),
    ]
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in needed if not hasattr(owner, name)]
    if missing:
        log.warning("this Faust lacks %s: its fixes are not applied", ", ".join(missing))
        return
    thread_getmany = faust_aiokafka.AIOKafkaConsumerThread.getmany

    async def getmany(self, active_partitions, timeout):
        if active_partitions is not None:
            active_partitions = set(active_partitions)
            if not active_partitions:
                return {}
        return await thread_getmany(self, active_partitions, timeout)

    faust_perform_seek = faust_consumer.Consumer.perform_seek

    async def perform_seek(self) -> None:
        await faust_perform_seek(self)
        uncommitted = [
            faust_aiokafka.ensure_aiokafka_TP(tp)
            for tp in self.assignment()
            if not self._is_changelog_tp(tp) and self._committed_offset.get(tp) is None
        ]
        if uncommitted:
            await self._thread.seek_to_beginning(*uncommitted)

    thread_topic_partitions = faust_aiokafka.AIOKafkaConsumerThread.topic_partitions

    def topic_partitions(self, topic: str) -> int | None:
        return thread_topic_partitions(self, topic) or None

    flow_resume = FlowControlEvent.resume

    def resume(self) -> None:
        if not self.is_active():
            flow_resume(self)

    thread_verify_event_path = faust_aiokafka.AIOKafkaConsumerThread.verify_event_path

    def verify_event_path(self, now: float, tp) -> None:
        # The state as Faust's own check reaches it (a private path of aiokafka's consumer).
        assignment = self._ensure_consumer()._fetcher._subscriptions.subscription.assignment
        state = assignment.state_value(faust_aiokafka.ensure_aiokafka_TP(tp)) if assignment else None
        if state is not None and not state.has_valid_position:
            return None
        return thread_verify_event_path(self, now, tp)

    client_metadata_update = AIOKafkaClient._metadata_update

    async def _metadata_update(self, cluster_metadata, topics) -> bool:
        # `_retry_backoff` is `retry_backoff_ms` in seconds (its default: Faust does not set it).
        wait = getattr(self, "_kvledger_metadata_at", -1e9) + self._retry_backoff - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        try:
            return await client_metadata_update(self, cluster_metadata, topics)
        finally:
            self._kvledger_metadata_at = time.monotonic()

    faust_aiokafka.AIOKafkaConsumerThread.getmany = getmany
    faust_aiokafka.AIOKafkaConsumerThread.verify_event_path = verify_event_path
    faust_aiokafka.AIOKafkaConsumerThread.topic_partitions = topic_partitions
    faust_consumer.Consumer.perform_seek = perform_seek
    FlowControlEvent.resume = resume
    AIOKafkaClient._metadata_update = _metadata_update
    _PATCHED = True
