"""Drive the Model Runner V2 adapter against MRV2's real classes on a scripted schedule: what
no CPU engine shows.

    python mrv2_adapter_run.py LEDGER_DIR [--pause FIRST:END] [--fault KIND@STEP[:REQ]]...

Real MRV2 engines run in the tests (`"runner": "v2"`, infra/mrv2-cpu: its Triton kernels in
Triton's interpreter). A CPU engine never pads a batch as a FULL CUDA graph does (it runs
eager), so this script keeps that case, and a schedule exact enough to pause over and to
compare every snapshot with the scheduler's truth:

* real: the MRV2 `GPUModelRunner` class (an instance made without its
  device-bound `__init__`; the adapter's attach points are checked against
  its real method signatures), `RequestState` (request -> state index, the
  host's computed tokens), `BlockTables` (rows staged by `append_block_ids`,
  lengths in its `num_blocks` host mirror, the persistent `input_block_tables`
  and `slot_mappings` buffers), `InputBatch` and `InputBuffers`, the real
  `prepare_dummy_attn` for a profile run, vLLM's `SchedulerOutput` records,
  vLLM's distributed state (one gloo rank), the plugin's adapter choice and
  its pause/resume, the file sink;
* stand-ins: `execute_model` (MRV2's request bookkeeping, in the order MRV2
  runs it, and its input preparation reduced to what the plan needs) and the
  three Triton kernels (apply staged block-table writes, gather block tables,
  compute slot mappings), written out in torch with the kernels' arithmetic.

Batches are padded as a FULL CUDA-graph dispatch pads them (to the next
multiple of 8 tokens), so the slot mapping carries padding after the real
tokens. Ledger steps count the profile run as step 0, so real step i is
ledger step i + 1. Faults: `slot_shift` moves REQ's first token one slot on
(default: the batch's first request); `pad_stale` writes a live block's slot
into the padding. It prints `RESULT {json}` with what the test asserts on.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import socket
from pathlib import Path

import numpy as np
import torch

BLOCK_SIZE = 16
MAX_REQS = 8
PROMPTS = {"req-a": 20, "req-b": 40, "req-c": 7, "req-d": 5}  # prompt lengths
ARRIVES = {"req-a": 1, "req-b": 1, "req-c": 3, "req-d": 10}  # ledger step of first schedule
FINISHES = {"req-b": 9}  # ledger step whose scheduler output lists it finished
STEPS = 12  # real steps: ledger steps 1..12
SNAPSHOT_INTERVAL = 4  # snapshots after ledger steps 3, 7, 11
PAD_ID = -1


def distributed_one_rank() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)


def apply_staged_writes(block_tables) -> None:
    """BlockTables.apply_staged_writes with its Triton write kernel written out in torch."""
    for table in block_tables.block_tables:
        lo = 0
        for row, start, hi in zip(
            table._staged_write_indices, table._staged_write_starts, table._staged_write_cu_lens, strict=True
        ):
            content = torch.tensor(table._staged_write_contents[lo:hi], dtype=table.gpu.dtype)
            table.gpu[row, start : start + hi - lo] = content
            lo = hi
        table.clear_staged_writes()
    block_tables.num_blocks.copy_to_uva()


def prepare_attn(block_tables, input_batch):
    """MRV2's prepare_attn: the gather and slot-mapping kernels' arithmetic, into the same
    persistent buffers, returning the same slices."""
    num_reqs, padded_reqs = input_batch.num_reqs, input_batch.num_reqs_after_padding
    qsl, positions = input_batch.query_start_loc_np, input_batch.positions
    gathered = []
    for gid, (table, out) in enumerate(zip(block_tables.block_tables, block_tables.input_block_tables, strict=True)):
        for i, state in enumerate(input_batch.idx_mapping_np[:num_reqs]):
            n = int(block_tables.num_blocks.np[gid, state])
            out[i, :n] = table.gpu[state, :n]
        out[num_reqs:padded_reqs] = 0  # padded rows read the null block
        slots = block_tables.slot_mappings[gid]
        for i in range(num_reqs):
            pos = positions[qsl[i] : qsl[i + 1]].long()
            slots[qsl[i] : qsl[i + 1]] = out[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        slots[qsl[num_reqs] :] = PAD_ID  # from the real token count to the end, for CUDA graphs
        gathered.append(out[:padded_reqs])
    return tuple(gathered), block_tables.slot_mappings[:, : input_batch.num_tokens_after_padding]


@dataclasses.dataclass
class Fault:
    kind: str
    step: int
    req_id: str | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, _, where = text.partition("@")
        step, _, req_id = where.partition(":")
        return cls(kind, int(step), req_id or None)


def inject(fault: Fault, input_batch, slot_mappings) -> None:
    slots = slot_mappings[0]
    if fault.kind == "slot_shift":
        i = input_batch.req_ids.index(fault.req_id) if fault.req_id else 0
        slots[int(input_batch.query_start_loc_np[i])] += 1
    elif fault.kind == "pad_stale":  # a live block's first slot in the padding
        slots[input_batch.num_tokens] = int(slots[0]) // BLOCK_SIZE * BLOCK_SIZE
    else:
        raise SystemExit(f"unknown fault {fault.kind}")


def make_runner(faults: list[Fault]):
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.states import RequestState

    cpu = torch.device("cpu")
    runner = object.__new__(GPUModelRunner)  # the real class; its __init__ needs a device
    runner.vllm_config = VllmConfig()
    runner.device = cpu
    runner.pcp_manager = None
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16, dtype=torch.float32)
    runner.kv_cache_config = KVCacheConfig(64, [], [KVCacheGroupSpec(["layer.0"], spec)])
    runner.block_tables = BlockTables([BLOCK_SIZE], MAX_REQS, 256, [32], cpu)
    runner.req_states = RequestState(MAX_REQS, 512, 256, 0, 512, cpu)
    buffers = InputBuffers(MAX_REQS, 256, cpu)
    step = {"ledger": 0}

    def execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False, is_profile=False, **_):
        if dummy_run:
            runner.prepare_dummy_attn(InputBatch.make_dummy(2, 8, buffers))
            return None
        step["ledger"] += 1
        so, states, tables = scheduler_output, runner.req_states, runner.block_tables
        for req_id in sorted(so.finished_req_ids | set(so.preempted_req_ids or ())):  # finish_requests
            states.remove_request(req_id)
        for r in so.scheduled_new_reqs:  # add_requests
            states.add_request(r.req_id, len(r.prompt_token_ids), r.prompt_token_ids, r.num_computed_tokens, 16)
            tables.append_block_ids(states.req_id_to_index[r.req_id], r.block_ids, overwrite=True)
        cached = so.scheduled_cached_reqs  # update_requests
        for req_id, computed, new_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            index = states.req_id_to_index[req_id]
            states.num_computed_tokens_np[index] = computed
            if new_ids is not None:
                tables.append_block_ids(index, new_ids, overwrite=False)
        for staged in (states.all_token_ids, states.total_len, states.num_computed_tokens):
            staged.clear_staged_writes()  # device-only request state the plan does not read
        apply_staged_writes(tables)
        batch = input_batch(so)
        runner.prepare_attn(batch)
        return None

    def input_batch(so):
        req_ids = list(so.num_scheduled_tokens)
        counts = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
        index = runner.req_states.req_id_to_index
        computed = runner.req_states.num_computed_tokens_np
        num_tokens = int(counts.sum())
        padded = (num_tokens // 8 + 1) * 8  # a FULL graph's capture size: padding always follows
        positions = torch.zeros(padded, dtype=torch.int64)
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        for i, r in enumerate(req_ids):
            positions[qsl[i] : qsl[i + 1]] = torch.arange(int(computed[index[r]]), int(computed[index[r]]) + counts[i])
        batch = InputBatch.make_dummy(len(req_ids), padded, buffers)
        idx = np.array([index[r] for r in req_ids], np.intp)
        return dataclasses.replace(
            batch,
            req_ids=req_ids,
            idx_mapping=torch.from_numpy(idx.astype(np.int64)),
            idx_mapping_np=idx,
            num_scheduled_tokens=counts,
            num_tokens=num_tokens,
            query_start_loc_np=qsl,
            positions=positions,
        )

    def prepare_attn_in_torch(input_batch):
        block_tables, slot_mappings = prepare_attn(runner.block_tables, input_batch)
        for fault in faults:  # below the runner: in what attention is handed
            if fault.step == step["ledger"]:
                inject(fault, input_batch, slot_mappings)
        return block_tables, slot_mappings

    runner.execute_model = execute_model
    runner.prepare_attn = prepare_attn_in_torch
    return runner


def scheduler_outputs(truth: dict):
    """A small schedule: prefills, decodes, late arrivals, a finish whose blocks are reused,
    crossing block boundaries. `truth` gets, per ledger step, each live request's blocks and
    computed tokens as the scheduler holds them."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    free = collections.deque(range(1, 64))
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for ledger_step in range(1, STEPS + 1):
        finished = {r for r, s in FINISHES.items() if s == ledger_step}
        for req_id in finished:  # freed blocks go first in line, so the next arrival reuses them
            free.extendleft(reversed(blocks.pop(req_id)))
            computed.pop(req_id)
        active = [r for r in PROMPTS if (ARRIVES[r] <= ledger_step and r in blocks) or ARRIVES[r] == ledger_step]
        new, cached_ids, cached_new, cached_computed, scheduled = [], [], [], [], {}
        for req_id in active:
            first = req_id not in blocks
            n = PROMPTS[req_id] if first else 1
            done = computed.get(req_id, 0)
            mine = blocks.setdefault(req_id, [])
            added = [free.popleft() for _ in range(-(-(done + n) // BLOCK_SIZE) - len(mine))]
            mine += added
            scheduled[req_id] = n
            if first:
                new.append(NewRequestData(req_id, list(range(n)), [], None, None, (list(mine),), 0, None))
            else:
                cached_ids.append(req_id)
                cached_new.append((added,) if added else None)
                cached_computed.append(done)
        truth[ledger_step] = {r: {"blocks": list(blocks[r]), "computed": computed.get(r, 0)} for r in blocks}
        yield SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                cached_ids, set(), [[] for _ in cached_ids], {}, cached_new, cached_computed, [0] * len(cached_ids)
            ),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=finished,
            free_encoder_mm_hashes=[],
        )
        for req_id, n in scheduled.items():
            computed[req_id] = computed.get(req_id, 0) + n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--pause", help="FIRST:END, ledger steps recorded as paused (END not)")
    parser.add_argument("--fault", action="append", default=[], type=Fault.parse)
    args = parser.parse_args()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (CPU stand-ins for the UVA buffers BlockTables uses)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from kvledger.producer import plugin
    from kvledger.producer.config import TraceConfig, parse_sink

    distributed_one_rank()
    bare = object.__new__(GPUModelRunner)
    adapter = plugin.probe_class(bare)
    probe = adapter(bare, TraceConfig(enabled=True))
    # The adapter's attach points against MRV2's real methods and their real signatures.
    missing = {point.method: point.missing(bare) for point, _ in probe.attach_points()}

    runner = make_runner(args.fault)
    config = TraceConfig(enabled=True, sink=parse_sink(f"file://{args.ledger}"), snapshot_interval=SNAPSHOT_INTERVAL)
    probe = plugin.attach(runner, config)
    pause = tuple(int(s) for s in args.pause.split(":")) if args.pause else (0, 0)
    runner.execute_model(None, dummy_run=True, is_profile=True)
    truth: dict = {}
    for ledger_step, so in enumerate(scheduler_outputs(truth), start=1):
        if ledger_step == pause[0]:
            plugin.pause_tracing()
        if ledger_step == pause[1]:
            plugin.resume_tracing()
        runner.execute_model(so)
    plugin.close_all()
    result = {"adapter": adapter.__name__, "missing": missing, "steps": probe.step, "truth": truth}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
