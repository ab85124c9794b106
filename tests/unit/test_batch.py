"""The batched fast path is invisible: `apply_many` == `apply`, event for event.

`kvledger check` replays through `Ledger.apply_many`, which proves runs of
steps clean in a few array passes and falls back to the step-by-step path
for anything else; the in-engine raise mode uses `Ledger.apply`. Both must
give the same violations, in the same order, and the same coverage.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.producer import records
from kvledger.schemas.events import Step, event_of, events_of
from kvledger.schemas.kinds import Check, ConnectorKind, ViolationKind
from kvledger.stream_app.core import Ledger, batch
from tests.synthetic.engine import FAULTS, SHARING_FAULTS, FaultSpec, SimConfig, simulate

from .test_detectors import MULTI_RANK_FAULTS, configs

DECODE_HEAVY = SimConfig(
    seed=1,
    steps=400,
    max_num_seqs=48,
    max_batched_tokens=2048,
    arrival_rate=6,
    prompt_len=(16, 64),
    output_len=(100, 300),
    num_blocks=3000,
    prefix_caching=False,
)


def both(events, batch_steps=64):
    one = Ledger()
    stepwise = [v for e in events for v in one.apply(event_of(e))] + one.finish()
    many = Ledger(batch_steps=batch_steps)
    batched = many.apply_many(events_of(events)) + many.finish()
    return (stepwise, one), (batched, many)


def assert_same(events, batch_steps=64):
    (a, one), (b, many) = both(events, batch_steps)
    assert b == a
    assert (many.coverage.checks, many.coverage.unchecked) == (one.coverage.checks, one.coverage.unchecked)
    assert (many.events, many.steps) == (one.events, one.steps)
    return a


@pytest.fixture
def fast_runs(monkeypatch):
    """Counts runs the fast path committed, so a test can insist it was exercised."""
    committed = []
    original = batch.plan_run

    def spy(state, steps):
        result = original(state, steps)
        if result is not None:
            committed.append(len(steps))
        return result

    monkeypatch.setattr(batch, "plan_run", spy)
    return committed


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    configs(),
    st.sampled_from((None, *FAULTS)),
    st.integers(5, 35),
    st.sampled_from([2, 7, 64]),
    st.booleans(),
    st.sampled_from([True, True, False]),
)
def test_batched_equals_stepwise(config, fault, step, batch_steps, byte_alias, chains):
    # byte_alias: groups whose blocks share bytes at other block ids (layout_alias), where there are two;
    # without chains: what a prefix hit read was computed from is unknown (older producers, embeddings)
    config = dataclasses.replace(config, byte_alias=byte_alias, prefix_chains=chains)
    if fault is not None:
        tp = 1 if fault in MULTI_RANK_FAULTS and config.tp_size > 1 else 0
        config = dataclasses.replace(config, faults=(FaultSpec(fault, step, tp_rank=tp),))
    assert_same(simulate(config).events, batch_steps)


@pytest.mark.parametrize("tp", [1, 2])
def test_fast_path_carries_clean_decode(fast_runs, tp):
    events = simulate(dataclasses.replace(DECODE_HEAVY, tp_size=tp)).events
    assert assert_same(events) == []
    # Nearly every step went the fast way: the lead's replayed, the other ranks' matched with it.
    assert sum(fast_runs) > 0.8 * len(events) / tp


def test_fast_path_judges_prefix_hits(fast_runs):
    """Steps that hand blocks out to be read (prefix hits) stay in runs: each read judged as at its step."""
    config = dataclasses.replace(DECODE_HEAVY, prefix_caching=True, shared_prefix_prob=0.6, output_len=(20, 60))
    events = simulate(config).events
    steps = [e.body for e in events_of(events) if isinstance(e.body, Step)]
    assert sum(map(batch.reads_blocks, steps)) > 50
    (stepwise, one), (batched, many) = both(events)
    assert batched == stepwise == []
    assert (many.coverage.checks, many.coverage.unchecked) == (one.coverage.checks, one.coverage.unchecked)
    assert many.coverage.checks[Check.PREFIX_IDENTITY] > 100
    assert many.coverage.checks[Check.READ_WRITTEN] == many.coverage.checks[Check.PREFIX_IDENTITY]
    assert sum(fast_runs) > 0.9 * len(steps)


def test_fast_path_takes_prefix_hits_of_unknown_prefix(fast_runs):
    """A stream without prefix chains (an older producer, prompts given as embeddings): hits stay in runs,
    each counted unchecked prefix_unknown as the step path counts it, and their fill still judged."""
    config = dataclasses.replace(
        DECODE_HEAVY, prefix_caching=True, shared_prefix_prob=0.6, output_len=(20, 60), prefix_chains=False
    )
    events = simulate(config).events
    (stepwise, one), (batched, many) = both(events)
    assert batched == stepwise == []
    assert (many.coverage.checks, many.coverage.unchecked) == (one.coverage.checks, one.coverage.unchecked)
    assert Check.PREFIX_IDENTITY not in many.coverage.checks and many.coverage.unchecked["prefix_unknown"] > 100
    assert many.coverage.checks[Check.READ_WRITTEN] == many.coverage.unchecked["prefix_unknown"]
    assert sum(fast_runs) > 0.5 * len(events)


@pytest.mark.parametrize("fault", FAULTS)
def test_fast_path_hands_faulty_runs_to_the_reference(fast_runs, fault):
    tp = 1 if fault in MULTI_RANK_FAULTS else 0
    shared = {"prefix_caching": True, "shared_prefix_prob": 0.9} if fault in SHARING_FAULTS else {}  # shared blocks
    config = dataclasses.replace(DECODE_HEAVY, tp_size=2, faults=(FaultSpec(fault, 250, tp_rank=tp),), **shared)
    sim = simulate(config)
    assert not sim.unplaced_faults
    violations = assert_same(sim.events)
    assert {e.kind for e in sim.expected} <= {v.kind for v in violations}
    assert fast_runs  # the clean stretches still went fast


def _recycled_block_at_5(**drawn) -> SimConfig:
    """A small rank as the property test draws it, a block recycled at step 5 (its examples pinned here)."""
    return SimConfig(
        steps=40,
        block_size=4,
        max_num_seqs=2,
        max_batched_tokens=16,
        shared_prefix_prob=0.0,
        prefix_caching=False,
        pad_to=8,
        snapshot_interval=0,
        health_interval=50,
        dummy_every=0,
        close_at_end=False,
        faults=(FaultSpec("recycled_block", 5, tp_rank=0),),
        **drawn,
    )


def test_reports_of_one_step_follow_its_requests_not_their_rows():
    """The fast path recycles a finished request's row after its run, the step path at once: the rows
    differ, and two reports of one step still come in the order of the step's requests."""
    config = _recycled_block_at_5(seed=0, num_blocks=23, arrival_rate=2.0, prompt_len=(1, 6), output_len=(1, 1))
    (stepwise, one), (batched, many) = both(simulate(config).events, batch_steps=2)
    key = next(iter(one.ranks))
    assert one.ranks[key].state.free_rows != many.ranks[key].state.free_rows  # rows numbered apart
    assert [v.req_id for v in batched if v.step == 5] == [v.req_id for v in stepwise if v.step == 5]
    assert len([v for v in stepwise if v.step == 5]) == 2


