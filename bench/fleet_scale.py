"""One production-sized engine in the stream worker: checkpoint size and cost, memory, replay cost.

The engine: a pool of 262,144 blocks (16 tokens each), 1,024 running requests
holding ~90 % of it, decoding one token each per step, so ~64 requests cross
a block boundary and get a new block every step. Its events are built with the
producer's record builders (what the probes write), for TP=1 and TP=8 (every
rank gets the same scheduler output and runs the same plan).

Printed, per TP degree, side by side in one run:
  * replay cost per engine step (the eight ranks' records of TP=8 together),
    core only (`Ledger.apply_many`, as the worker calls it), and its ratio
    TP=8 / TP=1 (target <= 1.5);
  * the worker's checkpoint of the engine (`EngineProjection.checkpoint`,
    Avro): bytes (target <= 1 MB, or pieces under 512 KiB each) and build
    time (target <= 20 ms), best of 5;
  * resident memory the engine's state takes (RSS of a fresh process after
    the replay, minus before; target <= 64 MB).

    python bench/fleet_scale.py [--blocks N] [--requests R] [--steps S]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from kvledger.producer import records
from kvledger.schemas.events import events_of
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.worker.projection import CHUNK_BYTES, EngineProjection

BLOCK_SIZE = 16
TARGETS = {"tp_ratio": 1.5, "checkpoint_bytes": 1 << 20, "checkpoint_ms": 20.0, "rss_mb": 64.0}


def engine_steps(num_blocks: int, requests: int, steps: int, seed: int = 0):
    """(input, plan) per step of one engine: the first step admits every request with its blocks."""
    rng = np.random.default_rng(seed)
    pool = rng.permutation(np.arange(1, num_blocks, dtype=np.int64))  # a pool after months of churn
    per_req = int(0.9 * (num_blocks - 1)) // requests
    rows = [pool[i * per_req : (i + 1) * per_req] for i in range(requests)]
    free = list(pool[requests * per_req :])
    # Staggered positions: about 1/16 of the requests need a new block at each step.
    computed = np.array([per_req * BLOCK_SIZE - 1 - (i % BLOCK_SIZE) for i in range(requests)], np.int64)
    indices = np.arange(requests)
    for step in range(steps):
        if step == 0:
            new = [
                records.new_request(i, f"req-{i}", [rows[i]], int(computed[i]), int(computed[i]) + 1, 1)
                for i in range(requests)
            ]
            inp = records.step_input(new_reqs=new)
        else:
            appends = []
            for i in np.flatnonzero(computed % BLOCK_SIZE == 0).tolist():
                block = free.pop()
                rows[i] = np.append(rows[i], block)
                appends.append((i, 0, [block]))
            ones = np.ones(requests, np.int64)
            inp = records.step_input(cached_columns=(indices, computed, ones), appends=appends)
        lens = np.array([r.size for r in rows], np.int64)
        table = np.zeros((requests, int(lens.max())), np.int64)
        for i, r in enumerate(rows):
            table[i, : r.size] = r
        slots = table[indices, computed // BLOCK_SIZE] * BLOCK_SIZE + computed % BLOCK_SIZE
        group = records.group_plan_from_table(0, slots, requests, table, lens)
        plan = records.step_plan(indices, np.ones(requests), computed, [group])
        yield inp, plan
        computed = computed + 1


def rank_events(num_blocks: int, requests: int, steps: int, tp: int) -> list[dict]:
    """Every rank's events, interleaved step by step as a partition of the events topic holds them."""
    info = records.rank_info(
        dp_size=1,
        tp_size=tp,
        pp_size=1,
        kv_groups=[records.kv_group(0, "FULL_ATTENTION", BLOCK_SIZE, num_blocks)],
        vllm_version="bench",
        runner="v1",
    )
    ranks = [records.RankIdentity("fleet-engine", tp_rank=t) for t in range(tp)]
    events = [records.envelope(r, 0, 0, info) for r in ranks]
    for n, (inp, plan) in enumerate(engine_steps(num_blocks, requests, steps)):
        body = records.step(n, "REAL", inp, plan)
        events += [records.envelope(r, n + 1, 0, body) for r in ranks]
    return events


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def measure(num_blocks: int, requests: int, steps: int, tp: int) -> dict:
    events = rank_events(num_blocks, requests, steps, tp)
    warm, timed = events[: tp * 2], events[tp * 2 :]
    before = _rss_mb()
    ledger = Ledger(join_transfers=False)
    assert not ledger.apply_many(events_of(warm))
    start = time.perf_counter()
    found = ledger.apply_many(events_of(timed))
    replay = time.perf_counter() - start
    assert not found, found[:3]
    del events, warm, timed
    rss = _rss_mb() - before
    projection = EngineProjection("fleet-engine", ledger)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        blob = projection.checkpoint()
        times.append(time.perf_counter() - start)
    restored = EngineProjection.restore(blob, "fleet-engine")
    assert restored.ledger.ranks.keys() == ledger.ranks.keys()
    tables = [s.state for s in ledger.ranks.values() if s.state is not None]
    held = int(tables[0].groups[0].hold_count.astype(bool).sum())
    return {
        "tp": tp,
        "tables": len(tables),
        "held_blocks": held,
        "step_us": replay / (steps - 2) * 1e6,
        "checkpoint_bytes": len(blob),
        "checkpoint_pieces": -(-len(blob) // CHUNK_BYTES),
        "checkpoint_ms": min(times) * 1e3,
        "rss_mb": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=262_144)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tp", type=int, default=0, help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    if args.tp:
        print(json.dumps(measure(args.blocks, args.requests, args.steps, args.tp)))
        return
    results = {}
    for tp in (1, 8):  # each in a fresh process: resident memory is the process's own
        cmd = [sys.executable, __file__, f"--blocks={args.blocks}", f"--requests={args.requests}"]
        out = subprocess.run([*cmd, f"--steps={args.steps}", f"--tp={tp}"], capture_output=True, text=True, check=True)
        results[tp] = json.loads(out.stdout)
    print(f"engine: {args.blocks:,} blocks, {args.requests:,} requests, {args.steps} decode steps")
    print(
        f"{'':<6}{'tables':>7}{'held blocks':>12}{'us/step':>10}{'checkpoint':>12}{'pieces':>8}{'ckpt ms':>9}"
        f"{'state MB':>10}"
    )
    for tp, r in results.items():
        print(
            f"TP={tp:<3}{r['tables']:>7}{r['held_blocks']:>12,}{r['step_us']:>10,.0f}{r['checkpoint_bytes']:>12,}"
            f"{r['checkpoint_pieces']:>8}{r['checkpoint_ms']:>9.1f}{r['rss_mb']:>10.1f}"
        )
    ratio = results[8]["step_us"] / results[1]["step_us"]
    checks = [
        ("replay per step, TP=8 / TP=1", ratio, TARGETS["tp_ratio"], f"{ratio:.2f}x"),
        ("checkpoint bytes (TP=8)", results[8]["checkpoint_bytes"], TARGETS["checkpoint_bytes"], None),
        ("checkpoint build ms (TP=8)", results[8]["checkpoint_ms"], TARGETS["checkpoint_ms"], None),
        ("state MB (TP=8)", results[8]["rss_mb"], TARGETS["rss_mb"], None),
    ]
    for what, value, target, shown in checks:
        verdict = "meets" if value <= target else "misses"
        print(f"  {what}: {shown or f'{value:,.1f}'} (target <= {target:,}): {verdict}")


if __name__ == "__main__":
    main()
