"""What the worker's views say of its engines' ranks, without Kafka: a rank is "in sync" only while
its checks cover all it did."""

from __future__ import annotations

from types import SimpleNamespace

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
