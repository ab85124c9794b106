"""The Kafka client's repeated warnings and errors: one line per kind per interval, with a count.

While its broker is gone, aiokafka logs every failed attempt of every routine (connect,
metadata, fetch, group coordinator): ~60 lines a second from one worker, 200,000 an hour of
outage, burying what else the worker says. Here the first record of each kind is logged as it
is; the repeats within `every` seconds are counted, and the first one after that is logged with
the count. A kind is the logger and the message's template, so a new kind of failure is logged
at once. Debug and info records pass untouched: who turned them on wants them all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

CLIENT = "aiokafka"  # the client's loggers: this one and those below it (one per module)
EVERY_S = 30.0


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


def client_loggers() -> list[logging.Logger]:
    """The client's loggers: CLIENT's own and those of its modules imported so far."""
    below = sorted(n for n in logging.root.manager.loggerDict if n.startswith(CLIENT + "."))
    return [logging.getLogger(n) for n in [CLIENT, *below]]


def hold_repeated_client_logs(every: float = EVERY_S) -> HoldRepeats:
    """Puts one HoldRepeats on the client's loggers (the records' own: a filter on a parent logger
    does not see its children's records); idempotent."""
    loggers = client_loggers()
    held = next((f for f in loggers[0].filters if isinstance(f, HoldRepeats)), None) or HoldRepeats(every)
    for logger in loggers:
        if held not in logger.filters:
            logger.addFilter(held)
    return held
