"""Frames: what a rank's probes write into its ring, and what the recorder reads back.

A frame is a few flat buffers behind a small header, so the engine thread
builds no records: the scheduler's fields go into the step's MessagePack header,
encoded once at the step's end (one C-level encode; a per-request Python loop
costs ~10 times more), the plan's arrays as they were copied
(`capture.StepCapture`). The recorder process
builds the records from them; rare bodies (RankInfo, connector events, and
every record in `raise` mode, which builds them on the engine thread) travel
built, as MessagePack.

    header, u64 words: kind | parts << 8, seq, emitted_at_us, then per part: dtype | size << 8
    parts, each 8-byte aligned

A part may itself hold parts (`pack_parts`: their count, their type words, the parts): the
plan's arrays are gathered so in one compiled call when attention is about to read them.
"""

from __future__ import annotations

import functools
import numbers
import struct
from enum import IntEnum
from itertools import compress, repeat
from operator import is_not
from typing import Any, NamedTuple

import msgspec
import numpy as np

from kvledger.producer import _hotpath, records
from kvledger.producer.chains import PrefixChains
from kvledger.schemas import pack_i32, unpack_i32
from kvledger.schemas.events import BODY_NAMES, Body, body_of


class FrameKind(IntEnum):
    BODY = 1  # a built record body: (name, body) as MessagePack
    STEP = 2  # a `capture.StepCapture`
    SNAPSHOT = 3  # a `capture.SnapshotCapture`
    HEALTH = 4  # the engine's counts (step, captured, probe_ns, closing); the recorder adds its own


class PartType(IntEnum):
    U8 = 1
    I32 = 2
    I64 = 3


_DTYPES = {PartType.U8: np.dtype(np.uint8), PartType.I32: np.dtype(np.int32), PartType.I64: np.dtype(np.int64)}
_OF_DTYPE = {dtype: part for part, dtype in _DTYPES.items()}
_PART_DTYPES = {int(part): (dtype, dtype.itemsize) for part, dtype in _DTYPES.items()}  # by a type word's low byte
_KINDS = {int(kind): kind for kind in FrameKind}  # by a header word's low byte
_HEAD = struct.Struct("<3Q")
_WORD = struct.Struct("<Q")


def as_array(part: Any) -> Any:
    """A part the compiled writer takes: a prefix sliced, a host tensor viewed, other integer
    widths widened, strided arrays copied."""
    if isinstance(part, tuple):  # (array, n) or (array, rows, cols)
        array, *counts = part
        if len(counts) == 2 and not isinstance(counts[1], numbers.Integral):  # cols as the rows' lengths
            counts[1] = prefix_max(counts[1], counts[0])
        if np.ndim(array) != len(counts) or min(counts) < 0 or any(map(int.__gt__, counts, np.shape(array))):
            raise ValueError(f"no {'x'.join(map(str, counts))} prefix in an array of shape {np.shape(array)}")
        part = array[: counts[0]] if len(counts) == 1 else array[: counts[0], : counts[1]]
    if isinstance(part, bytes | bytearray | memoryview):
        return part
    part = np.asarray(part)  # a host tensor: its view
    if part.dtype not in _OF_DTYPE:
        part = part.astype(np.int64)
    return np.ascontiguousarray(part)


class Frame(NamedTuple):
    """One frame read from the ring; its parts are views into the ring (copy what must outlive it)."""

    kind: FrameKind
    seq: int
    emitted_at_us: int
    parts: list[np.ndarray]


# The compiled calls take a part they refuse as `as_array` makes it (they call it themselves): no
# Python layer around them on the engine thread, where one costs ~1.5 us cold after a forward pass.
_hotpath.set_converter(as_array)
# pack_parts(parts) -> bytes: `parts` (as `Ring.write_frame` takes them) gathered into one part.
pack_parts = _hotpath.pack_parts
# prefix_max(array, n) -> int: the largest of `array[:n]` (0 for none), one compiled loop.
prefix_max = _hotpath.prefix_max


def _read_parts(buffer, n: int, words_at: int) -> list[np.ndarray]:
    """The `n` parts whose type words start at byte `words_at`, as views into `buffer`."""
    parts, offset = [], words_at + 8 * n
    for word in _words(n).unpack_from(buffer, words_at):
        dtype, itemsize = _PART_DTYPES[word & 0xFF]
        count = word >> 8
        parts.append(np.frombuffer(buffer, dtype, count, offset))
        offset += (count * itemsize + 7) & ~7
    return parts


