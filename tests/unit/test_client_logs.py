"""The Kafka client's repeated warnings, held: the first of a kind logged, the repeats counted and
logged with the next one after the interval; other kinds, and debug, untouched. Its known
start-up errors (a broker still starting) logged as warnings for a while after the worker's start."""

from __future__ import annotations

import logging

import pytest
from aiokafka import errors as client_errors

from kvledger.stream_app.worker.client_logs import (
    CLIENT,
    HoldRepeats,
    StartingBroker,
    client_loggers,
    hold_repeated_client_logs,
)

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
            for f in [f for f in logger.filters if isinstance(f, (HoldRepeats, StartingBroker))]:
                logger.removeFilter(f)


COORDINATOR = f"{CLIENT}.consumer.group_coordinator"  # the logger and call aiokafka logs it with
COORDINATOR_FAILED = "Group Coordinator Request failed: %s"


@pytest.fixture
def coordinator_logs(caplog):
    """The client's group coordinator logger under StartingBroker (60 s) then HoldRepeats, on one
    fake clock, as the worker puts them; the records that reached the handlers."""
    clock = Clock()
    logger = logging.getLogger(COORDINATOR)
    starting, held = StartingBroker(grace=60.0, clock=clock), HoldRepeats(every=30.0, clock=clock)
    saved = list(logger.filters)
    logger.filters[:] = [starting, held]
    caplog.set_level(logging.DEBUG, logger=COORDINATOR)
    try:
        yield logger, clock, starting, lambda: [(r.levelname, r.getMessage()) for r in caplog.records]
    finally:
        logger.filters[:] = saved


def test_a_coordinator_not_yet_elected_at_start_is_a_warning_that_says_why(coordinator_logs):
    logger, clock, starting, logged = coordinator_logs
    clock.now += 10  # a worker started ten seconds after its broker: the coordinator is still starting
    logger.error(COORDINATOR_FAILED, client_errors.GroupCoordinatorNotAvailableError())
    [(level, message)] = logged()
    assert level == "WARNING" and starting.downgraded == 1
    assert message == (
        "Group Coordinator Request failed: [Error 15] GroupCoordinatorNotAvailableError "
        "(the broker is still starting: retried; an error if it lasts 60 s after the worker's start)"
    )
    for _ in range(20):  # retried every 100 ms: held as repeats, as any client warning
        clock.now += 0.1
        logger.error(COORDINATOR_FAILED, client_errors.GroupCoordinatorNotAvailableError())
    assert len(logged()) == 1


def test_a_coordinator_still_missing_past_the_bound_is_an_error(coordinator_logs):
    logger, clock, _, logged = coordinator_logs
    logger.error(COORDINATOR_FAILED, client_errors.CoordinatorLoadInProgressError())
    clock.now += 61
    logger.error(COORDINATOR_FAILED, client_errors.GroupCoordinatorNotAvailableError())
    assert logged() == [
        (
            "WARNING",
            "Group Coordinator Request failed: [Error 14] GroupLoadInProgressError "
            "(the broker is still starting: retried; an error if it lasts 60 s after the worker's start)",
        ),
        (
            "ERROR",
            "Group Coordinator Request failed: [Error 15] GroupCoordinatorNotAvailableError "
            "(still failing 60 s or more after the worker's start)",
        ),
    ]


def test_other_errors_of_the_client_stay_errors_at_start(coordinator_logs):
    logger, _, starting, logged = coordinator_logs
    logger.error(COORDINATOR_FAILED, client_errors.GroupAuthorizationFailedError())  # not transient
    logger.error("Heartbeat failed: %r", client_errors.GroupCoordinatorNotAvailableError())  # another call
    logging.getLogger(f"{CLIENT}.conn").error(COORDINATOR_FAILED, client_errors.GroupCoordinatorNotAvailableError())
    assert [level for level, _ in logged()] == ["ERROR", "ERROR", "ERROR"] and starting.downgraded == 0


def test_the_worker_puts_the_start_filter_before_the_repeats_with_its_bound():
    import kvledger.stream_app.worker.app  # noqa: F401  (imports the client as the worker does)

    held = hold_repeated_client_logs(start_grace=5.0)
    try:
        filters = logging.getLogger(COORDINATOR).filters
        starting = [f for f in filters if isinstance(f, StartingBroker)]
        assert len(starting) == 1 and starting[0].grace == 5.0
        assert filters.index(starting[0]) < filters.index(held)
    finally:
        for logger in client_loggers():
            for f in [f for f in logger.filters if isinstance(f, (HoldRepeats, StartingBroker))]:
                logger.removeFilter(f)
