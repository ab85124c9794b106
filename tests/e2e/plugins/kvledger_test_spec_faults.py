"""Test-only vLLM plugin: moves the KV write of one speculative (draft) token to a wrong slot.

    KVLEDGER_TEST_SPEC_FAULT=draft_slot_shift   KVLEDGER_TEST_SPEC_FAULT_STEP=N

At the first runner step >= N whose batch verifies real draft tokens, the slot
mapping entry of the last draft token of the first such request is moved by
one slot inside its block (so only the address is wrong, not the owner), in
the tensor the runner hands attention. It prints one line on stderr,
`FAULT step=S req=R group=G expected=E actual=A`, which the tests match.
"""

import os
import sys


def register() -> None:
    fault = os.environ.get("KVLEDGER_TEST_SPEC_FAULT")
    if not fault:
        return
    if fault != "draft_slot_shift":
        raise ValueError(f"unknown KVLEDGER_TEST_SPEC_FAULT {fault!r}")
    at_step = int(os.environ.get("KVLEDGER_TEST_SPEC_FAULT_STEP", "3"))
    # Steps counted like the trace probes count them: one per execute_model call.
    state: dict = {"step": -1, "drafts": {}, "done": False}
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
        register_mrv2(state, at_step)
        return
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if getattr(cls, "_kvledger_test_spec_faults", False):
        return
    cls._kvledger_test_spec_faults = True
    execute_model, get_slot_mappings = cls.execute_model, cls._get_slot_mappings

    def traced_execute_model(self, scheduler_output, *args, **kwargs):
        state["step"] += 1
        state["drafts"] = scheduler_output.scheduled_spec_decode_tokens
        return execute_model(self, scheduler_output, *args, **kwargs)

    def faulty_get_slot_mappings(self, *args, **kwargs):
        by_gid, by_layer = get_slot_mappings(self, *args, **kwargs)
        if not state["done"] and state["step"] >= at_step and by_gid:
            state["done"] = shift_a_draft_slot(self, by_gid[0])
        return by_gid, by_layer

    def shift_a_draft_slot(runner, slots) -> bool:
        batch = runner.input_batch
        qsl = runner.query_start_loc.np
        return shift_last_draft(state, batch.req_ids, qsl, slots, batch.block_table[0].block_size)

    cls.execute_model = traced_execute_model
    cls._get_slot_mappings = faulty_get_slot_mappings


def shift_last_draft(state: dict, req_ids, qsl, slots, block_size: int, placeholders: bool = False) -> bool:
    """Move the first drafting request's last token (its last draft) one slot within its block.
    `placeholders`: the scheduler lists each draft as -1, the worker holding the drafts (MRV2)."""
    for i, req_id in enumerate(req_ids):
        drafts = state["drafts"].get(req_id) or []
        if not drafts or (min(drafts) < 0 and not placeholders):  # none, or padding rather than drafts
            continue
        token = int(qsl[i + 1]) - 1
        expected = int(slots[token])
        actual = expected + 1 if (expected + 1) % block_size else expected - 1  # same block
        slots[token] = actual
        print(
            f"FAULT step={state['step']} req={req_id} group=0 expected={expected} actual={actual}",
            file=sys.stderr,
            flush=True,
        )
        return True
    return False


def register_mrv2(state: dict, at_step: int) -> None:
    """The same fault in Model Runner V2: in the slot mapping its kernel computed (`prepare_attn`)."""
    import functools

    from vllm.v1.worker.gpu import model_runner

    cls = model_runner.GPUModelRunner
    if getattr(cls, "_kvledger_test_spec_faults", False):
        return
    cls._kvledger_test_spec_faults = True
    execute_model, prepare_attn = cls.execute_model, cls.prepare_attn

    @functools.wraps(execute_model)  # the probes check the parameters they read
    def counted_execute_model(self, scheduler_output, *args, **kwargs):
        # Counted as the probes count: they attach once the KV cache exists (a warm-up before, not).
        if getattr(self, "kv_caches", None):
            state["step"] += 1
        state["drafts"] = scheduler_output.scheduled_spec_decode_tokens
        return execute_model(self, scheduler_output, *args, **kwargs)

    @functools.wraps(prepare_attn)
    def faulty_prepare_attn(self, input_batch, *args, **kwargs):
        block_tables, slot_mappings = prepare_attn(self, input_batch, *args, **kwargs)
        if not state["done"] and state["step"] >= at_step and input_batch.num_reqs:
            req_ids, qsl = input_batch.req_ids[: input_batch.num_reqs], input_batch.query_start_loc_np
            block_size = self.block_tables.block_sizes[0]
            state["done"] = shift_last_draft(state, req_ids, qsl, slot_mappings[0], block_size, placeholders=True)
        return block_tables, slot_mappings

    cls.execute_model = counted_execute_model
    cls.prepare_attn = faulty_prepare_attn
