"""A: the step untraced (the probes paused: they still wrap the runner and count the step); B: traced.
What tracing costs the engine thread per step, its probes' own time and what it adds beyond it.

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/tracing.py
"""

from __future__ import annotations

from kvledger.producer.vllm_v1 import V1RunnerProbe


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    probe.paused = not variant_b
