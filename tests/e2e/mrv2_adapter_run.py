"""Drive the Model Runner V2 adapter against MRV2's real classes, as far as they run on CPU.

    python mrv2_adapter_run.py LEDGER_DIR [--fault slot_shift]

MRV2 needs Triton and a device, which this host lacks, so a real MRV2 engine
cannot run here. This script keeps everything real that runs on CPU and says
what stands in for the rest:

* real: the MRV2 `GPUModelRunner` class (an instance made without its
  device-bound `__init__`; the adapter's attach points are checked against
  its real method signatures), `BlockTables` (request rows appended through
  `append_block_ids`; the adapter reads row lengths from its `num_blocks`
  host mirror), `InputBatch` and `InputBuffers`, the real `prepare_dummy_attn`
  for a profile run, vLLM's `SchedulerOutput` records, vLLM's distributed
  state (one gloo rank), the plugin's adapter choice, the file sink;
* stand-ins: `execute_model` (MRV2's request bookkeeping and input
  preparation, reduced to what the plan needs) and `prepare_attn`, whose two
  Triton kernels (gather block tables, compute slot mappings) are replaced by
  the same arithmetic in torch.

It prints one line `RESULT {json}` with what the test asserts on.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
from pathlib import Path

import numpy as np
import torch

BLOCK_SIZE = 16
PROMPTS = {"req-a": 20, "req-b": 40, "req-c": 7}  # prompt lengths; req-c arrives at step 2
STEPS = 8


def distributed_one_rank() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)


def make_runner(fault: str | None):
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    cpu = torch.device("cpu")
    runner = object.__new__(GPUModelRunner)  # the real class; its __init__ needs a device
    runner.vllm_config = VllmConfig()
    runner.device = cpu
    runner.pcp_manager = None
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16, dtype=torch.float32)
    runner.kv_cache_config = KVCacheConfig(64, [], [KVCacheGroupSpec(["layer.0"], spec)])
    runner.block_tables = BlockTables([BLOCK_SIZE], 8, 256, [32], cpu)
    buffers = InputBuffers(8, 256, cpu)
    state_of: dict[str, int] = {}
    rows: dict[int, list[int]] = {}  # host mirror of the device block table (its writes need Triton)
    step = {"n": -1}

    def execute_model(
        scheduler_output,
        intermediate_tensors=None,
        dummy_run=False,
        skip_attn_for_dummy_run=False,
        is_profile=False,
        **_,
    ):
        if dummy_run:
            batch = InputBatch.make_dummy(2, 8, buffers)
            runner.prepare_dummy_attn(batch)
            return None
        step["n"] += 1
        so = scheduler_output
        for r in so.scheduled_new_reqs:
            index = state_of[r.req_id] = len(state_of)
            runner.block_tables.append_block_ids(index, r.block_ids, overwrite=True)
            rows[index] = list(r.block_ids[0])
        cached = so.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_ids is not None:
                runner.block_tables.append_block_ids(state_of[req_id], new_ids, overwrite=False)
                rows[state_of[req_id]] += new_ids[0]
        runner.prepare_attn(input_batch(so))
        return None

    def input_batch(so):
        req_ids = list(so.num_scheduled_tokens)
        counts = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        starts = [computed[r] for r in req_ids]
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(starts, counts, strict=True)])
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        batch = InputBatch.make_dummy(len(req_ids), int(counts.sum()), buffers)
        return dataclasses.replace(
            batch,
            req_ids=req_ids,
            idx_mapping_np=np.array([state_of[r] for r in req_ids], np.intp),
            query_start_loc_np=qsl,
            positions=torch.from_numpy(positions),
        )

    def prepare_attn(input_batch):
        """MRV2's prepare_attn with its Triton kernels written out in torch."""
        n, t = input_batch.num_reqs, input_batch.num_tokens
        table = torch.zeros((n, 32), dtype=torch.int32)
        for i, state in enumerate(input_batch.idx_mapping_np):
            table[i, : len(rows[state])] = torch.tensor(rows[state], dtype=torch.int32)
        slots = torch.full((1, input_batch.num_tokens_after_padding), -1, dtype=torch.int64)
        qsl = input_batch.query_start_loc_np
        for i in range(n):
            pos = input_batch.positions[qsl[i] : qsl[i + 1]]
            slots[0, qsl[i] : qsl[i + 1]] = table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        if fault == "slot_shift" and step["n"] == 3:
            slots[0, 0] += 1  # the first token of the first request, one slot off
        return (table,), slots[:, :t]

    runner.execute_model = execute_model
    runner.prepare_attn = prepare_attn
    return runner


def scheduler_outputs():
    """A small schedule: prefills, decodes, a late arrival, crossing block boundaries."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    free = iter(range(1, 64))
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for step in range(STEPS):
        active = [r for r in PROMPTS if r != "req-c" or step >= 2]
        new, cached_ids, cached_new, cached_computed, scheduled = [], [], [], [], {}
        for req_id in active:
            first = req_id not in blocks
            n = PROMPTS[req_id] if first else 1
            done = computed.get(req_id, 0)
            mine = blocks.setdefault(req_id, [])
            added = [next(free) for _ in range(-(-(done + n) // BLOCK_SIZE) - len(mine))]
            mine += added
            scheduled[req_id] = n
            if first:
                new.append(NewRequestData(req_id, list(range(n)), [], None, None, (list(mine),), 0, None))
            else:
                cached_ids.append(req_id)
                cached_new.append((added,) if added else None)
                cached_computed.append(done)
        yield SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                cached_ids, set(), [[] for _ in cached_ids], {}, cached_new, cached_computed, [0] * len(cached_ids)
            ),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        for req_id, n in scheduled.items():
            computed[req_id] = computed.get(req_id, 0) + n


def main() -> None:
    ledger = Path(sys.argv[1])
    fault = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--fault" else None
    import vllm.v1.worker.cpu.shm  # noqa: F401  (CPU stand-ins for the UVA buffers BlockTables uses)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from kvledger.producer.config import TraceConfig, parse_sink
    from kvledger.producer.plugin import probe_class

    distributed_one_rank()
    bare = object.__new__(GPUModelRunner)
    adapter = probe_class(bare)
    probe = adapter(bare, TraceConfig(enabled=True))
    # The adapter's attach points against MRV2's real methods and their real signatures.
    missing = {point.method: point.missing(bare) for point, _ in probe.attach_points()}

    runner = make_runner(fault)
    probe = adapter(runner, TraceConfig(enabled=True, sink=parse_sink(f"file://{ledger}"), snapshot_interval=4))
    probe.attach()
    runner.execute_model(None, dummy_run=True, is_profile=True)
    for so in scheduler_outputs():
        runner.execute_model(so)
    probe.close()
    print("RESULT " + json.dumps({"adapter": adapter.__name__, "missing": missing}), flush=True)


if __name__ == "__main__":
    main()
