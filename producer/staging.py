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

A whole plan (every group's block-table rows up to the widest row, slot
mappings, positions) or a snapshot's rows goes through `PlanGather`: one
kernel gathers them into one preallocated device buffer, one transfer copies
that to a pinned host buffer, one event marks it: a constant number of host
calls per step, whatever the number of KV groups and requests (`stage_all`
costs a few per tensor, ~10-40 us each on some device hosts). The kernel is
Triton's on CUDA; elsewhere (CPU tensors in tests, other backends) a fused
torch gather fills the same layout in a constant number of torch calls.
`KVLEDGER_GATHER=torch` takes the torch gather on CUDA too; `=triton` the kernel
on any tensors Triton takes (CPU tensors in Triton's interpreter: how the tests
run it on a CPU host, the switch theirs, never this package's).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("kvledger.producer")


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

    def __init__(self, max_in_flight: int = 64, host_copies: bool = True):
        self.max_in_flight = max_in_flight
        # CPU tensors copied by numpy at once; False: through the device path's buffer and lease, as
        # a device's would be (benchmarks and tests count that path's torch calls on a CPU host).
        self.host_copies = host_copies
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
        if self.host_copies and all(t.is_cpu for t in tensors):  # integer tensors (no grad): numpy copies
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
        device = next((t.device for t in tensors if not t.is_cpu), tensors[0].device)
        buffer, host = self._take(end, pinned=device.type != "cpu")
        for together, start, stop in joined:
            buffer[start:stop].view(together.dtype).copy_(together, non_blocking=True)
        event = new_event(device)
        event.record()
        lease = Lease(self, (buffer, host), len(tensors), event)
        # The host's places as numpy views (cheaper than torch's) of the pinned buffer's bytes.
        return [
            Staged(host[start:stop].view(_NUMPY[t.dtype]).reshape(t.shape), lease)
            for t, (start, stop) in zip(tensors, places, strict=True)
        ]

    def _take(self, nbytes: int, pinned: bool = True) -> tuple[Any, np.ndarray]:
        """A pinned buffer of at least `nbytes`, and its numpy view (`pinned` False: a plain host
        buffer, for copies of CPU tensors, where no accelerator may exist to pin with)."""
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
        buffer = torch.empty(max(2 * nbytes, 4096), dtype=torch.uint8, pin_memory=pinned)
        return buffer, buffer.numpy()

    def give_back(self, buffer) -> None:
        with self._lock:
            self._in_flight -= 1
            self._free.append(buffer)


class _Landed:
    """The event of copies made on the host (CPU tensors): complete when recorded."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def new_event(device) -> Any:
    """An event on `device`'s current stream once recorded (`torch.Event`); on the CPU, one
    already complete."""
    if device.type == "cpu":
        return _Landed()
    import torch

    return torch.Event(device=device)


# -- the plan gathered on the device: a constant number of host calls per step ---------------------
MAX_KERNEL_GROUPS = 8  # KV groups the kernel takes (each group's width is one of its arguments)
_INDEXES_KEPT = 8  # the torch gather's flat indices, by shape (a decoding batch keeps one for many steps)


def _kernel():
    """The Triton gather (`_triton_gather`), or None where Triton does not import (then the torch
    gather runs). Built when first asked: a CPU engine never imports Triton."""
    if not _KERNEL:
        try:
            _KERNEL.append(_build_kernel())
        except ImportError:  # no Triton: vLLM requires it on CUDA, other backends may lack it
            _KERNEL.append(None)
    return _KERNEL[0]


_KERNEL: list = []
triton: Any = None  # Triton and its language, once imported (the kernel's globals)
tl: Any = None


def _build_kernel():
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit(
        do_not_specialize=["rows_at", "padded", "num_tokens", "nrows", "w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7"]
    )
    def _gather_kernel(
        out64,  # int64 view of the staging buffer: slot mappings [groups, padded], then positions
        out32,  # int32 view of the staging buffer: from word `rows_at` the rows, table after table
        rows_at,
        slots,  # [groups, >= padded]
        slots_stride,
        padded,
        positions,  # [>= num_tokens]
        num_tokens,
        table_ptrs,  # uint64 [tables]: each table's address
        table_strides,  # int64 [tables]
        row_index,  # int64 [nrows] (HAS_INDEX): the table row of each gathered row
        nrows,
        w0,
        w1,
        w2,
        w3,
        w4,
        w5,
        w6,
        w7,  # each table's width (0 past the last)
        SLOT_GROUPS: tl.constexpr,
        HAS_INDEX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # program (g, r): row r of table g; the last column (r == nrows) copies group g's slot
        # mapping, and (0, nrows) the positions too.
        g = tl.program_id(0)
        r = tl.program_id(1)
        if r == nrows:
            if g < SLOT_GROUPS:
                for i in range(0, padded, BLOCK):
                    o = i + tl.arange(0, BLOCK)
                    m = o < padded
                    tl.store(out64 + g * padded + o, tl.load(slots + g * slots_stride + o, mask=m), mask=m)
            if g == 0:
                for i in range(0, num_tokens, BLOCK):
                    o = i + tl.arange(0, BLOCK)
                    m = o < num_tokens
                    tl.store(out64 + SLOT_GROUPS * padded + o, tl.load(positions + o, mask=m), mask=m)
            return
        # Table g's width, and the words of the tables before it (rows of each).
        g64 = g.to(tl.int64)
        width = (
            (g64 == 0) * w0 + (g64 == 1) * w1 + (g64 == 2) * w2 + (g64 == 3) * w3
            + (g64 == 4) * w4 + (g64 == 5) * w5 + (g64 == 6) * w6 + (g64 == 7) * w7
        )  # fmt: skip
        before = (
            (g64 > 0) * w0 + (g64 > 1) * w1 + (g64 > 2) * w2 + (g64 > 3) * w3
            + (g64 > 4) * w4 + (g64 > 5) * w5 + (g64 > 6) * w6
        )  # fmt: skip
        source = tl.load(row_index + r) if HAS_INDEX else r.to(tl.int64)
        table = tl.load(table_ptrs + g).to(tl.pointer_type(tl.int32))
        src = table + source * tl.load(table_strides + g)
        dst = out32 + rows_at + before * nrows + r.to(tl.int64) * width
        for i in range(0, width, BLOCK):
            o = i + tl.arange(0, BLOCK)
            m = o < width
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)

    def gather(views, at32, slots, padded, positions, num_tokens, ptrs, strides, row_index, nrows, widths):
        """One launch: the slot mappings, the positions and every table's rows into the staging
        buffer (`views`: its int64 and int32 views, made once)."""
        out64, out32 = views
        groups = slots.shape[0] if slots is not None else 0
        w = [*widths, *[0] * (MAX_KERNEL_GROUPS - len(widths))]
        grid = (max(groups, len(widths), 1), nrows + 1)
        _gather_kernel[grid](
            out64,
            out32,
            at32 // 4,
            slots if slots is not None else out64,
            slots.stride(0) if slots is not None else 0,
            padded,
            positions if positions is not None else out64,
            num_tokens,
            ptrs,
            strides,
            row_index if row_index is not None else out64,
            nrows,
            *w,
            SLOT_GROUPS=groups,
            HAS_INDEX=row_index is not None,
            BLOCK=256,
        )

    return gather


@dataclass
class Gathered:
    """A gather's host copies, each `Staged` behind the gather's one lease."""

    slots: list[Staged]  # per slot-mapping row: its first `padded` slots
    positions: Staged | None
    rows: list[Staged]  # per table: `[rows, width]`


class PlanGather:
    """A step's plan, or a snapshot's rows, gathered on the device into one preallocated staging
    buffer by one kernel, copied to one pinned host buffer by one transfer, behind one event.

    The layout (bytes): int64 slot mappings (`[groups, padded]`, row after row), then int64
    positions, then (aligned) int32 block-table rows, table after table, each `[rows, width]`.
    The staging buffer is reused step after step: the next gather is queued behind this step's
    transfer on the same stream. Host calls per step, whatever the groups and requests: the
    Triton kernel's launch, the transfer, the event (the torch gather: ~15 torch calls)."""

    def __init__(self, pool: StagingPool, use_kernel: bool | None = None):
        self.pool = pool
        # None: the Triton kernel on CUDA tensors where Triton imports, the torch gather elsewhere.
        self.use_kernel = use_kernel
        self.launches = 0  # the kernel's launches (a count of torch calls does not see them)
        self._staging: Any = None  # the device buffer (uint8), grown when a gather outgrows it
        self._views: tuple = ()  # its int64 and int32 views
        self._events: dict[int, Any] = {}  # per pinned buffer, its event, recorded again on reuse
        self._tables: tuple[tuple, Any, Any] | None = None  # (key, pointers, strides) on the device
        self._indexes: dict[tuple, Any] = {}  # the torch gather's flat indices, by shape

    def plan(
        self, slot_mappings, padded: int, positions, num_tokens: int, tables, num_reqs: int, widths: list[int]
    ) -> Gathered:
        """Every group's slot mapping `[:padded]` (`slot_mappings` `[groups, >= padded]`), the
        positions `[:num_tokens]` (None: none), and each table's first `num_reqs` rows up to its
        `width` (`tables` int32, `[>= num_reqs, >= width]` each, as many as `widths`)."""
        return self._gather(slot_mappings, padded, positions, num_tokens, tables, num_reqs, widths, None)

    def rows(self, tables, index: np.ndarray, widths: list[int]) -> list[Staged]:
        """Each table's rows `index` (host ints) up to its `width` (a snapshot's)."""
        if not tables:  # no KV group: nothing to copy (a lease with no copies would never come back)
            return []
        return self._gather(None, 0, None, 0, tables, len(index), widths, index).rows

    def _gather(self, slots, padded, positions, num_tokens, tables, nrows, widths, index) -> Gathered:
        device = (slots if slots is not None else positions if positions is not None else tables[0]).device
        groups = slots.shape[0] if slots is not None else 0
        padded = min(padded, slots.shape[1]) if slots is not None else 0
        num_tokens = num_tokens if positions is not None else 0
        n64 = groups * padded + num_tokens
        at32 = -(-n64 * 8 // _ALIGN) * _ALIGN
        ends = list(itertools.accumulate((nrows * w for w in widths), initial=at32 // 4))  # int32 words
        nbytes = max(ends[-1] * 4, 8)
        buffer, host = self.pool._take(nbytes, pinned=device.type != "cpu")
        try:
            staging = self._staging_buffer(nbytes, device)
            kernel = self._kernel_for(device.type, len(tables))
            if kernel is not None:
                ptrs, strides = self._table_pointers(tables, device)
                rows_index = None if index is None else self._device_index(index, device)
                try:
                    kernel(
                        self._views,
                        at32,
                        slots,
                        padded,
                        positions,
                        num_tokens,
                        ptrs,
                        strides,
                        rows_index,
                        nrows,
                        widths,
                    )
                    self.launches += 1
                except Exception:  # not built for this Triton or device: the torch gather from now on
                    log.exception("kv_trace: the plan's gather kernel failed; gathering with torch instead")
                    self.use_kernel, kernel = False, None
            if kernel is None:
                self._torch_gather(staging, at32, slots, padded, positions, num_tokens, tables, nrows, widths, index)
            buffer[:nbytes].copy_(staging[:nbytes], non_blocking=True)
            event = self._events.get(id(buffer))
            if event is None:
                if len(self._events) > 2 * self.pool.max_in_flight:  # buffers the pool dropped
                    self._events.clear()
                event = self._events[id(buffer)] = new_event(device)
            event.record()
        except BaseException:
            self.pool.give_back((buffer, host))
            raise
        lease = Lease(self.pool, (buffer, host), groups + (positions is not None) + len(widths), event)
        host64, host32 = host[: n64 * 8].view(np.int64), host[: ends[-1] * 4].view(np.int32)
        return Gathered(
            [Staged(host64[g * padded : (g + 1) * padded], lease) for g in range(groups)],
            Staged(host64[groups * padded : n64], lease) if positions is not None else None,
            [Staged(host32[a:b].reshape(nrows, w), lease) for a, b, w in zip(ends[:-1], ends[1:], widths, strict=True)],
        )

    def _kernel_for(self, device_type: str, num_tables: int):
        """The Triton kernel where it applies, else None (the torch gather)."""
        use = self.use_kernel
        if use is None:  # decided once: CUDA, unless KVLEDGER_GATHER=torch; anywhere with =triton
            choice = os.environ.get("KVLEDGER_GATHER", "")
            use = self.use_kernel = choice == "triton" or (device_type == "cuda" and choice != "torch")
            if choice == "triton":
                log.info("kv_trace: plans gathered by the Triton kernel on %s tensors (KVLEDGER_GATHER)", device_type)
        if not use or num_tables > MAX_KERNEL_GROUPS:
            return None
        return _kernel()

    def _staging_buffer(self, nbytes: int, device) -> Any:
        """The device buffer, grown (twice the size asked) when too small or on another device."""
        staging = self._staging
        if staging is None or staging.numel() < nbytes or staging.device != device:
            import torch

            size = -(-max(2 * nbytes, 4096) // _ALIGN) * _ALIGN
            staging = self._staging = torch.empty(size, dtype=torch.uint8, device=device)
            self._views = (staging.view(torch.int64), staging.view(torch.int32))  # the kernel's, made once
        return staging

    def _table_pointers(self, tables, device) -> tuple[Any, Any]:
        """The tables' addresses and row strides as device tensors (made again only when they move)."""
        key = tuple((t.data_ptr(), t.stride(0)) for t in tables)
        if self._tables is None or self._tables[0] != key:
            import torch

            ptrs = torch.tensor([k[0] for k in key] or [0], dtype=torch.uint64, device=device)
            strides = torch.tensor([k[1] for k in key] or [0], dtype=torch.int64, device=device)
            self._tables = (key, ptrs, strides)
        return self._tables[1], self._tables[2]

    def _device_index(self, index: np.ndarray, device) -> Any:
        """Host row indices on the device: queued from pinned memory, never waited for."""
        import torch

        host = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)

    def _torch_gather(self, staging, at32, slots, padded, positions, num_tokens, tables, nrows, widths, index):
        """The kernel's layout in a constant number of torch calls: one copy of the slot mappings,
        one of the positions, and the tables' rows by one index over the tables side by side."""
        import torch

        groups = slots.shape[0] if slots is not None else 0
        n64 = groups * padded + num_tokens
        if groups and padded:
            staging[: groups * padded * 8].view(torch.int64).view(groups, padded).copy_(slots[:, :padded])
        if num_tokens:
            staging[groups * padded * 8 : n64 * 8].view(torch.int64).copy_(positions[:num_tokens])
        n32 = nrows * sum(widths)
        if n32:
            if len({t.shape[0] for t in tables}) > 1:  # side by side takes as many rows of each
                tables = [t[: min(t.shape[0] for t in tables)] for t in tables]
            wide = torch.cat(tables, dim=1)  # rows side by side (one table too: as many calls for any)
            flat = self._flat_index(
                wide.shape[1], [t.shape[1] for t in tables], nrows, widths, index, device=wide.device
            )
            out = staging[at32 : at32 + n32 * 4].view(torch.int32)
            torch.index_select(wide.reshape(-1), 0, flat, out=out)

    def _flat_index(self, total: int, full: list[int], nrows: int, widths: list[int], index, device) -> Any:
        """Where each word of the rows' layout lies in the tables side by side (flattened)."""
        key = (total, tuple(full), nrows, tuple(widths), None if index is None else index.tobytes(), str(device))
        flat = self._indexes.get(key)
        if flat is None:
            rows = np.arange(nrows, dtype=np.int64) if index is None else np.asarray(index, np.int64)
            starts = np.cumsum([0, *full[:-1]])
            flat = np.concatenate(
                [
                    (rows[:, None] * total + s + np.arange(w)[None, :]).reshape(-1)
                    for s, w in zip(starts, widths, strict=True)
                ]
            )
            if len(self._indexes) >= _INDEXES_KEPT:
                self._indexes.clear()
            flat = self._indexes[key] = self._device_index(flat, device)
        return flat
