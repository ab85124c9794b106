"""A: a step's frame written at the step's end, after the forward pass, as before; B: written when
its plan is captured (`V1RunnerProbe._frame_at_plan`, what the probe does now on a runner without a
drafter or a KV connector), while what it reads is still warm.

    .venv-vllm/bin/python bench/probe_hot_path.py --paired bench/variants/frame_at_plan.py --forward-us 3000
    .venv-vllm/bin/python bench/engine_paired.py bench/variants/frame_at_plan.py
"""

from __future__ import annotations

from kvledger.producer.vllm_v1 import V1RunnerProbe


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    probe._frame_at_plan = variant_b
