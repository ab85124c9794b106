"""A: a step's request ids encoded every step, the layout's groups compared as a set built each
step, a host engine's step asked whether its copies landed; B: the ids encoded only when they
change (`frames.RepeatedIds`), the groups compared with a set made once, a host step written
without asking (what the probe does now).

    .venv-vllm/bin/python bench/probe_hot_path.py --paired bench/variants/repeated_ids.py --forward-us 3000
    .venv-vllm/bin/python bench/engine_paired.py bench/variants/repeated_ids.py
"""

from __future__ import annotations

from kvledger.producer.frames import RepeatedIds
from kvledger.producer.ring_recorder import RingRecorder
from kvledger.producer.vllm_v1 import PlanLayout, V1RunnerProbe

_SERVES = PlanLayout.serves


def _serves_with_a_new_set(self, batch, positions, slot_mappings: dict) -> bool:
    return batch is self.batch and positions is self.positions and slot_mappings.keys() == set(self.gids)


def _as_they_are(ids: list[str]) -> list[str]:
    return ids


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    recorder = probe.recorder
    if variant_b:
        ids = probe.__dict__.setdefault("_kept_ids", (RepeatedIds(), RepeatedIds()))
        probe._batch_ids, probe._scheduled_ids = ids
        PlanLayout.serves = _SERVES
        recorder.step = lambda capture, copied=False: RingRecorder.step(recorder, capture, copied)
    else:
        probe._batch_ids = probe._scheduled_ids = _as_they_are
        PlanLayout.serves = _serves_with_a_new_set
        recorder.step = lambda capture, copied=False: RingRecorder.step(recorder, capture)
