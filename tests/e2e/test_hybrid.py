"""Hybrid models on real vLLM engines: several KV cache groups of different kinds.

A Gemma-3-style model (three sliding-window layers, one full-attention layer:
four KV cache groups in one block pool) under preemption and prefix-cache hits
must be silent with every group checked, and a fault in a sliding-window group
and one in the full-attention group must each be caught with its group. A
Qwen3-Next-style model (three gated-delta-net state groups beside one
attention group) must be checked where the ledger models it and count the
rest as unchecked, by reason.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections import Counter

import pytest

from kvledger.schemas.files import discover, read_segment
from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import TEST_PLUGINS

pytestmark = [pytest.mark.e2e, pytest.mark.parallel]
SHARD_WEIGHT = 4  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "sliding_window": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# Full attention every 4th layer; linear key/value head dim 128 (the CPU GDN kernel refuses 32);
# one linear head and four KV heads keep the state page small: vLLM then aligns both kinds of
# group to 64-token blocks.
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 1,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# A shared prefix longer than the window: hits whose sliding-window rows start with null blocks.
PREFIX = list(range(3, 3 + 130))
PROMPTS = [
    [*PREFIX, 100, 101, 102],
    [*PREFIX, 200, 201],
    [*PREFIX, 250],
    [7, 8, 9],
    list(range(300, 320)),
    list(range(400, 410)),
]
# 24 blocks for four groups: the engine preempts; 64 tokens a step: prefills are chunked.
GEMMA_PRESSURE = {
    "model": GEMMA3,
    "prompts": PROMPTS,
    "max_tokens": 48,
    "num_blocks": 24,
    "max_model_len": 192,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 6,
}
# The CPU GDN kernels need bfloat16; prefix caching puts the state groups in vLLM's `align` mode
# (one state block per 64 tokens, the older ones freed as a request moves on); 20 blocks for
# four groups: the engine preempts.
QWEN_PRESSURE = {
    "model": QWEN3_NEXT,
    "dtype": "bfloat16",
    "prompts": PROMPTS[:5],
    "max_tokens": 64,
    "num_blocks": 20,
    "max_model_len": 256,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 6,
}


# A slot shift in the attention group and a swapped state row: each caught alone.
QWEN_FAULTS = "slot_shift@6:g3,block_swap@10:g0"


def assert_qwen_faults_caught_alone(run, result) -> dict[tuple[int, int], str]:
    """QWEN_FAULTS injected, and reported as the only violations: (step, group) -> request."""
    injected = {(int(f["step"]), int(f["group"])): f["req"] for f in run.faults}
    assert set(injected) == {(6, 3), (10, 0)}, run.faults
    assert {(v.kind, v.step, v.group, v.req_id) for v in result.violations} == {
        ("write_target_mismatch", 6, 3, injected[6, 3]),
        ("read_target_mismatch", 10, 0, injected[10, 0]),
    }, result.violations
    return injected


def traced(root, spec: dict, action: str, content_digests: float = 0.0) -> dict:
    kv_trace = {
        "enabled": True,
        "sink": f"file://{root}/ledger",
        "snapshot_interval": 16,
        "action": action,
        "content_digests": content_digests,
    }
    return {**spec, "kv_trace": kv_trace}


def ledger_bodies(ledger_root, name: str):
    for stream in discover(ledger_root):
        for path in stream.segments:
            for event in read_segment(path, []):
                if event["body"][0] == name:
                    yield event["body"][1]


def group_kinds(ledger_root) -> list[tuple[str, int | None]]:
    info = next(ledger_bodies(ledger_root, "kvledger.RankInfo"))
    return [(g["kind"], g["sliding_window"]) for g in info["kv_groups"]]


def step_inputs(ledger_root):
    return [s["input"] for s in ledger_bodies(ledger_root, "kvledger.Step") if s["input"] is not None]


def grants(inp: dict, num_groups: int):
    """(req_index, group, blocks) of every grant of a step input, new requests first."""
    for r in inp["new_reqs"]:
        yield from ((r["req_index"], g, unpack_i32(b).tolist()) for g, b in enumerate(r["block_ids"][:num_groups]))
    counts, blocks = unpack_i32(inp["append_counts"]).tolist(), unpack_i32(inp["append_block_ids"]).tolist()
    indices, gids = unpack_i32(inp["append_req_indices"]).tolist(), unpack_i32(inp["append_group_ids"]).tolist()
    for i, g, c, end in zip(indices, gids, counts, itertools.accumulate(counts), strict=True):
        yield i, g, blocks[end - c : end]


def reused_while_in_a_row(ledger_root, num_groups: int) -> Counter:
    """Per group, grants of a block that a live request still has in its row at another
    position: blocks the scheduler freed without telling the workers (out of the window, a
    spent state). Without the ledger's model of those frees, each would be a false alarm."""
    rows: dict[int, list[list[int]]] = {}
    index_of: dict[str, int] = {}
    found: Counter = Counter()
    for inp in step_inputs(ledger_root):
        for req_id in inp["finished_req_ids"]:
            rows.pop(index_of.get(req_id, -1), None)
        emptied = [index_of.get(r, -1) for r in inp["preempted_req_ids"]]
        for i in emptied + unpack_i32(inp["resumed_req_indices"]).tolist():
            if i in rows:
                rows[i] = [[] for _ in range(num_groups)]
        for r in inp["new_reqs"]:
            index_of[r["req_id"]] = r["req_index"]
            rows[r["req_index"]] = [[] for _ in range(num_groups)]
        for i, g, blocks in list(grants(inp, num_groups)):
            start = len(rows[i][g])
            for k, b in enumerate(blocks):
                if b and any(b in row[g] and row[g].index(b) != start + k for row in rows.values()):
                    found[g] += 1
            rows[i][g] += blocks
    return found


