"""The `kvledger` command line, run as users run it: the installed console script in a subprocess.

Ledgers are recorded by the synthetic engine into tmp dirs; what the CLI prints is checked
against what the simulation says it must find, and against the in-process replay core.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.producer.sinks import FileSink
from kvledger.schemas import unpack_i32
from kvledger.schemas.registry import STEP
from kvledger.stream_app.replay import replay
from tests.synthetic.demo import spread_faults
from tests.synthetic.engine import FAULT_KINDS, FAULTS, SHARING_FAULTS, FaultSpec, GroupSpec, SimConfig, simulate

STEPS = 240
ENGINE = "cli-engine"
VIOLATION_KEYS = {
    "type",
    "kind",
    "engine_id",
    "dp_rank",
    "tp_rank",
    "pp_rank",
    "step",
    "req_id",
    "group",
    "detail",
}
SUMMARY_KEYS = {"type", "events", "steps", "ranks", "checks", "unchecked", "violations"}


def _kvledger_script() -> str:
    # The console script of this interpreter first: `python -m kvledger.stream_app.cli` does nothing
    # (the module has no __main__ guard), and a `kvledger` elsewhere on PATH may be another install.
    beside = Path(sys.executable).with_name("kvledger")
    found = str(beside) if beside.exists() else shutil.which("kvledger")
    assert found, "the kvledger console script is not installed (pip install -e .)"
    return found


KVLEDGER = _kvledger_script()
# No forced colours or terminal width from the developer's shell: output goes to pipes.
ENV = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
ENV["COLUMNS"] = "200"


def run(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([KVLEDGER, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV)


def check_json(path: Path) -> tuple[subprocess.CompletedProcess, list[dict], dict]:
    """(process, violation lines, summary) of `kvledger check PATH --format json`."""
    proc = run("check", path, "--format", "json")
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines, f"no output; stderr: {proc.stderr}"
    *violations, summary = lines
    assert summary["type"] == "summary", summary
    assert all(v["type"] == "violation" for v in violations), [v["type"] for v in violations]
    return proc, violations, summary


def assert_one_line_error(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvledger: error: "), lines[0]


PLACEABLE = [f for f in FAULTS if f not in SHARING_FAULTS]  # this config has a sliding-window group


def config(faults: tuple[FaultSpec, ...] = (), **overrides) -> SimConfig:
    base = dict(
        seed=11,
        engine_id=ENGINE,
        steps=STEPS,
        tp_size=2,
        groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 64)),
        num_blocks=160,
        max_num_seqs=12,
        max_batched_tokens=192,
        arrival_rate=0.6,
        dummy_every=50,
        faults=faults,
    )
    base.update(overrides)
    return SimConfig(**base)


def record(root: Path, events: list[dict], chunk: int | None = None) -> Path:
    """Write events into a file ledger; with `chunk`, one FileSink.write (one Avro block) per chunk."""
    with FileSink(root) as sink:
        if chunk is None:
            sink.write(events)
        else:
            for at in range(0, len(events), chunk):
                sink.write(events[at : at + chunk])
    return root


# -- ledgers, recorded once per module -------------------------------------------------------------


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    sim = simulate(config())
    assert not sim.expected
    # The trace must exercise the hard paths, or "clean" proves little.
    assert sim.stats["preemptions"] and sim.stats["resumes"] and sim.stats["chunked_prefills"], sim.stats
    return sim, record(tmp_path_factory.mktemp("clean"), sim.events)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    sim = simulate(config(spread_faults(list(PLACEABLE), STEPS, 2)))
    assert not sim.unplaced_faults, sim.unplaced_faults
    assert {e.fault for e in sim.expected} == set(PLACEABLE)
    return sim, record(tmp_path_factory.mktemp("faulty"), sim.events)


@pytest.fixture(scope="module")
def faulty_check(faulty):
    return check_json(faulty[1])


# -- check --------------------------------------------------------------------------------------------


def test_clean_multi_rank_ledger_is_silent(clean):
    sim, root = clean
    proc, violations, summary = check_json(root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    assert violations == []
    assert summary.keys() >= SUMMARY_KEYS, summary.keys()  # extra keys are allowed
    assert summary["ranks"] == 2
    assert summary["events"] == len(sim.events)
    assert summary["steps"] > 0
    assert summary["checks"]["write"] > 0 and summary["checks"]["read"] > 0, summary["checks"]
    assert summary["violations"] == {}
    assert all(isinstance(n, int) for n in summary["unchecked"].values())


def test_every_injected_fault_is_reported(faulty, faulty_check):
    sim, _ = faulty
    proc, violations, summary = faulty_check
    assert proc.returncode == 1, proc.stderr
    for v in violations:
        assert v.keys() == VIOLATION_KEYS, v.keys()
    for e in sim.expected:
        hits = [
            v
            for v in violations
            if (v["kind"], v["engine_id"], v["dp_rank"], v["tp_rank"], v["pp_rank"])
            == (e.kind, e.engine_id, e.dp_rank, e.tp_rank, e.pp_rank)
            and all(
                want is None or v[name] == want
                for name, want in (("step", e.step), ("req_id", e.req_id), ("group", e.group))
            )
        ]
        assert hits, f"{e} not reported; got {[(v['kind'], v['tp_rank'], v['step']) for v in violations]}"
    allowed = {kind for e in sim.expected for kind in FAULT_KINDS[e.fault]}
    assert {v["kind"] for v in violations} <= allowed
    counts: dict[str, int] = {}
    for v in violations:
        counts[v["kind"]] = counts.get(v["kind"], 0) + 1
    assert summary["violations"] == counts
    assert summary["ranks"] == 2


def test_json_output_equals_the_core_in_process(faulty, faulty_check):
    _, root = faulty
    _, violations, summary = faulty_check
    found = []
    result = replay(root, on_violation=found.append)
    core = [{"type": "violation", **v.to_record()} for v in found]
    # Through JSON, as the CLI prints it (tuples become lists, int keys become strings).
    assert violations == json.loads(json.dumps(core))
    assert [{"type": "violation", **v.to_record()} for v in result.violations] == core
    core_summary = json.loads(json.dumps(result.summary()))
    assert {k: summary[k] for k in core_summary} == core_summary
    # The command's own verdict beside the core's summary: every rank checked, violations found.
    assert summary.keys() - core_summary.keys() == {"status", "unchecked_ranks"}
    assert summary["status"] == "violations" and summary["unchecked_ranks"] == []


def test_missing_path_is_unusable(tmp_path):
    assert_one_line_error(run("check", tmp_path / "nowhere"))
    assert_one_line_error(run("check", tmp_path / "nowhere", "--format", "json"))


def test_empty_directory_is_unusable(tmp_path):
    assert_one_line_error(run("check", tmp_path, "--format", "json"))


def test_non_avro_segment_is_unusable(tmp_path):
    rank = tmp_path / ENGINE / "dp0-tp0-pp0"
    rank.mkdir(parents=True)
    (rank / "1-000001.avro").write_text("this is not an Avro object container file\n")
    proc = run("check", tmp_path, "--format", "json")
    assert_one_line_error(proc)
    assert "1-000001.avro" in proc.stderr


def test_plain_text_file_is_unusable(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello\nworld\n")
    assert_one_line_error(run("check", text))


def test_truncated_segment_reports_what_was_read(clean, tmp_path):
    sim, _ = clean
    root = record(tmp_path / "ledger", sim.events, chunk=40)  # many small Avro blocks per segment
    (segment,) = (root / ENGINE / "dp0-tp1-pp0").glob("*.avro")
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) // 2])  # cut in the middle of a block

    proc, violations, summary = check_json(root)
    # What could not be read is unchecked, not the rank's fault: no violation, and never clean.
    assert proc.returncode == 3 and violations == [], (proc.returncode, summary)
    assert summary["status"] == "incomplete"
    assert summary["unchecked"]["rank_records_lost"] > 0
    assert proc.stderr == ""
    assert 0 < summary["events"] < len(sim.events)
    assert summary["ranks"] == 2
    (problem,) = summary["problems"]
    assert Path(problem["path"]).name == segment.name and str(segment) in problem["path"]
    assert problem["events_read"] > 0
    assert problem["reason"] == "truncated" and "torn last block" in problem["detail"]
    file_keys = [k for k in summary["unchecked"] if k.endswith("_file")]
    assert file_keys == ["truncated_file"], summary["unchecked"]

    text = run("check", root)
    assert text.returncode == proc.returncode
    assert "Traceback" not in text.stderr
    assert segment.name in text.stdout


def test_text_report(clean, faulty, faulty_check):
    out = run("check", clean[1])
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no progress bar when stderr is not a terminal
    assert "no violations" in out.stdout
    assert "\x1b[" not in out.stdout  # no colour into a pipe
    assert "2 rank stream(s)" in out.stdout

    _, violations, _ = faulty_check
    out = run("check", faulty[1])
    assert out.returncode == 1, out.stderr
    assert out.stderr == ""
    assert "no violations" not in out.stdout
    for kind in {v["kind"] for v in violations}:
        assert kind in out.stdout, kind
    # One line per violation, naming its rank.
    assert sum(1 for line in out.stdout.splitlines() if re.search(r"dp0-tp\d-pp0", line)) == len(violations)


def test_progress_bar_only_on_a_terminal(faulty):
    """With stderr on a terminal the bar is drawn there; the report on stdout is unchanged."""
    _, root = faulty
    piped = run("check", root)
    assert "replaying" not in piped.stderr
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [KVLEDGER, "check", str(root)], stdout=subprocess.PIPE, stderr=slave, env=ENV, text=True
        )
        os.close(slave)
        stderr = b""
        while chunk := _read_pty(master):
            stderr += chunk
        stdout = proc.stdout.read()
        assert proc.wait(timeout=60) == piped.returncode == 1
    finally:
        os.close(master)
    assert b"replaying" in stderr
    assert b"Traceback" not in stderr
    assert stdout == piped.stdout


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the child closed the terminal
        return b""


# -- query (time travel) ------------------------------------------------------------------------------


def worker_tables(events: list[dict], tp: int, upto: int) -> dict[str, list[list[int]]]:
    """Block tables of one rank's worker after the step input of step `upto`, from the raw events."""
    rows: dict[str, list[list[int]]] = {}
    id_of: dict[int, str] = {}
    for event in events:
        name, body = event["body"]
        if event["tp_rank"] != tp or name != STEP or body["input"] is None:
            continue
        if body["step"] > upto:
            break
        inp = body["input"]
        for req_id in inp["finished_req_ids"]:
            rows.pop(req_id, None)
        for req_id in inp["preempted_req_ids"]:
            if req_id in rows:
                rows[req_id] = [[] for _ in rows[req_id]]
        for req in inp["new_reqs"]:
            id_of[req["req_index"]] = req["req_id"]
            rows[req["req_id"]] = [unpack_i32(b).tolist() for b in req["block_ids"]]
        for index in unpack_i32(inp["resumed_req_indices"]).tolist():
            rows[id_of[index]] = [[] for _ in rows[id_of[index]]]  # resumed rows are replaced
        for index, group, blocks in appends(inp):
            rows[id_of[index]][group] += blocks
    return rows


