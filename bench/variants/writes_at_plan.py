"""A: a host step's frame, at its plan, made as a PlanCapture and a StepCapture and offered to the
recorder (`RingRecorder.step`: its readiness asked, its parts gathered); B: written of its pieces
(`V1RunnerProbe._writes_at_plan`, what the probe does now on a host engine checked elsewhere).

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/writes_at_plan.py
"""

from __future__ import annotations

from kvledger.producer.vllm_v1 import V1RunnerProbe

_AT_ATTACH: dict[int, bool] = {}  # per probe: the flag as attach set it (read before the first A sets it)


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    at_attach = _AT_ATTACH.setdefault(id(probe), probe._writes_at_plan)
    probe._writes_at_plan = variant_b and at_attach
