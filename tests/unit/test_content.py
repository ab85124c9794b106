"""Content digests: the core's comparison of sealed blocks' digests, and the rank's choice of what
to digest at a step (hand-checked numbers; the digest itself on real tensors is marked vllm)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from kvledger.producer import records
from kvledger.producer.content import GroupRows, SealTracker, sampled_blocks
from kvledger.producer.records import RankIdentity
from kvledger.schemas.events import event_of, events_of
from kvledger.stream_app.core import Ledger
from tests.e2e.conftest import vllm_python

BS = 4
SEALED, READ, RELEASED, SWEEP, ZEROED = "SEALED", "READ", "RELEASED", "SWEEP", "ZEROED"


class Rank:
    """One rank's hand-written stream: one full-attention group of 16 blocks of 4 tokens."""

    def __init__(self, tp: int = 0, tp_size: int = 1, incarnation: int = 1):
        self.rank = RankIdentity("e1", tp_rank=tp, incarnation=incarnation)
        self.seq = 0
        self.events = []
        group = records.kv_group(0, "FULL_ATTENTION", BS, 16)
        info = records.rank_info(dp_size=1, tp_size=tp_size, pp_size=1, vllm_version="t", runner="t", kv_groups=[group])
        self.add(info)

    def add(self, body, skip: int = 0) -> None:
        self.seq += skip
        self.events.append(records.envelope(self.rank, self.seq, 0, body))
        self.seq += 1

    def step(self, n, digests=(), *, inp=None, plan=None, skip: int = 0) -> None:
        content = None
        if digests:
            blocks, values, reasons = zip(*digests, strict=True)
            content = records.block_digests([0] * len(blocks), blocks, np.array(values, np.int64), reasons)
        self.add(records.step(n, "REAL", inp, plan, content), skip=skip)


def prefill(n: int = 0):
    """r0 prefills 8 tokens into blocks 3 and 7 (both full after the step)."""
    inp = records.step_input(new_reqs=[records.new_request(0, "r0", [[3, 7]], 0, 64, 8)])
    group = records.group_plan(0, np.array([12, 13, 14, 15, 28, 29, 30, 31]), 8, [np.array([3, 7])])
    return inp, records.step_plan([0], [8], [0], [group])


def decode_into(slot: int, n_computed: int = 8):
    """r0 writes one token at `slot` (its computed tokens say which position)."""
    inp = records.step_input(cached=[(0, n_computed, 1)])
    group = records.group_plan(0, np.array([slot]), 1, [np.array([3, 7])])
    return inp, records.step_plan([0], [1], [n_computed], [group])


def run(*ranks: Rank, interleave: bool = False):
    ledger = Ledger()
    events = [e for r in ranks for e in r.events]
    if interleave:
        events.sort(key=lambda e: e["seq"])
    found = [v for e in events for v in ledger.apply(event_of(e))] + ledger.finish()
    return found, ledger.coverage


def test_a_sealed_block_read_back_unchanged_is_verified_and_silent():
    r = Rank()
    inp, plan = prefill()
    r.step(0, inp=inp, plan=plan)
    r.step(1, [(3, 111, SEALED), (7, 222, SEALED)])
    r.step(2, [(3, 111, READ), (7, 222, SWEEP)])
    r.step(3, [(3, 111, RELEASED)])
    found, cov = run(r)
    assert found == []
    assert cov.checks["content_sealed"] == 2 and cov.checks["content_verified"] == 3


def test_a_change_no_plan_wrote_is_a_write_outside_every_plan():
    r = Rank()
    inp, plan = prefill()
    r.step(0, inp=inp, plan=plan)
    r.step(1, [(3, 111, SEALED)])
    r.step(2, [(3, 112, SWEEP)])
    found, _ = run(r)
    assert [(v.kind, v.step, v.group, v.req_id) for v in found] == [("sealed_block_modified", 2, 0, "r0")]
    assert "block 3 (sealed at step 1) changed, found by a sweep digest" in found[0].detail
    assert "no plan wrote into it since: a write outside every plan" in found[0].detail
    assert "held by r0" in found[0].detail


