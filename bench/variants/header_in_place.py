"""A: a step's header encoded into a new bytes object, as before; B: into the buffer the
recorder keeps across steps (`RingRecorder.step_now`, what the probe does now).

    .venv-vllm/bin/python bench/probe_hot_path.py --paired bench/variants/header_in_place.py --forward-us 3000
"""

from __future__ import annotations

import types

from kvledger.producer.capture import StepHeader
from kvledger.producer.frames import FrameKind, pack
from kvledger.producer.vllm_v1 import V1RunnerProbe


def _new_bytes(recorder, header: StepHeader, parts: list) -> None:
    recorder._offer(FrameKind.STEP, lambda: [pack(header), *parts])


def setup(probe: V1RunnerProbe, variant_b: bool) -> None:
    recorder = probe.recorder
    if variant_b:
        recorder.__dict__.pop("step_now", None)  # the class's own
    else:
        recorder.step_now = types.MethodType(_new_bytes, recorder)
