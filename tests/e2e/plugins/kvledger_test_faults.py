"""Test-only vLLM plugin: injects one KV addressing fault where vLLM computes the plan.

    KVLEDGER_TEST_FAULT=slot_shift|block_swap|foreign_write   KVLEDGER_TEST_FAULT_STEP=N
    KVLEDGER_TEST_FAULT_TP_RANK=R   (optional: only on that tensor-parallel rank)
    KVLEDGER_TEST_FAULT_PP_RANK=R   (optional: only on that pipeline stage)

It corrupts, at the runner's N-th step, what the real runner hands attention
(the slot mapping tensors, or the block table rows), so the trace probes see
a fault exactly as a runner bug would produce it. It prints one line
`FAULT step=S req=R group=G` on stderr, which the tests match against.
"""

import os
import sys


def register():
    fault = os.environ.get("KVLEDGER_TEST_FAULT")
    if not fault:
        return
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if getattr(cls, "_kvledger_test_faults", False):
        return
    cls._kvledger_test_faults = True
    at_step = int(os.environ.get("KVLEDGER_TEST_FAULT_STEP", "3"))
    state = {"step": -1, "undo": None}
    execute_model, get_slot_mappings = cls.execute_model, cls._get_slot_mappings

    def traced_execute_model(self, scheduler_output, *args, **kwargs):
        state["step"] += 1
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            if state["undo"] is not None:
                state["undo"]()
                state["undo"] = None

    def faulty_get_slot_mappings(self, *args, **kwargs):
        by_gid, by_layer = get_slot_mappings(self, *args, **kwargs)
        if state["step"] == at_step and by_gid and on_this_rank():
            inject(self, fault, by_gid)
        return by_gid, by_layer

    def on_this_rank():
        from vllm.distributed import parallel_state

        tp, pp = os.environ.get("KVLEDGER_TEST_FAULT_TP_RANK"), os.environ.get("KVLEDGER_TEST_FAULT_PP_RANK")
        if tp is not None and parallel_state.get_tensor_model_parallel_rank() != int(tp):
            return False
        return pp is None or parallel_state.get_pp_group().rank_in_group == int(pp)

    def inject(runner, kind, by_gid):
        batch = runner.input_batch
        table = batch.block_table[0]
        rows = table.block_table.np
        req_ids = batch.req_ids
        slots = by_gid[0]
        if kind == "slot_shift":
            slots[0] += 1  # the first token of the first request, one slot off
            victim = 0
        elif kind == "block_swap":
            victim = next(i for i in range(len(req_ids)) if table.num_blocks_per_row[i] >= 2)
            saved = rows[victim, :2].copy()
            rows[victim, :2] = saved[::-1]  # attention reads a swapped row; the write was planned before

            def undo():
                rows[victim, :2] = saved

            state["undo"] = undo
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
        print(f"FAULT step={state['step']} req={req_ids[victim]} group=0", file=sys.stderr, flush=True)

    cls.execute_model = traced_execute_model
    cls._get_slot_mappings = faulty_get_slot_mappings
