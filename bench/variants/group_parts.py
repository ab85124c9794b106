"""A: a host group's width found by its own compiled call and its slot mapping read through a view
of vLLM's buffer made once, after checking the tensor is a prefix of it (four torch reads), as the
probe did before; B: the slot mapping read through its own numpy view (one torch call) and the
width found as the rows are copied (`GroupLayout.parts`, what the probe does now).

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/group_parts.py
"""

from __future__ import annotations

from kvledger.producer.frames import prefix_max
from kvledger.producer.vllm_v1 import GroupLayout, V1RunnerProbe

_PARTS = GroupLayout.parts


def _checked_prefix(self: GroupLayout, slots, num_reqs: int) -> tuple:
    width = prefix_max(self.lens, num_reqs)
    kept = self.__dict__.get("_kept")
    if kept is None:
        buffer = self.table.slot_mapping.gpu
        kept = self.__dict__["_kept"] = (buffer.data_ptr(), buffer.dtype, buffer.numpy())
    if slots.data_ptr() == kept[0] and slots.dtype is kept[1] and slots.is_contiguous():
        slots = kept[2], slots.shape[0]
    return slots, (self.rows, num_reqs, width), (self.lens, num_reqs)


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    GroupLayout.parts = _PARTS if variant_b else _checked_prefix
