"""Bug zoo plugin: a dummy batch writes KV through the slots the persistent buffer still holds.

Reports: vllm-ascend PR 15492 (also 15409, 15417: "Invalidate dummy slots before attention
metadata build") and vLLM PR 39444 ("Fix V1 dummy run writing NaN to KV cache null block").
A data-parallel rank with no requests runs a dummy batch to keep its peers' collectives in
step. `_dummy_run` takes its slot mappings from the runner's persistent per-group buffer
(`block_table[g].slot_mapping`), which still holds the previous real step's slots (or, before
any step, zeros: block 0, the null block). vLLM PR 39444 fills them with -1 (PAD_SLOT_ID)
after `_get_slot_mappings`; vllm-ascend PR 15492 moved the same fill before the backend's
metadata build, because a backend copied the stale slots first. Without the fill, the dummy
forward writes KV into the block a finished request released, which the prefix cache may
still offer, or a new request may own.

    ZOO_DUMMY_STALE_SLOTS=1       revert the fix: a dummy batch's slot mappings are left as the
                                  buffer holds them (the fill to -1 touches throwaway copies)
    ZOO_DUMMY_ATTENTION=I[,I...]  the I-th dummy batches (0-based) build attention metadata, as a
                                  FULL CUDA-graph replay does; the others run as the CPU runner
                                  runs them, without

Where: `GPUModelRunner._dummy_run` of vLLM 0.32 (the CPU runner inherits it), the lines right
after `_get_slot_mappings`. The plugin wraps `_get_slot_mappings` for the duration of a dummy
batch (`Worker.execute_dummy_batch`) and hands `_dummy_run` a mapping whose `values()` are
copies: the fix's loop fills the copies, while indexing by group (attention metadata, the
forward context's per-layer slots, what kvledger's probe reads) gets the buffer itself.

What differs from the original, and why:

- the trigger: an idle DP rank of a MoE model runs `execute_dummy_batch` from the engine
  core's loop; here the test calls the same worker method through `LLM.collective_rpc`
  between generate calls, so one single-rank engine of a dense model suffices (DP on CPU
  needs two engine cores and a MoE model). The worker call and everything under it are
  vLLM's own.
- attention metadata: on CUDA a FULL-graph dummy replay builds it (the plan kvledger reads);
  the CPU runner has no graphs and builds none for a dummy batch, while its KV write still
  goes through the forward context's slot mapping (`unified_kv_cache_update`). The second
  variable makes chosen dummy batches build it (`force_attention=True`), standing in for the
  FULL-graph replay; without it the probe reads the slot mappings the forward context takes.

Each dummy batch prints one line on stderr, which the tests match:
`ZOO dummy=I stale=0|1 attention=0|1 slots=S,... blocks=B,... changed=N nonfinite=M`: the
slots the forward context carried for group 0 (-1: the batch writes nothing) and their blocks;
how many KV values of the blocks the buffer pointed at changed during the batch, in every layer
of group 0, and how many of them are not finite afterwards.
"""

import functools
import inspect
import os
import sys


def _block_bytes(runner, block: int) -> list:
    """A copy of `block` in every layer of KV cache group 0."""
    context = runner.compilation_config.static_forward_context
    layers = runner.kv_cache_config.kv_cache_groups[0].layer_names
    caches = [context[name].kv_cache for name in layers]
    return [(c[0] if isinstance(c, list) else c)[block].clone() for c in caches]


class _FillsCopies(dict):
    """Slot mappings by group whose `values()` are copies: `_dummy_run`'s fill loop touches
    those, every `[gid]` lookup gets the runner's buffer."""

    def values(self):
        return [tensor.clone() for tensor in super().values()]


def register() -> None:
    stale = os.environ.get("ZOO_DUMMY_STALE_SLOTS") == "1"
    attention = {int(i) for i in os.environ.get("ZOO_DUMMY_ATTENTION", "").split(",") if i.strip()}
    if not stale and not attention:
        return
    from vllm.v1.worker import gpu_model_runner, gpu_worker

    runner_cls, worker_cls = gpu_model_runner.GPUModelRunner, gpu_worker.Worker
    if getattr(runner_cls, "_zoo_dummy_slots", False):
        return
    runner_cls._zoo_dummy_slots = True
    state = {"batch": -1, "inside": False, "slots": None}
    execute_dummy_batch = worker_cls.execute_dummy_batch
    dummy_run, get_slot_mappings = runner_cls._dummy_run, runner_cls._get_slot_mappings
    signature = inspect.signature(get_slot_mappings)

    @functools.wraps(execute_dummy_batch)
    def zoo_execute_dummy_batch(self, *args, **kwargs):
        state["batch"] += 1
        state["inside"], state["slots"] = True, None
        runner = self.model_runner
        block_size = runner.input_batch.block_table[0].block_size
        # The blocks the buffer points at now (the dummy batch's tokens come first), as they are.
        width = getattr(runner, "uniform_decode_query_len", 1)
        now = runner.input_batch.block_table[0].slot_mapping.cpu[:width].tolist()
        before = {b: _block_bytes(runner, b) for b in {s // block_size for s in now if s >= 0}}
        try:
            return execute_dummy_batch(self, *args, **kwargs)
        finally:
            state["inside"] = False
            slots = state["slots"] or []
            blocks = [s // block_size if s >= 0 else -1 for s in slots]
            changed = nonfinite = 0
            for b, old in before.items():
                new = _block_bytes(runner, b)
                changed += sum(int((o != n).sum()) for o, n in zip(old, new, strict=True))
                nonfinite += sum(int((~n.isfinite()).sum()) for n in new)
            print(
                f"ZOO dummy={state['batch']} stale={int(stale)} attention={int(state['batch'] in attention)} "
                f"slots={','.join(map(str, slots))} blocks={','.join(map(str, blocks))} "
                f"changed={changed} nonfinite={nonfinite}",
                file=sys.stderr,
                flush=True,
            )

    @functools.wraps(dummy_run)
    def zoo_dummy_run(self, num_tokens, *args, **kwargs):
        if state["inside"] and state["batch"] in attention:
            kwargs["force_attention"] = True  # as a FULL-graph replay builds it
        return dummy_run(self, num_tokens, *args, **kwargs)

    @functools.wraps(get_slot_mappings)
    def zoo_get_slot_mappings(self, *args, **kwargs):
        by_gid, by_layer = get_slot_mappings(self, *args, **kwargs)
        if not state["inside"] or by_gid is None:
            return by_gid, by_layer
        bound = signature.bind(self, *args, **kwargs)
        num_real = bound.arguments["num_tokens_unpadded"]
        if not stale:  # the fix fills them with -1 before the forward: nothing is written
            state["slots"] = [-1] * num_real
            return by_gid, by_layer
        # What the forward context carries for group 0: the buffer's stale slots.
        state["slots"] = [int(s) for s in by_gid[0][:num_real].tolist()]
        return _FillsCopies(by_gid), by_layer

    worker_cls.execute_dummy_batch = zoo_execute_dummy_batch
    runner_cls._dummy_run = zoo_dummy_run
    runner_cls._get_slot_mappings = zoo_get_slot_mappings
