"""The V1 probe's plan copy on a CPU engine: straight from the runner's persistent buffers, in one
compiled call, and only when a tensor attention reads is the buffer's prefix it looks like."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.conftest import vllm_python

# A runner's buffers as vLLM's V1 runner holds them: 4 rows of a block table, the slot mapping's
# persistent buffer, query starts and positions.
RUNNER = """
from types import SimpleNamespace as NS
import numpy as np, torch
from kvledger.producer.config import TraceConfig
from kvledger.producer.vllm_v1 import V1RunnerProbe

rows = np.zeros((4, 32), np.int32)
device_rows = torch.from_numpy(rows)
buffer = torch.arange(100, 164, dtype=torch.int64)  # the slot mapping's persistent buffer
table = NS(block_table=NS(np=rows), get_device_tensor=lambda n: device_rows[:n],
           num_blocks_per_row=np.array([2, 3, 1, 0], np.int32), slot_mapping=NS(gpu=buffer, np=buffer.numpy()))
runner = NS(device=torch.device("cpu"), input_batch=NS(block_table=[table], req_ids=["a", "b", "c", "d"]),
            query_start_loc=NS(np=np.array([0, 2, 3, 5, 5], np.int32)), positions=torch.arange(7, 71))
"""

SCRIPT = (
    RUNNER
    + """
from kvledger.producer.frames import unpack_parts

probe = V1RunnerProbe(runner, TraceConfig(enabled=True))
rows[:3, :3] = [[1, 2, 0], [3, 4, 5], [6, 0, 0]]

def capture(slots):
    probe._capture_plan({"num_tokens": 5, "num_reqs": 3, "slot_mappings": {0: slots}})
    return [a.tolist() for a in unpack_parts(probe._plan.part())]

other = torch.tensor([7, 8, 9, -1, -1, -1])
as_int32 = buffer.view(torch.int32)[:6]  # the buffer's address, another dtype
for slots in (buffer[:6], other, as_int32, buffer[::2][:3]):
    qsl, positions, got, table_rows, lens = capture(slots)
    assert got == slots.tolist(), (got, slots)
assert qsl == [0, 2, 3, 5] and positions == [7, 8, 9, 10, 11] and lens == [2, 3, 1]
first = capture(buffer[:6])
assert first[3] == [1, 2, 0, 3, 4, 5, 6, 0, 0]  # 3 rows up to the widest, 3 blocks
rows[1, 2] = 99  # rewritten after attention read it: the copy keeps what was read
assert [a.tolist() for a in unpack_parts(probe._plan.part())][3] == first[3]
print("ok")
"""
)


@pytest.mark.vllm
def test_the_plan_is_copied_from_the_runners_buffers_only_where_a_tensor_is_their_prefix():
    proc = subprocess.run([vllm_python(), "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.stdout + proc.stderr)[-2000:]


WRITTEN_AT_PLAN = (
    RUNNER
    + """
from kvledger.producer.capture import RequestIndex, StepCapture
from kvledger.producer.frames import read_frame
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring_writer import RingWriter

so = NS(scheduled_new_reqs=[], finished_req_ids=set(), preempted_req_ids=set(), new_block_ids_to_zero=None,
        scheduled_cached_reqs=NS(req_ids=["a", "b", "c"], resumed_req_ids=set(), new_block_ids=[None, ([9],), None],
                                 num_computed_tokens=[40, 50, 60]),
        num_scheduled_tokens={"a": 2, "b": 1, "c": 2}, kv_cache_block_copies=())

def step(at_plan, of_pieces=False):
    rows[:3, :3] = [[1, 2, 0], [3, 4, 9], [6, 0, 0]]
    probe = V1RunnerProbe(runner, TraceConfig(enabled=True, snapshot_interval=0))
    probe.recorder = RingWriter(RankIdentity("t", 0, 0, 0, 1), probe.config, spawn=False)
    probe._frame_at_plan, probe._writes_at_plan = at_plan, of_pieces
    probe._before_step(so)
    probe._capture_plan({"num_tokens": 5, "num_reqs": 3, "slot_mappings": {0: buffer[:5]}})
    at_capture = probe.recorder.captured
    rows[1, 2] = 77  # the forward pass and the runner's next changes: the frame holds what attention read
    probe._after_step()
    [frame] = [read_frame(bytes(r)) for r in probe.recorder.ring.records()]
    probe.recorder.ring.close(unlink=True)
    return at_capture, StepCapture.from_parts(frame.parts).record(RequestIndex(), False)

early, late = step(True), step(False)
assert (early[0], late[0]) == (1, 0), (early[0], late[0])  # written with its plan, or at the step's end
assert early[1] == late[1] and early[1].plan is not None and early[1].input is not None
assert step(True, of_pieces=True) == early  # a host step's frame written of its pieces: the same, as early
print("ok")
"""
)


@pytest.mark.vllm
def test_a_step_written_with_its_plan_is_the_frame_its_end_would_write():
    proc = subprocess.run([vllm_python(), "-c", WRITTEN_AT_PLAN], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.stdout + proc.stderr)[-2000:]
