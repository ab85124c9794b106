"""The alert rules shipped for the stream workers, tested with Prometheus's own promtool.

`promtool test rules` replays the series of `alerts_test.yml` through
`alerts.yml` and compares the alerts firing at each evaluation time, labels
and annotations included; the checks here also keep the rules in step with
the metrics the workers really export, and prove the harness fails when a rule
is wrong. promtool comes from Debian's prometheus package
(`infra/install-prometheus`, run by `make test`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvledger.stream_app.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "infra" / "compose" / "prometheus"
RULES = RULES_DIR / "alerts.yml"
RULE_TESTS = RULES_DIR / "alerts_test.yml"
INSTALLED = (Path("/usr/local/bin/promtool"), Path.home() / ".local" / "bin" / "promtool")


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool") or next((str(p) for p in INSTALLED if p.exists()), None)
    if found is None:
        pytest.fail("no promtool: run infra/install-prometheus (make test does)", pytrace=False)
    return found


def run(promtool: str, *args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def alerts(text: str) -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)$", text, re.M)


def expressions(text: str) -> list[str]:
    """The rules' expressions, on one line or folded (`expr: >-` and the lines indented below)."""
    found = []
    for folded, inline in re.findall(r"^\s+expr: (?:>-\n((?:\s{10,}.+\n)+)|(.+)$)", text, re.M):
        found.append(" ".join(folded.split()) if folded else inline.strip())
    return found


def test_the_rules_are_valid(promtool):
    done = run(promtool, "check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts(RULES.read_text()))} rules found" in done.stdout


def test_every_rule_fires_and_stays_silent_where_its_tests_say(promtool):
    done = run(promtool, "test", "rules", RULE_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_tested_firing_and_silent():
    tests = RULE_TESTS.read_text()
    # Per alert: the evaluations that expect it firing and those that expect nothing.
    evaluations = re.findall(r"alertname: (\w+)\n\s+exp_alerts:(.*?)(?=\n\s+- eval_time:|\n\s+- name:|\Z)", tests, re.S)
    firing = {name for name, body in evaluations if "exp_labels" in body}
    silent = {name for name, body in evaluations if body.strip().startswith("[]")}
    names = set(alerts(RULES.read_text()))
    assert len(names) == 5
    assert firing == names, f"never tested firing: {names - firing}"
    assert silent == names, f"never tested silent: {names - silent}"


def test_the_rules_read_only_metrics_the_workers_export():
    exported = {m.name for m in WorkerMetrics().registry.collect()}
    # Counters are exposed with `_total`; prometheus-client reports their names without it.
    names = exported | {f"{name}_total" for name in exported}
    exprs = expressions(RULES.read_text())
    assert len(exprs) == len(alerts(RULES.read_text()))
    used = {m for e in exprs for m in re.findall(r"\b(kvledger_\w+)", e)}
    assert used and used <= names, f"not exported by the workers: {used - names}"
    assert {e for e in exprs if "kvledger_" not in e} == {'up{job="kvledger-workers"} == 0'}


def test_a_wrong_rule_fails_its_tests(promtool, tmp_path):
    """The harness can fail: the violation alert with `increase` alone misses a violation that
    created its series (a kind's first on an engine), the case its second branch is there for."""
    rules = RULES.read_text()
    [branch] = re.findall(r"\n +or sum by \(engine, kind\) \(kvledger_violations_total unless .*", rules)
    (tmp_path / RULES.name).write_text(rules.replace(branch, ""))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = run(promtool, "test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0
    assert "alertname: KVLedgerViolation, time: 8m" in done.stdout + done.stderr