def test_a_block_shared_before_a_run_and_written_in_it_is_judged_step_by_step():
    """A recycled block (two holders) filled within a run, then written again by one of them: whether it
    was full at that write is known only step by step (`shared_block_write`), and the run defers to it."""
    config = _recycled_block_at_5(seed=2352, num_blocks=35, arrival_rate=0.5, prompt_len=(1, 128), output_len=(1, 3))
    violations = assert_same(simulate(config).events, batch_steps=2)
    assert ViolationKind.SHARED_BLOCK_WRITE in {v.kind for v in violations}


@pytest.mark.parametrize("deadline", [25, 150])
def test_a_transfer_falling_due_inside_a_run_is_reported_as_step_by_step(fast_runs, deadline):
    """The fast path moves the transfer join's clocks a run at a time. A send no decode engine ever
    pulls (stuck) falls due inside a run: reported as step by step, at the same step, and the runs around it
    are still taken."""
    events = simulate(DECODE_HEAVY).events
    at = [i for i, e in enumerate(events) if e["body"][0] == "kvledger.Step"][10]
    first = events[at]
    intent = records.connector_event(
        9, "sim", ConnectorKind.SEND_INTENT, req_id="lost", transfer_id="t-lost", block_ids=[[]]
    )
    keys = ("engine_id", "dp_rank", "tp_rank", "pp_rank", "incarnation")
    events.insert(at, records.envelope_record(*(first[k] for k in keys), first["seq"], first["emitted_at_us"], intent))
    for e in events[at + 1 :]:
        e["seq"] += 1
    one = Ledger(transfer_deadline_steps=deadline)
    stepwise = [v for e in events for v in one.apply(event_of(e))] + one.finish()
    many = Ledger(transfer_deadline_steps=deadline, batch_steps=64)
    batched = many.apply_many(events_of(events)) + many.finish()
    assert batched == stepwise
    assert (many.coverage.checks, many.coverage.unchecked) == (one.coverage.checks, one.coverage.unchecked)
    assert [(v.kind, v.step) for v in batched] == [(ViolationKind.TRANSFER_STUCK, 9 + deadline)]
    assert sum(fast_runs) > 300
