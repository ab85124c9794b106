"""File-sink retention: the `kv_trace` keys, cutting segments at snapshots, deleting the oldest,
and readers that take a ledger whose beginning is gone for what it is (joined mid-stream).

Ledgers are recorded from the synthetic engine with tiny segments, so a few hundred steps
rotate and retire many of them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from kvledger.producer.config import DEFAULT_SEGMENT_BYTES, TraceConfig, TraceConfigError
from kvledger.producer.delivery import Delivery
from kvledger.producer.records import RankIdentity
from kvledger.producer.sinks import FileSink, open_sink
from kvledger.schemas.events import body_of
from kvledger.schemas.files import (
    UNCUT_SEGMENT_FACTOR,
    Retention,
    SegmentWriter,
    discover,
    end_marker_path,
    list_segments,
    rank_dir,
    read_segment,
    read_stream,
    segment_order,
)
from kvledger.schemas.registry import RANK_INFO, SNAPSHOT
from kvledger.stream_app.replay import replay
from tests.synthetic.engine import GroupSpec, SimConfig, simulate
from tests.unit.test_cli import check_json

ENGINE = "ret-engine"
SEGMENT = 20_000  # a segment header alone is ~15 KB (the writer schema)
KEEP = 90_000
BATCH = 8


def sim_config(**overrides) -> SimConfig:
    base = dict(
        seed=21,
        engine_id=ENGINE,
        steps=400,
        groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 64)),
        num_blocks=160,
        max_num_seqs=12,
        max_batched_tokens=192,
        arrival_rate=0.6,
        dummy_every=50,
        snapshot_interval=20,
        health_interval=20,
    )
    base.update(overrides)
    return SimConfig(**base)


@pytest.fixture(scope="module")
def events() -> list[dict]:
    sim = simulate(sim_config())
    assert not sim.expected
    return sim.events


def record(
    root: Path, events: list[dict], retention: Retention, segment: int = SEGMENT, batch: int = BATCH, **kw
) -> tuple:
    """Write through a FileSink in drain-sized batches; (sink, bytes on disk after each write)."""
    sink = FileSink(root, max_segment_bytes=segment, flush_interval=0, retention=retention, **kw)
    totals = []
    for at in range(0, len(events), batch):
        sink.write(events[at : at + batch])
        totals.append(disk_usage(root))
    sink.close()
    return sink, totals


def disk_usage(root: Path) -> list[tuple[int, int]]:
    """(bytes of all segments, bytes of the newest) per rank directory."""
    out = []
    for stream in discover(root):
        sizes = [p.stat().st_size for p in stream.segments]
        out.append((sum(sizes), sizes[-1]))
    return out


LOST = "rank_records_lost"


def assert_joined_mid_stream(unchecked: dict, ranks: int = 1, *also: str) -> None:
    """Unchecked: each rank stream's start (its beginning was deleted), and what a resync leaves
    out (requests preempted when the snapshot was taken are not in it); nothing lost between."""
    assert unchecked["joined_mid_stream"] == ranks, unchecked
    assert set(unchecked) <= {"joined_mid_stream", "unknown_request", *also}, unchecked


def first_events(path: Path, n: int = 2) -> list[tuple[int, str]]:
    return [(e["seq"], e["body"][0]) for e in list(read_segment(path, []))[:n]]


# -- configuration ---------------------------------------------------------------------------------


def config(**keys) -> TraceConfig:
    return TraceConfig.from_additional_config({"kv_trace": {"enabled": True, "sink": "file:///tmp/kvl", **keys}})


def test_retention_is_off_by_default_and_segments_keep_their_size():
    sink = config().sink
    assert (sink.segment_bytes, sink.retain_bytes, sink.retain_hours) == (DEFAULT_SEGMENT_BYTES, 0, 0.0)
    assert open_sink(sink).retention is None


def test_retention_keys_reach_the_file_sink():
    spec = config(segment_bytes=1 << 20, retain_bytes=1 << 30, retain_hours=1.5).sink
    assert (spec.segment_bytes, spec.retain_bytes, spec.retain_hours) == (1 << 20, 1 << 30, 1.5)
    sink = open_sink(spec)
    assert sink.max_segment_bytes == 1 << 20
    assert sink.retention == Retention(max_bytes=1 << 30, max_age_s=1.5 * 3600)
    assert open_sink(config(retain_hours=2).sink).retention == Retention(max_age_s=7200.0)


@pytest.mark.parametrize(
    ("keys", "key"),
    [
        ({"retain_bytes": -1}, "retain_bytes"),
        ({"retain_bytes": "1GB"}, "retain_bytes"),
        ({"retain_bytes": True}, "retain_bytes"),
        ({"retain_bytes": 1.5e9}, "retain_bytes"),
        ({"retain_hours": -0.5}, "retain_hours"),
        ({"retain_hours": "24h"}, "retain_hours"),
        ({"retain_hours": False}, "retain_hours"),
        ({"retain_hours": float("nan")}, "retain_hours"),
        ({"segment_bytes": 0}, "segment_bytes"),
        ({"segment_bytes": True}, "segment_bytes"),
        ({"segment_bytes": "64MiB"}, "segment_bytes"),
        # A budget smaller than one segment would keep nothing but the segment being written.
        ({"retain_bytes": 1 << 20}, "retain_bytes"),
        ({"retain_bytes": 1 << 20, "segment_bytes": 2 << 20}, "retain_bytes"),
        # The oldest segment kept is replayable only from a snapshot.
        ({"retain_bytes": 1 << 30, "snapshot_interval": 0}, "retain_bytes"),
        ({"retain_hours": 1, "snapshot_interval": 0}, "retain_hours"),
        # Kafka's retention is the topic's.
        ({"sink": "kafka://broker:9092", "retain_bytes": 1 << 30}, "retain_bytes"),
        ({"sink": "kafka://broker:9092", "segment_bytes": 1 << 20}, "segment_bytes"),
    ],
)
def test_bad_retention_settings_name_their_key(keys, key):
    with pytest.raises(TraceConfigError, match=rf"^kv_trace\.{key}: "):
        config(**keys)


# -- cutting and deleting ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def retained(tmp_path_factory, events):
    root = tmp_path_factory.mktemp("retained")
    sink, totals = record(root, events, Retention(max_bytes=KEEP))
    return root, sink, totals


def test_what_is_kept_stays_under_the_budget_plus_the_segment_being_written(retained):
    _, sink, totals = retained
    assert sink.deleted_segments > 5 and sink.deleted_bytes > 5 * SEGMENT
    for [(total, newest)] in totals:
        assert total - newest <= KEEP
        assert newest <= UNCUT_SEGMENT_FACTOR * SEGMENT + 10_000  # one batch past the forced cut at most


def test_segments_are_cut_at_snapshots_and_the_oldest_kept_replays_on_its_own(retained):
    root, sink, _ = retained
    [stream] = discover(root)
    first = stream.segments[0]
    # Numbering tells what went: every segment before the first kept one.
    assert segment_order(first) == (1, sink.deleted_segments + 1)
    [(seq, name), (_, then)] = first_events(first)
    assert seq > 0 and (name, then) == (RANK_INFO, SNAPSHOT)
    # Every kept segment begins where a reader can resync (no segment outgrew the forced cut).
    assert all(first_events(p, 1)[0][1] == RANK_INFO for p in stream.segments)


def test_check_of_a_retained_ledger_is_silent_and_counts_it_joined_mid_stream(retained):
    root, _, _ = retained
    proc, violations, summary = check_json(root)
    assert proc.returncode == 0 and violations == [], violations[:3]
    assert_joined_mid_stream(summary["unchecked"])
    assert summary["problems"] == []
    # It resynced at the first event kept and checked everything after.
    assert summary["checks"]["resync"] >= 1 and summary["checks"]["write"] > 100


def test_one_big_batch_is_cut_at_its_snapshots_and_its_newest_events_are_kept(tmp_path, events):
    """A drain thread that fell behind hands the writer everything at once: the batch is still cut
    at its snapshots, and retention keeps the newest finished segment whatever its size (it once
    deleted a whole stream: one uncut segment over the budget, rotated, then deleted)."""
    sink, totals = record(tmp_path, events, Retention(max_bytes=KEEP), batch=len(events))
    [stream] = discover(tmp_path)
    assert sink.deleted_segments > 0 and len(stream.segments) >= 2
    assert all(first_events(p, 1)[0][1] == RANK_INFO for p in stream.segments)
    [[(total, newest)]] = totals
    assert total - newest <= KEEP
    result = replay(tmp_path)
    assert result.violations == [] and result.problems == []
    assert result.ledger.coverage.checks["write"] > 100
    assert_joined_mid_stream(result.unchecked)


def test_retention_off_rotates_by_size_as_before(tmp_path, events):
    FileSink(tmp_path, max_segment_bytes=SEGMENT, flush_interval=0).write(events)
    [stream] = discover(tmp_path)
    assert segment_order(stream.segments[0]) == (1, 1)
    assert [e for p in stream.segments for e in read_segment(p, [])] == events


def test_a_stream_without_snapshots_is_cut_at_the_forced_size_and_counted_unchecked(tmp_path):
    events = simulate(sim_config(snapshot_interval=0, steps=300)).events
    sink, totals = record(tmp_path, events, Retention(max_bytes=KEEP), segment=5_000)
    assert sink.deleted_segments > 0
    [stream] = discover(tmp_path)
    assert all(newest <= UNCUT_SEGMENT_FACTOR * 5_000 + 10_000 for [(_, newest)] in totals)
    assert first_events(stream.segments[0], 1)[0][1] != RANK_INFO  # cut mid-stream
    result = replay(tmp_path)
    assert result.violations == [] and result.problems == []
    unchecked = result.unchecked
    assert unchecked["joined_mid_stream"] == 1 and unchecked["after_gap"] > 0
    assert result.ledger.coverage.checks["write"] == 0  # nothing to resync from: nothing checked


def test_deletion_runs_on_the_drain_thread_and_logs_each_segment(tmp_path, events, caplog):
    sink = FileSink(tmp_path, max_segment_bytes=SEGMENT, retention=Retention(max_bytes=KEEP))
    identity = RankIdentity(ENGINE, 0, 0, 0, incarnation=5)
    recorder = Delivery(identity, sink, capacity=len(events) + 8, drain_interval=0.005)
    with caplog.at_level(logging.DEBUG, logger="kvledger.producer"):
        for event in events:
            recorder.capture(body_of(*event["body"]))
            if event["seq"] % 64 == 0:
                time.sleep(0.002)  # let the drain thread write in several batches
        recorder.close(step=len(events), timeout=120)  # a loaded machine: the drain may take a while
    deleted = [r for r in caplog.records if "retention deleted" in r.getMessage()]
    assert len(deleted) == sink.deleted_segments > 0
    assert {r.threadName for r in deleted} == {"kvledger-drain-tp0"}
    assert recorder.dropped == 0
    result = replay(tmp_path)
    assert result.violations == []
    assert_joined_mid_stream(result.unchecked)


def test_retention_spans_incarnations_oldest_first_and_drops_their_end_markers(tmp_path, events):
    record(tmp_path, events[: len(events) // 2], Retention())  # incarnation 1, then a restart
    directory = rank_dir(tmp_path, ENGINE, 0, 0, 0)
    assert end_marker_path(directory, 1).exists()
    # The newer incarnation alone holds more than the budget: the older one goes first, whole.
    record(tmp_path, [dict(e, incarnation=2) for e in events], Retention(max_bytes=KEEP))
    assert {segment_order(p)[0] for p in list_segments(directory)} == {2}
    assert not end_marker_path(directory, 1).exists() and end_marker_path(directory, 2).exists()
    _, violations, summary = check_json(tmp_path)
    assert violations == [] and summary["problems"] == []
    assert_joined_mid_stream(summary["unchecked"])


def test_retain_hours_deletes_by_mtime_never_the_newest_segments(tmp_path, events):
    writer = SegmentWriter(tmp_path, ENGINE, 0, 0, 0, 1, max_segment_bytes=SEGMENT, retention=Retention(max_age_s=3600))
    at = 0

    def write_until_rotated() -> None:
        nonlocal at
        segment = writer.segment
        while writer.segment == segment:
            writer.write(events[at : at + BATCH])
            at += BATCH

    for _ in range(6):
        write_until_rotated()
    assert writer.deleted_segments == 0  # all fresh
    two_hours_ago = time.time() - 7200
    aged = list_segments(writer.dir)
    for path in aged[:3]:
        os.utime(path, (two_hours_ago, two_hours_ago))
    write_until_rotated()
    assert writer.deleted_segments == 3 and list_segments(writer.dir)[0] == aged[3]
    # Everything old, the segment being written too: that one stays, and the one finished before it
    # (it holds the newest events; retention never leaves a stream with nothing to replay).
    for path in list_segments(writer.dir):
        os.utime(path, (two_hours_ago, two_hours_ago))
    newest_finished = list_segments(writer.dir)[-2]
    writer._retire()
    assert list_segments(writer.dir) == [newest_finished, writer.path]
    write_until_rotated()  # and the stream goes on from there
    writer.close()
    result = replay(tmp_path)
    assert result.violations == []
    assert_joined_mid_stream(result.unchecked)


# -- readers ---------------------------------------------------------------------------------------


def test_a_deleted_first_segment_and_a_stale_end_marker_are_not_problems(tmp_path, events):
    directory = rank_dir(tmp_path, ENGINE, 0, 0, 0)
    writer = SegmentWriter(tmp_path, ENGINE, 0, 0, 0, 2, max_segment_bytes=SEGMENT, retention=Retention())
    for at in range(0, len(events), BATCH):
        writer.write(events[at : at + BATCH])
    writer.close()
    end_marker_path(directory, 1).write_text('{"seq": 99, "closed": true}')  # an incarnation all gone
    for path in list_segments(directory)[:2]:  # what retention would do, from -000001 on
        path.unlink()
    proc, violations, summary = check_json(tmp_path)
    assert proc.returncode == 0 and violations == []
    assert summary["problems"] == []
    assert_joined_mid_stream(summary["unchecked"])


def test_a_segment_deleted_while_being_read_is_reported_deleted_not_corrupt(tmp_path, events):
    record(tmp_path, events, Retention(max_bytes=KEEP))
    [stream] = discover(tmp_path)
    stream.segments[0].unlink()  # listed, then retired by a live writer
    problems = []
    got = list(read_stream(stream, problems))
    assert got and [p.reason for p in problems] == ["deleted"]


def test_ranks_retained_to_different_points_are_compared_where_both_kept_steps(tmp_path):
    """Each rank's retention deletes on its own: one rank may keep steps its peers no longer hold.
    Before a rank's first kept step its records are lost, not missing: counted unchecked
    (`rank_records_lost`), never reported."""
    events = simulate(sim_config(tp_size=2, steps=300)).events
    record(tmp_path, events, Retention(max_bytes=KEEP))
    tp1 = list_segments(rank_dir(tmp_path, ENGINE, 0, 1, 0))
    tp1[0].unlink()  # tp1 lost one more segment than tp0
    result = replay(tmp_path)
    assert result.violations == [], result.violations[:3]
    assert_joined_mid_stream(result.unchecked, 2, LOST)
    assert result.unchecked[LOST] > 0
    checks = result.ledger.coverage.checks
    # Every step is compared; those only one rank kept count the other's records lost. Only the
    # lead's tables resync (the other rank is compared with them, not replayed).
    assert checks["resync"] == 1 and checks["rank_compare"] > 20
    assert result.unchecked[LOST] == 2 * checks["rank_compare"] - result.ledger.steps


def test_a_rank_that_kept_everything_is_aligned_with_one_that_did_not(tmp_path):
    events = simulate(sim_config(tp_size=2, steps=300)).events
    tp0 = [e for e in events if e["tp_rank"] == 0]
    tp1 = [e for e in events if e["tp_rank"] == 1]
    record(tmp_path, tp0, Retention())  # complete, from seq 0
    # tp1 keeps its last ~200 steps: its first kept step lies within the lead's comparison window
    # (Ledger.rank_window); a rank whose retention lost more than the window is read as missing.
    record(tmp_path, tp1, Retention(max_bytes=2 * KEEP))
    result = replay(tmp_path)
    assert result.violations == [], result.violations[:3]
    assert_joined_mid_stream(result.unchecked, 1, LOST)
    assert result.unchecked[LOST] > 0


def test_a_rank_that_really_started_late_is_still_missing(tmp_path):
    """Lost records are those of a stream whose beginning is gone; a complete stream that starts
    late is a rank that did not report, whatever its peers' retention did."""
    events = simulate(sim_config(tp_size=2, steps=120)).events
    late = [e for e in events if e["tp_rank"] == 1]
    first_kept = next(i for i, e in enumerate(late) if e["body"][1].get("step", -1) >= 60)
    renumbered = [dict(e, seq=i) for i, e in enumerate(late[first_kept:])]
    record(tmp_path, [e for e in events if e["tp_rank"] == 0], Retention())
    record(tmp_path, renumbered, Retention())
    kinds = {v.kind for v in replay(tmp_path).violations}
    assert "rank_missing" in kinds
