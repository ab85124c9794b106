"""The file ledger (schemas/files.py): layout, rotation, and reading what a crash or a disk left behind.

`read_segment` must never raise: whatever it cannot read becomes a
ReadProblem whose events_read equals the number of events it yielded.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.producer.sinks import FILE_LINGER_S
from kvledger.schemas.files import (
    DEFLATE_LEVEL,
    EndMarker,
    LedgerPathError,
    ReadProblem,
    SegmentWriter,
    discover,
    rank_dir,
    read_end_marker,
    read_segment,
    read_stream,
)
from kvledger.schemas.kinds import ReadFailure, Unchecked
from kvledger.stream_app.replay import replay
from tests.synthetic.engine import SimConfig, simulate

BATCH = 5


@pytest.fixture(scope="module")
def events() -> list[dict]:
    return simulate(SimConfig(seed=1, steps=40, snapshot_interval=10, health_interval=10, dummy_every=7)).events


def write(root, events, engine_id="eng", dp=0, tp=0, pp=0, incarnation=7, batch=BATCH, **kw) -> None:
    writer = SegmentWriter(root, engine_id, dp, tp, pp, incarnation, **kw)
    for i in range(0, len(events), batch):
        writer.write(events[i : i + batch])
    writer.close()


def of_rank(events: list[dict], engine_id: str, dp: int = 0, tp: int = 0, pp: int = 0) -> list[dict]:
    """`events` as the rank's own writer records them: discovery reads a stream as its events name it."""
    return [{**e, "engine_id": engine_id, "dp_rank": dp, "tp_rank": tp, "pp_rank": pp} for e in events]


def read_all(paths) -> tuple[list[dict], list[ReadProblem]]:
    problems: list[ReadProblem] = []
    out = [e for p in paths for e in read_segment(p, problems)]
    return out, problems


def read_one(path) -> tuple[list[dict], list[ReadProblem]]:
    return read_all([path])


def block_ends(path: Path) -> list[int]:
    """File offsets just after each sync marker: the end of the header, then of every block."""
    data = path.read_bytes()
    with open(path, "rb") as fo:
        sync = fastavro.reader(fo)._header["sync"]
    ends, i = [], 0
    while (i := data.find(sync, i)) != -1:
        ends.append(i + len(sync))
        i += len(sync)
    return ends


def header_size(tmp_path: Path, events) -> int:
    write(tmp_path / "probe", events[:1])
    [stream] = discover(tmp_path / "probe")
    return block_ends(stream.segments[0])[0]


# -- layout and rotation -----------------------------------------------------------------------


def test_layout(tmp_path, events):
    own = [{**e, "engine_id": "e1", "dp_rank": 2, "tp_rank": 1, "pp_rank": 3} for e in events]
    write(tmp_path, own, engine_id="e1", dp=2, tp=1, pp=3, incarnation=42)
    assert (tmp_path / "e1" / "dp2-tp1-pp3" / "42-000001.avro").is_file()
    assert rank_dir(tmp_path, "e1", 2, 1, 3) == tmp_path / "e1" / "dp2-tp1-pp3"
    [stream] = discover(tmp_path)
    assert stream.identity == ("e1", 2, 1, 3) and stream.laid_out_as is None


def test_a_directory_renamed_holds_the_stream_its_events_name(tmp_path, events):
    """Events under directories that name another engine and rank (renamed, copied) are read as theirs."""
    write(tmp_path, events, engine_id="e1", dp=2, tp=1, pp=3, incarnation=42)
    first = events[0]
    told = (first["engine_id"], first["dp_rank"], first["tp_rank"], first["pp_rank"])
    for path in (tmp_path, tmp_path / "e1", tmp_path / "e1" / "dp2-tp1-pp3" / "42-000001.avro"):
        [stream] = discover(path)
        assert stream.identity == told != ("e1", 2, 1, 3), path
        assert stream.laid_out_as == ("e1", 2, 1, 3), path


