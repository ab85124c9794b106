"""Probes for vLLM's Model Runner V2 (vllm/v1/worker/gpu/model_runner.py).

MRV2 keeps block tables and slot mappings on the device and builds both in
`prepare_attn(input_batch)`, which returns exactly what attention reads:
per group the gathered block-table rows `[num_reqs_padded, max_blocks]` and
the slot mappings `[groups, num_tokens_padded]` (padding is PAD_SLOT_ID).
The probe wraps that function (and `prepare_dummy_attn` for dummy runs) and
stages the tensors to reused pinned host buffers without synchronising the
stream (producer/staging.py); row lengths come from the host mirror of the
runner's `BlockTables.num_blocks`. vllm-ascend's NPU runner subclasses this
runner (int32 slot mappings there), so the same adapter applies.

`execute_model(scheduler_output, ..., dummy_run=, is_profile=)` gives the
step and its input, as in the V1 adapter.
"""

from __future__ import annotations

from typing import Any

from kvledger.producer.vllm_v1 import AttachPoint, PlanCapture, V1RunnerProbe


class MRV2RunnerProbe(V1RunnerProbe):
    runner_name = "mrv2"

    def attach_points(self) -> list[tuple[AttachPoint, Any]]:
        return [
            (
                AttachPoint("execute_model", "step_input", ("scheduler_output", "dummy_run", "is_profile")),
                self._wrap_execute_model,
            ),
            (AttachPoint("prepare_attn", "step_plan", ("input_batch",)), self._wrap_prepare_attn),
            (AttachPoint("prepare_dummy_attn", "dummy_runs", ("input_batch",)), self._wrap_prepare_attn),
        ]

    def _wrap_execute_model(self, execute_model):
        def traced_execute_model(scheduler_output, *args, **kwargs):
            dummy = kwargs.get("dummy_run", False)
            if dummy:
                self._guard(self._before_dummy, "PROFILE" if kwargs.get("is_profile") else "DUMMY")
            else:
                self._guard(self._before_step, scheduler_output)
            try:
                result = execute_model(scheduler_output, *args, **kwargs)
            finally:
                self._guard(self._after_dummy if dummy else self._after_step)
            self._raise_found()
            return result

        return traced_execute_model

    def _wrap_prepare_attn(self, prepare_attn):
        def traced_prepare_attn(input_batch, *args, **kwargs):
            result = prepare_attn(input_batch, *args, **kwargs)
            self._guard(self._capture_mrv2_plan, input_batch, result)
            return result

        return traced_prepare_attn

    def _capture_mrv2_plan(self, input_batch, result) -> None:
        if self.paused:
            return
        block_tables, slot_mappings = result
        num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        padded = input_batch.num_tokens_after_padding
        stage = self.staging.stage
        if self._dummy_kind is not None:  # made-up requests reading zeroed rows
            slots = [(gid, stage(slot_mappings[gid, :padded])) for gid in range(len(block_tables))]
            self._plan = PlanCapture.of_dummy_run(slots)
            return
        # The host mirror of the device's row lengths, by request state.
        lens_by_group = self.runner.block_tables.num_blocks.np[:, input_batch.idx_mapping_np[:num_reqs]]
        groups = []
        for gid, table in enumerate(block_tables):
            lens = lens_by_group[gid]
            width = int(lens.max()) if num_reqs else 0
            groups.append((gid, stage(slot_mappings[gid, :padded]), stage(table[:num_reqs, :width]), lens))
        positions = stage(input_batch.positions[:num_tokens])
        self._plan = PlanCapture(
            req_ids=list(input_batch.req_ids[:num_reqs]),
            query_start_loc=input_batch.query_start_loc_np[: num_reqs + 1].copy(),
            positions=positions,
            num_tokens=num_tokens,
            groups=groups,
        )

    def _snapshot(self):
        return None  # MRV2 keeps request state on the device; see capabilities

    def capabilities(self) -> list[tuple[str, bool, str | None]]:
        return [
            *super().capabilities(),
            ("snapshot", False, "Model Runner V2 keeps request state on the device; not read"),
        ]
