"""The Model Runner V2 adapter against MRV2's real classes (mrv2_adapter_run.py says which parts
stand in for Triton kernels and a device this host lacks)."""

from __future__ import annotations

import json
import re
import subprocess

from kvledger.schemas.files import discover, read_segment
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import ROOT, vllm_python

SCRIPT = ROOT / "tests" / "e2e" / "mrv2_adapter_run.py"


def run(ledger, *args) -> dict:
    proc = subprocess.run(
        [vllm_python(), str(SCRIPT), str(ledger), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    assert proc.returncode == 0 and found, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(found[1])


def rank_info(ledger) -> dict:
    [stream] = discover(ledger)
    events = [e for path in stream.segments for e in read_segment(path, [])]
    return next(e["body"][1] for e in events if e["body"][0] == "kvledger.RankInfo")


def test_mrv2_clean_run_is_silent_and_checked(tmp_path):
    result = run(tmp_path)
    # The plugin picks the MRV2 adapter for MRV2's runner class, and every attach point
    # matches the real method and its parameters in this vLLM.
    assert result == {
        "adapter": "MRV2RunnerProbe",
        "missing": {"execute_model": None, "prepare_attn": None, "prepare_dummy_attn": None},
    }
    replayed = replay(tmp_path)
    assert replayed.violations == []
    checks = replayed.ledger.coverage.checks
    assert checks["write"] > 15 and checks["read"] == checks["write"] and checks["padding"] > 0
    assert not replayed.ledger.coverage.unchecked
    info = rank_info(tmp_path)
    assert info["runner"] == "mrv2"
    available = {c["name"]: c["available"] for c in info["capabilities"]}
    assert available == {
        "step_input": True,
        "step_plan": True,
        "dummy_runs": True,
        "connector": False,
        "snapshot": False,
    }


def test_mrv2_slot_shift_is_caught(tmp_path):
    run(tmp_path, "--fault", "slot_shift")  # at the 4th real step, ledger step 4 after the profile run
    violations = replay(tmp_path).violations
    assert [(v.kind, v.step, v.req_id) for v in violations] == [("write_target_mismatch", 4, "req-a")]