@functools.cache
def _words(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


def read_frame(record) -> Frame:
    """The frame in one ring record (a buffer: its parts are views into it)."""
    kind_parts, seq, at_us = _HEAD.unpack_from(record, 0)
    return Frame(_KINDS[kind_parts & 0xFF], seq, at_us, _read_parts(record, kind_parts >> 8, _HEAD.size))


def unpack_parts(part) -> list[np.ndarray]:
    """The parts a `pack_parts` part holds, as views into it."""
    return _read_parts(part, _WORD.unpack_from(part, 0)[0], _WORD.size)


# -- MessagePack, for every structured part ----------------------------------------------------------
def _integer(obj: Any) -> int:
    """numpy integers (a runner may hand them over) as ints; anything else unsupported fails loudly."""
    if isinstance(obj, numbers.Integral):
        return int(obj)
    raise NotImplementedError(f"a value of type {type(obj).__name__} cannot be recorded")


_encoder = msgspec.msgpack.Encoder(enc_hook=_integer)  # data only: nothing read back is executed
pack = _encoder.encode
# Into a buffer kept across calls (truncated to the message, its room kept): the engine thread's
# step header, where a fresh bytes object's allocation, cold after a forward pass, costs ~6 us.
pack_into = _encoder.encode_into
unpack = msgspec.msgpack.Decoder().decode


def body_part(body: Body) -> bytes:
    """A built record body as one frame part: its kind's name and its fields (MessagePack: data only)."""
    return pack((BODY_NAMES[type(body)], body))


def body_from_part(part) -> Body:
    """The body `body_part` packed, typed again."""
    return body_of(*unpack(part))


def _encoded_ids(ids: list[str]) -> msgspec.Raw:
    return msgspec.Raw(pack(ids))


# RepeatedIds() -> ids: a batch's request ids, encoded only when they change (a decoding batch keeps
# them step after step): `ids(req_ids, n)` is the MessagePack of `req_ids[:n]` as a `msgspec.Raw`,
# the last one again when those ids are the last call's, compared without a slice (compiled).
RepeatedIds = functools.partial(_hotpath.RepeatedIds, _encoded_ids)


# -- the step input ----------------------------------------------------------------------------------
# scheduler_fields(scheduler_output, cached_ids=None) -> tuple: the SchedulerOutput fields a
# StepInput is built from, as MessagePack encodes them, the lists themselves (one compiled call on
# the engine thread: 6 us of a cold step in Python). Encoded with the step's frame header by the end
# of the step, not later: the runner adopts some of the block-id lists as request state and extends
# them in place on later steps. `cached_ids` (a `RepeatedIds`) encodes the cached requests' ids
# ahead. The tokens scheduled per request go as a list aligned with the cached requests when they
# name exactly those, in their order, and none is new (most steps): their ids are not encoded twice.
# The fields' order is `_read_payload`'s.
scheduler_fields = _hotpath.scheduler_fields


# The recorder's reading of a payload: the batch's ids and tokens per request stay encoded (a batch
# seen before is looked up whole: `capture.RequestIndex.batch`, `_scheduled_column`).
_read_payload = msgspec.msgpack.Decoder(
    tuple[list, msgspec.Raw, list, list, list, msgspec.Raw, list, list, list, list]
).decode
_last_scheduled: tuple[bytes, bytes, bytes] = (b"", b"", b"")


def _scheduled_column(req_ids: bytes, num_scheduled: bytes) -> bytes:
    """The tokens scheduled per cached request, packed, of a dict by id or a list aligned with
    the cached requests (`scheduler_fields`): the last step's when its ids and counts were these
    (every request decoding one token, say)."""
    global _last_scheduled
    ids, counts, column = _last_scheduled
    if ids != req_ids or counts != num_scheduled:
        found = unpack(num_scheduled)
        column = pack_i32(found if isinstance(found, list) else [found.get(r, 0) for r in unpack(req_ids)])
        _last_scheduled = (req_ids, num_scheduled, column)
    return column


def step_input_record(payload, index, chains: PrefixChains | None = None, in_flight: int | None = None) -> dict:
    """The StepInput record of encoded `scheduler_fields` (the recorder's share); `index` gives the
    requests their dense indices, in the order the step names them; `chains`, the new requests'
    prefix chains (None until the rank's groups are known: not recorded); `in_flight`, the steps the
    engine core had in flight when it scheduled this one (None: not said)."""
    new, ids, resumed_ids, new_block_ids, computed, counts, finished, preempted, zero, copies = _read_payload(payload)
    ids, counts = bytes(ids), bytes(counts)
    num_scheduled = unpack(counts) if new else {}
    new_reqs = [
        records.new_request(
            index(req_id),
            req_id,
            blocks,
            num_computed,
            len(prompt) >> 2,
            num_scheduled.get(req_id, 0),
            chains(unpack_i32(prompt), extras) if chains is not None and prompt else None,
        )
        for req_id, blocks, num_computed, prompt, extras in new
    ]
    indices, packed = index.batch(ids)
    resumed = {index(r) for r in resumed_ids}
    if len(new_block_ids) != len(indices):
        raise ValueError(f"{len(new_block_ids)} new block lists for {len(indices)} cached requests")
    # Only requests that got blocks (a few per step) are visited; a resumed request's blocks replace
    # its row, so its groups count even when empty.
    got = compress(range(len(indices)), map(is_not, new_block_ids, repeat(None)))
    appends = [
        (indices[k], group, blocks)
        for k in got
        for group, blocks in enumerate(new_block_ids[k])
        if blocks or indices[k] in resumed
    ]
    finished = sorted(finished)
    for req_id in finished:
        index.forget(req_id)
    return records.step_input(
        new_reqs=new_reqs,
        cached_columns=(packed, computed, _scheduled_column(ids, counts)),
        resumed=[i for i in indices if i in resumed] if resumed else [],
        appends=appends,
        finished=finished,
        preempted=sorted(preempted),
        blocks_to_zero=zero,
        block_copies=copies,
        in_flight_steps=in_flight,
    )
