"""The shipped alert rules in a real Prometheus, scraping a real stream worker.

A worker projects two synthetic engines from the real broker, one clean and
one with injected faults; Prometheus (Debian's package, `infra/install-prometheus`)
loads `infra/compose/prometheus/alerts.yml` as the dev stack does and scrapes
the worker's /metrics every second. The violation alert must fire for the
faulty engine, once per kind the worker published, and never for the clean
one; a killed worker must raise the worker-down alert.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import prometheus_tool
from tests.stream_harness import Worker, events_done, free_port, online_violations, produce, start_worker, wait_for
from tests.synthetic.engine import FaultSpec, SimConfig, simulate

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "infra" / "compose" / "prometheus" / "alerts.yml"
JOB = "kvledger-workers"  # the job the worker-down rule names
STEPS = 80
CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {rules}
scrape_configs:
  - job_name: {job}
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


class Prometheus:
    def __init__(self, port: int, proc: subprocess.Popen, log: Path):
        self.port, self.proc, self.log = port, proc, log

    def api(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/{path}", timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self, name: str, state: str = "firing") -> list[dict]:
        return [
            a["labels"]
            for a in self.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == state
        ]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False


def wait_until(what: str, condition: Callable[[], bool], prometheus: Prometheus, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        assert prometheus.proc.poll() is None, f"prometheus exited:\n{prometheus.log.read_text()[-2000:]}"
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; alerts: {prometheus.api('alerts')}")


@pytest.fixture
def prometheus(tmp_path) -> Iterator[Callable[[int], Prometheus]]:
    """`start(worker_port)`: a Prometheus with the shipped rules scraping that worker."""
    binary = prometheus_tool("prometheus")
    started: list[Prometheus] = []

    def start(worker_port: int) -> Prometheus:
        config = tmp_path / "prometheus.yml"
        config.write_text(CONFIG.format(rules=RULES, job=JOB, port=worker_port))
        port, log = free_port(), tmp_path / "prometheus.log"
        args = [
            binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]  # fmt: skip
        server = Prometheus(port, subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT), log)
        started.append(server)
        wait_until("prometheus to be ready", server.ready, server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.proc.terminate()
            server.proc.wait(20)


def engine_events(engine_id: str, faults: tuple[FaultSpec, ...]) -> list[dict]:
    # Closed at the end, like an engine that stops (or crashes) right after its fault: the worker
    # retires it within a second, and its series must outlive that for the alert to fire.
    config = SimConfig(
        seed=7, engine_id=engine_id, steps=STEPS, tp_size=2, snapshot_interval=40, faults=faults, close_at_end=True
    )
    return simulate(config).events


def test_violation_alert_fires_for_the_faulty_engine_only(kafka_bootstrap, tmp_path, prometheus):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    clean = engine_events("eng-clean", ())
    faulty = engine_events("eng-faulty", (FaultSpec("slot_shift", 20), FaultSpec("rank_divergence", 50, tp_rank=1)))
    worker: Worker = start_worker(
        kafka_bootstrap, prefix, tmp_path / "state", tmp_path / "worker.log", "--partitions", "1", "--settle-after", "1"
    )
    try:
        server = prometheus(worker.port)
        rules = {r["name"] for g in server.api("rules")["groups"] for r in g["rules"]}
        assert {"KVLedgerViolation", "KVLedgerWorkerDown", "KVLedgerProducerDropping"} <= rules, rules
        wait_until("the worker's scrape target up", lambda: _target_up(server), server)

        produce(kafka_bootstrap, f"{prefix}.events", [*clean, *faulty])
        wait_for(
            "the worker to apply every event",
            events_done([worker], {"eng-clean": len(clean), "eng-faulty": len(faulty)}),
            [worker],
        )
        published, _ = online_violations(kafka_bootstrap, prefix)
        kinds = {v["kind"] for v in published}
        assert {v["engine_id"] for v in published} == {"eng-faulty"} and {
            "write_target_mismatch",
            "rank_divergence",
        } <= kinds

        def fired() -> bool:
            return {(a["engine"], a["kind"]) for a in server.alerts("KVLedgerViolation")} == {
                ("eng-faulty", kind) for kind in kinds
            }

        wait_until("one violation alert per kind on the faulty engine", fired, server)
        retired = {e["engine_id"] for e in json.loads(worker.get("/engines")) if e["state"] == "retired"}
        assert retired == {"eng-clean", "eng-faulty"}, retired
        [alert] = [a for a in server.api("alerts")["alerts"] if a["labels"].get("kind") == "write_target_mismatch"]
        assert alert["annotations"]["summary"] == "kvledger: write_target_mismatch on engine eng-faulty"
        assert server.alerts("KVLedgerWorkerDown", "pending") == [] and server.alerts("KVLedgerWorkerDown") == []

        worker.kill()
        # The rule waits a minute before firing; pending is what a minute-long test can see.
        wait_until(
            "the worker-down alert pending", lambda: bool(server.alerts("KVLedgerWorkerDown", "pending")), server
        )
        assert all(a["engine"] == "eng-faulty" for a in server.alerts("KVLedgerViolation"))
    finally:
        worker.stop()


def _target_up(server: Prometheus) -> bool:
    result = server.api("query?query=" + urllib.request.quote(f'up{{job="{JOB}"}}'))["result"]
    return bool(result) and result[0]["value"][1] == "1"
