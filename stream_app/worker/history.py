"""A short history of the worker's own metrics, for the status page's plots (/history).

Every `INTERVAL_S` the worker's registry is read (the same series /metrics
exports, their meaning untouched): events applied per engine (turned into a
rate), consumer lag per partition, events dropped by producers per engine and
rank, violations per engine and kind. Samples go into a ring holding the last
`WINDOW_S`; each sample keeps at most `MAX_SERIES` series per measure (the
largest), the rest folded into one "(other)" series, so memory is bounded
whatever the number of engines a worker sees.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

INTERVAL_S = 2.0  # between samples
WINDOW_S = 1800.0  # the ring's span: the last 30 minutes
MAX_SERIES = 24  # per measure and sample; the rest summed into OTHER
OTHER = "(other)"

# A series' labels: (engine,) for events, (partition,) for lag, (engine, rank) for drops,
# (engine, kind) for violations.
Labels = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Sample:
    """The worker's metrics at one moment; each measure maps a series' labels to its value."""

    t: float  # wall-clock seconds since the epoch: the plots' time axis
    events_per_s: dict[Labels, float]  # engine -> events applied per second since the previous sample
    lag: dict[Labels, float]  # events partition -> records not yet read
    dropped: dict[Labels, float]  # (engine, rank) -> events its probes dropped (cumulative per incarnation)
    violations: dict[Labels, float]  # (engine, kind) -> violations found so far


@dataclass
class Readings:
    """One read of the registry: the raw series of the measures sampled."""

    events: dict[Labels, float] = field(default_factory=dict)  # engine -> kvledger_events_total
    lag: dict[Labels, float] = field(default_factory=dict)  # partition -> kvledger_consumer_lag
    dropped: dict[Labels, float] = field(default_factory=dict)  # (engine, rank) -> producer drops
    violations: dict[Labels, float] = field(default_factory=dict)  # (engine, kind) -> kvledger_violations_total


# metric sample name -> (Readings field, the labels that name a series)
_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvledger_events_total": ("events", ("engine",)),
    "kvledger_consumer_lag": ("lag", ("partition",)),
    "kvledger_producer_dropped_events": ("dropped", ("engine", "rank")),
    "kvledger_violations_total": ("violations", ("engine", "kind")),
}


def read_registry(registry: CollectorRegistry) -> Readings:
    """The sampled series as the registry holds them now."""
    out = Readings()
    for metric in registry.collect():
        for s in metric.samples:
            source = _SOURCES.get(s.name)
            if source is not None:
                name, labels = source
                getattr(out, name)[tuple(s.labels.get(k, "") for k in labels)] = s.value
    return out


def capped(series: dict[Labels, float], limit: int = MAX_SERIES) -> dict[Labels, float]:
    """The `limit` largest series; the others summed into one per trailing label (its first label
    OTHER), so a kind or a rank stays apart while the engines beyond the cap are merged."""
    if len(series) <= limit:
        return dict(series)
    kept = dict(heapq.nlargest(limit, series.items(), key=lambda kv: (kv[1], kv[0])))
    for labels, value in series.items():
        if labels not in kept:
            folded = (OTHER, *labels[1:])
            kept[folded] = kept.get(folded, 0.0) + value
    return kept


class History:
    """The ring of samples; `record` is fed readings, `view` serves them."""

    def __init__(self, interval_s: float = INTERVAL_S, window_s: float = WINDOW_S, max_series: int = MAX_SERIES):
        self.interval_s, self.window_s, self.max_series = interval_s, window_s, max_series
        self.samples: deque[Sample] = deque(maxlen=max(1, int(window_s / interval_s)))
        # The previous read of each engine's event counter and its time, for the rate; only engines
        # the registry still exports, so it is bounded by the metrics' own retention.
        self._last_events: dict[Labels, float] = {}
        self._last_t: float | None = None

    def record(self, readings: Readings, now: float | None = None) -> Sample:
        t = time.time() if now is None else now
        dt = t - self._last_t if self._last_t is not None else None
        rates = {}
        for labels, total in readings.events.items():
            before = self._last_events.get(labels)
            if dt and dt > 0 and before is not None:
                rates[labels] = max(total - before, 0.0) / dt  # a series re-created after retiring restarts
        self._last_events, self._last_t = dict(readings.events), t
        cap = self.max_series
        sample = Sample(
            t,
            capped(rates, cap),
            capped(readings.lag, cap),
            capped(readings.dropped, cap),
            capped(readings.violations, cap),
        )
        self.samples.append(sample)
        return sample

    def view(self) -> dict:
        """The ring as columns: the sample times, and per measure each series' values at those times
        (null where a sample lacks the series)."""
        samples = list(self.samples)

        def columns(measure: str, names: tuple[str, ...]) -> list[dict]:
            keys = sorted({labels for s in samples for labels in getattr(s, measure)})
            return [
                {**dict(zip(names, labels, strict=True)), "values": [getattr(s, measure).get(labels) for s in samples]}
                for labels in keys
            ]

        return {
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "max_series": self.max_series,
            "t": [s.t for s in samples],
            "events_per_s": columns("events_per_s", ("engine",)),
            "lag": columns("lag", ("partition",)),
            "dropped": columns("dropped", ("engine", "rank")),
            "violations": columns("violations", ("engine", "kind")),
        }


def series_count(samples: Iterable[Sample]) -> int:
    """Values the ring holds (a bound on its memory, for tests)."""
    return sum(len(s.events_per_s) + len(s.lag) + len(s.dropped) + len(s.violations) for s in samples)
