"""Prometheus metrics of a worker. The names are a contract with the dashboards."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

from kvledger.schemas.kinds import ViolationKind

disable_created_metrics()  # one series per metric: the dashboards need no `_created` twins

# How long a retired engine's series stay exported. An engine that stops right after a fault
# (a KV corruption may well crash it) is retired within seconds; removed at once, its violation
# series would never be scraped and its alert never fire. Two 5-minute alert windows.
RETIRED_SERIES_S = 600.0


class WorkerMetrics:
    """The worker's metrics, in their own registry (served at /metrics)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # Retired engines whose series go at a deadline: engine -> (deadline, its ranks).
        self._retiring: dict[str, tuple[float, list[str]]] = {}
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
        self.ranks_out_of_sync = Gauge(
            "kvledger_ranks_out_of_sync",
            "Ranks whose checks miss some of what they did: tables waiting for a snapshot, or events "
            "their probes dropped (for the rest of the incarnation).",
            ["engine"],
            registry=r,
        )

        self.engines = Gauge("kvledger_engines", "Engines this worker holds state for.", registry=r)
        self.retired = Counter(
            "kvledger_engines_retired",
            "Engines retired: every rank shut down (closed), or silent for --retire-after (silent).",
            ["reason"],
            registry=r,
        )

    def engine_events(self, engine_id: str, n: int) -> None:
        self.events.labels(engine_id).inc(n)
        self._retiring.pop(engine_id, None)  # back before its series went: they stay

    def forget_engine(self, engine_id: str, ranks: list[str]) -> None:
        """A retired engine's series go, `RETIRED_SERIES_S` later: a worker that runs for months
        sees engines without end, and each must still be scraped once after its last finding."""
        self._retiring[engine_id] = (self.clock() + RETIRED_SERIES_S, ranks)

    def _drop_retired(self) -> None:
        now = self.clock()
        for engine_id, (deadline, ranks) in list(self._retiring.items()):
            if deadline > now:
                continue
            del self._retiring[engine_id]
            series = [(self.events, (engine_id,)), (self.ranks_out_of_sync, (engine_id,))]
            series += [(self.violations, (engine_id, kind)) for kind in ViolationKind]
            series += [(self.producer_dropped, (engine_id, rank)) for rank in ranks]
            for metric, labels in series:
                with contextlib.suppress(KeyError):  # never set
                    metric.remove(*labels)

    def exposition(self) -> bytes:
        self._drop_retired()
        return generate_latest(self.registry)
