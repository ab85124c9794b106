"""A: a host plan's parts gathered into a bytes object of their own (`frames.pack_parts`), then
copied into the frame, as the probe did before; B: handed to the frame's write as a list, a part
of parts packed in place (`Ring.write_frame`, what the probe does now): one allocation and one
copy of the plan less.

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/parts_in_place.py
"""

from __future__ import annotations

from kvledger.producer.frames import pack_parts
from kvledger.producer.vllm_v1 import V1RunnerProbe

_RECORD = V1RunnerProbe._record_input_step


def _packed_first(self: V1RunnerProbe, written=None) -> None:
    if written is not None:
        header, parts = written
        written = header, [pack_parts(p) if isinstance(p, list) else p for p in parts]
    _RECORD(self, written)


def _as_given(self: V1RunnerProbe, written=None) -> None:  # the same one call more as A's
    _RECORD(self, written)


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    V1RunnerProbe._record_input_step = _as_given if variant_b else _packed_first
