"""A: a step's tokens per request always sent as the scheduler's dict (ids and counts); B: as a
list aligned with the cached requests when it names exactly those, in order (`frames.scheduler_fields`,
what the probe does now): a decoding batch's ids are not encoded a second time.

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/aligned_counts.py
"""

from __future__ import annotations

from kvledger.producer import frames, vllm_v1
from kvledger.producer.vllm_v1 import V1RunnerProbe

_ALIGNED = frames.scheduler_fields
_COUNTS = 5  # the counts' place among the fields


def _as_the_dict(so, cached_ids=None) -> tuple:
    fields = _ALIGNED(so, cached_ids)
    return (*fields[:_COUNTS], so.num_scheduled_tokens, *fields[_COUNTS + 1 :])


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    vllm_v1.scheduler_fields = _ALIGNED if variant_b else _as_the_dict
