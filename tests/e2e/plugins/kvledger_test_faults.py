"""Test-only vLLM plugin: injects KV addressing faults where vLLM computes the plan.

    KVLEDGER_TEST_FAULT=FAULT[,FAULT...]   FAULT = KIND[@STEP][:gGROUP]
        KIND: slot_shift | block_swap | foreign_write
    KVLEDGER_TEST_FAULT_STEP=N     (the step of a fault without @STEP; default 3)
    KVLEDGER_TEST_FAULT_GROUP=G    (the KV cache group of a fault without :gG; default 0)
    KVLEDGER_TEST_FAULT_TP_RANK=R  (optional: only on that tensor-parallel rank)
    KVLEDGER_TEST_FAULT_PP_RANK=R  (optional: only on that pipeline stage)

e.g. `slot_shift@6:g1,slot_shift@10:g3`. Each fault corrupts, at the runner's
N-th step, what the real runner hands attention for that group (its slot
mapping tensor, or the block-table rows on its device), so the trace probes see a fault
exactly as a runner bug would produce it. Each prints one line
`FAULT step=S req=R group=G` on stderr, which the tests match against.
"""

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
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if getattr(cls, "_kvledger_test_faults", False):
        return
    cls._kvledger_test_faults = True
    faults = parse_faults(
        spec,
        int(os.environ.get("KVLEDGER_TEST_FAULT_STEP", "3")),
        int(os.environ.get("KVLEDGER_TEST_FAULT_GROUP", "0")),
    )
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

    def on_this_rank():
        from vllm.distributed import parallel_state

        tp, pp = os.environ.get("KVLEDGER_TEST_FAULT_TP_RANK"), os.environ.get("KVLEDGER_TEST_FAULT_PP_RANK")
        if tp is not None and parallel_state.get_tensor_model_parallel_rank() != int(tp):
            return False
        return pp is None or parallel_state.get_pp_group().rank_in_group == int(pp)

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

    def swappable(rows, lens, num_reqs):
        """The first row with two distinct blocks, and the first such pair (a sliding-window
        row starts with null blocks, which a swap would leave unchanged)."""
        for r in range(num_reqs):
            row = rows[r, : lens[r]]
            for i in range(len(row) - 1):
                if row[i] != row[i + 1]:
                    return r, i, i + 1
        raise ValueError("no block-table row with two distinct blocks to swap")

    cls.execute_model = traced_execute_model
    cls._get_slot_mappings = faulty_get_slot_mappings
