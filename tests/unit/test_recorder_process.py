"""A rank's ring and its recorder process: real processes, a real file ledger.

The rank side (`RingWriter`) writes frames; the recorder it spawns builds and
writes the records. Checked here: what reaches the ledger is exactly what the
rank would have built in process; a recorder SIGKILLed mid-run is replaced
and the ledger resyncs without a false violation; an engine SIGKILLed
mid-run leaves a complete ledger behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from kvledger.producer import plugin, records
from kvledger.producer.capture import PlanCapture, RequestIndex, SnapshotCapture, StepCapture, StepHeader
from kvledger.producer.chains import PrefixChains
from kvledger.producer.config import SinkSpec, TraceAction, TraceConfig
from kvledger.producer.frames import FrameKind, body_from_part, pack_parts, read_frame, scheduler_fields, unpack_parts
from kvledger.producer.processes import ProcessWatch
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring import Ring
from kvledger.producer.ring_writer import RingWriter, meta_path, request_stop_of, sweep_stale_rings
from kvledger.producer.staging import Lease, Staged
from kvledger.schemas.events import RankInfo, body_of
from kvledger.stream_app.replay import iter_ledger, replay
from tests.e2e import tracing_costs
from tests.synthetic.engine import SimConfig, simulate

from .test_frames import scheduler_output

RANK = RankIdentity("ring-eng", 0, 0, 0, 7)

# Two groups, as the test scheduler outputs have: one addresses slots (its prompts get chains), one not.
INFO = records.rank_info(
    dp_size=1,
    tp_size=1,
    pp_size=1,
    kv_groups=[records.kv_group(0, "FULL_ATTENTION", 16, 4096), records.kv_group(1, "MAMBA", 16, 4096)],
    vllm_version="x",
    runner="v1",
)


def config(root: Path, action: TraceAction = TraceAction.RECORD) -> TraceConfig:
    return TraceConfig(enabled=True, action=action, sink=SinkSpec("file", path=root), ring_bytes=1 << 20)


def ledger_events(root: Path) -> list[dict]:
    problems: list = []
    _, events = iter_ledger(root, problems)
    found = [event for _, event in events]
    assert problems == []
    return found


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    watch, deadline = ProcessWatch(pid), time.monotonic() + timeout  # a zombie counts as gone
    while watch.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not watch.alive()


def started(recorder: RingWriter, timeout: float = 60.0) -> int:
    """The pid of the recorder once it runs."""
    deadline = time.monotonic() + timeout
    while recorder.recorder_state() is not True:
        assert time.monotonic() < deadline and recorder.recorder_state() is not False, "no recorder"
        time.sleep(0.01)
    return recorder.recorder_pid


def plan(step: int) -> PlanCapture:
    """A plan shaped as the V1 runner's: 3 requests over 2 groups; even steps as a device engine
    leaves it (copies, gathered at the step's end), odd ones as a CPU engine (one part at once)."""
    rows = np.arange(12, dtype=np.int32).reshape(3, 4) + 100 * step
    lens = np.array([4, 2, 3], np.int32)
    slots = np.arange(7, dtype=np.int64) + 16 * step
    groups = [(Staged.host(slots), Staged.host(rows), lens), (Staged.host(slots + 1), Staged.host(rows), lens)]
    parts = PlanCapture.plan_parts(np.array([0, 3, 5, 6], np.int32), Staged.host(np.arange(7, dtype=np.int64)), groups)
    if step % 2:
        parts = pack_parts([p.numpy() if isinstance(p, Staged) else p for p in parts])
    return PlanCapture([f"r{step}-0", f"r{step}-1", "r0-1"], 6, [0, 1], parts)


def test_what_the_recorder_writes_is_what_the_rank_would_have_built(tmp_path):
    captures = [StepCapture(s, "REAL", scheduler_fields(scheduler_output(s)), plan(s)) for s in range(5)]
    dummy = PlanCapture.of_dummy_run([0], PlanCapture.dummy_parts([Staged.host(np.full(4, -1))]))
    captures.append(StepCapture(5, "DUMMY", None, dummy))
    snapshot = SnapshotCapture.of_rows(5, ["r4-0", "r4-1"], [3, 9], [[[1, 2], [3]], [[7], []]])
    recorder = RingWriter(RANK, config(tmp_path))
    recorder.body(INFO)
    for capture in captures:
        recorder.step(capture)
    recorder.snapshot(snapshot)
    recorder.close(step=5, timeout=30)

    index = RequestIndex()  # the rank's own build of the same captures, in the same order
    chains = PrefixChains.of(INFO)  # the recorder's, from the rank's RankInfo
    expected = [c.record(index, False, chains) for c in captures] + [snapshot.record(index)]
    assert expected[0].input.new_reqs[0].prefix_chains[0]  # the prompts' chains, at the first group's block size
    events = ledger_events(tmp_path)
    assert [e["seq"] for e in events] == list(range(9))  # RankInfo, 6 steps, the snapshot, the closing Health
    assert [body_of(*e["body"]) for e in events[1:8]] == expected
    health = events[-1]["body"][1]
    assert health["closing"] and health["events_captured"] == 8 and health["events_dropped"] == 0
    assert not recorder.ring.path.exists()  # the recorder unlinked the ring once drained


def test_a_killed_recorder_is_replaced_and_the_ledger_resyncs(tmp_path):
    sim = simulate(SimConfig(seed=4, steps=400, snapshot_interval=50)).events
    sim = [body_of(*e["body"]) for e in sim if e["tp_rank"] == 0]
    recorder = RingWriter(RankIdentity("sim-engine", 0, 0, 0, 11), config(tmp_path))
    first = started(recorder)
    for n, body in enumerate(sim):
        recorder.body(body)
        if n == len(sim) // 3:
            # The first recorder delivers what it read (idle: its sink is flushed); its pid is in
            # the ring before its imports are done, so wait for its events, not a fixed time.
            deadline = time.monotonic() + 30
            while not any(p.stat().st_size for p in tmp_path.rglob("*.avro")) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            os.kill(first, signal.SIGKILL)
            wait_gone(first)
            time.sleep(1.0)  # past RESPAWN_AFTER_S
            assert recorder.supervise()
        if n % 50 == 0:
            time.sleep(0.01)
    recorder.close(step=399, timeout=30)
    assert recorder.respawns == 1 and recorder.recorder_pid is None
    result = replay(tmp_path)
    incarnations = {e["incarnation"] for e in ledger_events(tmp_path)}
    assert len(incarnations) == 2  # the respawned recorder wrote under a new one
    assert result.violations == []  # no false alarm for the restart
    assert result.ledger.coverage.unchecked["rank_restarted"] == 1
    assert result.ledger.coverage.checks["write"] > 0  # checked again after the resync


ENGINE = """
import os, signal, sys, time
from pathlib import Path
from kvledger.producer.config import SinkSpec, TraceAction, TraceConfig
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring import Ring
from kvledger.producer.processes import ProcessWatch
from kvledger.producer.ring_writer import RingWriter, meta_path, sweep_stale_rings
from kvledger.schemas.events import body_of
from tests.synthetic.engine import SimConfig, simulate

sim = simulate(SimConfig(seed=2, steps=300, snapshot_interval=0)).events
sim = [body_of(*e["body"]) for e in sim if e["tp_rank"] == 0]
config = TraceConfig(enabled=True, action=TraceAction.RECORD, sink=SinkSpec("file", path=Path(sys.argv[1])))
recorder = RingWriter(RankIdentity("killed-eng", 0, 0, 0, 5), config)
for body in sim:
    recorder.body(body)
while recorder.recorder_state() is not True:
    time.sleep(0.01)
print(recorder.recorder_pid, len(sim), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # mid-run, nothing closed
"""


def test_an_engine_killed_mid_run_leaves_a_complete_ledger(tmp_path):
    done = subprocess.run([sys.executable, "-c", ENGINE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid, written = map(int, done.stdout.split())
    wait_gone(pid)  # the recorder drains the ring, closes the ledger and ends on its own
    events = ledger_events(tmp_path)  # no read problem: nothing truncated
    assert [e["seq"] for e in events] == list(range(written))
    result = replay(tmp_path)
    assert result.violations == []
    assert not result.ledger.closed  # killed unasked: nobody says the rank shut down


STOPPED_ENGINE = ENGINE.replace(
    "os.kill(os.getpid(), signal.SIGKILL)  # mid-run, nothing closed",
    """from kvledger.producer import plugin
plugin._probes.append(type("Probe", (), {"recorder": recorder})())
signal.signal(signal.SIGTERM, signal.SIG_DFL)
plugin.chain_signal(signal.SIGTERM)  # as the plugin does in a rank's process
print("READY", flush=True)
time.sleep(60)""",
)


@pytest.mark.parametrize("stopped_by", ["its engine's shutdown", "SIGTERM"])
def test_a_rank_stopped_on_purpose_and_killed_before_closing_is_closed_by_its_recorder(tmp_path, stopped_by):
    """vLLM's server marks the rings below the engines it stops, then SIGKILLs them; a rank's own
    SIGTERM handler marks its rings. Either way the recorder writes the rank's closing Health
    after all it wrote, and says so."""
    engine = subprocess.Popen(
        [sys.executable, "-c", STOPPED_ENGINE, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pid, written = map(int, engine.stdout.readline().split())
        assert engine.stdout.readline().strip() == "READY"
        if stopped_by == "SIGTERM":
            engine.send_signal(signal.SIGTERM)  # the handler marks the ring, then the default action
        else:
            assert request_stop_of([engine.pid]) == 1  # before the kill, as CoreEngineProcManager.shutdown
            engine.kill()
        engine.wait(30)
        wait_gone(pid)
        stderr = engine.stderr.read()
    finally:
        engine.kill()
        engine.wait()
    events = ledger_events(tmp_path)
    assert [e["seq"] for e in events] == list(range(written + 1))  # every frame, then the last word
    name, health = events[-1]["body"]
    last_step = max(e["body"][1]["step"] for e in events if e["body"][0] == "kvledger.Step")
    assert name == "kvledger.Health" and health["closing"] and health["step"] == last_step
    assert health["events_captured"] == written and health["events_dropped"] == 0
    result = replay(tmp_path)
    assert result.violations == [] and result.ledger.closed and result.problems == []
    assert f"closed for it at step {last_step} (seq {written})" in stderr, stderr
    assert "ended without closing" not in stderr


def test_only_live_ranks_below_the_stopped_processes_are_marked(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    rings = {
        name: Ring.create(tmp_path / f"kvledger-{pid}-dp0-tp0-pp0-0.ring", 4096)
        for name, pid in (("ours", os.getpid()), ("dead", gone.pid), ("elsewhere", 1))
    }
    assert request_stop_of([os.getppid(), gone.pid], tmp_path) == 1  # this process is below its parent
    assert {name: ring.stop_requested for name, ring in rings.items()} == {
        "ours": True,
        "dead": False,  # it died unasked
        "elsewhere": False,  # alive, but not below the processes stopped
    }


@pytest.mark.parametrize("action", [TraceAction.LOG])
def test_the_log_check_runs_in_the_recorder_and_logs_to_the_engines_stderr(tmp_path, action):
    script = (
        ENGINE.replace("TraceAction.RECORD", f"TraceAction.{action.name}")
        .replace(
            "simulate(SimConfig(seed=2, steps=300, snapshot_interval=0))",
            "simulate(SimConfig(seed=2, steps=300, snapshot_interval=0, faults=(FaultSpec('slot_shift', 120),)))",
        )
        .replace("import SimConfig, simulate", "import FaultSpec, SimConfig, simulate")
        .replace("os.kill(os.getpid(), signal.SIGKILL)  # mid-run, nothing closed", "recorder.close(299, timeout=60)")
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kv_trace: write_target_mismatch at step 120" in done.stderr


def test_rings_of_ranks_and_recorders_both_gone_are_swept(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid: a process that no longer exists
    dead, live = tmp_path / f"kvledger-{gone.pid}-dp0-tp0-pp0.ring", tmp_path / f"kvledger-{os.getpid()}-x.ring"
    for path in (dead, live):
        Ring.create(path, 4096).close()
    meta_path(dead).write_text("{}")
    sweep_stale_rings(tmp_path)
    assert not dead.exists() and not meta_path(dead).exists()  # a killed recorder's leftovers
    assert live.exists()  # its rank still runs


def test_frames_the_full_ring_turned_away_are_counted_in_health_and_show_as_gaps(tmp_path):
    recorder = RingWriter(RANK, config(tmp_path))  # a 1 MiB ring
    slots = Staged.host(np.full(60_000, -1, np.int64))  # 480 KB a frame: two fill the ring
    for step in range(40):  # far more than the ring holds before its recorder starts reading
        recorder.step(StepCapture(step, "DUMMY", None, PlanCapture.of_dummy_run([0], PlanCapture.dummy_parts([slots]))))
    assert recorder.dropped > 0
    started(recorder)
    recorder.close(step=0, timeout=30)
    events = ledger_events(tmp_path)
    health = events[-1]["body"][1]
    assert health["closing"] and health["events_captured"] == 40
    assert health["events_dropped"] == recorder.dropped == 40 - (len(events) - 1)


# -- device engines: a step's frame waits for its copies, the engine thread does not ----------------
class CopyEvent:
    """A device event, completed by the test (or by a wait for it)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += not self.done  # a wait for a copy still in flight
        self.done = True


class Pool:
    def __init__(self) -> None:
        self.given_back = 0

    def give_back(self, buffer) -> None:
        self.given_back += 1


def device_plan(step: int, event: CopyEvent, pool: Pool) -> PlanCapture:
    """`plan(step)` as a device engine leaves it: every tensor still being copied behind `event`."""
    rows = np.arange(12, dtype=np.int32).reshape(3, 4) + 100 * step
    lens, slots = np.array([4, 2, 3], np.int32), np.arange(7, dtype=np.int64) + 16 * step

    lease = Lease(pool, "a pinned buffer", 8, event)  # one per step, shared by its 8 copies

    def staged(array: np.ndarray) -> Staged:
        return Staged(array, lease)  # its place in the pinned buffer

    groups = [(staged(slots), staged(rows), staged(lens)), (staged(slots + 1), staged(rows), staged(lens))]
    arrays = PlanCapture.plan_parts(staged(np.array([0, 3, 5, 6], np.int32)), staged(np.arange(7)), groups)
    return PlanCapture([f"r{step}-0", f"r{step}-1", "r0-1"], 6, [0, 1], arrays)


def test_a_device_step_is_held_until_its_copies_land_and_later_frames_wait_behind_it(tmp_path):
    pool, events = Pool(), [CopyEvent() for _ in range(3)]
    captures = [
        StepCapture(s, "REAL", scheduler_fields(scheduler_output(s)), device_plan(s, events[s], pool)) for s in range(3)
    ]
    transfer = INFO
    recorder = RingWriter(RANK, config(tmp_path))
    recorder.step(captures[0])  # its copies are behind a forward pass still running
    assert recorder.body(transfer) is None  # held behind it, to keep the rank's order
    recorder.health(0)
    assert (recorder.held, recorder.captured) == (3, 0)
    events[0].done = True
    recorder.step(captures[1])  # step 0 and what followed it are written; step 1 is held
    assert (recorder.held, recorder.captured) == (1, 3)
    events[1].done = events[2].done = True
    recorder.step(captures[2])
    assert (recorder.held, recorder.captured) == (0, 5)
    recorder.close(step=2, timeout=30)
    assert [e.waited for e in events] == [0, 0, 0]  # the engine thread never waited for the device
    assert pool.given_back == len(captures)  # every step's pinned buffer back in the pool

    index = RequestIndex()
    # Step 0's frame came before the RankInfo: its prompts' chains were not known yet (not recorded).
    expected = [c.record(index, False, None if s == 0 else PrefixChains.of(INFO)) for s, c in enumerate(captures)]
    events_written = ledger_events(tmp_path)
    assert [e["seq"] for e in events_written] == list(range(6))
    assert [e["body"][0] for e in events_written] == [
        "kvledger.Step",
        "kvledger.RankInfo",
        "kvledger.Health",
        "kvledger.Step",
        "kvledger.Step",
        "kvledger.Health",
    ]
    assert [body_of(*e["body"]) for e in events_written if e["body"][0] == "kvledger.Step"] == expected
    assert events_written[2]["body"][1]["events_captured"] == 2  # its counts as written, after step 0 and the body


def test_a_held_step_carries_the_block_lists_as_they_were_when_it_was_recorded(tmp_path):
    # The probe hands over the scheduler's own lists (encoded with the frame's header); the runner
    # adopts some as request state and extends them in place on the next step, while a device
    # step's frame may still be held for its copies.
    pool, event = Pool(), CopyEvent()
    so = scheduler_output(2)
    expected = StepCapture(2, "REAL", scheduler_fields(so), plan(3)).record(RequestIndex(), False)
    recorder = RingWriter(RANK, config(tmp_path), spawn=False)
    recorder.step(StepCapture(2, "REAL", scheduler_fields(so), device_plan(2, event, pool)))
    assert recorder.held == 1
    so.scheduled_new_reqs[0].block_ids[0].extend([77, 78])  # the next step's appends, in place
    so.scheduled_cached_reqs.new_block_ids[0][0].append(79)
    event.done = True
    recorder.drain()
    [frame] = [read_frame(bytes(r)) for r in recorder.ring.records()]
    written = StepCapture.from_parts(frame.parts).record(RequestIndex(), False)
    assert written.input == expected.input
    recorder.ring.close(unlink=True)


def test_a_device_snapshot_is_held_until_its_rows_land_and_carries_what_the_host_would(tmp_path):
    # MRV2 snapshots its live requests from the device's block tables: one gathered copy per
    # group, queued behind the forward pass. The frame waits for them; the engine thread does not.
    pool, event = Pool(), CopyEvent()
    lease = Lease(pool, "a pinned buffer", 2, event)
    full = np.array([[1, 2, 0], [3, 0, 0]], np.int32), np.array([[7, 0], [0, 0]], np.int32)  # padded rows
    lens = [np.array([2, 1], np.int32), np.array([1, 0], np.int32)]
    snapshot = SnapshotCapture.of_staged(5, ["r4-0", "r4-1"], [3, 9], lens, [Staged(r, lease) for r in full])
    host = SnapshotCapture.of_rows(5, ["r4-0", "r4-1"], [3, 9], [[[1, 2], [3]], [[7], []]])
    recorder = RingWriter(RANK, config(tmp_path), spawn=False)
    recorder.snapshot(snapshot)
    recorder.health(5)
    assert (recorder.held, recorder.captured) == (2, 0)  # the Health waits behind it, in order
    event.done = True
    recorder.drain()
    assert (recorder.held, recorder.captured) == (0, 2) and event.waited == 0 and pool.given_back == 1
    frame, _ = [read_frame(bytes(r)) for r in recorder.ring.records()]
    assert frame.kind is FrameKind.SNAPSHOT
    assert SnapshotCapture.from_parts(frame.parts).record(RequestIndex()) == host.record(RequestIndex())
    recorder.ring.close(unlink=True)


def test_held_frames_are_bounded_and_the_rank_close_waits_for_the_rest(tmp_path):
    pool = Pool()
    events = [CopyEvent() for _ in range(6)]
    recorder = RingWriter(RANK, config(tmp_path), spawn=False, max_held=3)
    for s, event in enumerate(events):
        recorder.step(StepCapture(s, "REAL", None, device_plan(s, event, pool)))
    # Past three held, the oldest is waited for: the bound on the copies (and pinned buffers) in flight.
    assert recorder.held == 3 and [e.waited for e in events] == [1, 1, 1, 0, 0, 0]
    recorder.flush(timeout=0)
    assert recorder.held == 0 and all(e.waited == 1 for e in events)
    assert recorder.captured == 6
    recorder.ring.close(unlink=True)


def test_a_record_waiting_for_its_digest_holds_the_frames_after_it(tmp_path):
    recorder = RingWriter(RANK, config(tmp_path), spawn=False)
    hashed: list[bytes] = []
    info = records.rank_info(dp_size=1, tp_size=1, pp_size=1, kv_groups=[], vllm_version="x", runner="v1")
    recorder.body_when(lambda: bool(hashed), lambda: msgspec.structs.replace(info, vllm_version=hashed[0]))
    recorder.step(StepCapture(0, "REAL", scheduler_fields(scheduler_output(0)), plan(1)))  # a host plan, ready
    assert (recorder.held, recorder.captured) == (2, 0)  # the step waits behind the record
    hashed.append("y")
    recorder.step(StepCapture(1, "REAL", scheduler_fields(scheduler_output(1)), plan(3)))
    assert (recorder.held, recorder.captured) == (0, 3)
    frames = [read_frame(bytes(r)) for r in recorder.ring.records()]
    assert [(f.kind, f.seq) for f in frames] == [(FrameKind.BODY, 0), (FrameKind.STEP, 1), (FrameKind.STEP, 2)]
    assert body_from_part(frames[0].parts[0]).vllm_version == "y"  # built once ready
    recorder.ring.close(unlink=True)


def test_a_step_written_of_its_pieces_behind_a_held_frame_keeps_its_parts_as_they_were(tmp_path):
    # The plan's parts go as a part of parts, packed in place when written now; held, they are
    # packed at once: the runner reuses their buffers next step.
    recorder = RingWriter(RANK, config(tmp_path), spawn=False)
    landed: list[bool] = []
    info = records.rank_info(dp_size=1, tp_size=1, pp_size=1, kv_groups=[], vllm_version="x", runner="v1")
    recorder.body_when(lambda: bool(landed), lambda: info)
    buffer = np.arange(8, dtype=np.int64)
    header = StepHeader(0, "REAL", scheduler_fields(scheduler_output(0)), None)
    recorder.step_now(header, [[(buffer, 3), buffer]])
    buffer[:] = -1  # the runner's next step
    landed.append(True)
    recorder.step_now(header, [[(buffer, 2)]])
    frames = [read_frame(bytes(r)) for r in recorder.ring.records()]
    assert [(f.kind, f.seq) for f in frames] == [(FrameKind.BODY, 0), (FrameKind.STEP, 1), (FrameKind.STEP, 2)]
    assert [p.tolist() for p in unpack_parts(frames[1].parts[1])] == [[0, 1, 2], list(range(8))]
    assert [p.tolist() for p in unpack_parts(frames[2].parts[1])] == [[-1, -1]]
    recorder.ring.close(unlink=True)


def test_a_flush_that_interrupts_a_write_leaves_the_held_frames_in_order(tmp_path):
    recorder = RingWriter(RANK, config(tmp_path), spawn=False)
    info = records.rank_info(dp_size=1, tp_size=1, pp_size=1, kv_groups=[], vllm_version="x", runner="v1")
    landed = []

    def interrupted() -> RankInfo:  # a signal handler's flush while the frame is written
        recorder.flush(timeout=0)
        return msgspec.structs.replace(info, vllm_version="first")

    recorder.body_when(lambda: bool(landed), interrupted)
    recorder.body_when(lambda: bool(landed), lambda: msgspec.structs.replace(info, vllm_version="second"))
    landed.append(True)
    recorder.drain()
    frames = [read_frame(bytes(r)) for r in recorder.ring.records()]
    assert [(f.seq, body_from_part(f.parts[0]).vllm_version) for f in frames] == [(0, "first"), (1, "second")]
    assert recorder.held == 0
    recorder.ring.close(unlink=True)


def test_the_cost_counters_leave_out_their_own_wait_for_the_recorders(tmp_path, monkeypatch):
    # bench/engine_overhead.py reads these after each arm (tests/e2e/tracing_costs.py, the workers'
    # extension): the wait for the recorders to read the arm's frames polls the ring every ms, CPU
    # only the traced arm would spend and tracing never does.
    recorder = RingWriter(RANK, config(tmp_path), spawn=False)
    monkeypatch.setattr(plugin, "_probes", [SimpleNamespace(step=0, recorder=recorder)])
    before, _, _, _ = tracing_costs.process_counters()  # nothing to wait for
    recorder.health(0)  # a frame nobody reads: the next counters wait their 2 s for it
    started = time.process_time()
    after, steps, _, _ = tracing_costs.process_counters()
    waited = time.process_time() - started
    assert recorder.ring.pending and steps == 1
    assert waited > 0.002, "the wait polled for 2 s: it takes CPU"
    assert after - before < 0.25 * waited
    recorder.ring.close(unlink=True)


def test_the_cost_counters_read_a_recorders_cpu_from_proc():
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\ninput()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while tracing_costs.recorder_cpu_s(busy.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.2 <= tracing_costs.recorder_cpu_s(busy.pid) < 30
    finally:
        busy.communicate(b"\n", timeout=30)
    assert tracing_costs.recorder_cpu_s(busy.pid) == 0.0  # gone (reaped): nothing to read
    assert tracing_costs.recorder_cpu_s(None) == 0.0  # no recorder process
