"""Hybrid KV cache groups in the ledger core: Mamba-style state groups beside attention.

vLLM's Mamba manager frees every state block before the latest one of a live
request (prefix caching's `align` mode) without telling workers, and a state
block is updated in place, so it has one owner. Hand-written streams, each
one shape a real hybrid engine produces (see tests/e2e/test_hybrid.py).
"""

from __future__ import annotations

import numpy as np

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.schemas.events import event_of
from kvledger.stream_app.core import Ledger

RANK = RankIdentity("hybrid", incarnation=1)
BS = 4
MAMBA, ATTN = 0, 1


class HybridStream:
    """A rank with a state group (0) and a full-attention group (1), block size 4 in both
    (as vLLM aligns them); plans are built from the rows the scheduler handed out."""

    def __init__(self, state_block_size: int = BS):
        self.events: list[dict] = []
        self.rows: dict[int, list[list[int]]] = {}
        self.state_bs = state_block_size
        groups = [
            records.kv_group(MAMBA, "MAMBA", state_block_size, 32),
            records.kv_group(ATTN, "FULL_ATTENTION", BS, 32),
        ]
        self._add(records.rank_info(dp_size=1, tp_size=1, pp_size=1, vllm_version="t", runner="t", kv_groups=groups))

    def _add(self, body) -> None:
        self.events.append(records.envelope(RANK, len(self.events), 0, body))

    def step(self, n: int, *, new=(), cached=(), appends=None, finished=(), worker_rows=None) -> None:
        """new: (index, computed, scheduled, state blocks, attention blocks); cached: (index,
        computed, scheduled); appends: {index: (state blocks, attention blocks)};
        worker_rows: {(index, group): row} where the worker's table differs from the scheduler's."""
        appends = appends or {}
        for i, _, _, state, attn in new:
            self.rows[i] = [list(state), list(attn)]
        for i, (state, attn) in appends.items():
            self.rows[i][MAMBA] += state
            self.rows[i][ATTN] += attn
        for req_id in finished:
            del self.rows[int(req_id[1:])]
        inp = records.step_input(
            new_reqs=[records.new_request(i, f"r{i}", [s, a], c, 64, k) for i, c, k, s, a in new],
            cached=cached,
            appends=[(i, g, blocks) for i, both in appends.items() for g, blocks in enumerate(both) if blocks],
            finished=finished,
        )
        scheduled = [(i, c, k) for i, c, k, _, _ in new] + list(cached)
        groups = []
        for gid, bs in ((MAMBA, self.state_bs), (ATTN, BS)):
            rows = [np.array((worker_rows or {}).get((i, gid), self.rows[i][gid])) for i, _, _ in scheduled]
            slots = [self.rows[i][gid][p // bs] * bs + p % bs for i, c, k in scheduled for p in range(c, c + k)]
            groups.append(records.group_plan(gid, np.array(slots), len(slots), rows))
        plan = records.step_plan(
            [i for i, _, _ in scheduled], [k for *_, k in scheduled], [c for _, c, _ in scheduled], groups
        )
        self._add(records.step(n, "REAL", inp, plan))

    def check(self):
        ledger = Ledger()
        return [v for e in self.events for v in ledger.apply(event_of(e))] + ledger.finish(), ledger


def _found(violations) -> list[tuple]:
    return [(v.kind, v.step, v.req_id, v.group) for v in violations]


def test_a_state_block_granted_to_two_live_requests_is_caught():
    # Without prefix caching a state group's block spans the whole model length: one block per
    # request, at row position 0 for everyone, which the shared-prefix rule alone lets pass.
    s = HybridStream(state_block_size=64)
    s.step(0, new=[(0, 0, 4, [5], [1])])
    s.step(1, new=[(1, 0, 3, [5], [2])], cached=[(0, 4, 1)], appends={0: ([], [3])})
    violations, ledger = s.check()
    assert _found(violations) == [("foreign_block_write", 1, "r1", MAMBA)], violations
    assert "block 5 to be written, but another live request holds it" in violations[0].detail
    assert ledger.coverage.checks["exclusivity"] == 5  # every real block granted, in both groups


def test_a_spent_state_block_handed_to_another_request_is_no_violation():
    # r0's state moved on to block 6 (5 tokens done): the scheduler freed block 5 and hands it
    # to r1, whose first state position is null (align mode), at another row position.
    s = HybridStream()
    s.step(0, new=[(0, 0, 4, [5], [1])])
    s.step(1, cached=[(0, 4, 1)], appends={0: ([6], [2])})
    s.step(2, new=[(1, 0, 5, [0, 5], [3, 4])], cached=[(0, 5, 1)])
    violations, ledger = s.check()
    assert violations == []
    assert ledger.coverage.checks["exclusivity"] == 7


def test_a_prefix_hit_shares_a_state_block_but_a_write_to_it_is_caught():
    # r1 hits r0's sealed state after 8 tokens (block 5, row position 1) and writes on in block 7;
    # r0 waits this step (the token budget), so its state is still block 5.
    clean = HybridStream()
    clean.step(0, new=[(0, 0, 8, [0, 5], [1, 2])])
    clean.step(1, new=[(1, 8, 2, [0, 5, 7], [1, 2, 3])])
    violations, ledger = clean.check()
    assert violations == [] and ledger.coverage.checks["exclusivity"] == 8
    # The same block handed as the state r1 will write (it has computed only 4 tokens).
    faulty = HybridStream()
    faulty.step(0, new=[(0, 0, 8, [0, 5], [1, 2])])
    faulty.step(1, new=[(1, 4, 2, [0, 5], [9, 3])])
    violations, _ = faulty.check()
    assert _found(violations) == [("foreign_block_write", 1, "r1", MAMBA)], violations


def test_a_state_block_another_group_holds_is_caught():
    # One block pool serves every group: block 2 is r0's attention block, not a free state block.
    s = HybridStream()
    s.step(0, new=[(0, 0, 8, [0, 5], [1, 2])])
    s.step(1, new=[(1, 0, 3, [2], [3])], cached=[(0, 8, 1)], appends={0: ([6], [4])})
    violations, _ = s.check()
    assert _found(violations) == [("foreign_block_write", 1, "r1", MAMBA)], violations


def test_state_rows_are_read_checked_and_state_access_counted_unchecked():
    s = HybridStream()
    s.step(0, new=[(0, 0, 4, [5], [1])])
    s.step(1, cached=[(0, 4, 1)], appends={0: ([6], [2])}, worker_rows={(0, MAMBA): [5, 8]})
    violations, ledger = s.check()
    assert _found(violations) == [("read_target_mismatch", 1, "r0", MAMBA)], violations
    coverage = ledger.coverage
    # Per state-group step: rows compared; what the state kernels index in them is not modelled.
    assert coverage.checks["state_rows"] == 2 and coverage.unchecked["mamba_group"] == 2
    assert coverage.checks["write"] == coverage.checks["read"] == 2  # the attention group only


def test_a_prefix_hit_on_a_block_another_group_holds_is_caught():
    # r1 reads block 5 as its first attention block, a prefix hit; but block 5 is r0's state block.
    # A block is one group's at a time (one pool): a read of it in another group reads bytes
    # that group writes. The same hit on r0's attention block is a plain shared prefix.
    s = HybridStream()
    s.step(0, new=[(0, 0, 8, [0, 5], [1, 2])])
    s.step(1, new=[(1, 8, 2, [0, 5, 7], [5, 2, 3])])
    violations, _ = s.check()
    assert _found(violations) == [("foreign_block_write", 1, "r1", ATTN)], violations
    assert "block 5 to be read in group 1, but group(s) [0] hold it" in violations[0].detail
    clean = HybridStream()
    clean.step(0, new=[(0, 0, 8, [0, 5], [1, 2])])
    clean.step(1, new=[(1, 8, 2, [0, 5, 7], [1, 2, 3])])
    assert clean.check()[0] == []
