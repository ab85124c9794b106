"""Getting the plan's tensors to the host without stalling the engine.

On a CPU engine a probe copies the few arrays it needs and is done. On a
device (CUDA, or NPU through torch-npu), `tensor.cpu()` would synchronise the
stream on the hot path. Instead a probe copies a step's tensors into one
reused pinned host buffer with `non_blocking=True`, records one event on the
current stream, and returns a `Staged` handle per tensor. The step's frame is
written once the event has completed (`ready`, polled at the rank's later
probe points: the engine thread never waits for a forward pass still running,
see `ring_writer.RingWriter.step`); writing it reads the copies and gives
the buffer back to the pool. Only torch's generic device API is used
(`torch.Event`, `torch.accelerator`), so any backend that implements it works.

The pool is bounded: when every buffer is still in flight the copy is refused
(the caller records the plan as unavailable for that step, never blocks).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np


class StagingFull(RuntimeError):
    """Every pinned buffer of the pool is still in flight."""


class Lease:
    """A pinned buffer lent to the copies staged together, behind one event: back in the pool
    once each copy is read."""

    def __init__(self, pool: StagingPool, buffer: Any, copies: int, event: Any):
        self.pool = pool
        self.buffer = buffer
        self.copies = copies
        self.event = event
        self.landed = False  # known complete: its copies ask the device no more

    def ready(self) -> bool:
        if not self.landed:
            self.landed = self.event.query()
        return self.landed

    def wait(self) -> None:
        if not self.landed:
            self.event.synchronize()
            self.landed = True

    def release(self) -> None:
        self.copies -= 1
        if self.copies == 0:
            self.pool.give_back(self.buffer)


@dataclass
class Staged:
    """A host copy of a tensor; on a device, ready once its lease's event has completed."""

    buffer: np.ndarray  # a numpy copy (CPU tensors), or a view of its place in a pinned host buffer
    lease: Lease | None = None  # the pinned buffer and its event, until this copy is read

    @classmethod
    def host(cls, array: np.ndarray) -> Staged:
        """An array already copied to the host (CPU engines): nothing to wait for."""
        return cls(array)

    def ready(self) -> bool:
        """Whether the copy has landed (`numpy` would not wait)."""
        return self.lease is None or self.lease.ready()

    def numpy(self) -> np.ndarray:
        """Wait for the copy, return an owned array, free its place in the pinned buffer."""
        lease = self.lease
        if lease is None:
            return self.buffer
        lease.wait()
        array = self.buffer.copy()  # the pinned buffer goes back for reuse
        lease.release()
        self.buffer, self.lease = array, None  # asked again, the same copy
        return array


_ALIGN = 64  # each dtype's place in a shared buffer, in bytes (cache line; every dtype's alignment)


class _NumpyDtypes(dict):
    """torch dtype -> numpy dtype, of the integer tensors a probe copies (filled when first asked)."""

    def __missing__(self, dtype):
        import torch

        self[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        return self[dtype]


_NUMPY = _NumpyDtypes()


class StagingPool:
    """Reused pinned host buffers (bytes), sized to the largest set of copies seen."""

    def __init__(self, max_in_flight: int = 64):
        self.max_in_flight = max_in_flight
        self._free: list = []
        self._in_flight = 0
        self._lock = threading.Lock()  # a pool may be shared by threads

    def stage(self, tensor) -> Staged:
        """Start copying `tensor` to the host; never synchronises a device stream."""
        return self.stage_all([tensor])[0]

    def stage_all(self, tensors: list) -> list[Staged]:
        """Start copying each tensor to the host, behind one event, never synchronising: the
        tensors of a dtype and device joined there (one kernel) and copied in one transfer,
        each into its place in one pinned buffer. A step's plan is a dozen tensors; each torch
        call on a device tensor (a slice, a copy) costs tens of µs on some hosts."""
        if all(t.is_cpu for t in tensors):  # integer tensors (never requiring grad): numpy copies
            return [Staged.host(t.numpy().copy()) for t in tensors]
        import torch

        by_kind: dict[tuple[Any, Any], list[int]] = {}  # (dtype, device): joined together
        for i, t in enumerate(tensors):
            by_kind.setdefault((t.dtype, t.device), []).append(i)
        places: list[tuple[int, int]] = [(0, 0)] * len(tensors)  # each tensor's bytes in the buffer
        joined, end = [], 0
        for (dtype, _), members in by_kind.items():
            flat = [tensors[i].reshape(-1) for i in members]  # a view, or a copy of a strided slice
            together = flat[0] if len(flat) == 1 else torch.cat(flat)
            start = at = end
            for i in members:
                places[i] = (at, at + tensors[i].numel() * _NUMPY[dtype].itemsize)
                at = places[i][1]
            joined.append((together, start, at))
            end = -(-at // _ALIGN) * _ALIGN
        buffer, host = self._take(end)
        for together, start, stop in joined:
            buffer[start:stop].view(together.dtype).copy_(together, non_blocking=True)
        device = next(t.device for t in tensors if not t.is_cpu)
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        lease = Lease(self, (buffer, host), len(tensors), event)
        # The host's places as numpy views (cheaper than torch's) of the pinned buffer's bytes.
        return [
            Staged(host[start:stop].view(_NUMPY[t.dtype]).reshape(t.shape), lease)
            for t, (start, stop) in zip(tensors, places, strict=True)
        ]

    def _take(self, nbytes: int) -> tuple[Any, np.ndarray]:
        """A pinned buffer of at least `nbytes`, and its numpy view."""
        import torch

        with self._lock:
            if self._in_flight >= self.max_in_flight:
                raise StagingFull(f"{self._in_flight} pinned buffers in flight")
            self._in_flight += 1
            while self._free:  # a free buffer too small for this copy is dropped: sizes only grow
                buffer, host = self._free.pop()
                if host.size >= nbytes:
                    return buffer, host
        # Grown past every free buffer (or none yet): a new one, twice as large.
        buffer = torch.empty(max(2 * nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        return buffer, buffer.numpy()

    def give_back(self, buffer) -> None:
        with self._lock:
            self._in_flight -= 1
            self._free.append(buffer)
