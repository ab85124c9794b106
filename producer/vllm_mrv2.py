"""Probes for vLLM's Model Runner V2 (vllm/v1/worker/gpu/model_runner.py).

MRV2 keeps block tables and slot mappings on the device and builds both in
`prepare_attn(input_batch)`, which returns exactly what attention reads:
per group the gathered block-table rows `[num_reqs_padded, max_blocks]` and
the slot mappings `[groups, num_tokens_padded]` (padding is PAD_SLOT_ID).
The probe wraps that function (and `prepare_dummy_attn` for dummy runs) and
gathers the step's plan on the device into one staging buffer by one kernel,
copied to a reused pinned host buffer by one transfer behind one event, never
synchronising the stream (producer/staging.py `PlanGather`): a constant number
of host calls per step, whatever the groups and requests. Row lengths come
from the host mirror of the runner's `BlockTables.num_blocks`. vllm-ascend's
NPU runner subclasses this runner (int32 slot mappings there, widened to int64
by the gather), so the same adapter applies.

`execute_model(scheduler_output, ..., dummy_run=, is_profile=)` gives the
step and its input, as in the V1 adapter. Snapshots read MRV2's own request
state: `req_states` (request -> state index, computed tokens on the host) and
the device rows of `BlockTables`, gathered and staged like the plan (one
kernel for every group), every `snapshot_interval` steps only. Content
digests (`content_digests`) read a host copy of each row as MRV2 staged it
(`HostRows`, kept from `BlockTables.append_block_ids`): its rows live on the
device only, and reading them back every step would synchronise the stream.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvledger.producer.capture import PlanCapture, SnapshotCapture
from kvledger.producer.frames import as_array
from kvledger.producer.staging import PlanGather, Staged, StagingFull
from kvledger.producer.vllm_v1 import AttachPoint, V1RunnerProbe, content_unmodelled
from kvledger.schemas.kinds import Declaration, Runner, StepKind

log = logging.getLogger("kvledger.producer")


class MRV2RunnerProbe(V1RunnerProbe):
    runner_name = Runner.V2
    # Its plan's copies are still landing when it is captured (device rows): the frame would be held
    # over the forward pass anyway, so it is offered at the step's end as before.
    frame_at_plan = False
    # The plan and snapshots gathered by one kernel into one staging buffer (`PlanGather`); False:
    # each tensor sliced and staged on its own (`StagingPool.stage_all`, a few host calls per group).
    plan_gather = True

    def _gatherer(self) -> PlanGather:
        gather = self.__dict__.get("_plan_gatherer")
        if gather is None or gather.pool is not self.staging:
            gather = self._plan_gatherer = PlanGather(self.staging)
        return gather

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
                self._guard(self._before_dummy, StepKind.PROFILE if kwargs.get("is_profile") else StepKind.DUMMY)
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
        gids = list(range(len(block_tables)))
        gather = self.plan_gather and len(block_tables) == len(slot_mappings)
        if self._dummy_kind is not None:  # made-up requests reading zeroed rows
            if gather:
                staged = self._gatherer().plan(slot_mappings, padded, None, 0, [], 0, []).slots
                self._plan = PlanCapture.of_dummy_run(gids, PlanCapture.dummy_parts(staged))
                return
            slots = [slot_mappings[gid, :padded] for gid in gids]
            self._plan = PlanCapture.of_dummy_run(gids, self._copy(PlanCapture.dummy_parts(slots)))
            return
        self._digest_content(input_batch)
        # The host mirror of the device's row lengths, by request state.
        lens_by_group = self.runner.block_tables.num_blocks.np[:, input_batch.idx_mapping_np[:num_reqs]]
        qsl = (input_batch.query_start_loc_np, num_reqs + 1)
        ids = self._batch_ids(list(input_batch.req_ids[:num_reqs]))
        if gather:  # one kernel, one transfer, one event, whatever the groups and requests
            widths = lens_by_group.max(axis=1).tolist() if num_reqs else [0] * len(gids)
            got = self._gatherer().plan(
                slot_mappings, padded, input_batch.positions, num_tokens, block_tables, num_reqs, widths
            )
            groups = list(zip(got.slots, got.rows, lens_by_group, strict=True))  # lens: a copy already
            arrays = PlanCapture.plan_parts(np.array(as_array(qsl)), got.positions, groups)
            self._plan = PlanCapture(ids, num_tokens, gids, arrays)
            return
        groups = []
        for gid, table in enumerate(block_tables):
            lens = lens_by_group[gid]
            width = int(lens.max()) if num_reqs else 0
            groups.append((slot_mappings[gid, :padded], table[:num_reqs, :width], lens))
        parts = PlanCapture.plan_parts(qsl, input_batch.positions[:num_tokens], groups)
        self._plan = PlanCapture(ids, num_tokens, gids, self._copy(parts))

    def _snapshot(self) -> SnapshotCapture | None:
        """The live requests after this step, from MRV2's request state and device block tables.

        One device gather and one device-to-host copy per group, queued behind this step's
        forward pass (a snapshot step only, every `snapshot_interval` steps) and never waited for:
        the snapshot's frame is held until they land, like a step's. A request the rank never
        recorded (it arrived while paused) gets its index from the snapshot: that is how the
        ledger learns it.
        """
        states, tables = self.runner.req_states, self.runner.block_tables
        req_ids = list(states.req_id_to_index)
        slots = np.fromiter((states.req_id_to_index[r] for r in req_ids), np.int64, len(req_ids))
        computed = states.num_computed_tokens_np[slots].tolist()
        lens = tables.num_blocks.np[:, slots].copy()  # groups x requests
        try:
            rows = self._stage_rows(tables.block_tables, slots, lens)
        except StagingFull as exc:  # the recorder is behind: the next interval snapshots
            log.warning("kv_trace: step %d not snapshotted: %s", self.step, exc)
            return None
        return SnapshotCapture.of_staged(self.step, req_ids, computed, list(lens), rows)

    def _stage_rows(self, block_tables, slots: np.ndarray, lens: np.ndarray) -> list[Staged]:
        """Each group's rows of these request states, `[requests, longest row]`, staged to the host."""
        if self.plan_gather:  # one kernel for every group
            widths = lens.max(axis=1).tolist() if slots.size else [0] * len(block_tables)
            return self._gatherer().rows([t.gpu for t in block_tables], slots, widths)
        import torch

        index = torch.from_numpy(slots)
        rows = []
        for gid, table in enumerate(block_tables):
            device_rows = table.gpu
            if index.device != device_rows.device:  # from pinned memory: queued, not waited for
                index = index.pin_memory().to(device_rows.device, non_blocking=True)
            width = int(lens[gid].max()) if slots.size else 0
            rows.append(device_rows.index_select(0, index)[:, :width])
        return self.staging.stage_all(rows)

    # -- content digests: MRV2's rows live on the device; the digests read a host mirror of them --
    def _content_unmodelled(self) -> str | None:
        return content_unmodelled(self.runner, list(self.runner.block_tables.block_sizes))

    def _attach_content(self) -> list[tuple[str, bool, str | None]]:
        found = super()._attach_content()
        if self.content is not None:
            self._rows = HostRows.attach(self.runner.block_tables)
        return found

    def _held(self, req_id: str) -> tuple[Any, int] | None:
        states = self.runner.req_states
        index = states.req_id_to_index.get(req_id)
        if index is None:
            return None
        return self._rows.of(index), int(states.num_computed_tokens_np[index])

    def _digest_content(self, input_batch) -> None:
        """This step's sealed-block digests, from the host mirror of the batch's rows."""
        if self.content is None or self._input is None or self._content is not None:
            return
        num_reqs = input_batch.num_reqs
        indices = input_batch.idx_mapping_np[:num_reqs]
        tables = self._rows.batch(indices, len(self.content.groups))
        computed = self.runner.req_states.num_computed_tokens_np[indices]
        self._content = self.content.digest_rows(tables, computed, list(input_batch.req_ids[:num_reqs]), self.staging)

    def capabilities(self) -> list[tuple[str, bool, str | None]]:
        found = super().capabilities()
        if getattr(self.runner, "adaptive_verification", None) is not None:
            found.append(
                (
                    Declaration.ADAPTIVE_VERIFICATION,
                    False,
                    "adaptive verification re-splits draft tokens between requests on the device: "
                    "the host's per-request token counts are not those the slot mapping was built from",
                )
            )
        return found