@pytest.fixture(scope="module")
def gemma_clean(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("gemma")
    # In raise mode: a false alarm in the engine itself would fail this run; the full-attention
    # group's sealed blocks digested (test_content.py has the stray write this catches).
    engine(traced(root, GEMMA_PRESSURE, "raise", content_digests=1.0))
    return replay(root / "ledger"), root / "ledger"


def test_gemma3_four_groups_under_pressure_are_silent_and_all_checked(gemma_clean):
    result, ledger_root = gemma_clean
    assert group_kinds(ledger_root) == [("SLIDING_WINDOW", 64)] * 3 + [("FULL_ATTENTION", None)]
    assert result.violations == [] and not result.unchecked, (result.violations, result.unchecked)
    checks = result.ledger.coverage.checks
    # Writes and reads checked in every one of the four groups for every scheduled request.
    assert checks["position"] > 200 and checks["write"] == checks["read"] == 4 * checks["position"]
    assert checks["exclusivity"] > 100 and result.ledger.steps > 100
    assert checks["content_sealed"] > 0 and checks["content_verified"] > checks["content_sealed"]


def test_gemma3_run_really_preempted_hit_the_prefix_cache_and_slid_its_windows(gemma_clean):
    _, ledger_root = gemma_clean
    inputs = step_inputs(ledger_root)
    new = [r for inp in inputs for r in inp["new_reqs"]]
    assert any(inp["preempted_req_ids"] for inp in inputs), "no preemption"
    assert any(len(unpack_i32(inp["resumed_req_indices"])) for inp in inputs), "no resume"
    hits = [r for r in new if r["num_computed_tokens"] > 0]
    assert len(hits) >= 2, "no prefix-cache hits"
    # A hit deeper than the window: its sliding-window rows start with null blocks.
    assert any(unpack_i32(r["block_ids"][0])[0] == 0 for r in hits)
    # Blocks freed out of the window went to other grants while still in a live row.
    assert sum(reused_while_in_a_row(ledger_root, 4).values()) > 0


def test_gemma3_faults_in_a_sliding_window_group_and_the_full_attention_group(tmp_path, engine):
    run = engine(traced(tmp_path, GEMMA_PRESSURE, "log"), fault="slot_shift@6:g1,slot_shift@10:g3")
    injected = {(int(f["step"]), int(f["group"])): f["req"] for f in run.faults}
    assert set(injected) == {(6, 1), (10, 3)}, run.faults
    result = replay(tmp_path / "ledger")
    # Each caught in its group, at its step, for its request; nothing else reported.
    assert {(v.step, v.group) for v in result.violations} == set(injected), result.violations
    for (step, group), req in injected.items():
        assert any(
            (v.kind, v.step, v.group, v.req_id) == ("write_target_mismatch", step, group, req)
            for v in result.violations
        ), (step, group, result.violations)
        assert f"kv_trace: write_target_mismatch at step {step}, req {req}, group {group}" in run.log


def test_qwen3_next_state_groups_owned_and_rows_checked_the_rest_counted_unchecked(tmp_path, engine):
    """Attention checked in full; state groups: grant ownership and the rows their kernels
    index, counted `mamba_group` unchecked per group-step for what the kernels do with them.
    One run: a slot shift in the attention group and a swapped state row, both caught alone."""
    run = engine(traced(tmp_path, QWEN_PRESSURE, "log"), fault=QWEN_FAULTS)
    ledger_root = tmp_path / "ledger"
    kinds = group_kinds(ledger_root)
    assert kinds == [("MAMBA", None)] * 3 + [("FULL_ATTENTION", None)]
    inputs = step_inputs(ledger_root)
    assert sum(r["num_computed_tokens"] > 0 for inp in inputs for r in inp["new_reqs"]) >= 2, "no prefix hits"
    assert any(inp["preempted_req_ids"] for inp in inputs), "no preemption"
    # Align mode freed spent state blocks that were handed out again while still in a live row.
    assert sum(reused_while_in_a_row(ledger_root, 4).values()) > 0

    result = replay(ledger_root)
    injected = assert_qwen_faults_caught_alone(run, result)
    for kind, (step, group) in (("write_target_mismatch", (6, 3)), ("read_target_mismatch", (10, 0))):
        assert f"kv_trace: {kind} at step {step}, req {injected[step, group]}, group {group}" in run.log

    coverage = result.ledger.coverage
    plan_steps = sum(1 for s in ledger_bodies(ledger_root, "kvledger.Step") if s["plan"] is not None)
    assert plan_steps > 50
    # The attention group: writes and reads of every scheduled request.
    assert coverage.checks["write"] == coverage.checks["read"] == coverage.checks["position"] > 200
    # Every granted block's owner (state blocks too), and the state groups' rows every step ...
    assert coverage.checks["exclusivity"] > 20
    assert coverage.checks["state_rows"] == 3 * coverage.checks["position"]
    # ... and what their kernels read and write there, unmodelled, counted once per group and step.
    assert result.unchecked == Counter({"mamba_group": 3 * plan_steps}), result.unchecked


def test_fault_plugin_syntax_targets_steps_and_groups():
    spec = importlib.util.spec_from_file_location("faults", TEST_PLUGINS / "kvledger_test_faults.py")
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    # Defaults (KVLEDGER_TEST_FAULT_STEP / _GROUP) apply where an item names no step or group.
    assert faults.parse_faults("slot_shift@6:g1, block_swap:g3,foreign_write", 3, 0) == [
        ("slot_shift", 6, 1),
        ("block_swap", 3, 3),
        ("foreign_write", 3, 0),
    ]
    with pytest.raises(ValueError, match="bad KVLEDGER_TEST_FAULT item"):
        faults.parse_faults("slot_shift@g1", 3, 0)