def appends(inp: dict):
    """(req_index, group, block ids) of a StepInput's columnar appends."""
    counts = unpack_i32(inp["append_counts"]).tolist()
    blocks = unpack_i32(inp["append_block_ids"]).tolist()
    ends = [sum(counts[: i + 1]) for i in range(len(counts))]
    for index, group, count, end in zip(
        unpack_i32(inp["append_req_indices"]).tolist(),
        unpack_i32(inp["append_group_ids"]).tolist(),
        counts,
        ends,
        strict=True,
    ):
        yield index, group, blocks[end - count : end]


def step_inputs(events: list[dict]):
    """(step, input) of rank tp0's real steps, in order."""
    for event in events:
        name, body = event["body"]
        if event["tp_rank"] == 0 and name == STEP and body["input"] is not None:
            yield body["step"], body["input"]


def grown_request(events: list[dict]) -> tuple[str, int]:
    """A request admitted by a NewRequest that later got blocks appended, and a step it is scheduled at."""
    admitted: dict[int, tuple[str, int]] = {}
    for step, inp in step_inputs(events):
        gone = {*inp["preempted_req_ids"], *inp["finished_req_ids"]}
        admitted = {i: v for i, v in admitted.items() if v[0] not in gone}
        for req in inp["new_reqs"]:
            admitted[req["req_index"]] = (req["req_id"], step)
        scheduled = set(unpack_i32(inp["cached_req_indices"]).tolist())
        for index, _, _ in appends(inp):
            if index in admitted and index in scheduled and step > admitted[index][1] + 2:
                return admitted[index][0], step
    raise AssertionError("no request grew after admission")


