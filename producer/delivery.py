"""Per-rank delivery: sequence numbers, a bounded buffer, a drain thread (in a rank's recorder
process, `recorder_process`).

The recorder's reader calls `capture` and goes on: it stamps the event, appends
it to a bounded buffer and returns. A full buffer drops the event and counts
it, like a perf buffer's lost counter; nothing here blocks the engine or
raises into it. A drain thread wraps events in their envelope and hands them
to the sink. Sequence numbers are taken at capture, so every loss, in the
buffer or in the sink, shows in the ledger as a gap, and `Health` events
carry the counts.

Shutdown: vLLM may kill a worker at any moment (its server force-kills them
right after SIGTERM), so nothing waits for a close. A busy rank's events
reach the sink's destination within the sink's linger; once the rank is
idle (its newest event `idle_after` seconds old, nothing buffered) the
drain thread flushes the sink at once, so an idle rank holds nothing in
memory; `request_flush()` and `flush()` (from a signal handler) do the same
on request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.schemas.events import Body, Health

log = logging.getLogger("kvledger.producer")

# A rank whose newest event is this old, with nothing buffered, is idle: its sink is flushed.
IDLE_AFTER_S = 0.02


class Sink(Protocol):
    def write(self, events: list[dict]) -> None: ...

    def tick(self) -> None: ...  # the drain thread's regular call, to send what waited long enough

    # Optional: deliver everything now (the rank is idle); sinks without it get `tick`.
    def flush(self) -> None: ...

    def close(self, timeout: float) -> None: ...

    @property
    def lost(self) -> int: ...


class Delivery:
    def __init__(
        self,
        identity: RankIdentity,
        sink: Sink,
        *,
        capacity: int = 4096,
        drain_interval: float = 0.05,
        idle_after: float = IDLE_AFTER_S,
        observer: Callable[[list[dict]], None] | None = None,
    ):
        self.identity = identity
        self.sink = sink
        self.capacity = capacity
        self.captured = 0
        self.dropped_full = 0  # events the full buffer turned away
        self.sink_failed = 0  # events in batches the sink refused
        self.probe_ns = 0  # time the probes spent on the hot path, reported in Health
        self.high_water = 0
        self._seq = 0
        self._buffer: deque[tuple[int, int, tuple[str, dict]]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._drain_interval = drain_interval
        self._idle_after_us = int(idle_after * 1e6)
        self._newest_us = 0  # capture time of the newest event handed to the sink
        self._unflushed = False  # events handed to the sink since it was last flushed
        self._flush_waiters: deque[threading.Event] = deque()
        self._sink_flush = getattr(sink, "flush", sink.tick)
        self._observer = observer  # sees every batch on the drain thread (in-process checks)
        self._thread = threading.Thread(target=self._drain, name=f"kvledger-drain-tp{identity.tp_rank}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Every event captured that will not reach the ledger, wherever it was lost."""
        return self.dropped_full + self.sink_failed + self.sink.lost

    # -- hot path ------------------------------------------------------------------------
    def capture(
        self,
        body: Body | Callable[[], Body],
        *,
        seq: int | None = None,
        at_us: int | None = None,
    ) -> int:
        """Stamp and buffer one event; never blocks, never raises. Returns its sequence number.

        `body` may be a function that builds it: it runs on the drain thread. A recorder process
        passes the `seq` and `at_us` its rank stamped the frame with.
        """
        if seq is None:
            seq = self._seq
        self._seq = seq + 1
        self.captured += 1
        buffered = len(self._buffer)
        if buffered >= self.capacity:
            self.dropped_full += 1
            return seq
        self._buffer.append((seq, time.time_ns() // 1000 if at_us is None else at_us, body))
        if buffered >= self.high_water:
            self.high_water = buffered + 1
        return seq

    def wake(self) -> None:
        """Have the drain thread hand what is buffered to the sink now, not at its next round."""
        self._wake.set()

    @property
    def backlog(self) -> int:
        """Events buffered, not yet handed to the sink."""
        return len(self._buffer)

    def health(self, step: int, closing: bool = False) -> Health:
        counts = (self.captured, self.dropped, self.probe_ns, self.capacity, self.high_water)
        return records.health(step, *counts, closing=closing)

    # -- drain thread -----------------------------------------------------------------------
    def _drain(self) -> None:
        while not self._stop:
            self._wake.wait(self._drain_interval)
            self._wake.clear()
            self._drain_once()
        self._flush_buffer()  # what arrived with the stop (close() closes the sink next)
        while self._flush_waiters:
            self._flush_waiters.popleft().set()

    def _drain_once(self) -> None:
        waiters = []  # taken first: every event captured before a request is in the buffer now
        while self._flush_waiters:
            waiters.append(self._flush_waiters.popleft())
        self._flush_buffer()
        idle = self._unflushed and not self._buffer and time.time_ns() // 1000 - self._newest_us >= self._idle_after_us
        try:
            if waiters or idle:
                self._sink_flush()
                self._unflushed = False
            else:
                self.sink.tick()  # lingering batches leave even when the engine is idle
        except Exception:
            log.exception("kv_trace: the sink failed to flush")
        for waiter in waiters:
            waiter.set()

    def request_flush(self, *, wake: bool = True) -> threading.Event:
        """Ask the drain thread to deliver every event captured so far now, without waiting for
        it; the event returned is set once the sink had them. Never blocks. `wake=False` leaves
        the request for the drain thread's next round (at most `drain_interval` later) and takes
        no lock at all, so a signal handler may call it whatever the code it interrupted holds."""
        done = threading.Event()
        if not self._thread.is_alive():
            done.set()
            return done
        self._flush_waiters.append(done)  # a deque: atomic
        if wake:
            self._wake.set()
        return done

    def flush(self, timeout: float = 0.25) -> bool:
        """From a signal handler, a last chance before the process may be killed: deliver what
        was captured, waiting up to `timeout` seconds; True when the sink had it in time."""
        return self.request_flush(wake=False).wait(timeout) and not self._buffer

    def _flush_buffer(self) -> None:
        batch, bodies = [], []
        while self._buffer:
            seq, at_us, body = self._buffer.popleft()
            if callable(body):
                try:
                    body = body()
                except Exception:  # a broken record is lost, not the thread
                    log.exception("kv_trace: could not build an event")
                    self.sink_failed += 1
                    continue
            batch.append(records.envelope(self.identity, seq, at_us, body))
            bodies.append((seq, at_us, body))
        if not batch:
            return
        self._newest_us, self._unflushed = batch[-1]["emitted_at_us"], True
        if self._observer is not None:
            try:
                self._observer([records.event(self.identity, *typed) for typed in bodies])
            except Exception:
                log.exception("kv_trace: in-process check failed; it stops")
                self._observer = None
        try:
            self.sink.write(batch)
        except Exception as exc:  # the ledger loses them; the engine must not notice
            if not self.sink_failed:
                log.warning(
                    "kv_trace: the sink refused %d event(s): %s (further failures counted only)", len(batch), exc
                )
            self.sink_failed += len(batch)

    def close(self, step: int, timeout: float = 5.0) -> None:
        """Record a last Health event (`closing`: the rank says it is done), drain, and close the
        sink within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        while self._buffer and time.monotonic() < deadline:  # room for the last word
            time.sleep(0.001)
        self.capture(self.health(step, closing=True))
        self.finish(max(deadline - time.monotonic(), 0.0))

    def finish(self, timeout: float = 5.0) -> None:
        """Deliver what is buffered and close the sink within `timeout` seconds (no last word)."""
        deadline = time.monotonic() + timeout
        self._stop = True
        self._wake.set()
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        self.sink.close(max(deadline - time.monotonic(), 0.0))
        if self.dropped:
            log.warning("kv_trace: %s lost %d of %d captured event(s)", self.identity, self.dropped, self.captured)
