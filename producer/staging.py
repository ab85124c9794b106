"""Getting the plan's tensors to the host without stalling the engine.

On a CPU engine a probe copies the few arrays it needs and is done. On a
device (CUDA, or NPU through torch-npu), `tensor.cpu()` would synchronise the
stream on the hot path. Instead a probe copies into a reused pinned host
buffer with `non_blocking=True`, records an event on the current stream, and
returns a `Staged` handle. The step's frame is written once every event has
completed (`ready`, polled at the rank's later probe points: the engine thread
never waits for a forward pass still running, see `ring_recorder.RingRecorder.step`);
writing it reads the buffer and gives it back to the pool. Only torch's generic device API is used
(`torch.Event`, `torch.accelerator`), so any backend that implements it works.

The pool is bounded: when every buffer is still in flight the copy is refused
(the caller records the plan as unavailable for that step, never blocks).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np


class StagingFull(RuntimeError):
    """Every pinned buffer of this shape is still in flight."""


@dataclass
class Staged:
    """A host copy of a tensor (1-D or 2-D), ready once `event` (if any) has completed."""

    buffer: Any  # a numpy copy (CPU tensors) or a reused pinned host tensor (device tensors)
    shape: tuple[int, ...]
    event: Any = None
    pool: StagingPool | None = None

    @classmethod
    def host(cls, array: np.ndarray) -> Staged:
        """An array already copied to the host (CPU engines): nothing to wait for."""
        return cls(array, array.shape)

    def ready(self) -> bool:
        """Whether the copy has landed (`numpy` would not wait)."""
        return self.event is None or self.event.query()

    def numpy(self) -> np.ndarray:
        """Wait for the copy, return an owned array, free the buffer."""
        if self.pool is None:
            return self.buffer
        if self.event is not None:
            self.event.synchronize()
        # The pinned buffer goes back for reuse: keep a copy.
        array = self.buffer[: math.prod(self.shape)].view(self.shape).numpy().copy()
        self.pool.give_back(self.buffer)
        self.buffer, self.pool = array, None  # asked again, the same copy
        return array


class StagingPool:
    """Reused pinned host buffers, keyed by dtype, sized to the largest copy seen."""

    def __init__(self, max_in_flight: int = 64):
        self.max_in_flight = max_in_flight
        self._free: dict[Any, list] = defaultdict(list)
        self._in_flight = 0
        self._lock = threading.Lock()  # a pool may be shared by threads

    def stage(self, tensor) -> Staged:
        """Start copying `tensor` to the host; never synchronises a device stream."""
        if tensor.is_cpu:  # integer tensors (never requiring grad): numpy is the cheap copy
            return Staged.host(tensor.numpy().copy())
        import torch

        shape = tuple(tensor.shape)
        length = math.prod(shape)
        buffer = self._take(tensor.dtype, length)
        buffer[:length].view(shape).copy_(tensor, non_blocking=True)
        event = torch.Event(device=tensor.device)
        event.record(torch.accelerator.current_stream(tensor.device))
        return Staged(buffer, shape, event, self)

    def _take(self, dtype, length: int):
        import torch

        with self._lock:
            if self._in_flight >= self.max_in_flight:
                raise StagingFull(f"{self._in_flight} pinned buffers in flight")
            self._in_flight += 1
            free = self._free[dtype]
            while free:  # a free buffer too small for this copy is dropped: sizes only grow
                buffer = free.pop()
                if buffer.shape[0] >= length:
                    return buffer
        # Grown past every free buffer (or none yet): a new one, twice as large.
        return torch.empty(max(2 * length, 1024), dtype=dtype, pin_memory=True)

    def give_back(self, buffer) -> None:
        with self._lock:
            self._in_flight -= 1
            self._free[buffer.dtype].append(buffer)