def test_a_change_after_a_plan_wrote_into_the_block_says_so():
    # The plan's own write into a sealed block is a write-target finding of its own; the content
    # report names the step so the two can be read together.
    r = Rank()
    inp, plan = prefill()
    r.step(0, inp=inp, plan=plan)
    r.step(1, [(3, 111, SEALED)])
    inp, plan = decode_into(13, n_computed=8)  # slot 13 is block 3's: a wrong write target
    r.step(2, inp=inp, plan=plan)
    r.step(3, [(3, 999, READ)])
    found, _ = run(r)
    kinds = [v.kind for v in found]
    assert "write_target_mismatch" in kinds
    content = [v for v in found if v.kind == "sealed_block_modified"]
    assert len(content) == 1 and "a plan wrote into it at step 2" in content[0].detail


def test_a_change_is_reported_once_and_the_new_bytes_become_the_reference():
    r = Rank()
    r.step(0, [(5, 1, SEALED)])
    r.step(1, [(5, 2, SWEEP)])
    r.step(2, [(5, 2, SWEEP)])
    found, cov = run(r)
    assert [v.step for v in found] == [1]
    assert "held by no live request" in found[0].detail and found[0].req_id is None
    assert cov.checks["content_verified"] == 2


def test_a_reseal_replaces_the_reference():
    r = Rank()
    r.step(0, [(5, 1, SEALED)])
    r.step(1, [(5, 2, SEALED)])  # handed out again and sealed with new bytes
    r.step(2, [(5, 2, READ)])
    found, cov = run(r)
    assert found == [] and cov.checks["content_sealed"] == 2


def test_a_zeroed_block_must_be_zero():
    r = Rank()
    r.step(0, [(5, 1, SEALED)])
    r.step(1, [(5, 0, ZEROED), (6, 77, ZEROED)])
    r.step(2, [(5, 3, READ)])  # no reference after the zeroing: the first read is the baseline
    found, cov = run(r)
    assert [(v.kind, v.step) for v in found] == [("block_not_zeroed", 1)]
    assert "block 6 was to be zeroed" in found[0].detail
    assert cov.checks["content_zeroed"] == 2 and cov.unchecked["content_without_seal"] == 1


def test_reads_of_blocks_sealed_before_the_ledger_saw_them_are_counted_unchecked_then_compared():
    r = Rank()
    r.step(0, [(5, 1, READ)])
    r.step(1, [(5, 2, SWEEP)])
    found, cov = run(r)
    assert cov.unchecked["content_without_seal"] == 1
    assert len(found) == 1 and "first digested at step 0" in found[0].detail


def test_a_gap_forgets_the_ranks_references():
    r = Rank()
    r.step(0, [(5, 1, SEALED)])
    r.step(2, [(5, 2, SWEEP)], skip=3)  # lost events: a reseal may have been among them
    found, cov = run(r)
    assert [v for v in found if v.kind == "sealed_block_modified"] == []
    assert cov.unchecked["content_without_seal"] == 1


def test_tp_ranks_hold_other_heads_and_are_compared_each_with_itself():
    ranks = [Rank(tp=t, tp_size=2) for t in range(2)]
    for t, r in enumerate(ranks):
        r.step(0, [(5, 100 + t, SEALED)])
        r.step(1, [(5, 100 + t, SWEEP)] if t == 0 else [(5, 555, SWEEP)])
    found, cov = run(*ranks, interleave=True)
    assert [(v.kind, v.tp_rank, v.step) for v in found] == [("sealed_block_modified", 1, 1)]
    assert cov.checks["content_verified"] == 2


def test_misaligned_columns_are_unchecked_not_violations():
    r = Rank()
    content = records.block_digests([0, 0], [5], np.array([1], np.int64), [SEALED])
    r.add(records.step(0, "REAL", None, None, content))
    found, cov = run(r)
    assert found == [] and cov.unchecked["content_columns_misaligned"] == 1


# -- what the rank digests at a step ---------------------------------------------------------------
def rows(table, lens, *, block_size=BS, seals=True, state=False, gid=0):
    return GroupRows(gid, block_size, seals, state, np.array(table, np.int32), np.array(lens, np.int32))


def due_map(due):
    return {(g, r): sorted(b.tolist()) for g, b, r in zip(due.groups, due.blocks, due.reasons, strict=True)}


def tracker(num_blocks=32, sweep=0):
    return SealTracker(num_blocks, 1.0, sweep)


NONE = np.array([], np.int64)


