"""Test-only vLLM plugin: injects KV addressing faults where vLLM computes the plan.

    KVLEDGER_TEST_FAULT=FAULT[,FAULT...]   FAULT = KIND[@STEP][:gGROUP]
        KIND: slot_shift | block_swap | foreign_write | staged_row (Model Runner V2 only)
    KVLEDGER_TEST_FAULT_STEP=N     (the step of a fault without @STEP; default 3)
    KVLEDGER_TEST_FAULT_GROUP=G    (the KV cache group of a fault without :gG; default 0)
    KVLEDGER_TEST_FAULT_TP_RANK=R  (optional: only on that tensor-parallel rank)
    KVLEDGER_TEST_FAULT_PP_RANK=R  (optional: only on that pipeline stage)

e.g. `slot_shift@6:g1,slot_shift@10:g3`. Each fault corrupts, at the runner's
N-th step, what the real runner hands attention for that group (its slot
mapping tensor, or the block-table rows on its device), so the trace probes see a fault
exactly as a runner bug would produce it. Each prints one line
`FAULT step=S req=R group=G` on stderr, which the tests match against.

Under Model Runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`) the faults go into what MRV2's own
Triton kernels produced, in `prepare_attn`'s result: the slot mapping
(`_compute_slot_mappings_kernel`) for `slot_shift` and `foreign_write`, the gathered
block-table rows (`_gather_block_tables_kernel`) for `block_swap`; `staged_row` stages the
first append of the step one block early (`BlockTables.append_block_ids`: over the row's
last block), and MRV2's kernels then apply, gather and compute slots from that row.
"""

import functools
import os
import re
import sys

_FAULT = re.compile(r"^(?P<kind>[a-z_]+)(?:@(?P<step>\d+))?(?::g(?P<group>\d+))?$")


