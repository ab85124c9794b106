"""Content digests on real engines: a stray write into a sealed block's KV bytes, below every plan
(the test plugin in plugins/kvledger_test_content_faults.py), caught with the right kind, block
and step, on either runner (V1's, Model Runner V2's), on the TP rank it hit, and in a hybrid
model's full-attention group; a block vLLM was to zero (a Mamba hybrid) left with stale bytes,
caught at its step.

The clean runs with `content_digests: 1.0` (silent, with blocks sealed and verified) are the
clean runs of test_vllm_trace.py (preemption, prefix-cache hits, TP=2) and test_hybrid.py: one
engine run proves both the address checks and the content checks silent."""

from __future__ import annotations

import re

import pytest

from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import RUNNERS, assert_runner
from tests.e2e.test_hybrid import GEMMA_PRESSURE, QWEN_PRESSURE
from tests.e2e.test_hybrid import ledger_bodies as bodies_of
from tests.e2e.test_vllm_trace import PRESSURE

pytestmark = pytest.mark.e2e
SHARD_WEIGHT = 4  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)


def digesting(root, spec: dict, **extra) -> dict:
    kv_trace = {
        "enabled": True,
        "sink": f"file://{root}/ledger",
        "snapshot_interval": 16,
        "action": "log",
        "content_digests": 1.0,
    }
    return {**spec, **extra, "kv_trace": kv_trace}


def stray(engine, spec: dict, at: str, tp_rank: int | None = None) -> tuple[dict, str]:
    env = {"KVLEDGER_TEST_STRAY_WRITE": at}
    if tp_rank is not None:
        env["KVLEDGER_TEST_STRAY_TP_RANK"] = str(tp_rank)
    run = engine(spec, env=env)
    [line] = re.findall(r"^STRAY (.*)$", run.log, re.M)
    hit = dict(kv.split("=", 1) for kv in line.split())
    assert "req" in hit, f"the plugin found no full block to overwrite: {line}"
    return {k: hit[k] if k == "req" else int(hit[k]) for k in hit}, run.log


def first_digest_after(ledger_root, hit: dict) -> int:
    """The first step after the stray write at which the hit rank digested the block again."""
    for stream in bodies_of_rank(ledger_root, hit["tp"]):
        content = stream["content"]
        if stream["step"] <= hit["step"] or content is None:
            continue
        pairs = zip(unpack_i32(content["group_ids"]).tolist(), unpack_i32(content["block_ids"]).tolist(), strict=True)
        if (hit["group"], hit["block"]) in pairs:
            return stream["step"]
    raise AssertionError(f"the block was never digested again: {hit}")


def bodies_of_rank(ledger_root, tp: int):
    from kvledger.schemas.files import discover, read_segment

    for stream in discover(ledger_root):
        if stream.tp != tp:
            continue
        for path in stream.segments:
            for event in read_segment(path, []):
                if event["body"][0] == "kvledger.Step":
                    yield event["body"][1]


def assert_caught(ledger_root, log: str, hit: dict) -> None:
    result = replay(ledger_root)
    found = first_digest_after(ledger_root, hit)
    # The plan was untouched: the content check alone reports it, once, where it was found.
    assert [(v.kind, v.tp_rank, v.group, v.step) for v in result.violations] == [
        ("sealed_block_modified", hit["tp"], hit["group"], found)
    ], (hit, result.violations)
    [v] = result.violations
    assert v.detail.startswith(f"block {hit['block']} (sealed at step ")
    assert "no plan wrote into it since: a write outside every plan" in v.detail
    assert hit["req"] in v.detail and v.req_id is not None, (hit, v)  # among the block's holders
    assert f"kv_trace: sealed_block_modified at step {found}" in log  # the rank's own `log` action
    assert result.ledger.coverage.checks["content_verified"] > 0


@pytest.mark.parallel
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_stray_write_into_a_sealed_block_is_caught_on_either_runner(tmp_path, engine, runner):
    hit, log = stray(engine, digesting(tmp_path, PRESSURE, max_tokens=16, num_blocks=64, runner=runner), "8")
    assert hit["step"] == 8 and hit["tp"] == 0
    assert_runner(log, tmp_path / "ledger", runner)
    assert_caught(tmp_path / "ledger", log, hit)


def test_a_stray_write_on_one_tp_rank_is_caught_on_that_rank_only(tmp_path, engine):
    spec = digesting(tmp_path, PRESSURE, tp=2, max_tokens=12, num_blocks=64)
    hit, log = stray(engine, spec, "6", tp_rank=1)
    assert hit["tp"] == 1
    # Rank 0's digests of the same block stayed as they were, and no rank_divergence: each rank
    # holds its own heads, so digests are never compared across ranks.
    assert_caught(tmp_path / "ledger", log, hit)


@pytest.mark.parallel
def test_a_stray_write_into_a_hybrid_models_full_attention_group_is_caught(tmp_path, engine):
    hit, log = stray(engine, digesting(tmp_path, GEMMA_PRESSURE, max_tokens=24), "10:g3")
    assert hit["group"] == 3
    assert_caught(tmp_path / "ledger", log, hit)
    kinds = [g["kind"] for g in next(bodies_of(tmp_path / "ledger", "kvledger.RankInfo"))["kv_groups"]]
    assert kinds == ["SLIDING_WINDOW"] * 3 + ["FULL_ATTENTION"]


@pytest.mark.parallel
def test_a_block_left_unzeroed_is_caught_at_its_step(tmp_path, engine):
    # Qwen3-Next-style: Mamba layers make vLLM zero every new attention block before use.
    run = engine(digesting(tmp_path, QWEN_PRESSURE), env={"KVLEDGER_TEST_UNZEROED": "4"})
    [line] = re.findall(r"^UNZEROED (.*)$", run.log, re.M)
    hit = {k: int(v) for k, v in (kv.split("=", 1) for kv in line.split())}
    result = replay(tmp_path / "ledger")
    # Only the missed block, in the attention group, at the step it was zeroed; every other
    # zeroed block was zero and every sealed attention block kept its bytes.
    assert [(v.kind, v.step, v.group) for v in result.violations] == [
        ("block_not_zeroed", hit["step"], hit["group"])
    ], (hit, result.violations)
    assert result.violations[0].detail.startswith(f"block {hit['block']} was to be zeroed at this step")
    checks = result.ledger.coverage.checks
    assert checks["content_zeroed"] > 10 and checks["content_verified"] > 0, checks
    assert f"kv_trace: block_not_zeroed at step {hit['step']}" in run.log