class HostRows:
    """MRV2's block-table rows as it stages them (`BlockTables.append_block_ids`: a new or
    resumed request's rows replaced, a running one's appended), kept on the host for the
    content digests: MRV2 holds the rows themselves on the device only. One list per request
    state and group; a state's rows are replaced when the next request takes it."""

    def __init__(self) -> None:
        self.rows: dict[int, list[list[int]]] = {}

    @classmethod
    def attach(cls, block_tables) -> HostRows:
        mirror = cls()
        append = block_tables.append_block_ids

        def append_block_ids(req_index: int, new_block_ids, overwrite: bool):
            mirror.stage(req_index, new_block_ids, overwrite)
            return append(req_index, new_block_ids, overwrite)

        block_tables.append_block_ids = append_block_ids
        return mirror

    def stage(self, req_index: int, new_block_ids, overwrite: bool) -> None:
        rows = self.rows.get(req_index)
        if rows is None or overwrite:
            self.rows[req_index] = [list(ids) for ids in new_block_ids]
        else:
            for row, ids in zip(rows, new_block_ids, strict=True):
                row.extend(ids)

    def of(self, req_index: int) -> list[list[int]]:
        return self.rows.get(req_index, [])

    def batch(self, indices: np.ndarray, num_groups: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per group the rows of these request states `[requests, longest]` and their lengths."""
        rows = [self.rows.get(int(i)) or [[]] * num_groups for i in indices]
        tables = []
        for gid in range(num_groups):
            lens = np.fromiter((len(r[gid]) for r in rows), np.int64, len(rows))
            table = np.zeros((len(rows), int(lens.max()) if len(rows) else 0), np.int32)
            for i, r in enumerate(rows):
                table[i, : lens[i]] = r[gid]
            tables.append((table, lens))
        return tables
