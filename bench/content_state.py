"""What content digests cost outside the engine's forward pass, at production pool sizes.

* the rank's `SealTracker` (producer/content.py): memory (two arrays over the pool, whatever the
  fraction) and the time `due` takes per decode step (choosing what to digest: unsealing written
  blocks, sealing newly full ones, the sweep), for a pool of 10^6 blocks and 256 requests;
* the core's `ContentLedger` (stream_app/core/content.py): memory per sealed block it keeps a
  reference for, and the time per digest it compares, for 10^5 sealed blocks on TP=1 and TP=8
  (every rank keeps its own references: TP=8 holds eight per block).

    python bench/content_state.py [--blocks N] [--sealed S]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from kvledger.producer import records
from kvledger.producer.content import GroupRows, SealTracker
from kvledger.schemas.events import BlockDigests, typed
from kvledger.stream_app.core.content import ContentLedger
from kvledger.stream_app.core.violations import Coverage, RankKey

BLOCK_SIZE = 16


def tracker_figures(num_blocks: int, requests: int, steps: int, whole: bool = False) -> tuple[float, float]:
    """(MB, µs per step) of one rank's tracker, every block sampled, requests decoding in rows of up
    to 128 blocks; with `row_ids` (rows keep their requests) and without (every row looked at whole)."""
    tracemalloc.start()
    tracker = SealTracker(num_blocks, 1.0, sweep=4)
    mb = tracemalloc.get_traced_memory()[0] / 1e6
    tracemalloc.stop()
    width = 128
    rng = np.random.default_rng(0)
    table = rng.choice(np.arange(1, num_blocks), size=(requests, width), replace=False).astype(np.int32)
    computed = rng.integers(16, width * BLOCK_SIZE - steps - 1, size=requests).astype(np.int64)
    none = np.array([], np.int64)
    row_ids = [f"req-{i}" for i in range(requests)]
    start = time.perf_counter()
    for _ in range(steps):
        lens = (computed // BLOCK_SIZE + 1).astype(np.int32)  # the block being written is the last
        rows = [GroupRows(0, BLOCK_SIZE, True, False, table, lens)]
        tracker.due(rows, computed, none, {}, none, None, None if whole else row_ids)
        computed += 1
    return mb, (time.perf_counter() - start) / steps * 1e6


def ledger_figures(sealed: int, tp: int) -> tuple[float, float]:
    """(bytes per sealed block and rank, µs per compared digest) of the core's references."""
    holders = lambda block: []  # noqa: E731 - nothing to name on a clean run
    blocks = np.arange(1, sealed + 1, dtype=np.int32)
    values = blocks.astype(np.int64) * 0x9E3779B97F4A7C1  # any distinct digests
    chunk = 4096

    def digests(reason: str, at: int) -> BlockDigests:
        part = slice(at, at + chunk)
        d = records.block_digests(
            np.zeros(blocks[part].size, np.int32), blocks[part], values[part], [reason] * blocks[part].size
        )
        return typed(BlockDigests, d)

    seals = [digests("SEALED", at) for at in range(0, sealed, chunk)]
    sweeps = [digests("SWEEP", at) for at in range(0, sealed, chunk)]
    cov, out = Coverage(), []
    tracemalloc.start()
    ledger = ContentLedger({0: BLOCK_SIZE})
    for t in range(tp):
        key = RankKey("e1", 0, t, 0)
        for d in seals:
            ledger.apply(key, 0, d, holders, out, cov)
    per_block = tracemalloc.get_traced_memory()[0] / (sealed * tp)
    tracemalloc.stop()
    start = time.perf_counter()
    for t in range(tp):
        key = RankKey("e1", 0, t, 0)
        for d in sweeps:
            ledger.apply(key, 1, d, holders, out, cov)
    per_digest = (time.perf_counter() - start) / (sealed * tp) * 1e6
    assert out == [] and cov.checks["content_verified"] == sealed * tp
    return per_block, per_digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1 << 20)
    parser.add_argument("--sealed", type=int, default=100_000)
    args = parser.parse_args()
    mb, us = tracker_figures(args.blocks, 256, 200)
    _, whole = tracker_figures(args.blocks, 256, 200, whole=True)
    print(
        f"rank: SealTracker over {args.blocks:,} blocks: {mb:.1f} MB; due() per step at 256 requests: "
        f"{us:.0f} us ({whole:.0f} us looking at every row whole)"
    )
    print(f"\ncore: ContentLedger with {args.sealed:,} sealed blocks")
    print(f"{'TP':>3} {'B per block and rank':>21} {'MB':>7} {'us per digest':>14}")
    for tp in (1, 8):
        per_block, per_digest = ledger_figures(args.sealed, tp)
        print(f"{tp:>3} {per_block:>21.0f} {per_block * args.sealed * tp / 1e6:>7.1f} {per_digest:>14.2f}")


if __name__ == "__main__":
    main()
