"""What the probes capture of a step, and the one place it becomes a ledger record.

The engine thread fills a `StepCapture` (the scheduler's fields as one
MessagePack blob, the plan's arrays as copied) and hands it to the ring as a
frame (`to_parts`); the recorder process reads it back (`from_parts`) and
builds the Step record (`record`). `raise` mode builds the same record on the
engine thread from the same capture, so both paths share every rule here. The
same for snapshots and Health.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvledger.producer import records
from kvledger.producer.chains import PrefixChains
from kvledger.producer.frames import pack, pack_parts, step_input_record, unpack, unpack_parts
from kvledger.producer.staging import Staged
from kvledger.schemas import pack_i32

_EMPTY = np.zeros(0, np.int64)
_NIL = msgspec.Raw(msgspec.msgpack.encode(None))


# A step frame's header, as Structs: built on the engine thread by one C call each (a Python-level
# constructor costs ~1.5 us there, cold after a forward pass), read back in the recorder by the same
# declaration, with what it reads later left encoded.
class PlanHeader(msgspec.Struct, array_like=True):
    """What a step frame's header carries of the plan (nothing here waits for the device)."""

    req_ids: msgspec.Raw  # the runner's order, encoded ahead (`frames.RepeatedIds`); read back encoded
    num_tokens: int
    group_ids: list[int]
    has_positions: bool = True  # False for a dummy run: it serves no request
    draft_group: int = -1  # the KV cache group the drafter's layers write
    passes: list[tuple[int, int, bool, bool]] = []  # per drafter pass: index, real tokens, has positions, has qsl


class StepHeader(msgspec.Struct, array_like=True):
    """A step frame's header: the step, the scheduler's fields, the plan's, the digests' reasons."""

    step: int
    kind: str  # REAL, DUMMY, PROFILE, WARMUP
    # `frames.scheduler_fields` as the probe took them (encoded with the header, see StepCapture.header),
    # or already encoded; read back encoded (nil for none).
    scheduler: msgspec.Raw
    plan: PlanHeader | None
    reasons: list[str] | None = None  # per content digest (ContentCapture.reasons)
    in_flight: int = -1  # steps the engine core had in flight when it scheduled this one; -1: not said


_read_step = msgspec.msgpack.Decoder(StepHeader).decode
_BATCHES_KEPT = 8  # a step's batch in the scheduler's order and in the runner's, and a few past ones


