"""A rank's recorder, at work: reads its ring, builds the records, writes the sink.

Run by `recorder_process` once it has left the rank's process tree. It reads
the frames the probes wrote, builds each record once (`capture`), hands them
to a `Delivery` for the envelopes, the `log` check and the sink, and ends
when the ring is closed by the rank (a clean stop: the closing Health is in
it) or its rank's process is gone (killed: what the ring holds is delivered,
then the ledger is closed, nothing cut short). SIGTERM ends it the same way
once the ring is drained. Its log lines go to the engine's stderr.

A rank stopped on purpose but killed before it could close (vLLM's server
SIGKILLs its engines right after their SIGTERM, by default at once) has its
ring marked (`Ring.request_stop`, by its SIGTERM handler or by the server's
shutdown, `kvledger.producer.plugin`): the recorder then writes the rank's
closing Health itself, after everything the rank wrote, so a Kafka ledger
reads closed as a clean stop does. A rank that died unasked (a crash, an
OOM kill) is not closed: its ledger ends without the rank's last word.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import msgspec

from kvledger.producer.capture import HealthCapture, RequestIndex, SnapshotCapture, StepCapture
from kvledger.producer.chains import PrefixChains
from kvledger.producer.config import TraceAction
from kvledger.producer.delivery import Delivery
from kvledger.producer.frames import FrameKind, body_from_part, read_frame
from kvledger.producer.processes import ProcessWatch
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring import Ring
from kvledger.producer.ring_writer import RecorderMeta, meta_path, read_meta
from kvledger.producer.sinks import open_sink
from kvledger.schemas.events import LedgerEvent, RankInfo

log = logging.getLogger("kvledger.producer")

# Between looks at the ring while frames arrive. Each look finds the frames of several steps, built
# back to back and handed to the sink at once (`Delivery.wake`): on a host whose cores the
# engine keeps busy, the first frame of a look finds the caches cold and the next ones warm (a
# CPU engine, 64 requests, ~7 ms steps: the recorder's CPU per step 307-359 us with looks every
# 10 ms, 186-206 us every 50 ms; 139-157 us every 50 ms and 131-135 us every 100 ms once its
# drain thread no longer yielded after each record).
POLL_S = 0.1
# The rank counts as idle (its sink flushed, its end confirmed) once its newest record is this old:
# longer than in an engine's own thread, as records reach the recorder up to a poll and a drain late.
RANK_IDLE_S = 0.2
IDLE_POLL_S = 0.1  # once nothing arrived for SLOW_POLL_AFTER_S
SLOW_POLL_AFTER_S = 1.0
CLOSE_S = 30.0  # for the sink to deliver what it holds at the end


class ViolationLogger:
    """`action: log`: replays the rank's own events and logs what the ledger core finds."""

    def __init__(self):
        from kvledger.stream_app.core import Ledger

        self.ledger = Ledger()

    def __call__(self, events: list[LedgerEvent]) -> None:
        for v in self.ledger.apply_many(events):
            log.warning("kv_trace: %s on %s: %s", v.where(), v.rank, v.detail)


