"""Frames through the ring: the recorder rebuilds exactly the record the drain thread builds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvledger.producer import records
from kvledger.producer.capture import RequestIndex, StepCapture
from kvledger.producer.frames import (
    FrameKind,
    RepeatedIds,
    body_from_part,
    pack,
    pack_parts,
    prefix_max,
    read_frame,
    scheduler_fields,
    step_input_record,
    unpack_parts,
)
from kvledger.producer.ring import Ring
from kvledger.schemas.events import RankInfo
from kvledger.schemas.packing import pack_i32


def reference_step_input(so, index: RequestIndex) -> dict:
    """The StepInput record of a SchedulerOutput, built field by field as the probes first did:
    what the frames' columns must come back as."""
    num_scheduled = so.num_scheduled_tokens
    new_reqs = [
        records.new_request(
            index(r.req_id), r.req_id, blocks, r.num_computed_tokens, len(r.prompt_token_ids), num_scheduled[r.req_id]
        )
        for r in so.scheduled_new_reqs
        for blocks in [r.block_ids]
    ]
    cached = so.scheduled_cached_reqs
    indices = [index(r) for r in cached.req_ids]
    resumed = {index(r) for r in cached.resumed_req_ids}
    groups_of = cached.new_block_ids
    appends = [
        (i, group, blocks)
        for i, groups in zip(indices, groups_of, strict=True)
        if groups is not None
        for group, blocks in enumerate(groups)
        if blocks or i in resumed
    ]
    finished = sorted(so.finished_req_ids)
    for req_id in finished:
        index.forget(req_id)
    copies = [(c.src, c.dst) if hasattr(c, "src") else tuple(c) for c in so.kv_cache_block_copies]
    return records.step_input(
        new_reqs=new_reqs,
        cached=[
            (i, c, num_scheduled[r])
            for i, c, r in zip(indices, cached.num_computed_tokens, cached.req_ids, strict=True)
        ],
        resumed=[i for i in indices if i in resumed],
        appends=appends,
        finished=finished,
        preempted=sorted(so.preempted_req_ids),
        blocks_to_zero=so.new_block_ids_to_zero or (),
        block_copies=copies,
    )


def new_req(req_id: str, blocks: tuple[list[int], ...], computed: int = 0, prompt: int = 20):
    return SimpleNamespace(req_id=req_id, block_ids=blocks, num_computed_tokens=computed, prompt_token_ids=[1] * prompt)


def scheduler_output(step: int, admitting: bool = True):
    """SchedulerOutputs shaped as vLLM's: admissions, decodes with appends, a preemption, a resume,
    finished requests, blocks to zero and block copies, over two KV cache groups."""
    new = [new_req(f"r{step}-{i}", ([10 * step + i, 10 * step + i + 1], [500 + i]), computed=16 * i) for i in range(2)]
    new = new if admitting else []
    cached_ids = [f"r{s}-{i}" for s in range(step) for i in range(2)]
    new_blocks = [([7, 8], []) if k % 3 == 0 else None if k % 3 == 1 else ([], [9]) for k in range(len(cached_ids))]
    resumed = set(cached_ids[-1:]) if step == 3 else set()
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=cached_ids,
            resumed_req_ids=resumed,
            new_block_ids=new_blocks,
            num_computed_tokens=[30 + k for k in range(len(cached_ids))],
        ),
        num_scheduled_tokens={**{r.req_id: 20 for r in new}, **dict.fromkeys(cached_ids, 1)},
        finished_req_ids={"r0-0"} if step == 4 else set(),
        preempted_req_ids={"r1-1", "r1-0"} if step == 2 else set(),
        new_block_ids_to_zero=[3, 4] if step == 1 else None,
        kv_cache_block_copies=[(5, 6), SimpleNamespace(src=1, dst=2)] if step == 2 else (),
    )


