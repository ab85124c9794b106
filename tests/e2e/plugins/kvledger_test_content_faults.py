"""Test-only vLLM plugin: a stray write into a sealed block's KV bytes, below every plan.

    KVLEDGER_TEST_STRAY_WRITE=STEP[:gGROUP]   after the runner's STEP-th execute_model (its forward
                                              done), add 1.0 to the first 64 values of the first
                                              layer of GROUP (default 0) in the first block of the
                                              longest running request: a full block, so sealed
    KVLEDGER_TEST_STRAY_TP_RANK=R             (optional: only on that tensor-parallel rank)

The slot mappings and block tables are untouched: the address checks see a clean plan, as with
a kernel that writes where no plan said (vllm #43810, #53982). Prints one line
`STRAY step=S req=R group=G block=B tp=T` on stderr, which the tests match against.
"""

import os
import sys


def register():
    spec = os.environ.get("KVLEDGER_TEST_STRAY_WRITE")
    if not spec:
        return
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if getattr(cls, "_kvledger_test_stray_write", False):
        return
    cls._kvledger_test_stray_write = True
    step_s, _, group_s = spec.partition(":g")
    at, group = int(step_s), int(group_s or 0)
    only_tp = os.environ.get("KVLEDGER_TEST_STRAY_TP_RANK")
    state = {"step": -1}
    execute_model = cls.execute_model

    def execute_then_stray(self, scheduler_output, *args, **kwargs):
        state["step"] += 1
        result = execute_model(self, scheduler_output, *args, **kwargs)
        if state["step"] == at:
            _stray_write(self, group, only_tp)
        return result

    cls.execute_model = execute_then_stray


def _stray_write(runner, group: int, only_tp) -> None:
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank()
    if only_tp is not None and int(only_tp) != tp:
        return
    spec = runner.kv_cache_config.kv_cache_groups[group]
    block_size = spec.kv_cache_spec.block_size
    states = sorted(runner.requests.values(), key=lambda s: -s.num_computed_tokens)
    full = [s for s in states if s.num_computed_tokens >= 2 * block_size]
    if not full:
        print(f"STRAY none step={-1} (no request holds a full block)", file=sys.stderr, flush=True)
        return
    victim = full[0]
    block = victim.block_ids[group][0]
    layer = spec.layer_names[0]
    kv = runner.compilation_config.static_forward_context[layer].kv_cache
    kv = kv[0] if isinstance(kv, list) else kv
    kv[block].view(-1)[:64].add_(1.0)
    print(f"STRAY req={victim.req_id} group={group} block={block} tp={tp}", file=sys.stderr, flush=True)
