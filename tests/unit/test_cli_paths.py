"""Ledger paths as users give them: any directory inside a ledger, a segment, and what is no ledger.

Every command that reads a file ledger (`check`, `query`, `ls`) takes a ledger root, an engine's
or a rank's directory, or a single segment; a path that is missing, unreadable (permissions), or
holds a foreign file is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fastavro
import pytest
from click.testing import CliRunner

from kvledger.schemas import files
from kvledger.schemas.registry import VIOLATION
from kvledger.stream_app import replay as replay_module
from kvledger.stream_app.cli import ExitCode, main
from tests.synthetic.engine import simulate
from tests.unit.test_cli import ENGINE, assert_one_line_error, config, record, run, spread_faults

LEAD, FOLLOWER = "dp0-tp0-pp0", "dp0-tp1-pp0"
# Faults one rank's own stream shows (the cross-rank ones need both ranks).
RANK_OWN_FAULTS = ["slot_shift", "block_swap", "padding_write", "block_out_of_range"]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory) -> Path:
    """A clean two-rank engine (TP 2)."""
    return record(tmp_path_factory.mktemp("paths") / "ledger", simulate(config()).events)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    sim = simulate(config(spread_faults(RANK_OWN_FAULTS, 240, 2)))
    assert not sim.unplaced_faults
    return sim, record(tmp_path_factory.mktemp("paths-faulty") / "ledger", sim.events)


def check_json(*args, cwd: Path | None = None):
    proc = run_in(cwd, "check", *args, "--format", "json")
    assert "Traceback" not in proc.stderr, proc.stderr
    *violations, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    return proc, violations, summary


def run_in(cwd: Path | None, *args):
    if cwd is None:
        return run(*args)
    old = Path.cwd()
    os.chdir(cwd)
    try:
        return run(*args)
    finally:
        os.chdir(old)


def segment_of(ledger: Path, rank: str) -> Path:
    [segment] = (ledger / ENGINE / rank).glob("*.avro")
    return segment


# -- any directory inside a ledger, or a segment -------------------------------------------------------


def test_check_takes_the_root_an_engine_directory_a_rank_directory_or_a_segment(ledger):
    root, _, whole = check_json(ledger)
    assert root.returncode == ExitCode.CLEAN and whole["ranks"] == 2
    engine, _, by_engine = check_json(ledger / ENGINE)
    assert engine.returncode == ExitCode.CLEAN, engine.stderr
    assert by_engine == whole  # the same replay: the engine directory is the whole ledger here

    for path in (ledger / ENGINE / LEAD, segment_of(ledger, LEAD)):
        proc, violations, summary = check_json(path)
        # The lead's stream alone: checked, clean, and its peer's absence is no violation of either.
        assert proc.returncode == ExitCode.CLEAN, (path, proc.stdout[-2000:], proc.stderr)
        assert violations == [] and summary["ranks"] == 1 and summary["status"] == "clean"
        assert summary["checks"]["write"] > 0
        assert summary["unchecked"].get("rank_missing_steps", 0) == 0, summary["unchecked"]
        text = run("check", path)
        assert text.returncode == ExitCode.CLEAN and "no violations" in text.stdout
        assert f"not read: {ENGINE} {FOLLOWER}, beside the rank(s) given" in text.stdout


def test_a_rank_directory_inside_the_working_directory(ledger):
    """`kvledger check .` from inside a rank's directory names its engine from the layout."""
    proc, _, summary = check_json(".", cwd=ledger / ENGINE / LEAD)
    assert proc.returncode == ExitCode.CLEAN, proc.stderr
    assert summary["ranks"] == 1
    listed = run_in(ledger / ENGINE / LEAD, "ls", ".", "--format", "json")
    assert [e["engine_id"] for e in json.loads(listed.stdout)["engines"]] == [ENGINE]


def test_a_follower_rank_alone_is_not_clean(ledger):
    """A TP follower's steps are checked against its lead's tables: alone, nothing of it is checked."""
    proc, violations, summary = check_json(ledger / ENGINE / FOLLOWER)
    assert proc.returncode == ExitCode.NOT_ALL_CHECKED, (proc.stdout[-2000:], proc.stderr)
    assert violations == [] and summary["status"] == "nothing_checked"
    [unchecked] = summary["unchecked_ranks"]
    assert (unchecked["tp_rank"], unchecked["engine_id"]) == (1, ENGINE)
    assert LEAD in unchecked["reason"]
    text = run("check", ledger / ENGINE / FOLLOWER)
    assert text.returncode == ExitCode.NOT_ALL_CHECKED
    assert "no violations" not in text.stdout and "nothing checked" in text.stdout