def test_a_step_input_written_as_a_frame_reads_back_as_the_same_record(tmp_path):
    ring = Ring.create(tmp_path / "ring", 1 << 16)
    reader = Ring.attach(tmp_path / "ring")
    engine_index, drain_index = RequestIndex(), RequestIndex()
    for step in range(6):
        so = scheduler_output(step)
        expected = reference_step_input(so, drain_index)
        assert ring.write_frame(FrameKind.STEP, step, 1000 + step, [pack(scheduler_fields(so))])
        # The runner adopts block-id lists as request state and extends them in place later:
        # the frame holds them as they were when the step began.
        for r in so.scheduled_new_reqs:
            r.block_ids[0].append(999)
        [record] = list(reader.records())
        frame = read_frame(record)
        assert (frame.kind, frame.seq, frame.emitted_at_us) == (FrameKind.STEP, step, 1000 + step)
        assert step_input_record(frame.parts[0], engine_index) == expected, f"step {step}"
    assert engine_index._index == drain_index._index  # both gave out and forgot the same indices


def test_a_decoding_step_sends_its_counts_aligned_with_the_cached_requests_and_reads_back_the_same(tmp_path):
    # No new request and the counts naming the cached requests in their order: a list, not the ids
    # again; counts in another order (or naming a new request) stay a dict. Both read back alike.
    ring = Ring.create(tmp_path / "ring", 1 << 16)
    reader = Ring.attach(tmp_path / "ring")
    engine_index, drain_index = RequestIndex(), RequestIndex()
    for step, admitting, reordered in ((0, True, False), (3, True, False), (4, False, False), (5, False, True)):
        so = scheduler_output(step, admitting)
        if reordered:
            so.num_scheduled_tokens = dict(reversed(so.num_scheduled_tokens.items()))
        so.num_scheduled_tokens = {r: n + k for k, (r, n) in enumerate(so.num_scheduled_tokens.items())}
        expected = reference_step_input(so, drain_index)
        fields = scheduler_fields(so)
        aligned = not admitting and not reordered
        assert isinstance(fields[5], list) is aligned, f"step {step}"
        assert ring.write_frame(FrameKind.STEP, step, 0, [pack(fields)])
        [record] = list(reader.records())
        assert step_input_record(read_frame(record).parts[0], engine_index) == expected, f"step {step}"


def test_repeated_ids_are_encoded_once_and_again_when_they_change():
    ids = RepeatedIds()
    batch = [f"req-{i}" for i in range(64)]
    first = ids(batch)
    assert bytes(first) == pack(batch)
    assert ids(list(batch)) is first  # the same ids in a new list (the next step's): not encoded again
    batch[7] = "req-new"  # a request replaced in place: the copy kept is not the list changed
    assert bytes(ids(batch)) == pack(batch)
    assert bytes(ids(batch[:10])) == pack(batch[:10])
    # A prefix of a longer list (the runner's rows past the batch), compared without a slice.
    again = ids([*batch, "past-0", "past-1"], 10)
    assert bytes(again) == pack(batch[:10]) and ids(batch, 10) is again
    assert bytes(ids(tuple(batch), 3)) == pack(batch[:3])  # any sequence
    with pytest.raises(TypeError):
        ids(None)


