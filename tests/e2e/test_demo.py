"""`make demo` as a newcomer runs it (infra/demo, as the Makefile calls it): a real engine traced to
a file ledger, checked clean, then the same run with the slot mapping shifted by one slot at
step 6, the fault caught by the rank's own `log` check and by `kvledger check`.

What it prints is held to the README's sample line by line: the same lines in the same order,
ids, paths and numbers aside (tests/unit/test_readme.py's `normalized_demo_output`). The fault is
held in place: one finding, at the step and request the fault plugin reports, and the same in the
engine's log, in `kvledger check`'s output and in the `kvledger query` the demo suggests.
"""

from __future__ import annotations

import difflib
import re
import subprocess

import pytest

from kvledger.schemas.kinds import ViolationKind
from tests.e2e.conftest import ROOT, vllm_python
from tests.stream_harness import ENV, KVLEDGER
from tests.unit.test_readme import demo_sample, normalized_demo_output

pytestmark = [pytest.mark.e2e, pytest.mark.parallel]
SHARD_WEIGHT = 2  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)


INTERPRETED = "mrv2-cpu: Model Runner V2 with its Triton kernels in Triton's interpreter"


@pytest.mark.parametrize("runner", ["v1"])  # "v2" (`make demo RUNNER=v2`) passes too; by hand, for time
def test_make_demo_prints_the_readmes_sample(tmp_path, runner):
    """`make demo`, and `make demo RUNNER=v2` (Model Runner V2): the same sample, MRV2's engines
    saying at start that its kernels run interpreted."""
    ledger = tmp_path / "demo-ledger"
    # A wide terminal: the sample's lines unwrapped (rich wraps at 80 columns where it sees none).
    demo = subprocess.run(
        [ROOT / "infra" / "demo", vllm_python(), KVLEDGER, str(ledger)],
        env={**ENV, "COLUMNS": "200", "RUNNER": runner},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    printed = demo.stdout.replace(str(ledger), "demo-ledger")
    said = re.findall(rf"^{re.escape(INTERPRETED)}", printed, re.M)
    assert len(said) == (2 if runner == "v2" else 0), printed  # once per engine
    assert len(re.findall(rf", {runner} runner\)$", printed, re.M)) == 2, printed
    printed = "\n".join(line for line in printed.splitlines() if not line.startswith(INTERPRETED))

    want, got = normalized_demo_output(demo_sample()), normalized_demo_output(printed)
    assert got == want, "make demo no longer prints the README's sample:\n" + "\n".join(
        difflib.unified_diff(want, got, "README.md", "make demo", lineterm="")
    )

    [(step, req, group)] = re.findall(r"^FAULT step=(\d+) req=(\S+) group=(\d+)$", printed, re.M)
    assert step == "6"
    # The rank's own check, in the engine's log, and kvledger check afterwards: that one finding only.
    said = re.findall(r"^kv_trace: (\w+) at step (\d+), req (\S+), group (\d+) on ", printed, re.M)
    assert said == [("write_target_mismatch", step, req, group)], printed
    kinds = "|".join(kind.value for kind in ViolationKind)
    found = re.findall(rf"^({kinds}) \S+ dp0-tp0-pp0 step (\d+) req (\S+) group (\d+): ", printed, re.M)
    assert found == [("write_target_mismatch", step, req, group)], printed
    assert f"kvledger query demo-ledger/faulty --req {req} --step {step} " in printed
