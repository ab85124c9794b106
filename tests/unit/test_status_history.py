"""The worker's history for the status page (stream_app/worker/history.py): rates from the event
counters, a ring bounded in time and in series whatever the number of engines."""

from __future__ import annotations

from kvledger.stream_app.worker.history import MAX_SERIES, OTHER, History, Readings, read_registry, series_count
from kvledger.stream_app.worker.metrics import WorkerMetrics


def test_samples_read_the_worker_metrics_and_rate_the_events():
    metrics, history = WorkerMetrics(), History()
    metrics.engine_events("e1", 100)
    metrics.violations.labels("e1", "write_target_mismatch").inc()
    metrics.consumer_lag.labels("t.events", "0").set(7)
    metrics.producer_dropped.labels("e1", "dp0-tp0-pp0").set(3)
    first = history.record(read_registry(metrics.registry), now=1000.0)
    assert first.events_per_s == {}  # a rate needs two reads
    metrics.engine_events("e1", 50)
    second = history.record(read_registry(metrics.registry), now=1002.0)
    assert second.events_per_s == {("e1",): 25.0}
    assert second.lag == {("0",): 7.0}
    assert second.dropped == {("e1", "dp0-tp0-pp0"): 3.0}
    assert second.violations == {("e1", "write_target_mismatch"): 1.0}
    view = history.view()
    assert view["t"] == [1000.0, 1002.0]
    assert view["events_per_s"] == [{"engine": "e1", "values": [None, 25.0]}]
    assert view["violations"] == [{"engine": "e1", "kind": "write_target_mismatch", "values": [1.0, 1.0]}]


def test_the_ring_is_bounded_whatever_the_engines():
    history = History(interval_s=2.0, window_s=60.0)
    for i in range(100):  # 100 samples of 500 engines, each with violations of two kinds
        engines = {(f"e{j}",): float(i * j) for j in range(500)}
        kinds = {(f"e{j}", k): float(j) for j in range(500) for k in ("a", "b")}
        history.record(Readings(events=engines, violations=kinds), now=2.0 * i)
    assert len(history.samples) == 30
    last = history.samples[-1]
    assert len(last.events_per_s) == MAX_SERIES + 1 and (OTHER,) in last.events_per_s
    assert len(last.violations) == MAX_SERIES + 2 and {(OTHER, "a"), (OTHER, "b")} <= set(last.violations)
    # Nothing lost in the fold: the totals stay.
    assert sum(last.violations.values()) == 2 * sum(range(500))
    assert series_count(history.samples) <= 30 * 2 * (MAX_SERIES + 2)