def test_scheduler_fields_an_older_or_renaming_vllm_lacks_are_reported_missing_never_read_as_empty():
    so = scheduler_output(2)
    for name in ("preempted_req_ids", "new_block_ids_to_zero", "kv_cache_block_copies"):
        delattr(so, name)
    del so.scheduled_cached_reqs.resumed_req_ids
    del so.scheduled_new_reqs[1].prompt_token_ids
    missing: set[str] = set()
    fields = scheduler_fields(so, None, missing)
    assert missing == {
        "SchedulerOutput.preempted_req_ids",
        "SchedulerOutput.new_block_ids_to_zero",
        "SchedulerOutput.kv_cache_block_copies",
        "CachedRequestData.resumed_req_ids",
        "NewRequestData.prompt_token_ids",
    }
    # The frame still has its columns (the recorder reads ten); the caller declares them unavailable.
    assert fields[2] == fields[7] == fields[8] == fields[9] == ()
    # A new request's prompt goes as its token ids packed int32 (the recorder computes its prefix
    # chains), with its extra keys: () for none (a vLLM without the fields reads as none).
    assert fields[0] == [
        ("r2-0", so.scheduled_new_reqs[0].block_ids, 0, pack_i32(so.scheduled_new_reqs[0].prompt_token_ids), ()),
        ("r2-1", so.scheduled_new_reqs[1].block_ids, 16, b"", ()),
    ]
    assert fields[0][0][1] is so.scheduled_new_reqs[0].block_ids  # the list itself, encoded by the step's end
    # Without a set to report them in, an optional field missing fails as a required one does.
    for cached_ids in ((), (None,)):
        with pytest.raises(AttributeError, match="prompt_token_ids"):
            scheduler_fields(so, *cached_ids)
    with pytest.raises(TypeError, match="missing must be a set"):
        scheduler_fields(so, None, [])
    # Present but None or empty is no absence: nothing reported.
    full, missing = scheduler_output(1), set()
    full.preempted_req_ids = None
    assert scheduler_fields(full, None, missing)[7] == () and not missing
    assert pack(scheduler_fields(full, None, missing)) == pack(scheduler_fields(full)) and not missing
    # Block copies of either form; a field every vLLM has, missing, fails loudly (the probe goes quiet).
    so.kv_cache_block_copies = [(5, 6, "extra"), SimpleNamespace(src=1, dst=2)]
    assert scheduler_fields(so, None, set())[9] == [(5, 6), (1, 2)]
    del so.finished_req_ids
    with pytest.raises(AttributeError, match="finished_req_ids"):
        scheduler_fields(so, None, set())


def test_a_step_with_its_ids_encoded_ahead_is_the_same_frame(tmp_path):
    # The probe encodes the batch's ids once while they repeat: the frame's bytes, and so the
    # record the recorder builds, are those of the ids encoded with the rest of the header.
    cached_ids = RepeatedIds()
    for step in range(6):
        so = scheduler_output(step)
        assert pack(scheduler_fields(so, cached_ids)) == pack(scheduler_fields(so)), f"step {step}"
        assert pack(scheduler_fields(so, cached_ids)) == pack(scheduler_fields(so)), f"step {step}, again"


def test_frames_carry_any_mix_of_buffers(tmp_path):
    ring = Ring.create(tmp_path / "ring", 4096)
    parts = [b"abc", np.arange(5, dtype=np.int64), np.zeros(0, np.int32), np.array([-1, 7], np.int32)]
    assert ring.write_frame(FrameKind.STEP, 9, 10, parts)
    [record] = list(ring.records())
    frame = read_frame(record)
    assert bytes(frame.parts[0]) == b"abc" and frame.parts[1].tolist() == [0, 1, 2, 3, 4]
    assert frame.parts[2].size == 0 and frame.parts[3].tolist() == [-1, 7]


def test_parts_of_other_widths_are_widened_and_strided_views_copied(tmp_path):
    ring = Ring.create(tmp_path / "ring", 4096)
    rows = np.arange(12, dtype=np.int32).reshape(3, 4)
    parts = [np.array([3, 65535], np.uint16), rows[:, :2], np.array([True, False]), bytearray(b"xy")]
    assert ring.write_frame(FrameKind.STEP, 1, 2, parts)
    frame = read_frame(next(ring.records()))
    assert frame.parts[0].dtype == np.int64 and frame.parts[0].tolist() == [3, 65535]
    assert frame.parts[1].dtype == np.int32 and frame.parts[1].tolist() == [0, 1, 4, 5, 8, 9]
    assert frame.parts[2].tolist() == [1, 0] and bytes(frame.parts[3]) == b"xy"
    # Alone, a column slice is copied row by row in the compiled call; a transposed view (rows not
    # contiguous) is made contiguous first.
    assert ring.write_frame(FrameKind.STEP, 2, 3, [rows[:, 1:3]])
    assert ring.write_frame(FrameKind.STEP, 3, 4, [rows.T])
    frames = [read_frame(r).parts[0].tolist() for r in ring.records()]  # the first frame still unread
    assert frames[1:] == [[1, 2, 5, 6, 9, 10], rows.T.ravel().tolist()]


