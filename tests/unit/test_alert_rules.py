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
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kvledger.stream_app.worker.metrics import WorkerMetrics
from tests.conftest import prometheus_tool

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "infra" / "compose" / "prometheus"
RULES = RULES_DIR / "alerts.yml"
RULE_TESTS = RULES_DIR / "alerts_test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    return prometheus_tool("promtool")


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


# -- the commands the annotations give ------------------------------------------------------------------

# What Prometheus fills in, as a reader of an alert sees it: an engine id with a space in it, so that a
# command that does not quote it would split it into two arguments.
TEMPLATE_VALUES = {"engine": "decode node 2", "kind": "write_target_mismatch"}


def annotations(text: str) -> list[str]:
    """Every annotation's text, on one line or folded (`key: >-` and the lines indented below)."""
    found = []
    pattern = r"^(\s+)(?:summary|description): (?:>-\n((?:\1\s+.+\n)+)|(.+)$)"
    for _, folded, inline in re.findall(pattern, text, re.M):
        found.append(" ".join(folded.split()) if folded else inline.strip().strip('"'))
    return found


def filled(template: str) -> str:
    def value(match: re.Match) -> str:
        label = re.fullmatch(r"\$labels\.(\w+)", match[1].strip())
        return TEMPLATE_VALUES.get(label[1], label[1]) if label else "1"

    return re.sub(r"\{\{(.*?)\}\}", value, template)


def commands(text: str) -> list[list[str]]:
    """The `kvledger ...` commands of the annotations, templates filled in, split as a shell would."""
    return [shlex.split(filled(c))[1:] for a in annotations(text) for c in re.findall(r"`(kvledger [^`]*)`", a)]


def usage_error(args: list[str]) -> str | None:
    """What click says is wrong with `kvledger ARGS` (an unknown command or option, a missing
    argument, a bad value), without running it; None when it parses."""
    import click

    from kvledger.stream_app.cli import main

    name, *rest = args
    command = main.commands.get(name)
    if command is None:
        return f"No such command {name!r}"
    try:
        with main.make_context("kvledger", [name], resilient_parsing=True) as parent:
            command.make_context(name, rest, parent=parent).close()
    except click.UsageError as exc:
        return exc.format_message()
    return None


def run_command(args: list[str], monkeypatch) -> tuple[int, str]:
    """`kvledger ARGS` through click's runner, the violations topic read as empty (no broker)."""
    from click.testing import CliRunner

    from kvledger.stream_app.cli import main
    from kvledger.stream_app.worker import reader

    monkeypatch.setattr(reader, "read_violations", lambda *a, **kw: iter(()))
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def test_the_annotations_give_commands():
    rules = RULES.read_text()
    found = commands(rules)
    assert found, "no `kvledger ...` command in the alerts' annotations"
    [violation] = [a for a in annotations(rules) if "violation(s) on engine" in a]
    assert "`kvledger violations " in violation  # the alert a finding raises says how to read it
    assert commands(RULE_TESTS.read_text()), "the rule tests check the annotation with its command"


@pytest.mark.parametrize("source", [RULES, RULE_TESTS], ids=lambda p: p.name)
def test_every_command_in_an_annotation_is_valid(source, monkeypatch):
    for args in commands(source.read_text()):
        assert usage_error(args) is None, (args, usage_error(args))
        code, output = run_command(args, monkeypatch)
        assert "Usage:" not in output and "No such option" not in output, (args, output)
        assert code != 2, (args, output)
        if source is RULES and args[0] == "violations" and "--engine" in args:
            assert args[args.index("--engine") + 1] == TEMPLATE_VALUES["engine"], args  # quoted: one argument


def test_a_wrong_command_is_found(monkeypatch):
    """The checks can fail: an option the command line does not have, a command it does not have."""
    for args in (["violations", "--engine-id", "e1"], ["violation", "--engine", "e1"], ["query", "--step", "x"]):
        assert usage_error(args), args
        code, output = run_command(args, monkeypatch)
        assert code == 2 and ("No such option" in output or "Usage:" in output), output
    # An engine id left unquoted splits in two: the second part is an unexpected argument.
    unquoted = "`kvledger violations --bootstrap HOST:PORT --engine {{ $labels.engine }}`"
    assert usage_error(commands(f"    description: {unquoted}\n")[0])


def test_prometheus_is_found_in_the_projects_cache_and_nowhere_else(tmp_path):
    """infra/install-prometheus keeps both binaries in KVLEDGER_CACHE (as the broker's jars are),
    never in a system directory; `--find` says where, or fails in one line."""
    env = {"PATH": "/usr/bin:/bin", "KVLEDGER_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    script = ROOT / "infra" / "install-prometheus"
    missing = subprocess.run([script, "--find"], env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stdout == ""
    assert f"in {tmp_path}/prometheus/bin: run infra/install-prometheus" in missing.stderr
    cached = tmp_path / "prometheus" / "bin"
    cached.mkdir(parents=True)
    for tool in ("prometheus", "promtool"):  # stand-ins answering --version as Debian's do
        (cached / tool).write_text(f"#!/bin/sh\necho '{tool}, version 2.42.0+ds (branch: debian/sid)'\n")
        (cached / tool).chmod(0o755)
    found = subprocess.run([script, "--find"], env=env, capture_output=True, text=True)
    assert found.stdout == f"promtool={cached}/promtool 2.42.0+ds\n"
    assert "/usr/local" not in script.read_text()