def test_a_rank_directory_finds_that_ranks_faults(faulty):
    _, ledger = faulty
    _, whole, _ = check_json(ledger)
    proc, violations, _ = check_json(ledger / ENGINE / LEAD)
    assert proc.returncode == ExitCode.VIOLATIONS, proc.stderr
    assert {v["tp_rank"] for v in violations} == {0}
    assert "rank_missing" not in {v["kind"] for v in violations}  # the peer was left out, not missing
    own = {"write_target_mismatch", "read_target_mismatch", "unowned_write", "block_out_of_range"}
    key = lambda v: (v["kind"], v["step"], v["req_id"], v["group"])  # noqa: E731
    expected = {key(v) for v in whole if v["kind"] in own and v["tp_rank"] == 0}
    assert expected and expected <= {key(v) for v in violations}


def test_query_and_ls_take_a_rank_directory_and_a_segment(ledger):
    listed = json.loads(run("ls", ledger, "--format", "json").stdout)
    [engine] = listed["engines"]
    req_id = engine["requests"]["ids"][0]
    for path in (ledger / ENGINE, ledger / ENGINE / LEAD, segment_of(ledger, LEAD)):
        proc = run("query", path, "--req", req_id, "--format", "json")  # the only engine: no --engine needed
        assert proc.returncode == ExitCode.CLEAN, (path, proc.stderr)
        views = [json.loads(line) for line in proc.stdout.splitlines()]
        assert {v["engine_id"] for v in views} == {ENGINE}
        assert len(views) == (2 if path == ledger / ENGINE else 1)
        ls = run("ls", path, "--format", "json")
        assert ls.returncode == ExitCode.CLEAN, ls.stderr
        [one] = json.loads(ls.stdout)["engines"]
        assert one["engine_id"] == ENGINE
        assert [r["rank"] for r in one["ranks"]] == ([LEAD, FOLLOWER] if path == ledger / ENGINE else [LEAD])