def test_prefixes_and_blocks_are_copied_without_slicing_into_frames_and_packed_parts(tmp_path):
    """What a CPU engine's plan capture hands over: prefixes of persistent buffers, the top-left
    block of a block table (its rows far longer than what they hold), gathered into one part."""
    table = np.arange(40, dtype=np.int32).reshape(5, 8)
    slots, lens = np.arange(100, 120, dtype=np.int64), np.array([3, 1, 2, 9, 9], np.int32)
    width = prefix_max(lens, 3)
    specs = [(slots, 4), (table, 3, width), (lens, 3), b"hdr", (table, 0, 0), (slots, 0)]
    expected = [[100, 101, 102, 103], [0, 1, 2, 8, 9, 10, 16, 17, 18], [3, 1, 2], list(b"hdr"), [], []]
    packed = unpack_parts(pack_parts(specs))
    assert width == 3 and [p.tolist() for p in packed] == expected
    assert [p.dtype for p in packed[:3]] == [np.int64, np.int32, np.int32]
    ring = Ring.create(tmp_path / "ring", 4096)
    assert ring.write_frame(FrameKind.STEP, 1, 2, [*specs, pack_parts(specs)])
    frame = read_frame(next(ring.records()))
    assert [p.tolist() for p in frame.parts[:6]] == expected
    assert [p.tolist() for p in unpack_parts(frame.parts[6])] == expected  # a part of parts
    # A list among a frame's parts is that part of parts, packed in place: the same parts back.
    assert ring.write_frame(FrameKind.STEP, 2, 3, [b"head", specs, [], (slots, 2), [(lens, 2)]])
    frame = read_frame(list(ring.records())[-1])
    assert bytes(frame.parts[0]) == b"head" and frame.parts[3].tolist() == [100, 101]
    assert [p.tolist() for p in unpack_parts(frame.parts[1])] == expected
    assert unpack_parts(frame.parts[2]) == [] and [p.tolist() for p in unpack_parts(frame.parts[4])] == [[3, 1]]
    with pytest.raises(ValueError):  # a bad part inside fails the whole frame, nothing written
        ring.write_frame(FrameKind.STEP, 3, 4, [b"head", [(slots, 999)]])
    # Another width is widened, a strided source copied: the slow path, same result.
    odd = [(np.array([5, 6, 7], np.uint16), 2), (table[:, ::2], 2, 3), (table[:, 0], 3)]
    assert [p.tolist() for p in unpack_parts(pack_parts(odd))] == [[5, 6], [0, 2, 4, 8, 10, 12], [0, 8, 16]]
    assert prefix_max(lens, 0) == 0 and prefix_max(lens.astype(np.int64), 5) == 9
    assert prefix_max(np.array([3, 7, 9], np.uint16), 2) == 7  # another width: numpy's reduction
    # A block given its rows' lengths is as wide as the longest of them (the plan's rows), in the
    # compiled call or, for a source it refuses, through the converter.
    by_lens = [(table, 3, lens), (table, 3, lens.astype(np.int64)), (table, 0, lens), (table[:, ::2], 2, lens)]
    blocks = [p.tolist() for p in unpack_parts(pack_parts(by_lens))]
    assert blocks == [expected[1], expected[1], [], [0, 2, 4, 8, 10, 12]]
    with pytest.raises(ValueError):  # lengths wider than the table
        pack_parts([(table, 4, lens)])


def test_a_prefix_past_its_array_is_refused():
    table = np.zeros((2, 3), np.int32)
    for spec in [(table, 3, 1), (table, 1, 4), (np.zeros(3, np.int64), 4), (np.zeros(3, np.int64), -1), (table, 1)]:
        with pytest.raises(ValueError):
            pack_parts([spec])
    with pytest.raises(ValueError):
        prefix_max(np.zeros(3, np.int32), 4)


