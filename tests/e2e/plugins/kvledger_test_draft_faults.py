"""Test-only vLLM plugin: moves the KV write of one EAGLE drafter pass to a wrong slot.

    KVLEDGER_TEST_DRAFT_FAULT=draft_pass_shift   KVLEDGER_TEST_DRAFT_FAULT_STEP=N

At the first runner step >= N whose drafter runs a later pass (pass 1: the
token after the last accepted one, its slot computed by vLLM's
`eagle_step_update_slot_mapping_and_metadata`) with a real slot for the
batch's first request, that slot is moved by one inside its block (so only
the address is wrong, not the owner), in the drafter's `_slot_mapping_buffer`
its layers write with. Nothing else changes: the target's own plan stays
clean. It prints one line on stderr,
`FAULT step=S req=R group=G pass=1 expected=E actual=A`, which the tests match.
"""

import os
import sys


def register() -> None:
    fault = os.environ.get("KVLEDGER_TEST_DRAFT_FAULT")
    if not fault:
        return
    if fault != "draft_pass_shift":
        raise ValueError(f"unknown KVLEDGER_TEST_DRAFT_FAULT {fault!r}")
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker import gpu_model_runner

    runner_cls = gpu_model_runner.GPUModelRunner
    if getattr(runner_cls, "_kvledger_test_draft_faults", False):
        return
    runner_cls._kvledger_test_draft_faults = True
    at_step = int(os.environ.get("KVLEDGER_TEST_DRAFT_FAULT_STEP", "3"))
    # Steps counted like the trace probes count them: one per execute_model call.
    state: dict = {"step": -1, "runner": None, "pass": 0, "done": False}
    execute_model, get_slot_mapping = runner_cls.execute_model, SpecDecodeBaseProposer._get_slot_mapping

    def counted_execute_model(self, scheduler_output, *args, **kwargs):
        state["step"] += 1
        state["runner"] = self
        return execute_model(self, scheduler_output, *args, **kwargs)

    def faulty_get_slot_mapping(self, num_tokens, slot_mapping=None):
        result = get_slot_mapping(self, num_tokens, slot_mapping)
        # Pass 0 copies the target's slot mapping in; each later pass is one call without it.
        state["pass"] = 0 if slot_mapping is not None else state["pass"] + 1
        if not state["done"] and state["pass"] == 1 and state["step"] >= at_step and state["runner"] is not None:
            state["done"] = shift_first_slot(self, state["runner"])
        return result

    def shift_first_slot(drafter, runner) -> bool:
        buffer = drafter._slot_mapping_buffer
        expected = int(buffer[0])
        if expected < 0:  # clamped past the model's length: no write to move
            return False
        block_size = drafter.block_size
        actual = expected + 1 if (expected + 1) % block_size else expected - 1  # same block
        buffer[0] = actual
        print(
            f"FAULT step={state['step']} req={runner.input_batch.req_ids[0]} group={drafter.kv_cache_gid} "
            f"pass=1 expected={expected} actual={actual}",
            file=sys.stderr,
            flush=True,
        )
        return True

    runner_cls.execute_model = counted_execute_model
    SpecDecodeBaseProposer._get_slot_mapping = faulty_get_slot_mapping