def test_blocks_are_deflated_at_the_writers_level_and_read_back_whole(tmp_path, events):
    sizes = {}
    for level in (None, 9, DEFLATE_LEVEL, 1):
        root = tmp_path / f"level-{level}"
        kw = {} if level is None else {"compression_level": level}
        write(root, events, batch=len(events), **kw)  # one block: the sizes differ by the codec's level only
        [stream] = discover(root)
        got, problems = read_all(stream.segments)
        assert problems == [] and got == events
        sizes[level] = sum(p.stat().st_size for p in stream.segments)
    assert sizes[None] == sizes[DEFLATE_LEVEL]  # the default
    assert sizes[9] < sizes[DEFLATE_LEVEL] < sizes[1], sizes


@pytest.mark.parametrize("codec", ["deflate", "null"])
def test_rotation_by_size_loses_nothing_and_keeps_order(tmp_path, events, codec):
    limit = header_size(tmp_path, events) + 1500
    write(tmp_path / "ledger", events, max_segment_bytes=limit, codec=codec)
    [stream] = discover(tmp_path / "ledger")
    assert len(stream.segments) >= 4
    assert [p.name for p in stream.segments[:2]] == ["7-000001.avro", "7-000002.avro"]
    got, problems = read_all(stream.segments)
    assert problems == []
    assert got == events


def test_segments_sort_numerically(tmp_path, events):
    """Segment 10 after segment 9, incarnation 10 after incarnation 9."""
    write(tmp_path, events[:12], incarnation=9, batch=1, max_segment_bytes=1)
    write(tmp_path, events[12:20], incarnation=10, batch=1, max_segment_bytes=1)
    [stream] = discover(tmp_path)
    got, problems = read_all(stream.segments)
    assert problems == []
    assert got == events[:20]
    names = [p.name for p in stream.segments]
    assert names.index("9-000010.avro") == names.index("9-000009.avro") + 1
    assert names.index("10-000001.avro") > names.index("9-000012.avro")


def test_several_ranks_and_engines(tmp_path, events):
    write(tmp_path, of_rank(events, "a"), engine_id="a", tp=0)
    write(tmp_path, of_rank(events[:10], "a", tp=1), engine_id="a", tp=1)
    write(tmp_path, of_rank(events[:3], "b", dp=1), engine_id="b", dp=1)
    streams = discover(tmp_path)
    assert [(s.engine_id, s.dp, s.tp, s.pp) for s in streams] == [
        ("a", 0, 0, 0),
        ("a", 0, 1, 0),
        ("b", 1, 0, 0),
    ]
    assert [len(read_all(s.segments)[0]) for s in streams] == [len(events), 10, 3]


@pytest.mark.parametrize(
    "engine_id",
    ["prefill/node-1", "decode node 2", "a/b c/../d", "100%/x", "%2F", "décode-ü", " lead and trail "],
)
def test_engine_ids_survive_the_directory_layout(tmp_path, events, engine_id):
    own = of_rank(events[:4], engine_id)
    write(tmp_path, own, engine_id=engine_id)
    write(tmp_path, of_rank(events[:2], "other"), engine_id="other")
    assert len([p for p in tmp_path.iterdir()]) == 2, "one directory per engine, nothing nested"
    streams = {s.engine_id: s for s in discover(tmp_path)}
    assert set(streams) == {engine_id, "other"}
    assert all(s.laid_out_as is None for s in streams.values())  # the layout names what the events do
    assert read_all(streams[engine_id].segments) == (own, [])


@pytest.mark.parametrize("engine_id", [".", ".."])
def test_dot_engine_ids_stay_inside_the_root(tmp_path, events, engine_id):
    root = tmp_path / "ledger"
    write(root, of_rank(events[:2], engine_id), engine_id=engine_id)
    assert [(s.engine_id, s.laid_out_as) for s in discover(root)] == [(engine_id, None)]


def test_negative_incarnation_is_not_skipped_silently(tmp_path, events):
    try:
        write(tmp_path, events[:2], incarnation=-5)
    except ValueError:
        return  # rejecting it up front is fine too
    assert sum(len(s.segments) for s in discover(tmp_path)) == 1


