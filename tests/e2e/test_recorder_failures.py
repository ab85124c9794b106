"""A rank's recorder process and its engine, each SIGKILLed mid-run (a real engine, a file ledger).

* The recorder killed: the engine goes on unaffected (same outputs every
  round), a new recorder takes over the ring, and the ledger resyncs under
  a new incarnation without a false violation.
* The engine's worker killed: its recorder drains the ring and closes the
  ledger on its own; nothing in it is cut short.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from kvledger.schemas.files import discover, read_segment
from kvledger.stream_app.replay import replay

from .test_broker_outage import Background, recorders, rounds, wait

PROMPTS = [[(11 * i + j) % 400 + 3 for j in range(24 + 8 * i)] for i in range(6)]
SPEC = {
    "prompts": PROMPTS,
    "max_tokens": 24,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 256,
    "max_seconds": 300,
    # vLLM's own processes: the worker the recorder watches is a process of its own, as in a server.
    # In the driver's process (conftest.engine_env) one CI run recorded the whole run under the
    # first incarnation after a respawn; not reproduced here since (docs/testing.md).
    "engine_process": True,
}


def writing_to(ledger: Path):
    return lambda sink: sink.path == ledger


def events_of(ledger: Path) -> list[dict]:
    return [e for stream in discover(ledger) for path in stream.segments for e in read_segment(path, [])]


def start(engine, work: Path, *, expect_failure: bool = False) -> tuple[Background, Path, Path]:
    ledger = work / "ledger"
    trace = {"enabled": True, "sink": f"file://{ledger}", "snapshot_interval": 16, "action": "log"}
    stop = work / "stop"
    spec = {**SPEC, "kv_trace": trace, "stop_file": str(stop), "rounds_file": str(work / "rounds.jsonl")}
    return Background(lambda: engine(spec, timeout=420, expect_failure=expect_failure)), ledger, stop


def test_a_killed_recorder_is_replaced_and_the_engine_never_notices(engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("recorder-kill")
    started, ledger, stop = start(engine, work)
    rounds_file = work / "rounds.jsonl"
    wait("the engine's first round", lambda: len(rounds(rounds_file)) >= 1, 300, engine=started)
    mine = writing_to(ledger)
    [(first, _)] = recorders(mine)
    os.kill(first, signal.SIGKILL)
    replaced = lambda: any(pid != first for pid, _ in recorders(mine))  # noqa: E731
    wait("a new recorder", replaced, 120, engine=started)
    n = len(rounds(rounds_file))
    wait("rounds after the new recorder took over", lambda: len(rounds(rounds_file)) >= n + 2, 300, engine=started)
    stop.touch()
    run = started.result(180)

    assert "the recorder process ended" in run.log  # the rank saw it and said so
    assert len({r["digest"] for r in rounds(rounds_file)}) == 1  # every round's outputs alike: unaffected
    result = replay(ledger)
    assert result.violations == []  # the restart is no false alarm
    assert result.ledger.coverage.unchecked["rank_restarted"] == 1
    events = events_of(ledger)
    incarnations = list(dict.fromkeys(e["incarnation"] for e in events))
    assert len(incarnations) == 2
    later = [e["body"][0] for e in events if e["incarnation"] == incarnations[1]]
    # The rank re-announced itself and snapshotted within its first steps after the respawn.
    assert "kvledger.RankInfo" in later[:80] and "kvledger.Snapshot" in later[:80]
    assert later.count("kvledger.Step") > 50 and result.ledger.coverage.checks["write"] > 100


def test_a_killed_engine_leaves_its_recorder_to_close_the_ledger(engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-kill")
    started, ledger, _ = start(engine, work, expect_failure=True)
    wait("the engine's first rounds", lambda: len(rounds(work / "rounds.jsonl")) >= 2, 300, engine=started)
    mine = writing_to(ledger)
    [(_, worker)] = recorders(mine)
    os.kill(worker, signal.SIGKILL)  # the rank's process, mid-round
    run = started.result(180)  # the engine fails (its worker died): expected
    deadline = time.monotonic() + 60
    while recorders(mine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not recorders(mine), "the recorder did not end after its rank died"

    result = replay(ledger)
    assert result.problems == []  # nothing truncated: the recorder closed what it wrote
    assert result.violations == []
    events = events_of(ledger)
    assert [e["seq"] for e in events] == list(range(len(events)))  # nothing lost either
    steps = [e["body"][1]["step"] for e in events if e["body"][0] == "kvledger.Step"]
    assert len(steps) > 50
    assert "ended without closing" in run.log  # the recorder said so, on the engine's stderr
