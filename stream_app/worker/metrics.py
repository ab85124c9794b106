"""Prometheus metrics of a worker. The names are a contract with the dashboards."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

from kvledger.stream_app.core.violations import KINDS

disable_created_metrics()  # one series per metric: the dashboards need no `_created` twins


class WorkerMetrics:
    """The worker's metrics, in their own registry (served at /metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # prometheus-client appends `_total` to counter names on exposition.
        self.events = Counter("kvledger_events", "Ledger events applied.", ["engine"], registry=r)
        self.violations = Counter("kvledger_violations", "Violations found.", ["engine", "kind"], registry=r)
        self.unchecked = Counter("kvledger_unchecked", "Checks that could not run.", ["reason"], registry=r)
        self.deadletters = Counter(
            "kvledger_deadletter", "Records sent to the dead-letter topic.", ["reason"], registry=r
        )
        self.consumer_lag = Gauge(
            "kvledger_consumer_lag", "Records not yet read, per partition.", ["topic", "partition"], registry=r
        )
        self.producer_dropped = Gauge(
            "kvledger_producer_dropped_events",
            "Events the engine's probes dropped (from Health events, cumulative per incarnation).",
            ["engine", "rank"],
            registry=r,
        )

        self.engines = Gauge("kvledger_engines", "Engines this worker holds state for.", registry=r)
        self.retired = Counter(
            "kvledger_engines_retired",
            "Engines retired: every rank shut down (closed), or silent for --retire-after (silent).",
            ["reason"],
            registry=r,
        )

    def forget_engine(self, engine_id: str, ranks: list[str]) -> None:
        """A retired engine's series go: a worker that runs for months sees engines without end."""
        series = [(self.events, (engine_id,))]
        series += [(self.violations, (engine_id, kind)) for kind in KINDS]
        series += [(self.producer_dropped, (engine_id, rank)) for rank in ranks]
        for metric, labels in series:
            with contextlib.suppress(KeyError):  # never set
                metric.remove(*labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
