"""`make demo-cluster` as a newcomer runs it: the dev stack without Docker (infra/dev-stack, from
infra/stack.toml) and a real engine with a fault traced through it (infra/demo-cluster).

The stack runs on free ports in its own state directory; the demo must find the injected fault
on the violations topic, on a worker's status page and as a firing Prometheus alert, and
`infra/dev-stack status` / `down` must say and do what they claim.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.conftest import _free_ports
from tests.e2e.conftest import vllm_python
from tests.stream_harness import ENV, KVLEDGER

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("KAFKA", "KAFKA_CONTROLLER", "SCHEMA_REGISTRY", "WORKER_1", "WORKER_2", "PROMETHEUS")


def dev_stack(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([ROOT / "infra" / "dev-stack", command], env=env, capture_output=True, text=True, timeout=180)


def _logs_of_parts_not_running(status: str, state: Path) -> str:
    """The tail of each log of a part `status` does not list as running, so a failure says why."""
    tails = []
    for name in re.findall(r"^(\S+)\s+(?!running\s)", status, re.M):
        log = state / f"{name}.log"
        if log.exists():
            tails.append(f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    return "".join(tails)


def test_demo_cluster_finds_the_fault_through_the_dev_stack(tmp_path):
    env = {
        **ENV,
        "KVLEDGER_STACK_DIR": str(tmp_path / "stack"),
        "KVLEDGER_DEMO_DIR": str(tmp_path / "demo"),
        "KVLEDGER_BIN": KVLEDGER,
        **{f"KVLEDGER_STACK_{part}_PORT": str(p) for part, p in zip(PARTS, _free_ports(len(PARTS)), strict=True)},
    }
    try:
        demo = subprocess.run(
            [ROOT / "infra" / "demo-cluster", vllm_python(), KVLEDGER],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        running = dev_stack("status", env)
        assert running.returncode == 0, running.stdout + _logs_of_parts_not_running(running.stdout, tmp_path / "stack")
        assert len(re.findall(r"^\S+\s+running\s+\S+$", running.stdout, re.M)) == 5, running.stdout
    finally:
        dev_stack("down", env)

    [fault] = re.findall(r"^FAULT step=(\d+) req=(\S+) group=(\d+)$", demo.stdout, re.M)
    [engine_id] = re.findall(r"^alert firing: KVLedgerViolation for engine (\S+) ", demo.stdout, re.M)
    found = [json.loads(line) for line in (tmp_path / "demo" / "violations.json").read_text().splitlines()]
    mine = [(v["kind"], str(v["step"]), v["req_id"], str(v["group"])) for v in found if v.get("engine_id") == engine_id]
    assert mine == [("write_target_mismatch", *fault)]
    assert f"status page: http://127.0.0.1:{env['KVLEDGER_STACK_WORKER_1_PORT']}/" in demo.stdout or (
        f"status page: http://127.0.0.1:{env['KVLEDGER_STACK_WORKER_2_PORT']}/" in demo.stdout
    )
    stopped = dev_stack("status", env)
    assert stopped.returncode == 1 and stopped.stdout.count(" stopped ") == 5, stopped.stdout
    assert not any(Path(tmp_path / "stack").glob("*.pid")), "down leaves no pid files"
    assert os.path.isdir(tmp_path / "stack" / "kafka"), "the broker's data stays for the next up"
