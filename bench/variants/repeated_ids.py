"""A: a step's request ids encoded every step, the layout's groups compared as a set built each
step; B: the ids encoded only when they change (`frames.RepeatedIds`), the groups compared with a
set made once (what the probe does now).

    .venv-vllm/bin/python bench/probe_hot_path.py --paired bench/variants/repeated_ids.py --forward-us 3000
    .venv-vllm/bin/python bench/engine_paired.py bench/variants/repeated_ids.py
"""

from __future__ import annotations

from kvledger.producer.frames import RepeatedIds
from kvledger.producer.vllm_v1 import PlanLayout, V1RunnerProbe

_SERVES = PlanLayout.serves


def _serves_with_a_new_set(self, batch, positions, slot_mappings: dict) -> bool:
    return batch is self.batch and positions is self.positions and slot_mappings.keys() == set(self.gids)


def _as_they_are(ids: list[str], n: int | None = None) -> list[str]:
    return ids if n is None else ids[:n]


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    if variant_b:
        probe._batch_ids, probe._scheduled_ids = probe.__dict__.setdefault("_kept_ids", (RepeatedIds(), RepeatedIds()))
        PlanLayout.serves = _SERVES
    else:
        probe._batch_ids = probe._scheduled_ids = _as_they_are
        PlanLayout.serves = _serves_with_a_new_set