def test_a_single_segment_of_several_is_not_a_lost_tail(tmp_path):
    """A segment read on its own whose incarnation goes on in the next one lost nothing: only the
    incarnation's last segment is held to its writer's end marker."""
    events = simulate(config(tp_size=1)).events
    writer = files.SegmentWriter(tmp_path / "ledger", ENGINE, 0, 0, 0, 1, max_segment_bytes=16 << 10)
    for at in range(0, len(events), 20):
        writer.write(events[at : at + 20])
    writer.close()
    segments = sorted((tmp_path / "ledger" / ENGINE / LEAD).glob("*.avro"))
    assert len(segments) >= 3
    for segment in (segments[0], segments[len(segments) // 2]):
        _, _, summary = check_json(segment)
        assert summary["problems"] == [], (segment.name, summary["problems"])
    # The first holds the rank's RankInfo: checked. One from the middle of the stream has no RankInfo
    # before its steps (without retention, segments are not cut at snapshots): nothing checked.
    assert check_json(segments[0])[0].returncode == ExitCode.CLEAN
    assert check_json(segments[1])[0].returncode == ExitCode.NOT_ALL_CHECKED


# -- what is no ledger: one line, exit 2 ------------------------------------------------------------------

COMMANDS = [("check",), ("ls",), ("query", "--req", "req-0")]


def copy_ledger(ledger: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ledger, tmp_path / "ledger"))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_foreign_file_named_as_a_segment(ledger, tmp_path, command):
    root = copy_ledger(ledger, tmp_path)
    foreign = root / ENGINE / FOLLOWER / "1-000002.avro"
    foreign.write_bytes(b"\x80\x81\x82 not a segment\n" * 10)
    for path in (root, root / ENGINE, foreign):
        proc = run(command[0], path, *command[1:])
        assert_one_line_error(proc)
        assert f"{foreign.name} is not a ledger segment: not an Avro object container file" in proc.stderr
        assert "codec" not in proc.stderr and "utf-8" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_avro_records_of_another_schema(ledger, tmp_path, command):
    root = copy_ledger(ledger, tmp_path)
    foreign = root / ENGINE / LEAD / "2-000001.avro"
    with open(foreign, "wb") as fo:
        fastavro.writer(fo, VIOLATION, [])
    proc = run(command[0], root, *command[1:])
    assert_one_line_error(proc)
    assert f"{foreign.name} is not a ledger segment: an Avro file of kvledger.Violation records" in proc.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_files_that_are_no_segment_given_directly(ledger, tmp_path, command):
    marker = ledger / ENGINE / LEAD / "1.end"
    proc = run(command[0], marker, *command[1:])
    assert_one_line_error(proc)
    assert "end marker" in proc.stderr
    binary = tmp_path / "dump.bin"
    binary.write_bytes(bytes([0x80, 0x00, 0xFF]) * 100)
    proc = run(command[0], binary, *command[1:])
    assert_one_line_error(proc)
    assert "not a ledger segment: not an Avro object container file" in proc.stderr
    assert "utf-8" not in proc.stderr
    assert_one_line_error(run(command[0], tmp_path / "missing", *command[1:]))


def test_a_segment_torn_inside_its_header_is_nothing_readable(ledger, tmp_path):
    root = copy_ledger(ledger, tmp_path)
    segment = segment_of(root, LEAD)
    segment.write_bytes(segment.read_bytes()[:100])  # the magic bytes, then half a header
    proc = run("check", root / ENGINE / LEAD)
    assert_one_line_error(proc)
    assert "no readable events" in proc.stderr and "header" in proc.stderr


# -- permissions ----------------------------------------------------------------------------------------


def invoke(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result.exit_code, result.output


def assert_one_line(code: int, output: str, *, naming: str) -> None:
    assert code == ExitCode.INPUT_ERROR, output
    assert "Traceback" not in output
    [line] = output.strip().splitlines()
    assert line.startswith("kvledger: error: cannot read ") and line.endswith("permission denied"), line
    assert naming in line, line


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("denied", ["engine", "rank"])
def test_an_unreadable_directory_inside_a_readable_root(ledger, monkeypatch, command, denied):
    """What a directory without read permission does to a listing (root reads through any mode bits,
    so the refusal is made here, at the system call, and holds for every user)."""
    target = ledger / ENGINE if denied == "engine" else ledger / ENGINE / FOLLOWER
    real_scandir, real_iterdir = os.scandir, Path.iterdir

    def scandir(path="."):
        if Path(os.path.abspath(path)) == target:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    def iterdir(self):
        if Path(os.path.abspath(self)) == target:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    code, output = invoke(command[0], ledger, *command[1:])
    assert_one_line(code, output, naming=target.name)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_an_unreadable_segment(ledger, monkeypatch, command):
    target = segment_of(ledger, FOLLOWER)
    real_open = open

    def guarded(path, *args, **kwargs):
        if Path(os.path.abspath(path)) == target:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(files, "open", guarded, raising=False)  # the module's own `open`
    code, output = invoke(command[0], ledger, *command[1:])
    assert_one_line(code, output, naming=target.name)


def test_an_os_error_the_readers_do_not_expect_is_one_line(ledger, monkeypatch):
    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/somewhere/1-000001.avro")

    monkeypatch.setattr(replay_module, "read_stream", unreadable)
    code, output = invoke("check", ledger)
    assert_one_line(code, output, naming="/somewhere/1-000001.avro")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads through mode bits: covered by the monkeypatched tests")
@pytest.mark.parametrize("denied", ["engine", "rank", "segment"])
def test_chmod_000_inside_a_readable_root(ledger, tmp_path, denied):
    root = copy_ledger(ledger, tmp_path)
    target = {
        "engine": root / ENGINE,
        "rank": root / ENGINE / FOLLOWER,
        "segment": segment_of(root, FOLLOWER),
    }[denied]
    target.chmod(0)
    try:
        for command in COMMANDS:
            proc = run(command[0], root, *command[1:])
            assert_one_line_error(proc)
            assert "permission denied" in proc.stderr and target.name in proc.stderr, proc.stderr
    finally:
        target.chmod(0o755)