def parse_faults(spec, default_step, default_group):
    """[(kind, step, group)] from the KVLEDGER_TEST_FAULT syntax above."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _FAULT.match(item)
        if m is None:
            raise ValueError(f"bad KVLEDGER_TEST_FAULT item {item!r}")
        step, group = m["step"], m["group"]
        faults.append(
            (m["kind"], default_step if step is None else int(step), default_group if group is None else int(group))
        )
    return faults


def register():
    spec = os.environ.get("KVLEDGER_TEST_FAULT")
    if not spec:
        return
    faults = parse_faults(
        spec,
        int(os.environ.get("KVLEDGER_TEST_FAULT_STEP", "3")),
        int(os.environ.get("KVLEDGER_TEST_FAULT_GROUP", "0")),
    )
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
        register_mrv2(faults)
        return
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if getattr(cls, "_kvledger_test_faults", False):
        return
    cls._kvledger_test_faults = True
    state = {"step": -1, "undo": []}
    execute_model, get_slot_mappings = cls.execute_model, cls._get_slot_mappings

    def traced_execute_model(self, scheduler_output, *args, **kwargs):
        state["step"] += 1
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            while state["undo"]:
                state["undo"].pop()()

    def faulty_get_slot_mappings(self, *args, **kwargs):
        by_gid, by_layer = get_slot_mappings(self, *args, **kwargs)
        if by_gid and on_this_rank():
            for kind, step, group in faults:
                if step == state["step"]:
                    inject(self, kind, group, by_gid)
        return by_gid, by_layer

    def inject(runner, kind, group, by_gid):
        batch = runner.input_batch
        table = batch.block_table[group]
        rows = table.block_table.np
        req_ids = batch.req_ids
        slots = by_gid[group]
        if kind == "slot_shift":
            slots[0] += 1  # the first token of the first request, one slot off
            victim = 0
        elif kind == "block_swap":
            # The device tensor attention reads (committed from the CPU mirror, which stays
            # right): a swapped row there; the write was planned before.
            victim, i, j = swappable(rows, table.num_blocks_per_row, len(req_ids))
            device = table.get_device_tensor(len(req_ids))
            saved = device[victim].clone()
            device[victim, i], device[victim, j] = saved[j], saved[i]
            state["undo"].append(lambda: device[victim].copy_(saved))
        elif kind == "foreign_write":
            victim = 0
            mine = set(rows[victim, : table.num_blocks_per_row[victim]].tolist())
            theirs = next(
                int(b)
                for i in range(1, len(req_ids))
                for b in rows[i, : table.num_blocks_per_row[i]]
                if int(b) not in mine and int(b) != 0
            )
            slots[0] = theirs * table.block_size  # into a block only another live request holds
        else:
            raise ValueError(f"unknown KVLEDGER_TEST_FAULT {kind!r}")
        print(f"FAULT step={state['step']} req={req_ids[victim]} group={group}", file=sys.stderr, flush=True)

    cls.execute_model = traced_execute_model
    cls._get_slot_mappings = faulty_get_slot_mappings


def swappable(rows, lens, num_reqs):
    """The first row with two distinct blocks, and the first such pair (a sliding-window
    row starts with null blocks, which a swap would leave unchanged)."""
    for r in range(num_reqs):
        row = rows[r, : lens[r]]
        for i in range(len(row) - 1):
            if row[i] != row[i + 1]:
                return r, i, i + 1
    raise ValueError("no block-table row with two distinct blocks to swap")


def on_this_rank():
    from vllm.distributed import parallel_state

    tp, pp = os.environ.get("KVLEDGER_TEST_FAULT_TP_RANK"), os.environ.get("KVLEDGER_TEST_FAULT_PP_RANK")
    if tp is not None and parallel_state.get_tensor_model_parallel_rank() != int(tp):
        return False
    return pp is None or parallel_state.get_pp_group().rank_in_group == int(pp)


def register_mrv2(faults):
    """The same faults in Model Runner V2 (vllm/v1/worker/gpu/model_runner.py), after its kernels."""
    from vllm.v1.worker.gpu import block_table, model_runner

    cls, tables = model_runner.GPUModelRunner, block_table.BlockTables
    if getattr(cls, "_kvledger_test_faults", False):
        return
    cls._kvledger_test_faults = True
    state = {"step": -1, "runner": None, "staged": set()}
    execute_model, prepare_attn, append_block_ids = cls.execute_model, cls.prepare_attn, tables.append_block_ids

    @functools.wraps(execute_model)  # the probes check the parameters they read
    def counted_execute_model(self, scheduler_output, *args, **kwargs):
        # Counted as the probes count: they attach once the KV cache exists (a warm-up before, not).
        if getattr(self, "kv_caches", None):
            state["step"] += 1
        state["runner"] = self
        if on_this_rank():
            state["staged"] = {g for kind, step, g in faults if kind == "staged_row" and step == state["step"]}
        return execute_model(self, scheduler_output, *args, **kwargs)

    @functools.wraps(prepare_attn)
    def faulty_prepare_attn(self, input_batch, *args, **kwargs):
        block_tables, slot_mappings = prepare_attn(self, input_batch, *args, **kwargs)
        if input_batch.num_reqs and on_this_rank():
            for kind, step, group in faults:
                if step == state["step"] and kind != "staged_row":
                    inject(self, kind, group, input_batch, block_tables, slot_mappings)
        return block_tables, slot_mappings

    @functools.wraps(append_block_ids)
    def early_append_block_ids(self, req_index, new_block_ids, overwrite):
        for group in sorted(state["staged"]):
            if not overwrite and new_block_ids[group] and self.num_blocks.np[group, req_index] > 0:
                state["staged"].discard(group)
                self.num_blocks.np[group, req_index] -= 1  # the append starts over the row's last block
                req_id = state["runner"].req_states.index_to_req_id[req_index]
                print(f"FAULT step={state['step']} req={req_id} group={group}", file=sys.stderr, flush=True)
        return append_block_ids(self, req_index, new_block_ids, overwrite)

    def inject(runner, kind, group, input_batch, block_tables, slot_mappings):
        lens = runner.block_tables.num_blocks.np[group, input_batch.idx_mapping_np[: input_batch.num_reqs]]
        rows, slots = block_tables[group], slot_mappings[group]
        if kind == "slot_shift":
            slots[0] += 1  # the first token of the first request, one slot off
            victim = 0
        elif kind == "block_swap":  # in the gathered rows attention reads; the slots were computed before
            victim, i, j = swappable(rows.cpu().numpy(), lens, input_batch.num_reqs)
            rows[victim, i], rows[victim, j] = rows[victim, j].clone(), rows[victim, i].clone()
        elif kind == "foreign_write":
            victim = 0
            mine = set(rows[0, : lens[0]].tolist())
            theirs = next(
                int(b)
                for i in range(1, input_batch.num_reqs)
                for b in rows[i, : lens[i]].tolist()
                if int(b) not in mine and int(b) != 0
            )
            slots[0] = theirs * runner.block_tables.block_sizes[group]  # a block only another request holds
        else:
            raise ValueError(f"unknown KVLEDGER_TEST_FAULT {kind!r}")
        req_id = input_batch.req_ids[victim]
        print(f"FAULT step={state['step']} req={req_id} group={group}", file=sys.stderr, flush=True)

    cls.execute_model = counted_execute_model
    cls.prepare_attn = faulty_prepare_attn
    tables.append_block_ids = early_append_block_ids
