"""Cluster mode end to end: real vLLM engines -> Kafka sink -> the real broker -> `kvledger stream`
-> the violations topic, read back with `kvledger violations`.

One clean engine and one with the slot mapping shifted at one step trace to
the same events topic. The clean engine's events, read from the topic, are
every one it captured, in order, closed, and replay clean; the worker must
report exactly the injected fault, with its kind, engine, step and request,
and nothing for the clean engine.
The worker's status page, rendered by headless Chromium (infra/install-chromium),
must show both engines and the violation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid

import pytest

from kvledger.schemas.events import event_of
from kvledger.stream_app.core import Ledger
from tests.e2e.test_vllm_trace import PRESSURE
from tests.stream_harness import (
    BATCHES,
    events_done,
    events_per_engine,
    online_violations,
    read_all,
    start_worker,
    wait_for,
)


def rendered_page(url: str) -> str:
    """The DOM of `url` after its scripts ran, as headless Chromium renders it."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("no chromium on PATH (run infra/install-chromium)", pytrace=False)
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def assert_every_event_delivered_and_clean(events: list[dict]) -> None:
    """The Kafka sink from a real engine: every event it captured on the topic, replayed clean."""
    assert events and [e["seq"] for e in events] == list(range(len(events)))
    assert events[-1]["body"][0] == "kvledger.Health" and events[-1]["body"][1]["events_dropped"] == 0
    assert events[-1]["body"][1]["closing"] and not any(e["body"][1].get("closing") for e in events[:-1])
    ledger = Ledger()
    assert [v for e in events for v in ledger.apply(event_of(e))] + ledger.finish() == []
    assert ledger.closed  # the engine shut down cleanly: a worker would retire it now
    assert ledger.coverage.checks["write"] > 10


@pytest.fixture
def worker(kafka_bootstrap, tmp_path):
    prefix = f"e2e{uuid.uuid4().hex[:8]}"
    args = ("--partitions", "2", "--store", "memory", "--settle-after", "1")
    worker = start_worker(kafka_bootstrap, prefix, tmp_path / "state", tmp_path / "worker.log", *args)
    try:
        yield prefix, worker
    finally:
        worker.stop()


def test_engines_through_kafka_to_the_violations_topic(kafka_bootstrap, worker, engine):
    prefix, worker = worker
    topic = f"{prefix}.events"
    spec = {**PRESSURE, "max_tokens": 12, "num_blocks": 64}
    kv_trace = {"enabled": True, "sink": f"kafka://{kafka_bootstrap}/{topic}", "snapshot_interval": 16}
    engine({**spec, "kv_trace": kv_trace})
    assert_every_event_delivered_and_clean(
        [e for m in read_all(kafka_bootstrap, topic) for e in BATCHES.decode(m.value())]
    )
    faulty = engine({**spec, "kv_trace": kv_trace}, fault="slot_shift", fault_step=6)
    [injected] = faulty.faults
    # With a Kafka sink the engine only records (`action: record`): the worker alone finds the fault.
    assert "kv_trace: write_target_mismatch" not in faulty.log, faulty.log[-3000:]

    # Wait until the worker has applied every record of both engines and holds no step.
    produced = events_per_engine(kafka_bootstrap, topic)
    assert len(produced) == 2, produced
    wait_for("every event applied", events_done([worker], dict(produced)), [worker], timeout=120)

    violations, summary = online_violations(kafka_bootstrap, prefix)
    assert [(v["kind"], v["step"], v["req_id"]) for v in violations] == [
        ("write_target_mismatch", int(injected["step"]), injected["req"])
    ]
    assert summary["violations"] == {"write_target_mismatch": 1}

    # The status page, as a browser shows it: both engines' ranks, the violation in red.
    page = rendered_page(f"http://127.0.0.1:{worker.port}/")
    engines_table = re.search(r'<table id="engines">(.*?)</table>', page, re.S)[1]
    violations_table = re.search(r'<table id="violations">(.*?)</table>', page, re.S)[1]
    assert all(engine_id in engines_table for engine_id in produced), engines_table
    assert re.search(r'<td class="bad">write_target_mismatch</td>', violations_table), violations_table
    assert injected["req"] in violations_table
    assert "1 recent violation(s)" in page
