"""The Kafka client's repeated warnings and errors: one line per kind per interval, with a count.

While its broker is gone, aiokafka logs every failed attempt of every routine (connect,
metadata, fetch, group coordinator): ~60 lines a second from one worker, 200,000 an hour of
outage, burying what else the worker says. Here the first record of each kind is logged as it
is; the repeats within `every` seconds are counted, and the first one after that is logged with
the count. A kind is the logger and the message's template, so a new kind of failure is logged
at once. Debug and info records pass untouched: who turned them on wants them all.

A worker started with its broker (a restart of the stack, a rolling deploy) also meets the
broker's own start-up: the client logs `Group Coordinator Request failed: [Error 15]
GroupCoordinatorNotAvailableError` at ERROR while the coordinator is still being elected, and
retries it. `StartingBroker` logs these known transient errors as WARNINGs, saying so, for
`grace` seconds after the worker's start (60 by default, `--client-start-grace`); one that lasts
longer is logged as the error it is, saying for how long it has lasted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from aiokafka import errors as client_errors

CLIENT = "aiokafka"  # the client's loggers: this one and those below it (one per module)
EVERY_S = 30.0
START_GRACE_S = 60.0
# The client's errors that a broker still starting causes, and retries: logger, message template,
# and the errors (its argument) that are transient then.
TRANSIENT_AT_START: dict[tuple[str, str], tuple[type[Exception], ...]] = {
    (f"{CLIENT}.consumer.group_coordinator", "Group Coordinator Request failed: %s"): (
        client_errors.GroupCoordinatorNotAvailableError,  # 15: no coordinator elected yet
        client_errors.CoordinatorLoadInProgressError,  # 14: it is loading the group's offsets
        client_errors.NotCoordinatorForGroupError,  # 16: it moved while the broker started
    ),
}


class HoldRepeats(logging.Filter):
    """Passes a kind's first warning (or worse), then one per `every` seconds, counting the rest."""

    def __init__(self, every: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every = every
        self.clock = clock
        self.kinds: dict[tuple[str, str], tuple[float, int]] = {}  # kind -> (last passed at, held since)
        self.lock = threading.Lock()  # the consumer logs from Faust's consumer thread too

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind, now = (record.name, str(record.msg)), self.clock()
        with self.lock:
            passed_at, held = self.kinds.get(kind, (None, 0))
            if passed_at is not None and now - passed_at < self.every:
                self.kinds[kind] = (passed_at, held + 1)
                return False
            self.kinds[kind] = (now, 0)
        if held:
            # The message and its arguments stay as they are; the count follows what they format to.
            record.msg = f"{record.msg} [{held} more like this in the last {now - passed_at:.0f} s]"
        return True


class StartingBroker(logging.Filter):
    """Logs the client's known start-up errors (`TRANSIENT_AT_START`) as WARNINGs for `grace`
    seconds after `started`, saying they are retried; later, as errors saying how long it lasted.
    The words it adds are the same each time, so `HoldRepeats` (after it) still counts repeats."""

    def __init__(
        self, grace: float = START_GRACE_S, clock: Callable[[], float] = time.monotonic, started: float | None = None
    ) -> None:
        super().__init__()
        self.grace = grace
        self.clock = clock
        self.started = clock() if started is None else started
        self.downgraded = 0  # records logged as warnings

    def transient(self, record: logging.LogRecord) -> bool:
        errors = TRANSIENT_AT_START.get((record.name, str(record.msg)))
        args = record.args if isinstance(record.args, tuple) else ()
        return errors is not None and len(args) == 1 and isinstance(args[0], errors)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not self.transient(record):
            return True
        if self.clock() - self.started < self.grace:
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            record.msg = (
                f"{record.msg} (the broker is still starting: retried; an error if it lasts "
                f"{self.grace:.0f} s after the worker's start)"
            )
            self.downgraded += 1
        else:
            record.msg = f"{record.msg} (still failing {self.grace:.0f} s or more after the worker's start)"
        return True


def client_loggers() -> list[logging.Logger]:
    """The client's loggers: CLIENT's own and those of its modules imported so far."""
    below = sorted(n for n in logging.root.manager.loggerDict if n.startswith(CLIENT + "."))
    return [logging.getLogger(n) for n in [CLIENT, *below]]


def hold_repeated_client_logs(every: float = EVERY_S, start_grace: float = START_GRACE_S) -> HoldRepeats:
    """Puts one StartingBroker, then one HoldRepeats, on the client's loggers (the records' own: a
    filter on a parent logger does not see its children's records); idempotent (a second worker
    in the process keeps the first one's start)."""
    loggers = client_loggers()
    starting = next((f for f in loggers[0].filters if isinstance(f, StartingBroker)), None) or StartingBroker(
        start_grace
    )
    held = next((f for f in loggers[0].filters if isinstance(f, HoldRepeats)), None) or HoldRepeats(every)
    for logger in loggers:
        if starting not in logger.filters:  # first: repeats are counted as they are logged
            logger.filters.insert(0, starting)
        if held not in logger.filters:
            logger.addFilter(held)
    return held
