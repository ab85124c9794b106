"""The ledger core as a state machine: hand-checked numbers, determinism, snapshots, gaps."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.schemas.events import event_of
from kvledger.stream_app.core import Ledger
from tests.synthetic.engine import FaultSpec, GroupSpec, SimConfig, simulate

RANK = RankIdentity("e1", incarnation=7)
BS = 4


class Stream:
    """A hand-written rank stream: block size 4, one full-attention group of 16 blocks."""

    def __init__(self):
        self.seq = 0
        self.events = []
        self.add(
            records.rank_info(
                dp_size=1,
                tp_size=1,
                pp_size=1,
                vllm_version="test",
                runner="test",
                kv_groups=[records.kv_group(0, "FULL_ATTENTION", BS, 16)],
            )
        )

    def add(self, body):
        self.events.append(records.envelope(RANK, self.seq, 0, body))
        self.seq += 1

    def step(self, n, *, new=(), cached=(), appends=(), finished=(), slots, reqs, rows, padding=0, zero=(), copies=()):
        inp = records.step_input(
            new_reqs=[records.new_request(i, f"r{i}", [b], c, 64, n) for i, b, c, n in new],
            cached=cached,
            appends=[(i, 0, b) for i, b in appends],
            finished=finished,
            blocks_to_zero=zero,
            block_copies=copies,
        )
        slots = np.array([*slots, *([-1] * padding)])
        group = records.group_plan(0, slots, len(slots) - padding, [np.array(r) for r in rows])
        plan = records.step_plan([i for i, _, _ in reqs], [t for _, t, _ in reqs], [p for _, _, p in reqs], [group])
        self.add(records.step(n, "REAL", inp, plan))

    def check(self):
        ledger = Ledger()
        return [v for e in self.events for v in ledger.apply(event_of(e))] + ledger.finish(), ledger


def prefill_then_decode(decode_slot=29, padding_slot=None):
    s = Stream()
    # r0 prefills 5 tokens into blocks [3, 7]: slots 12..15, 28.
    s.step(0, new=[(0, [3, 7], 0, 5)], slots=[12, 13, 14, 15, 28], reqs=[(0, 5, 0)], rows=[[3, 7]])
    # Decode position 5 -> block 7, offset 1 -> slot 29; pad to 4 entries.
    slots = [decode_slot] + ([padding_slot] if padding_slot is not None else [])
    s.step(1, cached=[(0, 5, 1)], slots=slots, reqs=[(0, 1, 5)], rows=[[3, 7]], padding=0)
    return s


def test_hand_checked_stream_is_clean():
    violations, ledger = prefill_then_decode().check()
    assert violations == []
    assert ledger.coverage.checks["write"] == 2 and ledger.coverage.checks["read"] == 2


def test_write_target_uses_the_slot_formula():
    violations, _ = prefill_then_decode(decode_slot=30).check()
    assert [(v.kind, v.step, v.req_id, v.group) for v in violations] == [("write_target_mismatch", 1, "r0", 0)]
    assert "expected slot 29, actual slot 30" in violations[0].detail


def test_free_block_write_and_out_of_pool_write():
    violations, _ = prefill_then_decode(decode_slot=9 * BS).check()  # block 9: nobody holds it
    assert {v.kind for v in violations} == {"write_target_mismatch", "foreign_block_write"}
    assert "free" in next(v for v in violations if v.kind == "foreign_block_write").detail
    violations, _ = prefill_then_decode(decode_slot=99 * BS).check()
    assert {v.kind for v in violations} == {"write_target_mismatch", "block_out_of_range"}


def test_pending_send_holds_blocks_until_done():
    s = Stream()
    s.step(0, new=[(0, [3], 0, 4)], slots=[12, 13, 14, 15], reqs=[(0, 4, 0)], rows=[[3]])
    s.add(records.connector_event(0, "test", "SEND_INTENT", req_id="r0", transfer_id="t1", block_ids=[[3]]))
    # r0 finishes (its blocks stay with the pending send); r1 is handed block 3 and writes it.
    s.step(1, new=[(1, [3], 0, 1)], finished=["r0"], slots=[12], reqs=[(1, 1, 0)], rows=[[3]])
    violations, _ = s.check()
    assert [(v.kind, v.req_id) for v in violations] == [("foreign_block_write", "r1")]
    assert "pending KV send" in violations[0].detail


def two_requests_sharing_a_prefix(**overwrites) -> Stream:
    """r0 holds blocks 1, 2; r1 reads block 1 from the prefix cache and writes block 3."""
    s = Stream()
    s.step(0, new=[(0, [1, 2], 0, 8)], slots=range(4, 12), reqs=[(0, 8, 0)], rows=[[1, 2]])
    s.step(1, new=[(1, [1, 3], 4, 4)], slots=range(12, 16), reqs=[(1, 4, 4)], rows=[[1, 3]], **overwrites)
    return s


def test_zeroing_fresh_blocks_and_copying_into_fresh_ones_is_clean():
    # Block 3 is new this step; a copy-on-write fills block 3 for r1, or block 5 for the cache alone.
    for copies in ([(2, 3)], [(2, 5)]):
        violations, ledger = two_requests_sharing_a_prefix(zero=[3], copies=copies).check()
        assert violations == [] and ledger.coverage.checks["overwrite_target"] == 2


@pytest.mark.parametrize(
    ("overwrites", "why"),
    [
        ({"zero": [1]}, "zeroes block 1, but 2 live requests hold it"),
        ({"copies": [(3, 2)]}, "copies into block 2, but a live request already held it before this step"),
        ({"copies": [(1, 3), (1, 7)], "zero": [99]}, "zeroes block 99, but outside the pool"),
    ],
)
def test_overwriting_a_block_someone_else_reads_is_caught(overwrites, why):
    violations, _ = two_requests_sharing_a_prefix(**overwrites).check()
    assert [(v.step, v.req_id, v.group) for v in violations] == [(1, None, None)]
    assert why in violations[0].detail, violations


def test_a_block_being_computed_may_be_read_by_a_prefix_hit_in_the_same_step():
    # vLLM caches the blocks a step will fill when it allocates them: r1, scheduled behind r0 in
    # the same step, reads block 1 (its first 4 tokens) while r0 writes it.
    s = Stream()
    s.step(
        0,
        new=[(0, [1, 2], 0, 8), (1, [1, 3], 4, 4)],
        slots=range(4, 16),
        reqs=[(0, 8, 0), (1, 4, 4)],
        rows=[[1, 2], [1, 3]],
    )
    violations, ledger = s.check()
    assert violations == [] and ledger.coverage.checks["exclusivity"] == 4


@pytest.mark.parametrize(
    ("second", "why"),
    [
        # r1 is handed block 1 at the position r0 holds it, to be written (it computed nothing).
        ({"new": [(1, [1, 3], 0, 8)], "slots": [*range(4, 8), *range(12, 16)]}, "another live request holds it"),
    ],
)
def test_a_written_block_someone_already_holds_is_caught_even_at_the_same_position(second, why):
    s = Stream()
    s.step(0, new=[(0, [1, 2], 0, 8)], slots=range(4, 12), reqs=[(0, 8, 0)], rows=[[1, 2]])
    s.step(1, **second, reqs=[(1, 8, 0)], rows=[[1, 3]])
    violations, _ = s.check()
    assert [(v.kind, v.step, v.req_id) for v in violations] == [("foreign_block_write", 1, "r1")], violations
    assert why in violations[0].detail


def test_two_grants_writing_one_block_in_one_step_are_caught():
    s = Stream()
    s.step(
        0,
        new=[(0, [1], 0, 4), (1, [1], 0, 4)],
        slots=[4, 5, 6, 7, 4, 5, 6, 7],
        reqs=[(0, 4, 0), (1, 4, 0)],
        rows=[[1], [1]],
    )
    violations, _ = s.check()
    assert {(v.kind, v.req_id) for v in violations} == {("foreign_block_write", "r0"), ("foreign_block_write", "r1")}


def test_padding_into_the_null_block_is_fine_but_not_into_real_blocks():
    assert prefill_then_decode(padding_slot=2).check()[0] == []
    violations, _ = prefill_then_decode(padding_slot=13).check()
    assert [v.kind for v in violations] == ["unowned_write"]


REALISTIC = SimConfig(
    seed=3,
    steps=240,
    tp_size=2,
    groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 48)),
    num_blocks=90,
    max_num_seqs=10,
    max_batched_tokens=96,
    snapshot_interval=40,
    faults=(
        FaultSpec("slot_shift", 50),
        FaultSpec("block_swap", 150),
        FaultSpec("rank_missing", 100, tp_rank=1),
    ),
)


def _run(events, ledger=None):
    ledger = ledger or Ledger()
    return [v for e in events for v in ledger.apply(event_of(e))] + ledger.finish()


def test_same_events_same_violations_whatever_the_rank_interleaving():
    events = simulate(REALISTIC).events
    reference = _run(events)
    assert reference and reference == _run(events)
    # Online, ranks interleave arbitrarily (each rank's own order kept).
    rng = random.Random(1)
    by_rank: dict = {}
    for e in events:
        by_rank.setdefault(e["tp_rank"], []).append(e)
    shuffled, cursors = [], dict.fromkeys(by_rank, 0)
    while any(cursors[r] < len(by_rank[r]) for r in by_rank):
        r = rng.choice([r for r in by_rank if cursors[r] < len(by_rank[r])])
        burst = rng.randint(1, 12)
        shuffled += by_rank[r][cursors[r] : cursors[r] + burst]
        cursors[r] += burst
    assert sorted(map(repr, _run(shuffled))) == sorted(map(repr, reference))


def test_gap_makes_checks_wait_for_the_next_snapshot():
    config = dataclasses.replace(
        REALISTIC,
        tp_size=1,
        faults=(FaultSpec("sequence_gap", 45), FaultSpec("slot_shift", 60), FaultSpec("slot_shift", 130)),
    )
    sim = simulate(config)
    ledger = Ledger()
    violations = _run(sim.events, ledger)
    kinds = [(v.kind, v.step) for v in violations]
    # The shift at 60 falls in the blind spot (after the gap, before the snapshot at 79) ...
    assert ("sequence_gap", 44) in kinds and all(step != 60 for _, step in kinds)
    # ... which is accounted for, and checking resumes after the resync.
    assert ledger.coverage.unchecked["after_gap"] == 79 - 45
    assert ledger.coverage.checks["resync"] == 1
    assert any(k == "write_target_mismatch" and step == 130 for k, step in kinds)


def test_new_incarnation_restarts_the_rank():
    first = simulate(dataclasses.replace(REALISTIC, faults=(), tp_size=1, steps=60)).events
    second = simulate(dataclasses.replace(REALISTIC, faults=(), tp_size=1, steps=60, incarnation=2, seed=9)).events
    ledger = Ledger()
    assert _run(first + second, ledger) == []
    assert ledger.coverage.unchecked["rank_restarted"] == 1


def test_joining_mid_stream_waits_for_a_snapshot():
    events = simulate(dataclasses.replace(REALISTIC, faults=(), tp_size=1)).events
    ledger = Ledger()
    late = [e for e in events if e["seq"] >= 30]
    assert _run(late, ledger) == []
    assert ledger.coverage.unchecked["joined_mid_stream"] == 1
    assert ledger.coverage.unchecked["after_gap"] > 0 and ledger.coverage.checks["write"] > 0


def test_a_watermark_mid_stream_settles_once_and_late_records_are_counted_not_held():
    events = simulate(dataclasses.replace(REALISTIC, faults=())).events
    assert _run(events) == []
    # Rank 1 falls silent after step 20; a watermark settles what waits for it; then its records come late.
    cut = next(i for i, e in enumerate(events) if e["tp_rank"] == 1 and e["body"][1].get("step", -1) == 21)
    late = [e for e in events[cut:] if e["tp_rank"] == 1]
    rest = [e for e in events[cut:] if e["tp_rank"] != 1]
    ledger = Ledger()
    found = [v for e in events[:cut] + rest for v in ledger.apply(event_of(e))]
    assert found == []  # held, not yet reported
    settled = ledger.settle_held()
    assert [(v.kind, v.tp_rank, v.step) for v in settled] == [("rank_missing", 1, 21)]  # one run, reported once
    found = [v for e in late for v in ledger.apply(event_of(e))] + ledger.settle_held() + ledger.finish()
    assert found == []  # rank 0 reported every step: never missing
    assert ledger.coverage.unchecked["rank_late_after_settle"] > 0


def test_a_rank_that_closed_before_a_step_is_not_missing_from_it():
    """A shutdown that reaches one rank before the group's last (empty) step: that rank said it
    was done, so the step it never ran is unchecked for it, not a rank gone missing."""
    cfg = dataclasses.replace(REALISTIC, faults=(), steps=60, close_at_end=True)
    events = simulate(cfg).events
    last = cfg.steps - 1
    dropped = next(
        i
        for i, e in enumerate(events)
        if e["tp_rank"] == 1 and e["body"][0] == "kvledger.Step" and e["body"][1]["step"] == last
    )
    closed_early = events[:dropped] + events[dropped + 1 :]
    for e in closed_early[dropped:]:  # the rank's closing Health: one event fewer, one step earlier
        if e["tp_rank"] == 1:
            e["seq"] -= 1
            e["body"][1].update(step=last - 1, events_captured=e["body"][1]["events_captured"] - 1)
    ledger = Ledger()
    assert _run(closed_early, ledger) == []
    assert ledger.coverage.unchecked["rank_closed_before_step"] == 1
    # Without its closing Health (killed, not shut down), the same absence is a rank gone missing.
    killed = [e for e in closed_early if not (e["tp_rank"] == 1 and e["body"][1].get("closing"))]
    assert [(v.kind, v.tp_rank, v.step) for v in _run(killed)] == [("rank_missing", 1, last)]