class RequestIndex:
    """Dense, never reused indices for request ids, as the packed columns want."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._next = 0
        # Id lists as the frames carry them (MessagePack) -> their indices and those packed: a batch
        # seen again (most decode steps) is looked up whole. Emptied when an id is forgotten.
        self._batches: dict[bytes, tuple[list[int], bytes]] = {}

    def __call__(self, req_id: str) -> int:
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = self._next
            self._next += 1
        return index

    def many(self, req_ids: list[str]) -> list[int]:
        get = self._index.get
        found = [get(r) for r in req_ids]
        return found if None not in found else [self(r) for r in req_ids]

    def batch(self, encoded: msgspec.Raw | bytes) -> tuple[list[int], bytes]:
        """The indices of a MessagePack list of ids (`many`), and them packed as int32."""
        key = bytes(encoded)
        found = self._batches.get(key)
        if found is None:
            indices = self.many(unpack(key))
            if len(self._batches) >= _BATCHES_KEPT:
                self._batches.clear()
            found = self._batches[key] = (indices, pack_i32(indices))
        return found

    def get(self, req_id: str) -> int | None:
        return self._index.get(req_id)

    def forget(self, req_id: str) -> None:
        if self._index.pop(req_id, None) is not None:
            self._batches.clear()  # a batch naming it would now give it a new index


@dataclass
class DraftPassCapture:
    """What the hot path copied of one drafter pass."""

    pass_index: int
    slots: Staged  # the whole slot mapping the pass writes with
    positions: Staged | None  # its real tokens' positions; None for a pass serving no request
    qsl: np.ndarray | None  # the first pass's query starts per request (later passes: one token each)
    num_real: int

    def record(self, group_id: int) -> dict:
        slots = self.slots.numpy()
        if self.qsl is None:
            return records.draft_pass(group_id, self.pass_index, [], [], slots)
        positions = self.positions.numpy()
        if self.pass_index == 0:
            counts = np.diff(self.qsl)
            starts = np.minimum(self.qsl[:-1], max(positions.size - 1, 0))
            first = positions[starts] if positions.size else np.zeros(counts.size, np.int64)
        else:
            counts, first = np.ones(self.num_real, np.int32), positions
        return records.draft_pass(group_id, self.pass_index, counts, first, slots)


_NO_REQUESTS = np.zeros(1, np.int32)  # a dummy run's query starts
_NO_ROWS, _NO_LENS = np.zeros((0, 0), np.int32), np.zeros(0, np.int32)


@dataclass
class PlanCapture:
    """What the hot path copied of one step's plan, when attention was about to read it (a view
    copied at the step's end would miss a row rewritten in between)."""

    req_ids: list[str] | msgspec.Raw  # the runner's order; a `frames.RepeatedIds` encodes them ahead
    num_tokens: int
    group_ids: list[int]
    # The plan's arrays (`plan_parts`): on the host, gathered into one frame part when they were
    # copied (`frames.pack_parts`); on a device, owned copies and device copies still in flight.
    arrays: Any
    has_positions: bool = True  # False for a dummy run: it serves no request
    drafts: list[DraftPassCapture] = field(default_factory=list)  # the drafter's passes, in order
    draft_group: int = -1  # the KV cache group the drafter's layers write

    @staticmethod
    def plan_parts(qsl: Any, positions: Any, groups: list[tuple[Any, Any, Any]]) -> list:
        """The arrays' order: query starts, positions, then per group its slot mapping,
        block-table rows (2-D: a row per request) and row lengths."""
        return [qsl, positions, *(array for group in groups for array in group)]

    @classmethod
    def dummy_parts(cls, slot_mappings: list) -> list:
        """A dummy run's: no request, no rows, every slot it writes padding (a real one is a fault)."""
        return cls.plan_parts(_NO_REQUESTS, _EMPTY, [(slots, _NO_ROWS, _NO_LENS) for slots in slot_mappings])

    @classmethod
    def of_dummy_run(cls, group_ids: list[int], arrays: Any) -> PlanCapture:
        """A dummy run's plan, of its `dummy_parts` as copied."""
        return cls([], 0, group_ids, arrays, has_positions=False)

    def ready(self) -> bool:
        """Whether every device copy of this plan has landed (`to_parts` would not wait)."""
        if not isinstance(self.arrays, list) and not self.drafts:  # a host engine's: copied already
            return True
        arrays = self.arrays if isinstance(self.arrays, list) else []
        staged = [a for a in arrays if isinstance(a, Staged)]
        for d in self.drafts:
            staged += [d.slots] if d.positions is None else [d.slots, d.positions]
        return all(s.ready() for s in staged)

    def part(self) -> Any:
        """The arrays as one frame part; waits for a device copy still in flight."""
        if not isinstance(self.arrays, list):
            return self.arrays
        return pack_parts([a.numpy() if isinstance(a, Staged) else a for a in self.arrays])

    def record(self, index: RequestIndex, full_rows: bool) -> dict:
        qsl, positions, *rest = unpack_parts(self.part())
        starts = qsl[:-1]
        first = positions.take(starts) if self.has_positions else _EMPTY
        group_records = []
        for k, gid in enumerate(self.group_ids):
            slots, rows, lens = rest[3 * k : 3 * k + 3]
            table = rows.reshape(lens.size, rows.size // lens.size if lens.size else 0)
            num_real = min(self.num_tokens, len(slots))
            group_records.append(records.group_plan_from_table(gid, slots, num_real, table, lens, full_rows))
        drafts = [d.record(self.draft_group) for d in self.drafts] or None
        # A recorder reads the ids still encoded (`from_parts`): a batch seen before is looked up whole.
        ids = self.req_ids
        req_indices = index.batch(ids)[1] if isinstance(ids, msgspec.Raw) else index.many(ids)
        return records.step_plan(req_indices, qsl[1:] - starts, first, group_records, drafts)

    # -- the wire form: a small header, the plan's part, then the drafter's arrays -----------------
    def header(self) -> PlanHeader:
        """What the step's header carries of this plan."""
        passes = [(d.pass_index, d.num_real, d.positions is not None, d.qsl is not None) for d in self.drafts]
        return PlanHeader(self.req_ids, self.num_tokens, self.group_ids, self.has_positions, self.draft_group, passes)

    def array_parts(self) -> list:
        """The frame's parts; waits for a device copy still in flight."""
        arrays = [self.part()]
        for d in self.drafts:
            arrays += [d.slots.numpy(), d.positions.numpy() if d.positions is not None else _EMPTY]
            arrays.append(d.qsl if d.qsl is not None else _EMPTY)
        return arrays

    @classmethod
    def from_parts(cls, h: PlanHeader, arrays: list[np.ndarray]) -> PlanCapture:
        plan, *rest = arrays
        drafts = []
        for k, (pass_index, num_real, has_pos, has_qsl) in enumerate(h.passes):
            slots, pos, pass_qsl = rest[3 * k : 3 * k + 3]
            drafts.append(
                DraftPassCapture(
                    pass_index,
                    Staged.host(slots),
                    Staged.host(pos) if has_pos else None,
                    pass_qsl if has_qsl else None,
                    num_real,
                )
            )
        return cls(h.req_ids, h.num_tokens, h.group_ids, plan, h.has_positions, drafts, h.draft_group)


@dataclass
class ContentCapture:
    """The step's digests of sealed blocks (producer/content.py), taken before its forward pass."""

    groups: np.ndarray  # int32, one per digest
    blocks: np.ndarray  # int32, aligned
    digests: Staged  # int64 (the uint64 digests' bits), aligned; on a device, still being copied
    reasons: list[str]  # DigestReason symbols, aligned

    def record(self) -> dict:
        return records.block_digests(self.groups, self.blocks, self.digests.numpy(), self.reasons)


@dataclass
class StepCapture:
    """One step as the engine thread leaves it: built into a Step record by `record`."""

    step: int
    kind: str  # REAL, DUMMY, PROFILE, WARMUP
    # The scheduler's fields (REAL steps): as the probe took them (`frames.scheduler_fields`), or
    # still encoded, as a frame carries them (the same bytes either way).
    scheduler: tuple | msgspec.Raw | None
    plan: PlanCapture | None
    content: ContentCapture | None = None
    in_flight: int = -1  # steps the engine core had in flight when it scheduled this one; -1: not said

    def record(self, index: RequestIndex, full_rows: bool, chains: PrefixChains | None = None) -> tuple[str, dict]:
        # The input first: it gives this step's new requests their indices, which the plan names.
        scheduler = pack(self.scheduler) if isinstance(self.scheduler, tuple) else self.scheduler
        in_flight = self.in_flight if self.in_flight >= 0 else None
        inp = step_input_record(scheduler, index, chains, in_flight) if scheduler is not None else None
        plan = self.plan.record(index, full_rows) if self.plan is not None else None
        content = self.content.record() if self.content is not None else None
        return records.step(self.step, self.kind, inp, plan, content)

    def ready(self) -> bool:
        """Whether every device copy of this step has landed: its frame can be written without
        waiting for the device."""
        plan, content = self.plan, self.content
        return (plan is None or plan.ready()) and (content is None or content.digests.ready())

    def fields(self) -> StepHeader:
        """The step's header, not encoded yet (`RingWriter.step_now` encodes it in place)."""
        plan = self.plan.header() if self.plan is not None else None
        reasons = self.content.reasons if self.content is not None else None
        return StepHeader(self.step, self.kind, self.scheduler, plan, reasons, self.in_flight)

    def header(self) -> bytes:
        """The frame's first part, encoded at once: the scheduler's fields go in with it, in one
        encode, while the runner has not yet changed their lists (see `frames.scheduler_fields`),
        even when the frame waits for device copies."""
        return pack(self.fields())

    def array_parts(self) -> list:
        """The frame's other parts: the plan's, then the content digests' (waits for the device)."""
        arrays = self.plan.array_parts() if self.plan is not None else []
        if self.content is not None:
            c = self.content
            arrays += [c.groups, c.blocks, c.digests.numpy()]
        return arrays

    def to_parts(self, header: bytes | bytearray | None = None) -> list:
        """The frame's parts in order: its header (`header()`, or as encoded already), then the arrays."""
        return [self.header() if header is None else header, *self.array_parts()]

    @classmethod
    def from_parts(cls, parts: list[np.ndarray]) -> StepCapture:
        # The scheduler's blob and the plan's ids are read later, as they are (no copy, no strings).
        h = _read_step(parts[0])
        arrays, content = parts[1:], None
        if h.reasons is not None:
            arrays, (groups, blocks, digests) = arrays[:-3], arrays[-3:]
            content = ContentCapture(groups, blocks, Staged.host(digests), h.reasons)
        plan = PlanCapture.from_parts(h.plan, arrays) if h.plan is not None else None
        return cls(h.step, h.kind, None if h.scheduler == _NIL else h.scheduler, plan, content, h.in_flight)


@dataclass
class SnapshotCapture:
    """The live requests after a step: per request its id and computed tokens, per group the
    row lengths and every row's blocks end to end."""

    step: int
    req_ids: list[str]
    computed: list[int]
    lens: list[np.ndarray]  # per group: the rows' lengths, by request
    blocks: list[np.ndarray]  # per group: the rows, concatenated (cut from `rows` once they land)
    # Per group `[requests, widest row]`, copies from a device still landing (MRV2); None once cut.
    rows: list[Staged] | None = None

    @classmethod
    def of_staged(
        cls, step: int, req_ids: list[str], computed: list[int], lens: list[np.ndarray], rows: list[Staged]
    ) -> SnapshotCapture:
        """From device rows being copied to the host: the frame waits for them (`ready`), the
        engine thread never does."""
        return cls(step, req_ids, computed, lens, [], rows)

    def ready(self) -> bool:
        """Whether its rows are on the host."""
        return self.rows is None or all(r.ready() for r in self.rows)

    def _cut_rows(self) -> None:
        """Each group's blocks from its rows, the first `lens` of each (waits if they are still landing)."""
        if self.rows is not None:
            rows, self.rows = [r.numpy() for r in self.rows], None
            self.blocks = [host[np.arange(host.shape[1]) < n[:, None]] for host, n in zip(rows, self.lens, strict=True)]

    @classmethod
    def of_rows(cls, step: int, req_ids: list[str], computed, rows: list[list]) -> SnapshotCapture:
        """From per-group lists of per-request block lists (V1's request states)."""
        lens = [np.fromiter((len(r) for r in group), np.int32, len(group)) for group in rows]
        blocks = [
            np.fromiter((b for r in group for b in r), np.int32, int(n.sum()))
            for group, n in zip(rows, lens, strict=True)
        ]
        return cls(step, req_ids, [int(c) for c in computed], lens, blocks)

    def record(self, index: RequestIndex) -> tuple[str, dict]:
        # A request that arrived while tracing was paused gets its index here: after the
        # resync its later steps are checked, not counted as unknown.
        self._cut_rows()
        starts = [np.concatenate([[0], np.cumsum(n)]) for n in self.lens]
        live = [
            (
                index(req_id),
                req_id,
                self.computed[j],
                [b[s[j] : s[j + 1]] for b, s in zip(self.blocks, starts, strict=True)],
            )
            for j, req_id in enumerate(self.req_ids)
        ]
        return records.snapshot(self.step, live)

    def to_parts(self) -> list:
        self._cut_rows()
        return [pack((self.step, self.req_ids, self.computed, len(self.lens))), *self.lens, *self.blocks]

    @classmethod
    def from_parts(cls, parts: list[np.ndarray]) -> SnapshotCapture:
        step, req_ids, computed, groups = unpack(parts[0])
        return cls(step, req_ids, computed, list(parts[1 : 1 + groups]), list(parts[1 + groups : 1 + 2 * groups]))


@dataclass
class HealthCapture:
    """The rank's own counts for a Health record; the recorder adds what was lost past the rank."""

    step: int
    captured: int  # frames the rank offered before this one
    probe_ns: int  # the probes' time on the engine thread, cumulative
    closing: bool = False

    def record(self, dropped: int, capacity: int, high_water: int) -> tuple[str, dict]:
        counts = (self.captured, dropped, self.probe_ns, capacity, high_water)
        return records.health(self.step, *counts, closing=self.closing)

    def to_parts(self) -> list:
        return [pack((self.step, self.captured, self.probe_ns, self.closing))]

    @classmethod
    def from_parts(cls, parts: list[np.ndarray]) -> HealthCapture:
        return cls(*unpack(parts[0]))
