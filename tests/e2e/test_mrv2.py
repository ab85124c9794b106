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
from tests.e2e.conftest import assert_runner, step_inputs
from tests.e2e.test_hybrid import GEMMA_PRESSURE, group_kinds, reused_while_in_a_row
from tests.e2e.test_vllm_trace import PRESSURE

pytestmark = pytest.mark.e2e

V2 = {"runner": "v2"}
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
    return engine(traced(root, PRESSURE, "log"), fault=FAULTS), replay(root / "ledger"), root / "ledger"


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
    run = engine(traced(tmp_path, GEMMA_PRESSURE, "log"), fault="slot_shift@6:g1,slot_shift@10:g3")
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
