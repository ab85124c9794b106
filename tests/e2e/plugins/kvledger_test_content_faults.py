"""Test-only vLLM plugin: a stray write into a sealed block's KV bytes, below every plan.

    KVLEDGER_TEST_STRAY_WRITE=STEP[:gGROUP]   after the runner's STEP-th execute_model (its forward
                                              done), add 1.0 to the first 64 values of the first
                                              layer of GROUP (default 0) in the first block of the
                                              longest running request: a full block, so sealed
    KVLEDGER_TEST_STRAY_TP_RANK=R             (optional: only on that tensor-parallel rank)
    KVLEDGER_TEST_UNZEROED=STEP               at the first step from STEP on whose blocks vLLM
                                              zeroes (`new_block_ids_to_zero`, Mamba models), add
                                              1.0 to the first 64 values of the first full-attention
                                              layer in the first of them once zeroed: a zeroing that
                                              missed a block (vllm PR #47574's stale bytes)

The slot mappings and block tables are untouched: the address checks see a clean plan, as with
a kernel that writes where no plan said (vllm #43810, #53982). Prints one line
`STRAY step=S req=R group=G block=B tp=T` (or `UNZEROED step=S group=G block=B`) on stderr,
which the tests match against.
"""

import functools
import os
import sys


def register():
    spec = os.environ.get("KVLEDGER_TEST_STRAY_WRITE")
    unzeroed = os.environ.get("KVLEDGER_TEST_UNZEROED")
    if not spec and not unzeroed:
        return
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":  # Model Runner V2's
        from vllm.v1.worker.gpu import model_runner

        cls = model_runner.GPUModelRunner
    if getattr(cls, "_kvledger_test_stray_write", False):
        return
    cls._kvledger_test_stray_write = True
    step_s, _, group_s = (spec or "-1").partition(":g")
    at, group = int(step_s), int(group_s or 0)
    only_tp = os.environ.get("KVLEDGER_TEST_STRAY_TP_RANK")
    state = {"step": -1, "unzeroed": int(unzeroed) if unzeroed else None}
    execute_model = cls.execute_model

    @functools.wraps(execute_model)  # the probes check the parameters they read
    def execute_then_stray(self, scheduler_output, *args, **kwargs):
        # Counted as the probes count: they attach once the KV cache exists (a warm-up before, not).
        if getattr(self, "kv_caches", None):
            state["step"] += 1
        result = execute_model(self, scheduler_output, *args, **kwargs)
        if state["step"] == at:
            _stray_write(self, at, group, only_tp)
        return result

    cls.execute_model = execute_then_stray
    if state["unzeroed"] is None:
        return
    # The CPU runner zeroes blocks its own way; wrap whichever this process runs.
    for runner_cls in (cpu_model_runner.CPUModelRunner, cls):
        _wrap_zeroing(runner_cls, state)


def _wrap_zeroing(runner_cls, state: dict) -> None:
    zero = runner_cls.__dict__.get("_zero_block_ids")
    if zero is None:
        return

    def zero_then_miss(self, block_ids):
        zero(self, block_ids)
        if state["unzeroed"] is not None and state["step"] >= state["unzeroed"] and block_ids:
            state["unzeroed"] = None  # once
            _unzero(self, state["step"], int(block_ids[0]))

    runner_cls._zero_block_ids = zero_then_miss


def _unzero(runner, step: int, block: int) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for gid, spec in enumerate(runner.kv_cache_config.kv_cache_groups):
        if isinstance(spec.kv_cache_spec, FullAttentionSpec):
            kv = runner.compilation_config.static_forward_context[spec.layer_names[0]].kv_cache
            kv = kv[0] if isinstance(kv, list) else kv
            kv[block].view(-1)[:64].add_(1.0)
            print(f"UNZEROED step={step} group={gid} block={block}", file=sys.stderr, flush=True)
            return


def _stray_write(runner, step: int, group: int, only_tp) -> None:
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank()
    if only_tp is not None and int(only_tp) != tp:
        return
    spec = runner.kv_cache_config.kv_cache_groups[group]
    block_size = spec.kv_cache_spec.block_size
    states = sorted(_first_blocks(runner, group), key=lambda s: -s[1])
    full = [s for s in states if s[1] >= 2 * block_size]
    if not full:
        print(f"STRAY step={step} none (no request holds a full block)", file=sys.stderr, flush=True)
        return
    req_id, _, block = full[0]
    layer = spec.layer_names[0]
    kv = runner.vllm_config.compilation_config.static_forward_context[layer].kv_cache
    kv = kv[0] if isinstance(kv, list) else kv
    kv[block].view(-1)[:64].add_(1.0)
    print(f"STRAY step={step} req={req_id} group={group} block={block} tp={tp}", file=sys.stderr, flush=True)


def _first_blocks(runner, group: int) -> list[tuple[str, int, int]]:
    """(request, computed tokens, first block of `group`) of every live request: the V1 runner's
    request states, or Model Runner V2's (its rows on the device)."""
    if hasattr(runner, "requests"):
        return [(s.req_id, s.num_computed_tokens, s.block_ids[group][0]) for s in runner.requests.values()]
    states, rows = runner.req_states, runner.block_tables.block_tables[group].gpu
    return [
        (req_id, int(states.num_computed_tokens_np[i]), int(rows[i, 0])) for req_id, i in states.req_id_to_index.items()
    ]