def test_discover_single_file_flat_directory_and_missing_root(tmp_path, events):
    write(tmp_path / "ledger", events[:3])
    [stream] = discover(tmp_path / "ledger")
    [segment] = stream.segments
    [single] = discover(segment)
    rank = (stream.engine_id, stream.dp, stream.tp, stream.pp)
    assert single.segments == [segment] and (single.engine_id, single.dp, single.tp, single.pp) == rank
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "x.avro").write_bytes(segment.read_bytes())
    (flat / "y.avro").write_bytes(segment.read_bytes())
    found = discover(flat)
    assert [len(s.segments) for s in found] == [1, 1]
    first = read_one(segment)[0][0]  # outside the layout, a segment names its rank by its first event
    recorded = (first["engine_id"], first["dp_rank"], first["tp_rank"], first["pp_rank"])
    assert [(s.engine_id, s.dp, s.tp, s.pp) for s in found] == [recorded, recorded]
    with pytest.raises(LedgerPathError):
        discover(tmp_path / "nope")


# -- damaged segments --------------------------------------------------------------------------


def test_truncated_last_segment(tmp_path, events):
    limit = header_size(tmp_path, events) + 3000
    write(tmp_path / "ledger", events, max_segment_bytes=limit)
    [stream] = discover(tmp_path / "ledger")
    *earlier, last = [s for s in stream.segments if len(read_one(s)[0])]
    before, _ = read_all(earlier)
    full, _ = read_one(last)
    ends = block_ends(last)
    assert len(ends) >= 3, "header + at least two blocks"
    data = last.read_bytes()
    complete = (len(ends) - 2) * BATCH  # events in the blocks before the last one (all full)
    assert complete < len(full) <= complete + BATCH
    start, stop = ends[-2], ends[-1]
    for cut in sorted({start + 1, start + 7, (start + stop) // 2, stop - 20, stop - 16, stop - 1}):
        last.write_bytes(data[:cut])
        got, problems = read_all([*earlier, last])
        [problem] = problems
        assert problem.reason in ("truncated", "corrupt"), problem
        assert problem.path == str(last)
        assert problem.events_read == len(got) - len(before)
        assert got == events[: len(got)], "only whole, correct events come out"
        # a block counts only once it is whole, sync marker included
        assert len(got) - len(before) == complete, cut
    last.write_bytes(data)
    assert read_all(stream.segments) == (before + full, [])


def test_truncated_inside_the_header_is_not_avro(tmp_path, events):
    write(tmp_path, events[:5])
    [stream] = discover(tmp_path)
    path = stream.segments[0]
    header_end = block_ends(path)[0]
    data = path.read_bytes()
    for cut in (3, 4, 50, header_end // 2, header_end - 1):
        path.write_bytes(data[:cut])
        got, problems = read_one(path)
        assert got == []
        assert [(p.reason, p.events_read) for p in problems] == [("not_avro", 0)], cut


def test_non_avro_file(tmp_path):
    path = tmp_path / "1-000001.avro"
    path.write_text('{"engine_id": "e", "seq": 0}\n' * 20)
    assert [(p.reason, p.events_read) for p in read_one(path)[1]] == [("not_avro", 0)]
    path.write_bytes(b"Obj\x01" + b"\xff" * 200)  # the Avro magic, garbage after it
    assert [(p.reason, p.events_read) for p in read_one(path)[1]] == [("not_avro", 0)]


def test_empty_file(tmp_path):
    path = tmp_path / "1-000001.avro"
    path.write_bytes(b"")
    got, problems = read_one(path)
    assert got == []
    assert [(p.reason, p.events_read) for p in problems] == [(ReadFailure.EMPTY, 0)]
    assert problems[0].reason.unchecked == Unchecked.EMPTY_FILE == "empty_file"


def test_header_only_segment_is_fine(tmp_path, events):
    """A writer killed right after rotating leaves a segment with a header and no block."""
    write(tmp_path, events[:5], max_segment_bytes=1)
    [stream] = discover(tmp_path)
    assert len(stream.segments) == 2
    assert read_one(stream.segments[1]) == ([], [])


@pytest.mark.parametrize("codec", ["deflate", "null"])
@pytest.mark.parametrize(
    "fill",
    [
        "zeros",
        "random",
        "ones",
    ],
)
def test_garbage_block_in_the_middle(tmp_path, events, codec, fill):
    write(tmp_path, events[:40], codec=codec)
    [stream] = discover(tmp_path)
    path = stream.segments[0]
    ends = block_ends(path)
    data = bytearray(path.read_bytes())
    k = 3  # blocks 0..2 stay intact; block 3 spans ends[3]..ends[4]
    size = ends[k + 1] - ends[k]
    garbage = {
        "zeros": bytes(size),
        "ones": b"\xff" * size,
        "random": bytes((i * 167 + 13) % 256 for i in range(size)),
    }[fill]
    data[ends[k] : ends[k + 1]] = garbage
    path.write_bytes(bytes(data))
    got, problems = read_one(path)
    [problem] = problems
    assert problem.reason in ("truncated", "corrupt")
    assert problem.events_read == len(got)
    assert k * BATCH <= len(got) < 40
    assert got[: k * BATCH] == events[: k * BATCH]


def test_unreadable_paths_are_problems_not_exceptions(tmp_path):
    for path in (tmp_path / "missing.avro", tmp_path):
        got, problems = read_one(path)
        assert got == []
        assert len(problems) == 1 and problems[0].events_read == 0


@pytest.fixture(scope="module")
def small_segment(tmp_path_factory, events) -> bytes:
    root = tmp_path_factory.mktemp("fuzz")
    write(root, events[:12], batch=3, codec="null")
    [stream] = discover(root)
    return stream.segments[0].read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_read_segment_never_raises(tmp_path, small_segment, events, data):
    blob = bytearray(small_segment)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at : at + 4] = data.draw(st.binary(min_size=1, max_size=4))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    path = tmp_path / "fuzz.avro"
    path.write_bytes(bytes(blob))
    got, problems = read_one(path)  # must not raise
    assert len(problems) <= 1
    if problems:
        assert problems[0].events_read == len(got)
        assert isinstance(problems[0].reason, ReadFailure)


# -- torn tails and shutdown -------------------------------------------------------------------


def block_events(path: Path) -> list[tuple[int, int]]:
    """(end offset, events so far) after the header and after every block of a segment."""
    with open(path, "rb") as fo:
        blocks = fastavro.block_reader(fo)
        out, total = [(fo.tell(), 0)], 0
        for block in blocks:
            total += block.num_records
            out.append((block.offset + block.size, total))
    return out


def cut_offsets(ends: list[int], size: int, n: int = 150) -> list[int]:
    """Every offset around each block boundary (a cut in the count, the size, the sync marker),
    and `n` more spread over the rest."""
    near = {c for end in ends for c in range(end - 17, end + 6)}
    spread = set(range(ends[0], size, max(1, (size - ends[0]) // n)))
    return sorted(c for c in near | spread if ends[0] <= c < size)


@pytest.mark.parametrize("codec", ["deflate", "null"])
def test_a_segment_cut_anywhere_keeps_every_whole_block_and_is_truncated(tmp_path, events, codec):
    """A writer killed mid-write: the cut tail is `truncated`, never `corrupt`, and every whole
    block before the cut is read back, wherever the cut falls after the header."""
    write(tmp_path / "ledger", events, codec=codec)
    [stream] = discover(tmp_path / "ledger")
    [path] = stream.segments
    data = path.read_bytes()
    ends = block_events(path)
    assert len(ends) > 6, "several blocks"
    cut_path = tmp_path / "cut" / path.name
    cut_path.parent.mkdir()
    whole = dict(ends)
    cuts = cut_offsets(list(whole), len(data))
    for cut in cuts:
        cut_path.write_bytes(data[:cut])
        got, problems = read_one(cut_path)
        kept = max(n for end, n in ends if end <= cut)
        assert got == events[:kept], cut
        if cut in whole:
            assert problems == [], cut
        else:
            [problem] = problems
            assert (problem.reason, problem.events_read) == ("truncated", kept), (cut, problem)
            assert "torn last block" in problem.detail
    assert len(cuts) > 300


def test_a_torn_last_block_in_a_replay_is_counted_and_keeps_the_rest(tmp_path, events):
    write(tmp_path / "ledger", events)
    [stream] = discover(tmp_path / "ledger")
    [path] = stream.segments
    data = path.read_bytes()
    end, kept = block_events(path)[-2]
    path.write_bytes(data[: end + (len(data) - end) // 2])
    result = replay(tmp_path / "ledger")
    summary = result.summary()
    assert result.ledger.events == kept and result.violations == []
    assert [(p["reason"], p["events_read"]) for p in summary["problems"]] == [("truncated", kept)]
    assert summary["unchecked"]["truncated_file"] == 1


def test_a_corrupt_block_before_whole_blocks_is_corrupt_not_truncated(tmp_path, events):
    write(tmp_path, events[:40], codec="null")
    [stream] = discover(tmp_path)
    path = stream.segments[0]
    ends = block_ends(path)
    data = bytearray(path.read_bytes())
    data[ends[2] : ends[2] + 2] = b"\x01\x7f"  # block 2's count and size are garbage; blocks 3... are whole
    path.write_bytes(bytes(data))
    got, problems = read_one(path)
    assert [p.reason for p in problems] == ["corrupt"] and got == events[: 2 * BATCH]


def test_the_end_marker_tells_a_closed_or_idle_stream_from_a_killed_one(tmp_path, events):
    root = tmp_path / "ledger"
    writer = SegmentWriter(root, "eng", 0, 0, 0, 3, flush_interval=0.0)
    [marker] = root.glob("eng/dp0-tp0-pp0/3.end")
    assert read_end_marker(marker) == EndMarker(-1, False)
    writer.write(events[:10])
    # Every block is in the file, but the writer never said the stream ends there: killed while busy.
    [stream] = discover(root)
    got, problems = read_stream_all(stream)
    assert got == events[:10]
    [problem] = problems
    assert (problem.reason, problem.events_read) == ("truncated", 10) and "confirmation" in problem.detail
    writer.confirm()  # idle: the file holds everything
    assert read_end_marker(marker) == EndMarker(events[9]["seq"], False)
    assert read_stream_all(stream) == (events[:10], [])
    writer.write(events[10:20])
    assert [p.reason for p in read_stream_all(stream)[1]] == ["truncated"]
    writer.close()
    assert read_end_marker(marker) == EndMarker(events[19]["seq"], True)
    assert read_stream_all(stream) == (events[:20], [])


def test_the_end_marker_follows_rotation_and_incarnations(tmp_path, events):
    root = tmp_path / "ledger"
    write(root, events[:12], incarnation=1, max_segment_bytes=1)  # closed, one segment per write
    killed = SegmentWriter(root, "eng", 0, 0, 0, 2, max_segment_bytes=1)
    killed.write(events[:5])  # rotated: the newest segment holds only a header
    [stream] = discover(root)
    got, problems = read_stream_all(stream)
    assert got == events[:12] + events[:5]
    [problem] = problems
    assert problem.reason == "truncated" and problem.path == str(stream.segments[-1])
    assert problem.events_read == 5  # of the incarnation
    assert Path(problem.path).name.startswith("2-")


def test_a_stream_without_end_marker_is_read_as_it_is(tmp_path, events):
    """Segments written by other tools (or an older writer) have no marker: no judgement."""
    write(tmp_path / "ledger", events[:10])
    [stream] = discover(tmp_path / "ledger")
    for marker in (tmp_path / "ledger").rglob("*.end"):
        marker.unlink()
    assert read_stream_all(stream) == (events[:10], [])


def read_stream_all(stream) -> tuple[list[dict], list[ReadProblem]]:
    problems: list[ReadProblem] = []
    return list(read_stream(stream, problems)), problems


# A producer process tracing a synthetic engine to a file ledger, one step every PACE seconds,
# with the plugin's signal handlers chained in front of the default ones; idle at the end.
WRITER = """
import faulthandler, os, signal, sys, time
from kvledger.producer import plugin
from kvledger.producer.delivery import Delivery
from kvledger.producer.records import RankIdentity
from kvledger.producer.sinks import FileSink
from kvledger.schemas.events import body_of
from tests.synthetic.engine import SimConfig, simulate

faulthandler.enable()  # a SIGABRT from the test dumps every thread's stack, should it hang

bodies = [body_of(*e["body"]) for e in simulate(SimConfig(seed=2, steps=int(sys.argv[3]), snapshot_interval=50)).events]
recorder = Delivery(RankIdentity("killed", 0, 0, 0, 1), FileSink(sys.argv[1]))
probe = type("Probe", (), {"recorder": recorder})()
plugin._probes.append(probe)
# The handlers a process started from a terminal has: one started by a background job inherits
# SIGINT ignored, and the chained handler then rightly leaves it ignored after its flush.
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
for signum in (signal.SIGTERM, signal.SIGINT):
    plugin.chain_signal(signum)
print("BUSY", flush=True)
try:
    for body in bodies:
        recorder.capture(body)
        time.sleep(float(sys.argv[2]))
    print("IDLE", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    os._exit(130)  # no close: what the signal's flush wrote is all there is
"""
PACE = 0.003
# A busy rank's events are in the file within the sink's linger and a drain period (plus
# the time the drain thread takes); the assertion leaves room for a loaded machine.
LOSS_BOUND_S = FILE_LINGER_S + 0.05
BOUND_SLACK_S = 0.1


def kill_writer(root: Path, signum: int, *, when: str, steps: int = 300) -> tuple[int, float]:
    """Start the writer, send `signum` while it is busy (0.4 s in) or once idle; (exit status, kill time)."""
    stderr = root.parent / f"{root.name}.stderr"
    with stderr.open("w") as err:
        argv = [sys.executable, "-c", WRITER, str(root), str(PACE), str(steps)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout.readline().strip() == "BUSY"
        if when == "busy":
            time.sleep(0.4)
        else:
            assert proc.stdout.readline().strip() == "IDLE"
            time.sleep(0.1)
        killed_at = time.time()
        proc.send_signal(signum)
        try:
            return proc.wait(30), killed_at
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler: where each thread stands
            proc.wait(10)
            pytest.fail(f"the writer did not exit within 30 s of signal {signum}:\n{stderr.read_text()[-4000:]}")
    finally:
        proc.kill()
        proc.wait()


def newest_event_at(root: Path) -> float:
    [stream] = discover(root)
    return max(e["emitted_at_us"] for e in read_stream(stream, [])) / 1e6


def test_sigkill_of_a_busy_writer_loses_at_most_the_bound_and_says_so(tmp_path):
    status, killed_at = kill_writer(tmp_path, signal.SIGKILL, when="busy")
    assert status == -signal.SIGKILL
    lost_s = killed_at - newest_event_at(tmp_path)
    print(f"SIGKILL while busy: the newest event in the file is {lost_s * 1000:.0f} ms older than the kill")
    assert 0 <= lost_s <= LOSS_BOUND_S + BOUND_SLACK_S
    result = replay(tmp_path)
    [problem] = result.problems
    assert problem.reason == "truncated" and "confirmation" in problem.detail, problem  # never corrupt
    assert result.violations == [] and result.unchecked["truncated_file"] == 1
    assert result.ledger.events > 0.4 / PACE / 3  # most of the 0.4 s of steps (the machine may be slow)


def test_sigkill_of_an_idle_writer_loses_nothing(tmp_path):
    status, _ = kill_writer(tmp_path, signal.SIGKILL, when="idle", steps=60)
    assert status == -signal.SIGKILL
    result = replay(tmp_path)
    assert result.problems == [] and not result.unchecked and result.violations == []
    assert result.ledger.steps == 60


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_sigterm_and_sigint_flush_everything_then_run_the_handler_before_ours(tmp_path, signum, status):
    """The chained handler flushes, then the previous one acts: the default SIGTERM kills the
    process, Python's SIGINT raises KeyboardInterrupt (the writer then exits without a close)."""
    got, killed_at = kill_writer(tmp_path, signum, when="busy")
    assert got == status
    result = replay(tmp_path)
    assert result.problems == [] and not result.unchecked and result.violations == []
    assert killed_at - newest_event_at(tmp_path) <= PACE + BOUND_SLACK_S  # the step just before the signal