def resumed_request(events: list[dict]) -> tuple[str, int]:
    """A request resumed after preemption (its row replaced), and the step it resumed at."""
    id_of: dict[int, str] = {}
    for step, inp in step_inputs(events):
        for req in inp["new_reqs"]:
            id_of[req["req_index"]] = req["req_id"]
        resumed = unpack_i32(inp["resumed_req_indices"]).tolist()
        if resumed:
            return id_of[resumed[0]], step
    raise AssertionError("no request was resumed")


@pytest.mark.parametrize("pick", [grown_request, resumed_request])
def test_query_block_table_at_a_step(clean, pick):
    sim, root = clean
    req_id, step = pick(sim.events)
    proc = run("query", root, "--engine", ENGINE, "--req", req_id, "--step", step, "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    views = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [v["tp_rank"] for v in views] == [0, 1]
    for view in views:
        assert view["type"] == "block_table" and view["req_id"] == req_id and view["engine_id"] == ENGINE
        assert view["step"] == step
        want = worker_tables(sim.events, view["tp_rank"], step)[req_id]
        assert len(want) == 2 and all(want), want  # both KV cache groups hold blocks
        assert view["rows"] == want
        assert view["first_seen"] <= step <= view["last_seen"]

    text = run("query", root, "--engine", ENGINE, "--req", req_id, "--step", step)
    assert text.returncode == 0
    assert "Traceback" not in text.stderr
    for g, row in enumerate(want):
        assert f"group {g}: {len(row)} block(s) {row}" in text.stdout


def first_steps(events: list[dict]) -> dict[str, int]:
    """Every request id of the events (admitted by a NewRequest), with the step it first appears at."""
    seen: dict[str, int] = {}
    for event in events:
        name, body = event["body"]
        if name == STEP and body["input"] is not None:
            for req in body["input"]["new_reqs"]:
                seen.setdefault(req["req_id"], body["step"])
    return seen


def steps_of(events: list[dict]) -> tuple[int, int]:
    steps = [e["body"][1]["step"] for e in events if "step" in e["body"][1]]
    return min(steps), max(steps)


def test_query_unknown_ids_name_what_exists(clean):
    sim, root = clean
    first, last = steps_of(sim.events)
    req_id = next(iter(first_steps(sim.events)))
    for args, names in [
        (["--engine", ENGINE, "--req", "req-does-not-exist"], ["req-does-not-exist", "req-0, req-1", "--all-requests"]),
        (["--engine", "no-such-engine", "--req", req_id], ["no-such-engine", ENGINE]),
        (["--req", req_id, "--rank", "dp0-tp7-pp0"], ["dp0-tp7-pp0", "dp0-tp0-pp0, dp0-tp1-pp0"]),
        (["--req", req_id, "--rank", "tp1"], ["'tp1'", "dp0-tp0-pp0, dp0-tp1-pp0"]),
        (["--req", req_id, "--step", "9999"], ["step 9999", f"steps {first}..{last}"]),
        (["--req", req_id, "--step", "-1"], ["step -1", f"steps {first}..{last}"]),
    ]:
        for fmt in ("text", "json"):
            proc = run("query", root, *args, "--format", fmt)
            assert_one_line_error(proc)
            for name in names:
                assert name in proc.stderr, (args, proc.stderr)


def test_query_a_request_not_live_at_the_step(clean):
    """A request that exists but holds no blocks at the step: shown so, with where it does (exit 0)."""
    sim, root = clean
    req_id, first = max(first_steps(sim.events).items(), key=lambda kv: kv[1])
    assert first > 1
    proc = run("query", root, "--req", req_id, "--step", first - 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(f"holds no blocks; it first appears at step {first}" in x for x in lines), lines
    one = run("query", root, "--req", req_id, "--step", first, "--rank", "dp0-tp1-pp0", "--format", "json")
    assert one.returncode == 0, one.stderr
    [view] = [json.loads(line) for line in one.stdout.splitlines()]
    assert view["tp_rank"] == 1 and view["rows"] is not None


def violation_at(violations: list[dict], kind: str, *, group: bool) -> dict:
    return next(v for v in violations if v["kind"] == kind and (v["group"] is not None) == group and v["req_id"])


def test_query_text_shows_the_wrong_slot_beside_the_expected_one(faulty, faulty_check):
    _, root = faulty
    _, violations, _ = faulty_check
    v = violation_at(violations, "write_target_mismatch", group=True)
    args = ("query", root, "--req", v["req_id"], "--step", v["step"], "--rank", "dp0-tp0-pp0")
    as_json = run(*args, "--format", "json")
    assert as_json.returncode == 1, as_json.stderr  # the step's plan broke a rule for the request
    [view] = [json.loads(line) for line in as_json.stdout.splitlines()]
    [group] = [g for g in view["plan"]["groups"] if g["group_id"] == v["group"]]
    wrong = [i for i, w in enumerate(group["wrong"]) if w]
    assert wrong, group
    text = run(*args)
    assert text.returncode == 1, text.stderr
    i, size = wrong[0], group["block_size"]
    written, expected = group["written"][i], group["expected"][i]
    line = next(x for x in text.stdout.splitlines() if f"group {v['group']}: WRONG slot" in x)
    assert f"position {group['positions'][i]} written to slot {written} (block {written // size}," in line
    assert f"the ledger's row gives slot {expected} (block {expected // size}," in line
    assert written != expected


def test_query_text_shows_a_wrong_read(faulty, faulty_check):
    _, root = faulty
    _, violations, _ = faulty_check
    v = violation_at(violations, "read_target_mismatch", group=True)
    text = run("query", root, "--req", v["req_id"], "--step", v["step"], "--rank", "dp0-tp0-pp0")
    assert text.returncode == 1, text.stderr
    [line] = [x for x in text.stdout.splitlines() if f"group {v['group']}: WRONG read" in x]
    assert "the ledger's row is" in line


def test_query_a_clean_step_shows_the_plan_as_the_row_gives(clean):
    sim, root = clean
    req_id, step = grown_request(sim.events)
    text = run("query", root, "--req", req_id, "--step", step, "--rank", "dp0-tp0-pp0")
    assert text.returncode == 0, text.stderr
    assert f"plan of step {step}:" in text.stdout
    assert "WRONG" not in text.stdout and "as the ledger's row gives" in text.stdout


def test_query_missing_path_is_unusable(tmp_path):
    assert_one_line_error(run("query", tmp_path / "nowhere", "--engine", ENGINE, "--req", "req-0"))


# -- the demo, end to end ------------------------------------------------------------------------------

_INJECTED = re.compile(
    r"^\s+injected (?P<fault>\w+): expect (?P<kind>\w+) on tp(?P<tp>\d+) at "
    r"(?:step (?P<step>\d+)|somewhere)(?: for (?P<req>\S+))?$"
)


def test_demo_records_faults_the_checker_finds(tmp_path):
    out = tmp_path / "demo"
    demo = subprocess.run(
        [sys.executable, "-m", "tests.synthetic.demo", str(out), "--steps", "300"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert demo.returncode == 0, demo.stderr
    assert "could not place" not in demo.stderr, demo.stderr
    printed = [m.groupdict() for m in map(_INJECTED.match, demo.stdout.splitlines()) if m]
    assert {p["fault"] for p in printed} == set(PLACEABLE), demo.stdout

    proc, violations, summary = check_json(out)
    assert proc.returncode == 1, proc.stderr
    assert summary["ranks"] == 2
    for p in printed:
        assert any(
            v["kind"] == p["kind"]
            and v["tp_rank"] == int(p["tp"])
            and (p["step"] is None or v["step"] == int(p["step"]))
            and (p["req"] is None or v["req_id"] == p["req"])
            for v in violations
        ), f"demo fault not found: {p}"


def test_several_ledgers_are_checked_together(tmp_path, faulty, faulty_check):
    """`check A B`: one replay over both (as for the two engines of a pair): the union of their reports."""
    other = record(tmp_path / "other", simulate(config(engine_id="other-engine")).events)
    proc = run("check", other, faulty[1], "--format", "json")
    *violations, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    _, faulty_violations, faulty_summary = faulty_check
    assert proc.returncode == 1
    assert sorted(map(json.dumps, violations)) == sorted(map(json.dumps, faulty_violations))
    assert summary["ranks"] == faulty_summary["ranks"] + 2


# -- exit statuses ------------------------------------------------------------------------------------


def test_every_command_documents_its_exit_statuses():
    from click.testing import CliRunner

    from kvledger.stream_app.cli import CheckStatus, ExitCode, main

    assert [int(c) for c in ExitCode] == [0, 1, 2, 3]
    assert {s.exit_code for s in CheckStatus} == {0, 1, 3}
    uses = {
        "check": {0, 1, 2, 3},
        "query": {0, 1, 2},
        "ls": {0, 2},
        "violations": {0, 1, 2},
        "stream": {0, 2},
    }
    assert set(main.commands) == set(uses)
    for command, codes in uses.items():
        result = CliRunner().invoke(main, [command, "--help"], terminal_width=100)
        assert result.exit_code == 0, result.output
        _, _, epilog = result.output.partition("Exit status:\n")
        documented = {int(m) for m in re.findall(r"^ +(\d)  \S", epilog, re.M)}
        assert documented == codes, (command, epilog)
    top = CliRunner().invoke(main, ["--help"]).output
    assert "0 clean, 1 violations, 2 input error (a usage error too), 3 not all checked" in " ".join(top.split())
    epilog = " ".join(CliRunner().invoke(main, ["check", "--help"]).output.split())
    assert "status incomplete, input was lost before any check" in epilog


def test_exit_statuses_are_named_once():
    """Every exit of the command line goes through ExitCode: no bare status anywhere."""
    source = (Path(__file__).resolve().parents[2] / "stream_app" / "cli.py").read_text()
    assert re.findall(r"sys\.exit\(\s*\d", source) == []
    assert re.findall(r"\bEXIT_[A-Z]+\s*=", source) == []


def record_blocks(root: Path, events: list[dict]) -> Path:
    """A file ledger whose segments hold one event per Avro block."""
    from kvledger.schemas.files import SegmentWriter

    writers: dict[tuple, SegmentWriter] = {}
    for e in events:
        key = (e["engine_id"], e["dp_rank"], e["tp_rank"], e["pp_rank"], e["incarnation"])
        if key not in writers:
            writers[key] = SegmentWriter(root, *key, flush_interval=0)  # each write its own block
        writers[key].write([e])
    for writer in writers.values():
        writer.close()
    return root


def torn_after_first_event(root: Path, rank: str) -> Path:
    """Cut a rank's only segment a few bytes into its second block (one event per block)."""
    [segment] = (root / ENGINE / rank).glob("*.avro")
    data = segment.read_bytes()
    with open(segment, "rb") as fo:
        import fastavro

        sync = fastavro.reader(fo)._header["sync"]
    header_end = data.index(sync) + len(sync)
    first_block_end = data.index(sync, header_end) + len(sync)
    segment.write_bytes(data[: first_block_end + 5])
    return segment


def test_a_ledger_where_nothing_was_checked_is_not_clean(tmp_path):
    sim = simulate(config(tp_size=1, steps=60))
    root = record_blocks(tmp_path / "ledger", sim.events)
    torn_after_first_event(root, "dp0-tp0-pp0")
    proc, violations, summary = check_json(root)
    assert proc.returncode == 3, (proc.returncode, summary)
    assert violations == [] and summary["events"] == 1
    assert summary["status"] == "nothing_checked"
    [rank] = summary["unchecked_ranks"]
    assert rank["tp_rank"] == 0 and "no step" in rank["reason"]
    text = run("check", root)
    assert text.returncode == 3
    assert "no violations" not in text.stdout
    assert "nothing checked" in text.stdout


def test_one_rank_where_nothing_was_checked_is_not_clean(clean, tmp_path):
    sim, _ = clean
    root = record_blocks(tmp_path / "ledger", sim.events)
    torn_after_first_event(root, "dp0-tp1-pp0")
    proc, violations, summary = check_json(root)
    assert proc.returncode == 3, (proc.returncode, summary)
    assert violations == [] and summary["checks"]["write"] > 0  # the other rank was checked
    assert [(r["dp_rank"], r["tp_rank"], r["pp_rank"]) for r in summary["unchecked_ranks"]] == [(0, 1, 0)]
    text = run("check", root)
    assert text.returncode == 3
    assert "no violations" not in text.stdout.replace("no violations on the 1 rank(s) checked", "")
    assert f"nothing checked on {ENGINE} dp0-tp1-pp0" in text.stdout


# -- input lost: never clean ----------------------------------------------------------------------------


def block_ends(segment: Path) -> list[int]:
    """File offsets just after each sync marker: the end of the header, then of every block."""
    import fastavro

    data = segment.read_bytes()
    with open(segment, "rb") as fo:
        sync = fastavro.reader(fo)._header["sync"]
    ends, at = [], 0
    while (at := data.find(sync, at)) != -1:
        at += len(sync)
        ends.append(at)
    return ends


def cut_at_a_block_boundary(segment: Path) -> None:
    ends = block_ends(segment)
    assert len(ends) > 3, "a segment of several blocks"
    segment.write_bytes(segment.read_bytes()[: ends[len(ends) // 2]])


def cut_inside_a_block(segment: Path) -> None:
    ends = block_ends(segment)
    segment.write_bytes(segment.read_bytes()[: ends[len(ends) // 2] + 30])


def garble_a_block(segment: Path) -> None:
    ends = block_ends(segment)
    data = bytearray(segment.read_bytes())
    at = ends[len(ends) // 2] + 8
    data[at : at + 64] = bytes(64)
    segment.write_bytes(bytes(data))


def damage_the_header(segment: Path) -> None:
    """A second segment beside the first, whose header is unreadable."""
    segment.with_name(segment.name.replace("000001", "000002")).write_bytes(b"Obj\x01" + bytes(40))


def empty_segment_after(segment: Path) -> None:
    segment.with_name(segment.name.replace("000001", "000002")).write_bytes(b"")


@pytest.mark.parametrize(
    ("damage", "unchecked"),
    [
        (cut_at_a_block_boundary, "truncated_file"),  # the writer's end marker says more was written
        (cut_inside_a_block, "truncated_file"),
        (garble_a_block, "corrupt_file"),
        (damage_the_header, "not_avro_file"),
        (empty_segment_after, "empty_file"),
    ],
)
def test_a_ledger_that_lost_input_is_never_clean(clean, tmp_path, damage, unchecked):
    """A clean ledger with part of one rank's stream lost or unreadable: no violation, and exit 3
    (status incomplete), never 0, in text and in JSON alike."""
    sim, _ = clean
    root = record(tmp_path / "ledger", sim.events, chunk=40)  # many blocks, the writer's end marker beside
    [segment] = (root / ENGINE / "dp0-tp1-pp0").glob("*.avro")
    damage(segment)
    proc, violations, summary = check_json(root)
    assert (proc.returncode, violations, summary["status"]) == (3, [], "incomplete"), summary
    assert summary["unchecked"][unchecked] == 1 and summary["unchecked_ranks"] == []
    text = run("check", root)
    assert text.returncode == 3
    assert "no violations\n" not in text.stdout
    assert f"incomplete: no violations in what was read, but input was lost before any check ({unchecked} 1)" in (
        text.stdout
    )


def test_a_tail_cut_where_its_writer_confirmed_more_says_so(clean, tmp_path):
    sim, _ = clean
    root = record(tmp_path / "ledger", sim.events, chunk=40)
    [segment] = (root / ENGINE / "dp0-tp1-pp0").glob("*.avro")
    cut_at_a_block_boundary(segment)
    text = run("check", root)
    assert text.returncode == 3
    [lost] = [line for line in text.stdout.splitlines() if line.startswith("tail lost:")]
    assert re.search(r"the writer confirmed the stream through seq \d+, the file ends at seq \d+", lost), lost


def test_a_zero_byte_rank_beside_a_checked_one_is_named_as_such(tmp_path):
    sim = simulate(config(tp_size=1, steps=60))
    root = record(tmp_path / "ledger", sim.events)
    empty = root / ENGINE / "dp0-tp1-pp0"
    empty.mkdir()
    (empty / "1-000001.avro").write_bytes(b"")
    proc, _, summary = check_json(root)
    assert (proc.returncode, summary["status"]) == (3, "nothing_checked"), summary
    assert summary["unchecked"]["empty_file"] == 1 and "empty_file_file" not in summary["unchecked"]
    [problem] = summary["problems"]
    assert problem["reason"] == "empty"
    text = run("check", root).stdout
    assert f"nothing checked on {ENGINE} dp0-tp1-pp0: no event of it could be read" in text
    assert "not clean: nothing checked on 1 rank(s); no violations on the 1 rank(s) checked" in text
    assert "no check of the KV cache ran" not in text  # the other rank's were run: said above


def test_a_renamed_engine_directory_is_checked_and_listed_as_its_events_engine(clean, tmp_path):
    sim, root = clean
    renamed = tmp_path / "renamed"
    shutil.copytree(root / ENGINE, renamed)
    proc, _, summary = check_json(renamed)
    assert (proc.returncode, summary["status"], summary["ranks"]) == (0, "clean", 2), summary
    assert summary["unchecked_ranks"] == []
    assert [(r["engine_id"], r["path_names"]["engine_id"]) for r in summary["renamed"]] == [(ENGINE, "renamed")] * 2
    text = run("check", renamed).stdout
    assert "nothing checked" not in text and "no violations" in text
    line = (
        f"renamed: {renamed / 'dp0-tp0-pp0'} holds the events of engine {ENGINE} dp0-tp0-pp0 "
        "(its path names renamed dp0-tp0-pp0): checked as that engine's"
    )
    assert line in text.splitlines()
    listed = json.loads(run("ls", renamed, "--format", "json").stdout)
    assert [e["engine_id"] for e in listed["engines"]] == [ENGINE]
    assert all(r["events"] > 0 and r["segments"] == 1 for r in listed["engines"][0]["ranks"])
    assert "listed as that engine's" in run("ls", renamed).stdout
    # `query` finds the engine under its own id too.
    req_id = first_steps(sim.events).popitem()[0]
    queried = run("query", renamed, "--engine", ENGINE, "--req", req_id)
    assert queried.returncode == 0 and req_id in queried.stdout, queried.stdout + queried.stderr


# -- output into a pipe or a file: whole lines ------------------------------------------------------------


def test_piped_output_is_never_wrapped(tmp_path):
    """Into a pipe, whatever the width a terminal would have, each line comes whole: a long path, the
    list of checks run, an incarnation of `ls` (ids as long as real ones)."""
    engine = "vllm-" + "7" * 40
    incarnation = 1_700_000_000_123_456_789  # a worker's start, in ns
    sim = simulate(config(engine_id=engine, tp_size=1, steps=60, close_at_end=True, incarnation=incarnation))
    deep = tmp_path / ("a-directory-with-a-name-long-enough-to-pass-eighty-columns-on-its-own-" * 2)
    whole, cut = record_blocks(deep / "whole", sim.events), record_blocks(deep / "cut", sim.events)
    [segment] = (cut / engine / "dp0-tp0-pp0").glob("*.avro")
    cut_inside_a_block(segment)
    env = {k: v for k, v in ENV.items() if k not in ("COLUMNS", "LINES")}

    def piped(*args: str | Path) -> list[str]:
        proc = subprocess.run([KVLEDGER, *map(str, args)], capture_output=True, text=True, env=env, timeout=60)
        return proc.stdout.splitlines()

    lines = piped("check", cut)
    [checks] = [line for line in lines if line.startswith("checks run: ")]
    assert re.fullmatch(r"checks run: (\w+ \d+, )+write \d+", checks), checks
    [lost] = [line for line in lines if line.startswith("tail lost: ")]
    assert lost.startswith(f"tail lost: {segment}: truncated after ") and lost.endswith(")"), lost
    assert any(line.startswith("incomplete: ") and line.endswith(": not clean") for line in lines), lines
    listing = piped("ls", whole)
    assert f"engine {engine}: 1 rank(s), steps 0..59, " in listing[0], listing
    assert f"    incarnation {incarnation}: steps 0..59, {len(sim.events)} event(s) " in "\n".join(listing)
    assert any(line.endswith(", shut down") and f"incarnation {incarnation}" in line for line in listing), listing


# -- ls ------------------------------------------------------------------------------------------------


def expected_inventory(events: list[dict]) -> dict:
    ranks: dict[str, dict] = {}
    for e in events:
        name = f"dp{e['dp_rank']}-tp{e['tp_rank']}-pp{e['pp_rank']}"
        r = ranks.setdefault(name, {"events": 0, "seqs": [], "steps": [], "incarnations": set()})
        r["events"] += 1
        r["seqs"].append(e["seq"])
        r["incarnations"].add(e["incarnation"])
        if "step" in e["body"][1]:
            r["steps"].append(e["body"][1]["step"])
    return ranks


def assert_lists(listed: dict, sim_events: list[dict], *, files: bool) -> None:
    [engine] = listed["engines"]
    assert engine["engine_id"] == ENGINE
    assert (engine["first_step"], engine["last_step"]) == steps_of(sim_events)
    want = expected_inventory(sim_events)
    assert [r["rank"] for r in engine["ranks"]] == sorted(want)
    for rank in engine["ranks"]:
        w = want[rank["rank"]]
        assert rank["events"] == w["events"]
        [inc] = rank["incarnations"]
        assert {inc["incarnation"]} == w["incarnations"]
        assert (inc["first_seq"], inc["last_seq"]) == (min(w["seqs"]), max(w["seqs"]))
        assert (inc["first_step"], inc["last_step"]) == (min(w["steps"]), max(w["steps"]))
        assert ("segments" in rank) == files
    ids = list(first_steps(sim_events))
    assert engine["requests"]["count"] == len(ids)
    return engine, ids


def test_ls_lists_engines_ranks_incarnations_steps_and_requests(clean):
    sim, root = clean
    proc = run("ls", root, "--format", "json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    listed = json.loads(proc.stdout)
    engine, ids = assert_lists(listed, sim.events, files=True)
    assert engine["requests"]["ids"] == ids[:10] and engine["requests"]["complete"] is False
    assert all(r["segments"] == 1 and r["bytes"] > 0 for r in engine["ranks"])
    every = json.loads(run("ls", root, "--format", "json", "--all-requests").stdout)
    assert every["engines"][0]["requests"] == {"count": len(ids), "ids": ids, "complete": True}

    text = run("ls", root)
    assert text.returncode == 0
    first, last = steps_of(sim.events)
    assert f"engine {ENGINE}: 2 rank(s), steps {first}..{last}, {len(ids)} request(s)" in text.stdout
    assert "dp0-tp0-pp0: 1 segment(s)" in text.stdout and "dp0-tp1-pp0: 1 segment(s)" in text.stdout
    assert f"incarnation 1: steps {first}..{last}" in text.stdout
    assert f"requests: {', '.join(ids[:10])} ... and {len(ids) - 10} more" in text.stdout
    all_text = run("ls", root, "--all-requests").stdout
    assert f"requests: {', '.join(ids)}\n" in all_text


def test_ls_two_engines_and_a_restart(tmp_path):
    a = simulate(config(engine_id="eng-a", tp_size=1, steps=40)).events
    b1 = simulate(config(engine_id="eng-b", tp_size=1, steps=30)).events
    b2 = simulate(config(engine_id="eng-b", tp_size=1, steps=20, incarnation=2, seed=5)).events
    root = record(tmp_path / "ledger", a + b1 + b2)
    listed = json.loads(run("ls", root, "--format", "json").stdout)
    assert [e["engine_id"] for e in listed["engines"]] == ["eng-a", "eng-b"]
    [rank] = listed["engines"][1]["ranks"]
    assert [i["incarnation"] for i in rank["incarnations"]] == [1, 2]
    assert rank["segments"] == 2
    assert [i["events"] for i in rank["incarnations"]] == [len(b1), len(b2)]


def test_ls_usage_errors_are_one_line(tmp_path):
    assert_one_line_error(run("ls"))
    assert_one_line_error(run("ls", tmp_path, "--bootstrap", "127.0.0.1:1"))
    assert_one_line_error(run("ls", tmp_path))  # no segments


class FakeMessage:
    def __init__(self, offset: int, value: bytes):
        self._offset, self._value = offset, value

    def error(self):
        return None

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return ENGINE.encode()


class FakeConsumer:
    """The part of a confluent-kafka Consumer `ls` uses, over messages per partition."""

    def __init__(self, partitions: list[list[bytes]]):
        self.partitions, self.at = partitions, None
        self.closed = False

    def get_watermark_offsets(self, tp, timeout=None):
        return 0, len(self.partitions[tp.partition])

    def assign(self, tps):
        [tp] = tps
        self.at = (tp.partition, tp.offset)

    def consume(self, n, timeout=None):
        partition, offset = self.at
        values = self.partitions[partition][offset : offset + n]
        self.at = (partition, offset + len(values))
        return [FakeMessage(offset + i, v) for i, v in enumerate(values)]

    def close(self):
        self.closed = True


def test_ls_reads_the_events_topic(clean, monkeypatch):
    """`ls --bootstrap`: the same listing from the events topic (batches of events, any partition)."""
    from click.testing import CliRunner

    from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
    from kvledger.stream_app.cli import main
    from kvledger.stream_app.worker import topics

    sim, root = clean
    codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH)
    by_rank = [[e for e in sim.events if e["tp_rank"] == tp] for tp in (0, 1)]
    partitions = [[codec.encode(evs[i : i + 7]) for i in range(0, len(evs), 7)] for evs in by_rank]
    partitions[1].append(b"not a ledger event")
    consumer = FakeConsumer(partitions)
    asked = []
    monkeypatch.setattr(topics, "admin", lambda bootstrap, **kw: asked.append(bootstrap))
    monkeypatch.setattr(
        topics, "partitions_of", lambda client, topic: len(partitions) if topic == "kv.events" else None
    )
    monkeypatch.setattr(topics, "assigned_consumer", lambda *a, **kw: consumer)
    args = ["ls", "--bootstrap", "broker:9092", "--topic-prefix", "kv", "--format", "json", "--all-requests"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert asked == ["broker:9092"] and consumer.closed
    listed = json.loads(result.output)
    assert listed["undecodable"] == 1
    engine, _ = assert_lists(listed, sim.events, files=False)
    from_files = json.loads(run("ls", root, "--format", "json", "--all-requests").stdout)["engines"][0]
    for rank in from_files["ranks"]:
        del rank["segments"], rank["bytes"]
    assert engine == from_files

    missing = CliRunner().invoke(main, ["ls", "--bootstrap", "broker:9092"])  # no kvledger.events topic
    assert missing.exit_code == 2 and missing.output.startswith("kvledger: error: topic kvledger.events")


# -- violations --engine ---------------------------------------------------------------------------------


def test_violations_of_one_engine(monkeypatch):
    from click.testing import CliRunner

    from kvledger.stream_app.cli import main
    from kvledger.stream_app.core import Violation
    from kvledger.stream_app.worker import reader

    def found(engine_id: str, step: int) -> Violation:
        record = {
            "kind": "write_target_mismatch",
            "engine_id": engine_id,
            "dp_rank": 0,
            "tp_rank": 0,
            "pp_rank": 0,
            "step": step,
            "req_id": "req-1",
            "group": 0,
            "detail": "1 token(s) written to the wrong slot",
        }
        return Violation.of(record)

    def read_violations(bootstrap, topic, *, stats, **kw):
        for n, v in enumerate([found("eng-a", 3), found("eng-b", 4), found("eng-a", 9)]):
            stats.kinds[v.kind] += 1
            stats.engines.add(v.engine_id)
            yield str(n), v

    monkeypatch.setattr(reader, "read_violations", read_violations)
    base = ["violations", "--bootstrap", "broker:9092", "--format", "json"]
    result = CliRunner().invoke(main, [*base, "--engine", "eng-a"])
    assert result.exit_code == 1, result.output
    *shown, summary = [json.loads(line) for line in result.output.splitlines()]
    assert [(v["engine_id"], v["step"]) for v in shown] == [("eng-a", 3), ("eng-a", 9)]
    assert summary["violations"] == {"write_target_mismatch": 2} and summary["engines"] == 1
    both = CliRunner().invoke(main, [*base, "--engine", "eng-a", "--engine", "eng-b"])
    assert len(both.output.splitlines()) == 4
    none = CliRunner().invoke(main, [*base, "--engine", "eng-c"])
    assert none.exit_code == 0, none.output
    assert json.loads(none.output)["violations"] == {}
