"""What the worker's views and its status page say, without Kafka: a rank is "in sync" only while
its checks cover all it did; the page says "none" of violations only where it lists none."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvledger.schemas.events import events_of
from kvledger.stream_app.worker.metrics import WorkerMetrics
from kvledger.stream_app.worker.projection import EngineProjection
from kvledger.stream_app.worker.views import engines_view
from tests.synthetic.engine import SimConfig, simulate

HEALTH = "kvledger.Health"


def projection(engine_id: str, dropped: int = 0) -> EngineProjection:
    """An engine applied whole; with `dropped`, its probes' last Health counts that many events lost."""
    events = simulate(SimConfig(seed=4, engine_id=engine_id, steps=40, health_interval=10)).events
    if dropped:
        at = max(i for i, e in enumerate(events) if e["body"][0] == HEALTH)
        name, body = events[at]["body"]
        events[at] = {**events[at], "body": (name, {**body, "events_dropped": dropped})}
    engine = EngineProjection(engine_id)
    engine.ledger.apply_many(events_of(events))
    return engine


def worker(*engines: EngineProjection) -> SimpleNamespace:
    """The part of a StreamWorker engines_view reads."""
    return SimpleNamespace(engines={e.engine_id: e for e in engines}, anchors={}, retired=[], lag=lambda tp: None)


def test_a_rank_whose_probes_dropped_events_is_not_in_sync():
    lossy, whole = projection("lossy", dropped=3), projection("whole")
    view = {e["engine_id"]: e["ranks"] for e in engines_view(worker(lossy, whole))}
    assert [(r["events_dropped"], r["in_sync"]) for r in view["lossy"]] == [(3, False)]
    assert [(r["events_dropped"], r["in_sync"]) for r in view["whole"]] == [(0, True)]
    assert (lossy.ledger.ranks_out_of_sync, whole.ledger.ranks_out_of_sync) == (1, 0)


def test_the_out_of_sync_gauge_goes_with_a_retired_engine():
    metrics = WorkerMetrics(clock=lambda: 1e9)
    metrics.ranks_out_of_sync.labels("lossy").set(1)
    assert 'kvledger_ranks_out_of_sync{engine="lossy"} 1.0' in metrics.exposition().decode()
    metrics.forget_engine("lossy", [])
    metrics.clock = lambda: 2e9
    assert "lossy" not in metrics.exposition().decode()


PAGE = Path(__file__).resolve().parents[2] / "stream_app" / "worker" / "status.html"


def page_function(name: str) -> str:
    """One top-level function of the status page's script, as written."""
    found = re.search(rf"^function {name}\(.*?^\}}$", PAGE.read_text(), re.M | re.S)
    assert found, f"no function {name} in {PAGE.name}"
    return found[0]


def test_the_page_says_none_of_violations_only_where_it_lists_none():
    """The plots are this worker's last 30 minutes; the table below lists the fleet's recent violations.
    With one listed and none plotted, the page said "none" above it."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("no node to run the page's script: run infra/install-chromium (make test does)", pytrace=False)
    script = page_function("violationPlotsNote") + "\nconsole.log(JSON.stringify([0, 1, 3].map(violationPlotsNote)));"
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=30, check=True).stdout
    none, one, three = json.loads(out)
    assert none == "none"
    assert one.startswith("none in this worker's last 30 minutes; the 1 violation(s) listed below"), one
    assert "the 3 violation(s) listed below" in three
    assert "violationPlotsNote(listed)" in page_function("renderPlots")
    assert "shown.length" in page_function("renderOverview").split("renderPlots(", 1)[1].split("\n", 1)[0]
