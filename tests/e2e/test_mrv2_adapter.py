"""The Model Runner V2 adapter against MRV2's real classes on a scripted schedule: a FULL CUDA
graph's padding, snapshots compared with the scheduler's truth, a pause over exact steps
(mrv2_adapter_run.py says which parts stand in; real MRV2 engines: test_mrv2.py and the tests run
on both runners)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from kvledger.schemas.events import events_of
from kvledger.schemas.files import discover, read_segment
from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import ROOT, vllm_python

pytestmark = pytest.mark.parallel
SHARD_WEIGHT = 1  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

SCRIPT = ROOT / "tests" / "e2e" / "mrv2_adapter_run.py"
STEP, SNAPSHOT = "kvledger.Step", "kvledger.Snapshot"


def run(ledger, *args) -> dict:
    proc = subprocess.run(
        [vllm_python(), str(SCRIPT), str(ledger), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    assert proc.returncode == 0 and found, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(found[1])


def events(ledger) -> list[dict]:
    [stream] = discover(ledger)
    return [e for path in stream.segments for e in read_segment(path, [])]


def bodies(evs: list[dict], name: str) -> list[dict]:
    return [e["body"][1] for e in evs if e["body"][0] == name]


def check(evs: list[dict]) -> Ledger:
    ledger = Ledger()
    ledger.violations = ledger.apply_many(events_of(evs)) + ledger.finish()
    return ledger


def test_mrv2_clean_run_is_silent_checked_and_resyncs_at_its_snapshots(tmp_path):
    result = run(tmp_path)
    # The plugin picks the MRV2 adapter for MRV2's runner class, and every attach point
    # matches the real method and its parameters in this vLLM.
    assert result["adapter"] == "MRV2RunnerProbe"
    assert result["missing"] == {"execute_model": None, "prepare_attn": None, "prepare_dummy_attn": None}
    assert result["steps"] == 12  # the profile run and 12 real steps
    replayed = replay(tmp_path)
    assert replayed.violations == []
    checks = replayed.ledger.coverage.checks
    evs = events(tmp_path)
    real = [s for s in bodies(evs, STEP) if s["kind"] == "REAL"]
    scheduled = sum(len(unpack_i32(s["plan"]["req_indices"])) for s in real)
    assert scheduled == 33 and checks["write"] == checks["read"] == checks["position"] == scheduled
    assert checks["padding"] == 13 and not replayed.ledger.coverage.unchecked  # and the profile run
    # Batches were padded as a FULL CUDA graph pads them, and the padding was recorded.
    assert len(real) == 12 and all(g["num_padding"] > 0 for s in real for g in s["plan"]["groups"])
    [info, *_] = bodies(evs, "kvledger.RankInfo")
    assert info["runner"] == "v2" and info["snapshot_interval"] == 4
    available = {c["name"]: c["available"] for c in info["capabilities"]}
    assert available == {"step_input": True, "step_plan": True, "dummy_runs": True, "connector": False}

    # Each snapshot holds what the scheduler handed out, read back from the device rows: after
    # step 11 req-b is gone and req-d holds the blocks it freed.
    snaps = bodies(evs, SNAPSHOT)
    assert [s["step"] for s in snaps] == [3, 7, 11]
    for snap in snaps:
        held = {
            r["req_id"]: {"blocks": unpack_i32(r["block_ids"][0]).tolist(), "computed": r["num_computed_tokens"]}
            for r in snap["requests"]
        }
        assert held == result["truth"][str(snap["step"])]
    assert set(result["truth"]["11"]) == {"req-a", "req-c", "req-d"}
    assert set(result["truth"]["11"]["req-d"]["blocks"]) & set(result["truth"]["7"]["req-b"]["blocks"])

    # A ledger that lost steps 4-6 reports the gap, resyncs at the snapshot after step 7 and
    # checks every step after it, silently; without the snapshots it stays blind.
    lost = [e for e in evs if not (e["body"][0] == STEP and 4 <= e["body"][1]["step"] <= 6)]
    resynced = check(lost)
    assert [(v.kind, v.step) for v in resynced.violations] == [("sequence_gap", 3)]
    assert resynced.coverage.checks["resync"] == 1
    assert dict(resynced.coverage.unchecked) == {"after_gap": 1}  # step 7, before its snapshot
    assert resynced.coverage.checks["write"] == checks["write"] - sum(
        len(unpack_i32(s["plan"]["req_indices"])) for s in real if 4 <= s["step"] <= 7
    )
    blind = check([e for e in lost if e["body"][0] != SNAPSHOT])
    assert dict(blind.coverage.unchecked) == {"after_gap": 6} and not blind.coverage.checks["resync"]


def test_mrv2_paused_rank_resyncs_and_faults_after_it_are_caught(tmp_path):
    # Paused over steps 2-4 (req-c arrives at 3, unseen), resumed at 5: the snapshot after
    # step 7 brings req-c in, and a slot shift of req-c's first token at step 9 and a live
    # block's slot in the padding at step 10 are each caught.
    run(tmp_path, "--pause", "2:5", "--fault", "slot_shift@9:req-c", "--fault", "pad_stale@10")
    replayed = replay(tmp_path)
    assert [(v.kind, v.step, v.req_id, v.group) for v in replayed.violations] == [
        ("write_target_mismatch", 9, "req-c", 0),
        ("unowned_write", 10, None, 0),
    ]
    cov = replayed.ledger.coverage
    assert cov.checks["resync"] == 1
    assert dict(cov.unchecked) == {"steps_not_recorded": 3, "after_gap": 3}  # 2-4 paused; 5-7 wait
    assert "req-c" in {r["req_id"] for r in bodies(events(tmp_path), SNAPSHOT)[0]["requests"]}
