"""The Kafka client's repeated warnings, held: the first of a kind logged, the repeats counted and
logged with the next one after the interval; other kinds, and debug, untouched."""

from __future__ import annotations

import logging

import pytest

from kvledger.stream_app.worker.client_logs import CLIENT, HoldRepeats, client_loggers, hold_repeated_client_logs

CONNECT = "Unable connect to node with id %s: %s"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged(caplog):
    """A logger of its own under a HoldRepeats on a fake clock, and what reached its handlers."""
    clock = Clock()
    logger = logging.getLogger("kvledger.test.client")
    held = HoldRepeats(every=30.0, clock=clock)
    logger.addFilter(held)
    caplog.set_level(logging.DEBUG, logger=logger.name)
    try:
        yield logger, clock, lambda: [r.getMessage() for r in caplog.records if r.name == logger.name]
    finally:
        logger.removeFilter(held)


def test_a_storm_of_one_kind_is_one_line_per_interval_with_its_count(logged):
    logger, clock, lines = logged
    for i in range(600):  # 10 a second for a minute, alternating nodes: one kind (one template)
        logger.error(CONNECT, i % 2, "[Errno 111] Connect call failed")
        clock.now += 0.1
    assert lines() == [
        "Unable connect to node with id 0: [Errno 111] Connect call failed",
        "Unable connect to node with id 0: [Errno 111] Connect call failed [299 more like this in the last 30 s]",
    ]
    clock.now += 60  # quiet for a while: the next is logged at once, with the 299 held since
    logger.error(CONNECT, 1, "refused")
    assert lines()[-1] == "Unable connect to node with id 1: refused [299 more like this in the last 90 s]"
    logger.error(CONNECT, 1, "refused")  # and the one after it is held again
    assert len(lines()) == 3


def test_a_new_kind_and_debug_are_logged_at_once(logged):
    logger, _, lines = logged
    logger.error(CONNECT, 1, "refused")
    logger.error(CONNECT, 1, "refused")
    logger.error("Unable to update metadata from %s", [1])
    logger.warning("Marking the coordinator dead (node %s) for group %s", 1, "g")
    for _ in range(3):
        logger.debug("Sending metadata request %s to node %s", "req", 1)
    assert lines() == [
        "Unable connect to node with id 1: refused",
        "Unable to update metadata from [1]",
        "Marking the coordinator dead (node 1) for group g",
        *["Sending metadata request req to node 1"] * 3,
    ]


def test_every_client_logger_holds_repeats_once():
    import kvledger.stream_app.worker.app  # noqa: F401  (imports the client as the worker does)

    names = [CLIENT, f"{CLIENT}.conn", f"{CLIENT}.consumer.fetcher", f"{CLIENT}.consumer.group_coordinator",
             f"{CLIENT}.producer.sender"]  # fmt: skip
    held = hold_repeated_client_logs()
    try:
        assert hold_repeated_client_logs() is held  # a second worker in the process adds nothing
        for name in names:
            assert [f for f in logging.getLogger(name).filters if isinstance(f, HoldRepeats)] == [held], name
    finally:
        for logger in client_loggers():
            logger.removeFilter(held)