def test_full_blocks_below_the_computed_tokens_seal_once():
    t = tracker()
    g = [rows([[3, 7, 9]], [3])]
    # 6 computed tokens: block 3 is full (positions 0..3); 7 is being written.
    assert due_map(t.due(g, np.array([6]), NONE, {}, NONE)) == {(0, SEALED): [3]}
    assert due_map(t.due(g, np.array([8]), NONE, {}, NONE)) == {(0, SEALED): [7]}
    assert t.due(g, np.array([9]), NONE, {}, NONE).blocks == []  # nothing new is full
    assert t.sealed_total == 2


def test_a_reused_block_is_unsealed_by_its_write_and_sealed_again():
    t = tracker()
    t.due([rows([[3, 7]], [2])], np.array([8]), NONE, {}, NONE)
    # Block 7 freed and handed to a new request that writes it from position 0.
    due = t.due([rows([[7]], [1])], np.array([0]), NONE, {}, NONE)
    assert due.blocks == [] and t.sealed_in[7] == -1 and t.sealed_in[3] == 0
    assert due_map(t.due([rows([[7]], [1])], np.array([4]), NONE, {}, NONE)) == {(0, SEALED): [7]}


def test_prefix_hits_and_resumes_read_what_was_sealed_and_releases_digest_on_the_way_out():
    t = tracker()
    t.due([rows([[3, 7]], [2])], np.array([8]), NONE, {}, NONE)
    # A second request hits both blocks of the prefix and computes block 9.
    g = [rows([[3, 7, 0], [3, 7, 9]], [2, 3])]
    due = t.due(g, np.array([8, 8]), np.array([1]), {0: np.array([3, 7])}, NONE)
    assert due_map(due) == {(0, READ): [3, 7], (0, RELEASED): [3, 7]}


def test_zeroed_and_copied_blocks_are_no_longer_sealed():
    t = tracker()
    t.due([rows([[3, 7]], [2])], np.array([8]), NONE, {}, NONE)
    t.due([], np.array([], np.int64), NONE, {}, np.array([7]))
    assert t.sealed_in[3] == 0 and t.sealed_in[7] == -1


def test_state_groups_never_seal_but_their_writes_unseal_a_shared_pool():
    t = tracker()
    t.due([rows([[3, 7]], [2])], np.array([8]), NONE, {}, NONE)
    state = rows([[7]], [1], seals=False, state=True, gid=1)
    assert t.due([state], np.array([100]), NONE, {}, NONE).blocks == []
    assert t.sealed_in[7] == -1


def test_the_sweep_walks_the_sealed_blocks_and_wraps():
    t = SealTracker(64, 1.0, sweep=2, sweep_window=16)
    t.sealed_in[[5, 6, 7, 40]] = 0
    seen = []
    for _ in range(6):
        due = t.due([], np.array([], np.int64), NONE, {}, NONE)
        seen.append(sorted(b for arr in due.blocks for b in arr.tolist()))
    assert seen[:2] == [[5, 6], [7]]
    assert [40] in seen and seen.count([5, 6]) == 2  # it came back round


def test_the_sample_is_a_fixed_draw_per_block_id_and_never_the_null_block():
    a, b = sampled_blocks(200_000, 0.01), sampled_blocks(100_000, 0.01)
    assert np.array_equal(a[:100_000], b)  # every rank (and any pool size) draws the same ids
    assert 0.008 < a.mean() < 0.012 and not a[0] and not sampled_blocks(10, 1.0)[0]
    assert not sampled_blocks(1000, 0.0).any()


def test_unsampled_blocks_are_not_sealed():
    t = SealTracker(32, 0.0, 0)
    assert t.due([rows([[3, 7]], [2])], np.array([8]), NONE, {}, NONE).blocks == []


@pytest.mark.vllm
def test_the_digest_on_real_tensors():
    # vLLM's page layout (offset + layer * layer_stride + block * block_stride) read back as words.
    script = """
from types import SimpleNamespace as NS
import torch
from kvledger.producer.content import digest_blocks, group_pages
nb, page = 8, 64
spec = NS(page_size_bytes=page)
cfg = NS(num_blocks=nb, kv_cache_groups=[NS(layer_names=["a", "b"], kv_cache_spec=spec)],
         kv_cache_tensors=[NS(layers=["a", "b"], offset=0, layer_stride=page, block_stride=2 * page)])
raw = torch.zeros(nb * 2 * page, dtype=torch.uint8)
pages = group_pages(cfg, raw.view(torch.float16))
ids = torch.tensor([1, 2, 3])
assert digest_blocks(pages[0], ids).tolist() == [0, 0, 0]
raw.view(torch.float16)[(2 * 2 * page + page) // 2] = 1.0  # block 2, layer b, first value
d = digest_blocks(pages[0], ids).tolist()
assert d[0] == 0 and d[2] == 0 and d[1] != 0, d
raw.view(torch.float16)[(2 * 2 * page + page) // 2] = 0.0
raw.view(torch.float16)[(2 * 2 * page) // 2] = 1.0  # the same value in layer a: another digest
assert digest_blocks(pages[0], ids).tolist()[1] not in (0, d[1])
print("ok")
"""
    proc = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_zeroed_blocks_are_digested_in_every_sealing_group():
    t = tracker()
    g = [rows([[3]], [1]), rows([[3]], [1], seals=False, gid=1)]
    due = t.due(g, np.array([0]), NONE, {}, np.array([5, 6]), np.array([5, 9, 0]))
    assert due_map(due) == {(0, ZEROED): [5, 9]}  # never the null block


