"""Replay throughput of `kvledger check`, in step-events per second.

A step-event is one rank's record of one step (input + plan). Two streams:
decode-heavy (64 running requests, one token each per step) and
prefill-heavy (long prompts in 2048-token chunks). Each is written to a file
ledger, then replayed by the same code path as `kvledger check`. In the same
run, to show where the time goes: Avro decoding alone, the core alone on the
batched path `kvledger check` uses (`Ledger.apply_many`), and the core step by
step (`Ledger.apply`, what the in-engine raise mode uses).

    python bench/replay_throughput.py [--steps N] [--repeat R]
    python bench/replay_throughput.py --baseline DIR [--pairs P] [--without-chains]

With --baseline, the same measurements run on another checkout of the
project (DIR, e.g. `git worktree add /tmp/base main`) and on this one, in
alternating processes, P pairs: the median ratio of each figure is printed
(a change to the core must not slow replay down). Each replays its own
producer's stream; --without-chains leaves the new requests' prefix chains
out of this checkout's (as producers before them wrote), so that a baseline
that predates them is compared on what both record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _root  # noqa: F401  (the checkout's root, for tests.synthetic)
from checkouts import env_importing, has_module  # bench/, beside this script

from kvledger.producer.sinks import FileSink
from kvledger.schemas import unpack_i32
from kvledger.schemas.files import discover, read_segment
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.replay import replay

if not has_module("kvledger.stream_app.core.events"):  # this checkout types records at its edges
    from kvledger.schemas.events import event_of, events_of
else:  # an older checkout's ledger typed what it was given (its new modules would come from this checkout)

    def event_of(record: dict) -> dict:
        return record

    def events_of(records: list[dict]) -> list[dict]:
        return records


from tests.synthetic.engine import SimConfig, simulate

STREAMS = {
    "decode-heavy": dict(
        max_num_seqs=64,
        max_batched_tokens=2048,
        arrival_rate=8,
        prompt_len=(16, 64),
        output_len=(4000, 8000),
        num_blocks=40000,
        prefix_caching=False,
    ),
    "prefill-heavy": dict(
        max_num_seqs=16,
        max_batched_tokens=2048,
        arrival_rate=4,
        prompt_len=(1500, 6000),
        output_len=(1, 4),
        num_blocks=40000,
        shared_prefix_prob=0.3,
    ),
}
TARGET_DECODE = 50_000


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(name: str, steps: int, repeat: int, chains: bool = True) -> dict:
    config = SimConfig(
        seed=1, steps=steps, snapshot_interval=500, health_interval=500, prefix_chains=chains, **STREAMS[name]
    )
    sim = simulate(config)
    step_events = sum(e["body"][0] == "kvledger.Step" for e in sim.events)
    reqs = [
        len(e["body"][1]["plan"]["req_indices"]) // 4
        for e in sim.events[-200:]
        if e["body"][0] == "kvledger.Step" and e["body"][1]["plan"]
    ]
    with tempfile.TemporaryDirectory() as root:
        with FileSink(root) as sink:
            sink.write(sim.events)
        segments = [p for s in discover(root) for p in s.segments]
        size = sum(p.stat().st_size for p in segments)

        def decode_only():
            for p in segments:
                for _ in read_segment(p, []):
                    pass

        def core_batched():
            ledger = Ledger()
            ledger.apply_many(events_of(sim.events))

        def core_stepwise():
            ledger = Ledger()
            for e in sim.events:
                ledger.apply(event_of(e))

        def check():
            result = replay(root)
            assert not result.violations, result.violations[:3]

        t_check, t_decode, t_core, t_step = (
            _best(f, repeat) for f in (check, decode_only, core_batched, core_stepwise)
        )
    tokens = sum(
        int(unpack_i32(e["body"][1]["plan"]["num_tokens"]).sum())
        for e in sim.events
        if e["body"][0] == "kvledger.Step" and e["body"][1]["plan"]
    )
    return {
        "stream": name,
        "step_events": step_events,
        "reqs_per_step": statistics.mean(reqs),
        "bytes_per_event": size / len(sim.events),
        "check": step_events / t_check,
        "decode": step_events / t_decode,
        "core": step_events / t_core,
        "stepwise": step_events / t_step,
        "tokens": tokens / t_check,
    }


_FIGURES = ("check", "decode", "core", "stepwise")


def _measure_in(checkout: Path, steps: int, repeat: int, chains: bool = True) -> dict:
    """The measurements of one process importing kvledger from `checkout`."""
    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, str(checkout / "bench" / "replay_throughput.py"), "--json"]
        cmd += ["--steps", str(steps), "--repeat", str(repeat)] + ([] if chains else ["--without-chains"])
        env = env_importing(checkout, Path(root))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{checkout}: the benchmark failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout)


def compare(baseline: Path, steps: int, repeat: int, pairs: int, chains: bool = True) -> None:
    here = Path(__file__).resolve().parents[1]
    ratios: dict[tuple[str, str], list[float]] = {}
    for i in range(pairs):
        order = [(baseline, "base"), (here, "this")] if i % 2 == 0 else [(here, "this"), (baseline, "base")]
        got = {label: _measure_in(path, steps, repeat, chains or label == "base") for path, label in order}
        for base, this in zip(got["base"], got["this"], strict=True):
            for figure in _FIGURES:
                ratios.setdefault((base["stream"], figure), []).append(this[figure] / base[figure])
            # What each checkout's producer records per event (the streams are each checkout's own).
            ratios.setdefault((base["stream"], "B/event"), []).append(this["bytes_per_event"] / base["bytes_per_event"])
        print(f"pair {i + 1}/{pairs} done", file=sys.stderr)
    print(f"this checkout / {baseline} (step-events/s: > 1 is faster; B/event: > 1 records more), {pairs} pairs")
    print(f"{'stream':<14} {'figure':<10} {'median':>8} {'min':>8} {'max':>8}")
    for (stream, figure), values in ratios.items():
        print(f"{stream:<14} {figure:<10} {statistics.median(values):>8.3f} {min(values):>8.3f} {max(values):>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure side by side with this one")
    parser.add_argument("--pairs", type=int, default=5, help="alternating process pairs, with --baseline")
    parser.add_argument("--without-chains", action="store_true", help="this checkout's streams without prefix chains")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one process of --baseline
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    if args.baseline is not None:
        return compare(args.baseline, args.steps, args.repeat, args.pairs, not args.without_chains)
    if args.json:
        chains = not args.without_chains
        return print(json.dumps([measure(name, args.steps, args.repeat, chains) for name in STREAMS]))
    columns = ("stream", "steps", "req/step", "B/event", "check/s", "decode/s", "core/s", "stepwise/s", "tokens/s")
    print(" ".join(f"{c:>14}" if i else f"{c:<14}" for i, c in enumerate(columns)))
    for name in STREAMS:
        r = measure(name, args.steps, args.repeat)
        values = (
            r["step_events"],
            r["reqs_per_step"],
            r["bytes_per_event"],
            r["check"],
            r["decode"],
            r["core"],
            r["stepwise"],
            r["tokens"],
        )
        print(f"{r['stream']:<14} " + " ".join(f"{v:>14,.0f}" if v >= 10 else f"{v:>14.1f}" for v in values))
        if r["stream"] == "decode-heavy":
            verdict = "meets" if r["check"] >= TARGET_DECODE else "misses"
            print(
                f"  decode-heavy `kvledger check`, target {TARGET_DECODE:,} step-events/s on one core: {verdict} "
                f"({r['check'] / TARGET_DECODE:.2f}x); core alone {r['core'] / TARGET_DECODE:.2f}x, "
                f"Avro decoding alone {r['decode'] / TARGET_DECODE:.2f}x"
            )


if __name__ == "__main__":
    main()
