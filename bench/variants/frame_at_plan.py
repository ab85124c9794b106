"""A: a step's frame written at the step's end, after the forward pass, as before; B: written when
its plan is captured (`V1RunnerProbe._frame_at_plan`, what the probe does now on a runner without a
drafter or a KV connector), while what it reads is still warm.

    .venv-vllm/bin/python bench/probe_hot_path.py --paired bench/variants/frame_at_plan.py --forward-us 3000
    .venv-vllm/bin/python bench/engine_paired.py bench/variants/frame_at_plan.py
"""

from __future__ import annotations

from kvledger.producer.vllm_v1 import V1RunnerProbe

_AT_ATTACH: dict[int, tuple[bool, bool]] = {}  # per probe: the two flags as attach set them


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    # A frame written at the step's end is not written at the plan of its pieces either.
    at_attach = _AT_ATTACH.setdefault(id(probe), (probe._frame_at_plan, probe._writes_at_plan))
    probe._frame_at_plan, probe._writes_at_plan = at_attach if variant_b else (False, False)