def test_frames_wrap_and_a_full_ring_drops_them_counted(tmp_path):
    ring = Ring.create(tmp_path / "ring", 1024)
    sizes = [40, 100, 7, 0, 33]
    written = 0
    for seq in range(200):  # many laps: every frame crosses the end once in a while
        part = np.full(sizes[seq % 5], seq, np.int32)
        assert ring.write_frame(FrameKind.STEP, seq, seq, [b"h" * (seq % 9), part])
        written += 1
        if seq % 3 == 2:  # the consumer lags a little, then reads all
            for record in ring.records():
                frame = read_frame(record)
                assert frame.parts[1].tolist() == [frame.seq] * sizes[frame.seq % 5]
                assert bytes(frame.parts[0]) == b"h" * (frame.seq % 9)
    assert ring.published == written and ring.dropped == 0
    assert len(list(ring.records())) == 2  # the last two, still unread
    big = np.zeros(200, np.int32)
    accepted = [ring.write_frame(FrameKind.STEP, 1000 + k, 0, [big]) for k in range(10)]
    assert accepted[0] and not all(accepted) and ring.dropped == accepted.count(False)


def test_a_probe_reading_a_scheduler_output_without_a_field_declares_step_input_unavailable_and_counts_steps():
    """A field missing is an unavailable capability (a rename reads as nothing to zero or copy
    otherwise): `step_input` unavailable, naming the fields, announced ahead of the first step
    without them and again when another goes missing; every such step counted."""
    from kvledger.producer.config import TraceConfig
    from kvledger.producer.ring_writer import RingWriter
    from kvledger.producer.vllm_v1 import V1RunnerProbe

    runner = SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=None))
    probe = V1RunnerProbe(runner, TraceConfig(enabled=True, snapshot_interval=0))
    probe.unavailable, probe.connector_capabilities = {}, []  # as `attach` leaves them: every point found
    probe.recorder = RingWriter(records.RankIdentity("t", 0, 0, 0, 1), probe.config, spawn=False)
    probe._rank_info = lambda: records.rank_info(  # what `_rank_info` reads of vLLM is not here
        dp_size=1, tp_size=1, pp_size=1, kv_groups=[], vllm_version="x", runner="v1", capabilities=probe.capabilities()
    )
    try:
        for step in range(5):
            so = scheduler_output(step)
            if step >= 1:
                del so.kv_cache_block_copies  # a rename, say
            if step >= 3:
                del so.scheduled_cached_reqs.resumed_req_ids
            probe._before_step(so)
            probe._after_step()
        frames = [read_frame(bytes(r)) for r in probe.recorder.ring.records()]
    finally:
        probe.recorder.ring.close(unlink=True)
    assert [f.kind for f in frames] == [
        FrameKind.STEP,
        FrameKind.BODY,
        *[FrameKind.STEP] * 2,
        FrameKind.BODY,
        *[FrameKind.STEP] * 2,
    ]
    infos = [body_from_part(f.parts[0]) for f in frames if f.kind is FrameKind.BODY]
    assert [type(info) for info in infos] == [RankInfo] * 2
    [first], [then] = ([c for c in info.capabilities if c.name == "step_input"] for info in infos)
    assert first.available is False and "SchedulerOutput.kv_cache_block_copies" in first.reason
    assert "resumed_req_ids" not in first.reason
    assert then.available is False
    assert "CachedRequestData.resumed_req_ids, SchedulerOutput.kv_cache_block_copies" in then.reason
    assert probe.steps_missing_fields == 4
    assert probe.fields_missing == {"SchedulerOutput.kv_cache_block_copies", "CachedRequestData.resumed_req_ids"}
    # The steps are still recorded, with what could be read, and the recorder builds their records.
    steps = [f for f in frames if f.kind is FrameKind.STEP]
    assert [f.seq for f in steps] == [0, 2, 3, 5, 6]
    index = RequestIndex()
    built = [StepCapture.from_parts(f.parts).record(index, False) for f in steps]
    assert [b.step for b in built] == [0, 1, 2, 3, 4]