def test_steps_not_recorded_forget_the_ranks_references():
    r = Rank()
    r.step(0, [(5, 1, SEALED)])
    r.step(3, [(5, 2, SWEEP)])  # steps 1 and 2 never recorded (tracing paused): reseals unknown
    found, cov = run(r)
    assert found == [] and cov.unchecked["content_without_seal"] == 1


# -- the batched fast path ---------------------------------------------------------------------------
ROW = [3, 7, 9, 11, 12, 13, 14, 15]  # r0's blocks: 32 tokens


def decoding(digests_at: dict[int, list], steps: int = 20) -> Rank:
    """r0 prefills 8 tokens, then decodes one token a step; digests at the steps given."""
    r = Rank()
    inp = records.step_input(new_reqs=[records.new_request(0, "r0", [ROW], 0, 64, 8)])
    slots = np.array([ROW[p // BS] * BS + p % BS for p in range(8)])
    group = records.group_plan(0, slots, 8, [np.array(ROW)])
    r.step(0, digests_at.get(0, ()), inp=inp, plan=records.step_plan([0], [8], [0], [group]))
    for n in range(1, steps):
        p = 7 + n
        inp = records.step_input(cached=[(0, p, 1)])
        group = records.group_plan(0, np.array([ROW[p // BS] * BS + p % BS]), 1, [np.array(ROW)])
        r.step(n, digests_at.get(n, ()), inp=inp, plan=records.step_plan([0], [1], [p], [group]))
    return r


@pytest.mark.parametrize(
    "changed_at",
    [None, 3, 15],  # clean; a change in the run that sealed the block; in a later run
    ids=["clean", "same_run", "later_run"],
)
def test_the_batched_path_finds_what_the_step_path_finds(monkeypatch, changed_at):
    from kvledger.stream_app.core import batch

    committed = []
    plan_run = batch.plan_run

    def spy(state, steps):
        result = plan_run(state, steps)
        committed.append(result is not None)
        return result

    monkeypatch.setattr(batch, "plan_run", spy)
    digests = {1: [(3, 11, SEALED), (7, 22, SEALED)]}
    for n in range(2, 20):  # the sweep takes blocks 3 and 7 in turn; 3's bytes change at changed_at
        changed = changed_at is not None and n >= changed_at
        digests[n] = [(3, 99 if changed else 11, SWEEP)] if n % 2 or n == changed_at else [(7, 22, SWEEP)]
    events = decoding(digests).events
    one = Ledger()
    stepwise = [v for e in events for v in one.apply(event_of(e))] + one.finish()
    many = Ledger(batch_steps=8)
    batched = many.apply_many(events_of(events)) + many.finish()
    assert batched == stepwise
    assert (many.coverage.checks, many.coverage.unchecked) == (one.coverage.checks, one.coverage.unchecked)
    assert [(v.kind, v.step) for v in stepwise] == (
        [] if changed_at is None else [("sealed_block_modified", changed_at)]
    )
    assert any(committed), "the fast path never ran"
    assert one.coverage.checks["content_verified"] == 18


def test_a_run_is_tried_on_a_copy_of_the_references_it_touches():
    """The fast path tries the content rule on `trial` copies: what it finds there is what applying
    the run would report, and trying it changes nothing of the ledger's own references."""
    from kvledger.stream_app.core.content import ContentLedger, Sealed
    from kvledger.stream_app.core.violations import Coverage, RankKey

    key = RankKey("e1", 0, 0, 0)
    ledger = ContentLedger({0: BS})
    ledger.sealed[3] = {(0, 0, 0): Sealed(11, 0, baseline=False), (1, 0, 0): Sealed(77, 0, baseline=False)}

    def clean(*steps) -> bool:
        digests = [records.block_digests([0] * len(s), *zip(*s, strict=True)) for s in steps]
        trial, found = ledger.trial({b for s in steps for b, _, _ in s}), []
        for n, d in enumerate(digests):
            trial.apply(key, n, d, lambda block: [], found, Coverage())
        return not found

    assert clean([(3, 11, SWEEP)], [(5, 1, SEALED)], [(5, 1, READ), (6, 4, READ)], [(6, 4, SWEEP)])
    assert not clean([(3, 12, SWEEP)])  # the ledger's reference (this rank's, not tp 1's)
    assert not clean([(5, 1, SEALED)], [(5, 2, RELEASED)])  # a reference set earlier in the run
    assert not clean([(6, 4, READ)], [(6, 5, SWEEP)])  # a baseline set earlier in the run
    assert not clean([(9, 1, ZEROED)])
    assert clean([(3, 0, ZEROED)], [(3, 12, SWEEP)])  # zeroed: forgotten, the next digest a baseline
    assert ledger.sealed[3][(0, 0, 0)].digest == 11  # a check changes nothing


def test_a_rank_that_cannot_digest_says_so_once():
    rank = RankIdentity("e1", incarnation=1)
    group = records.kv_group(0, "FULL_ATTENTION", BS, 16)
    caps = [("content_digests", False, "a KV connector writes blocks outside the runner's plan")]
    info = records.rank_info(
        dp_size=1, tp_size=1, pp_size=1, vllm_version="t", runner="t", kv_groups=[group], capabilities=caps
    )
    ledger = Ledger()
    for seq in range(3):  # written again before each snapshot
        ledger.apply(records.event(rank, seq, 0, info))
    assert ledger.coverage.unchecked == {"content_digests": 1}


def test_a_block_another_request_computes_in_the_same_step_is_not_sealed_by_a_prefix_hit():
    # r1 hits block 7 of the prefix while r0 is still computing it (vLLM caches a block once
    # this step's tokens will fill it): its bytes are not there before the forward pass.
    t = tracker()
    g = [rows([[3, 7, 0], [3, 7, 9]], [2, 3])]
    due = t.due(g, np.array([4, 8]), np.array([1]), {}, NONE, None, ["r0", "r1"])
    assert due_map(due) == {(0, SEALED): [3]}
    # The next step r0's tokens are in: block 7 seals (r1's row was looked at, r0's catches it).
    due = t.due(g, np.array([8, 9]), NONE, {}, NONE, None, ["r0", "r1"])
    assert due_map(due) == {(0, SEALED): [7]}


def test_rows_that_keep_their_requests_are_looked_at_from_where_they_were_left():
    """Against looking at every row whole, over a random schedule of decodes, prefills, moves
    and new requests: the same digests, step by step."""
    rng = np.random.default_rng(5)
    free = list(range(1, 4000))
    rng.shuffle(free)
    live: list[dict] = []
    quick, whole = tracker(4000), tracker(4000)
    serial = 0
    for _ in range(200):
        if len(live) < 8 and rng.random() < 0.5:
            live.insert(int(rng.integers(0, len(live) + 1)), {"id": f"r{serial}", "row": [], "computed": 0})
            serial += 1
        if live and rng.random() < 0.05:
            live.pop(int(rng.integers(0, len(live))))
        for r in live:  # this step's tokens: a prefill chunk or one decode token
            r["next"] = int(rng.integers(1, 40)) if r["computed"] < 20 else 1
            while len(r["row"]) * BS < r["computed"] + r["next"]:
                r["row"].append(free.pop())
        width = max((len(r["row"]) for r in live), default=1)
        table = np.zeros((len(live), width), np.int32)
        for i, r in enumerate(live):
            table[i, : len(r["row"])] = r["row"]
        lens = np.array([len(r["row"]) for r in live], np.int32)
        computed = np.array([r["computed"] for r in live], np.int64)
        g = [GroupRows(0, BS, True, False, table, lens)]
        a = quick.due(g, computed, NONE, {}, NONE, None, [r["id"] for r in live])
        b = whole.due(g, computed, NONE, {}, NONE)
        assert due_map(a) == due_map(b)
        for r in live:
            r["computed"] += r["next"]
    assert quick.sealed_total == whole.sealed_total > 100