class FrameReader:
    """Frames into record bodies, in the order the rank wrote them (the request index is used in
    step order)."""

    def __init__(self, ring: Ring, recorder: Delivery, full_rows: bool):
        self.ring = ring
        self.recorder = recorder
        self.full_rows = full_rows
        self.index = RequestIndex()
        self.chains: PrefixChains | None = None  # from the rank's RankInfo: its groups' block sizes
        self.step = 0  # the newest step a frame named
        self.probe_ns = 0  # the rank's probe time, as its newest Health said
        self.closed_by_rank = False  # its closing Health was read

    def closing_health(self) -> HealthCapture:
        """The rank's closing Health, made for it (`close_for_rank`): its newest step, every frame
        it offered (the ring counts them: published or dropped), its probe time as last reported."""
        return HealthCapture(self.step, self.ring.published + self.ring.dropped, self.probe_ns, closing=True)

    def close_for_rank(self) -> int:
        """Record the closing Health of a rank that was stopped before it could; its seq."""
        health = self.closing_health()
        r = self.recorder
        body = health.record(self.ring.dropped + r.dropped, r.capacity, r.high_water)
        return r.capture(body, seq=health.captured, at_us=time.time_ns() // 1000)

    def body(self, kind: FrameKind, parts: list) -> tuple[str, dict]:
        if kind is FrameKind.STEP:
            return StepCapture.from_parts(parts).record(self.index, self.full_rows, self.chains)
        if kind is FrameKind.SNAPSHOT:
            return SnapshotCapture.from_parts(parts).record(self.index)
        if kind is FrameKind.HEALTH:
            r = self.recorder
            health = HealthCapture.from_parts(parts)
            self.probe_ns, self.closed_by_rank = health.probe_ns, self.closed_by_rank or health.closing
            return health.record(self.ring.dropped + r.dropped, r.capacity, r.high_water)
        body = body_from_part(parts[0])
        if isinstance(body, RankInfo):
            self.chains = PrefixChains.of(body)
        return body

    def read(self, limit: int) -> int:
        """Hand up to `limit` frames to the recorder; returns how many."""
        n = 0
        for record in self.ring.records():
            if n >= limit:
                break  # left unreleased: read again next time
            data = bytes(record)  # the ring's bytes are released when the next record is asked for
            record.release()
            frame = read_frame(data)
            n += 1
            try:
                body = self.body(frame.kind, frame.parts)
            except Exception:  # a frame we cannot build is lost (its seq shows it), not the recorder
                log.exception("kv_trace: could not build a record from a %s frame", frame.kind.name)
                self.recorder.sink_failed += 1
            else:
                self.step = max(self.step, getattr(body, "step", self.step))
                self.recorder.capture(body, seq=frame.seq, at_us=frame.emitted_at_us)
        return n


def identity_of(meta: RecorderMeta) -> RankIdentity:
    """The rank's identity; a respawned recorder records under a new incarnation (the records its
    predecessor held, and the request indices it gave, went with it: the ledger resyncs)."""
    if meta.generation == 0:
        return meta.identity
    return replace(meta.identity, incarnation=(time.time_ns() ^ os.getpid()) & ((1 << 63) - 1))


def run(ring_path: Path, ring: Ring, engine: ProcessWatch) -> int:
    """Record from `ring` (attached) until it is closed or `engine`, its rank, is gone."""
    try:
        meta = read_meta(meta_path(ring_path))
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.error("kv_trace: recorder for %s cannot start: %s", ring_path, exc)
        return 1
    config = meta.config
    observer = ViolationLogger() if config.action is TraceAction.LOG else None
    sink = open_sink(config.sink, config.kafka, config.schema_registry)
    recorder = Delivery(
        identity_of(meta),
        sink,
        capacity=config.buffer_events,
        observer=observer,
        idle_after=RANK_IDLE_S,
        drain_interval=POLL_S,
    )
    reader = FrameReader(ring, recorder, config.full_rows)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's Ctrl-C is the engine's
    last_frame = time.monotonic()
    while True:
        # Read before looking at the end: a closed ring or a gone rank is drained first.
        done = ring.producer_closed or not engine.alive() or bool(stopping)
        room = recorder.capacity // 2 - recorder.backlog
        n = reader.read(room) if room > 0 else 0
        now = time.monotonic()
        if n:
            last_frame = now
            recorder.wake()
        elif done and ring.pending == 0:
            break
        time.sleep(POLL_S if now - last_frame < SLOW_POLL_AFTER_S else IDLE_POLL_S)
    closed = ring.producer_closed or reader.closed_by_rank
    stopped = not closed and ring.stop_requested and not engine.alive()
    if stopped:
        seq = reader.close_for_rank()
    recorder.finish(CLOSE_S)
    ring.close(unlink=True)
    meta_path(ring_path).unlink(missing_ok=True)
    if stopped:
        log.info(
            "kv_trace: %s: its rank was stopped before it could close; closed for it at step %d (seq %d)",
            recorder.identity,
            reader.step,
            seq,
        )
    elif not closed:
        log.warning("kv_trace: %s: its rank ended without closing; the ledger holds all it wrote", recorder.identity)
    return 0
