"""A retired engine's series stay exported for a while, so a scrape still sees its last findings."""

from __future__ import annotations

from kvledger.stream_app.worker.metrics import RETIRED_SERIES_S, WorkerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def series(m: WorkerMetrics, engine: str) -> list[str]:
    return [line for line in m.exposition().decode().splitlines() if f'engine="{engine}"' in line]


def test_a_retired_engines_series_go_after_the_grace_period_only():
    clock = Clock()
    m = WorkerMetrics(clock)
    m.engine_events("e1", 10)
    m.violations.labels("e1", "write_target_mismatch").inc()
    m.producer_dropped.labels("e1", "dp0-tp0-pp0").set(3)
    m.engine_events("e2", 1)
    m.forget_engine("e1", ["dp0-tp0-pp0"])  # retired right after its finding
    clock.now = RETIRED_SERIES_S - 1
    assert len(series(m, "e1")) == 3  # still scraped: the violation alert can fire
    clock.now = RETIRED_SERIES_S + 1
    assert series(m, "e1") == [] and len(series(m, "e2")) == 1


def test_an_engine_back_before_the_deadline_keeps_its_series():
    clock = Clock()
    m = WorkerMetrics(clock)
    m.engine_events("e1", 10)
    m.forget_engine("e1", [])
    clock.now = 5.0
    m.engine_events("e1", 2)
    clock.now = RETIRED_SERIES_S * 2
    assert series(m, "e1") == ['kvledger_events_total{engine="e1"} 12.0']
