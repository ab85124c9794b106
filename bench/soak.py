"""A soak of one stream worker: a restarting fleet, SIGKILLs, and the worker's memory over time.

200 engines of 8 TP ranks each run 6,250 steps (10^7 step-events in all) on
the real broker, produced through the engines' Kafka sink round by round (8
steps of each engine per round, generated engine by engine and lazily, so the
benchmark's own memory stays flat). Every engine restarts about twice, each
time under a new engine id and a new incarnation; half of its lives end with
a closing Health event on every rank (the worker retires it at once), the
others just go silent (retired after --retire-after seconds). Every tenth
engine carries faults in every life: a slot shift, a block-table swap, a rank
that diverges, and a rank missing at the life's last step (held until the
engine is retired). One `kvledger stream` worker projects it all and is
SIGKILLed and restarted twice (same state dir and group). Production is paced
to the worker: a round goes out once it has read the previous one, as a fleet
within its worker's capacity leaves it caught up now and then, which is when it
settles and retires engines.

While it runs, the worker's resident memory (VmRSS of its process: the
console script is the worker itself) is sampled every few seconds with the
events it has applied. At the end: throughput, the memory curve's verdict
(flat: its maximum over the last third of the last worker's life within 1.25x
of its value at the end of the first third) and the violations topic against
an offline replay of the same events, life by life (a `Ledger` each, and
`finish()` at the life's end, as retirement settles held steps): nothing lost,
nothing duplicated, every injected fault found exactly once.

    python bench/soak.py [--engines 200] [--tp 8] [--steps 6250] [--bootstrap HOST:PORT]

Without --bootstrap a private broker is started with infra/local-kafka.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import _root  # noqa: F401  (the checkout's root, for tests.stream_harness)
from stream_throughput import broker

# The soak's fleet and driver are shared with its short version in the tests.
from tests.stream_harness import (
    FleetSpec,
    Sample,
    Soak,
    SoakResult,
    SoakVerdict,
    judge,
    memory_flat,
)

TARGET_STEP_EVENTS = 10**7


def print_sample(s: Sample) -> None:
    print(f"{s.t:8.1f} {s.worker:>6} {s.applied:>14,.0f} {s.rss_mb:>9.1f}", flush=True)


def nearest(samples: list[Sample], t: float) -> Sample:
    return min(samples, key=lambda s: abs(s.t - t))


def report_throughput(r: SoakResult) -> None:
    print(f"\nstep-events: {r.step_events:,} ({r.events:,} events, {r.messages:,} messages), "
          f"from {r.spec.engines} engines x TP {'/'.join(map(str, r.spec.tp))}, "
          f"{len(r.reference.lives):,} lives (engine ids)")  # fmt: skip
    print(f"elapsed: {r.elapsed:,.0f} s (first event produced -> worker read and committed all), "
          f"{r.step_events / r.elapsed:,.0f} step-events/s end to end (generation, offline replay, "
          f"broker and worker sharing this machine)")  # fmt: skip
    cpu = max(s.cpu_s for s in r.samples)
    print(f"worker CPU: {cpu:,.0f} s over its {len(r.kills) + 1} processes, "
          f"{r.step_events / cpu:,.0f} step-events per worker CPU-second")  # fmt: skip


def report_memory(r: SoakResult) -> None:
    during = [s for s in r.samples if r.produced_from <= s.t <= r.read_by]
    start, middle, end = during[0], nearest(during, (r.produced_from + r.read_by) / 2), during[-1]
    peak = max(during, key=lambda s: s.rss_mb)
    print(f"worker RSS: start {start.rss_mb:.0f} MB, middle {middle.rss_mb:.0f} MB, end {end.rss_mb:.0f} MB, "
          f"max {peak.rss_mb:.0f} MB (at {peak.t:.0f} s, worker {peak.worker}); "
          f"after every engine retired {r.samples[-1].rss_mb:.0f} MB")  # fmt: skip
    flat, first, last = memory_flat(r.samples, r.read_by)
    print(f"memory flat: {'yes' if flat else 'NO'} (last worker: max over the last third of its life "
          f"{last:.0f} MB vs {first:.0f} MB at the end of its first third, ratio {last / first:.2f}, "
          f"limit 1.25)")  # fmt: skip
    print(f"this benchmark's own peak RSS: {own_peak_mb():.0f} MB")


def own_peak_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(text.split("VmHWM:")[1].split()[0]) / 1024


def report_violations(r: SoakResult, v: SoakVerdict) -> None:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(v.by_kind.items()))
    print(f"violations on the topic: {len(r.violations):,} ids ({kinds}); {r.resent} record(s) re-sent "
          f"under an id already there, {len(r.resent_differing)} of them with other bytes")  # fmt: skip
    offline = sum(r.reference.violations.values())
    print(f"no violation lost or duplicated: {'yes' if not v.lost and not v.extra else 'NO'} "
          f"(offline replay {offline:,}; lost {sum(v.lost.values())}, not found offline "
          f"{sum(v.extra.values())})")  # fmt: skip
    for what, items in (("lost", v.lost), ("not found offline", v.extra)):
        for key in sorted(items)[:5]:
            print(f"  {what}: {key}")
    if v.lost or v.extra:
        print_evidence(r, {json.loads(k)["engine_id"] for k in (v.lost + v.extra)})
    dead = ", ".join(f"{k} {n}" for k, n in sorted(r.dead_letters.items())) or "none"
    print(f"dead letters: {sum(r.dead_letters.values())} ({dead})")
    placed, odd = len(r.reference.faults), len(v.faults_not_once)
    print(f"every fault found once: {'yes' if not odd else 'NO'} ({placed:,} faults placed, "
          f"{placed - odd:,} found exactly once; {r.reference.unplaced} found no target)")  # fmt: skip
    for fault, online, offline in v.faults_not_once[:5]:
        print(f"  {fault}: published {online}x, offline {offline}x")


def print_evidence(r: SoakResult, engine_ids: set[str]) -> None:
    """What the workers' logs say of the engines whose violations differ (their lives' lines, warnings)."""
    for log in r.logs:
        lines = log.read_text(errors="replace").splitlines()
        shown = [line for line in lines if any(e in line for e in engine_ids) or "WARNING" in line or "ERROR" in line]
        print(f"  {log.name}: {len(shown)} line(s) of {len(lines)} name those engines or warn")
        for line in shown[:40]:
            print(f"    {line[:200]}")


def report_engines(r: SoakResult) -> None:
    live = sum(e["state"] == "live" for e in r.engines)
    print(f"engines at the end: {live} live in /engines, kvledger_engines {r.engines_gauge:.0f}; "
          f"{r.engine_series:,} kvledger_events_total series (one per engine id the last worker saw)")  # fmt: skip
    left = sorted(r.live_checkpoints)
    print(f"checkpoints left in the changelog after every engine ended: {len(left)}"
          + (f" ({', '.join(left[:6])}{', ...' if len(left) > 6 else ''})" if left else ""))  # fmt: skip


def extrapolate(r: SoakResult) -> None:
    if r.step_events >= 0.99 * TARGET_STEP_EVENTS:  # a missing-rank fault leaves out a few of the planned
        return
    hours = TARGET_STEP_EVENTS / (r.step_events / r.elapsed) / 3600
    cpu_hours = TARGET_STEP_EVENTS * max(s.cpu_s for s in r.samples) / r.step_events / 3600
    print(f"\nEXTRAPOLATION, not measured: at this run's rates, {TARGET_STEP_EVENTS:,} step-events would take "
          f"{hours:.1f} h end to end on this machine and {cpu_hours:.1f} worker CPU-hours")  # fmt: skip


@contextlib.contextmanager
def work_dir(keep: Path | None) -> Iterator[str]:
    if keep is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield tmp
        return
    keep.mkdir(parents=True, exist_ok=True)
    yield str(keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=200, help="engines running at once")
    parser.add_argument("--tp", type=int, default=8, help="TP ranks per engine")
    parser.add_argument("--steps", type=int, default=6250, help="steps of each engine over the run (all lives)")
    parser.add_argument("--lives", type=int, default=3, help="lives per engine, on average")
    parser.add_argument("--kills", default="0.2,0.4", help="SIGKILL the worker after these fractions of the run")
    parser.add_argument("--retire-after", type=float, default=60.0)
    parser.add_argument("--settle-after", type=float, default=5.0)
    parser.add_argument("--store", choices=("rocksdb", "memory"), default="rocksdb", help="the worker's tables")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--bootstrap", help="an existing broker (default: start one)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (worker logs, broker data)")
    args = parser.parse_args()
    # Engines' lives (new, restored, retired) are logged at info: the evidence when a verdict fails.
    os.environ.setdefault("KVLEDGER_TEST_WORKER_LOGLEVEL", "info")
    spec = FleetSpec(engines=args.engines, tp=(args.tp,), steps=args.steps, lives=args.lives)
    kills = tuple(float(f) for f in args.kills.split(",") if f)
    at = ", ".join(f"{k:.0%}" for k in kills)
    print(f"soak: {args.engines} engines x {args.tp} ranks x {args.steps:,} steps = {spec.step_events:,} "
          f"step-events planned; --store {args.store}; worker SIGKILLed at {at} of them")  # fmt: skip
    with work_dir(args.keep) as tmp, broker(args.bootstrap, Path(tmp)) as bootstrap:
        print(f"{'t (s)':>8} {'worker':>6} {'events applied':>14} {'RSS (MB)':>9}", flush=True)
        soak = Soak(
            bootstrap, spec, Path(tmp), settle_after=args.settle_after, retire_after=args.retire_after,
            sample_every=args.sample_every, on_sample=print_sample, worker_options=("--store", args.store),
        )  # fmt: skip
        result = soak.run(kills)
        report(result, args.retire_after)


def report(r: SoakResult, retire_after: float) -> None:
    kills = ", ".join(f"{t:.0f} s" for t in r.kills)
    print(f"kills at {kills}; 'events applied' sums the worker processes' kvledger_events_total "
          f"(a killed worker's unsaved tail is applied, and counted, again)")  # fmt: skip
    report_throughput(r)
    report_memory(r)
    report_violations(r, judge(r))
    report_engines(r)
    gap = "" if r.longest_round < 0.75 * retire_after else " (TOO CLOSE: live engines may have been retired)"
    print(f"longest an engine waited between two of its chunks: {r.longest_round:.1f} s, "
          f"--retire-after {retire_after:.0f} s{gap}")  # fmt: skip
    extrapolate(r)


if __name__ == "__main__":
    main()
