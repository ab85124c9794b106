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
# Faults that need several ranks to be visible (as in tests/synthetic/demo.py).
MULTI_RANK = {"rank_divergence", "rank_missing"}


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


def spread_faults(names: list[str], steps: int, tp_size: int) -> tuple[FaultSpec, ...]:
    """Faults evenly over the run; multi-rank faults on tp1 (how tests/synthetic/demo.py places them)."""
    spread = max(steps // (len(names) + 1), 1)
    return tuple(
        FaultSpec(name, spread * (i + 1), tp_rank=1 if name in MULTI_RANK and tp_size > 1 else 0)
        for i, name in enumerate(names)
    )


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
    assert summary == json.loads(json.dumps(result.summary()))


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
    # What could not be read is unchecked, not the rank's fault: the clean ledger stays clean.
    assert proc.returncode == 0 and violations == [], (proc.returncode, summary)
    assert summary["unchecked"]["rank_records_lost"] > 0
    assert proc.stderr == ""
    assert 0 < summary["events"] < len(sim.events)
    assert summary["ranks"] == 2
    (problem,) = summary["problems"]
    assert Path(problem["path"]).name == segment.name and str(segment) in problem["path"]
    assert problem["events_read"] > 0
    file_keys = [k for k in summary["unchecked"] if k.endswith("_file")]
    assert file_keys == [f"{problem['reason']}_file"], summary["unchecked"]

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
    assert sum(1 for line in out.stdout.splitlines() if re.search(r"dp0/tp\d/pp0", line)) == len(violations)


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


def test_query_unknown_request_holds_no_blocks(clean):
    _, root = clean
    proc = run("query", root, "--engine", ENGINE, "--req", "req-does-not-exist")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all("holds no blocks" in line for line in lines), proc.stdout
    as_json = run("query", root, "--engine", ENGINE, "--req", "req-does-not-exist", "--format", "json")
    assert as_json.returncode == 1
    assert [json.loads(line)["rows"] for line in as_json.stdout.splitlines()] == [None, None]


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
