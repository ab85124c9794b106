"""Every detector is silent on valid streams and loud on its fault, in the right place.

Streams come from the synthetic engine (scheduler with prefix caching,
chunked prefill, preemption/resume, sliding-window groups, several ranks);
hypothesis explores its configurations.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvledger.schemas.events import event_of
from kvledger.stream_app.core import Ledger, Violation
from tests.synthetic.engine import (
    FAULT_KINDS,
    FAULTS,
    SHARING_FAULTS,
    Expected,
    FaultSpec,
    GroupSpec,
    SimConfig,
    simulate,
)

MULTI_RANK_FAULTS = {"rank_divergence", "rank_missing"}


def run_ledger(events) -> tuple[list[Violation], Ledger]:
    ledger = Ledger()
    found = [v for e in events for v in ledger.apply(event_of(e))]
    return found + ledger.finish(), ledger


def matches(expected: Expected, v: Violation) -> bool:
    return (
        v.kind == expected.kind
        and (v.engine_id, v.dp_rank, v.tp_rank, v.pp_rank)
        == (expected.engine_id, expected.dp_rank, expected.tp_rank, expected.pp_rank)
        and (expected.step is None or v.step == expected.step)
        and (expected.req_id is None or v.req_id == expected.req_id)
        and (expected.group is None or v.group == expected.group)
    )


@st.composite
def configs(draw, min_ranks: int = 1) -> SimConfig:
    window = draw(st.sampled_from([None, 32, 48, 100]))
    groups = (GroupSpec(),) if window is None else (GroupSpec(), GroupSpec("SLIDING_WINDOW", window))
    tp = draw(st.integers(min_value=min_ranks, max_value=2))
    block_size = draw(st.sampled_from([4, 16, 32]))
    prompt_max, output_max = draw(st.integers(2, 300)), draw(st.integers(1, 80))
    # Room for at least one request in every group, up to a roomy pool (a prompt that
    # starts with a shared prefix can be up to 80 tokens long, whatever prompt_max is).
    need = len(groups) * (-(-(max(prompt_max, 80) + output_max) // block_size) + 1)
    return SimConfig(
        seed=draw(st.integers(0, 2**16)),
        steps=draw(st.integers(40, 140)),
        tp_size=tp,
        pp_size=draw(st.sampled_from([1, 1, 2])),
        groups=groups,
        block_size=block_size,
        num_blocks=need + 1 + draw(st.integers(0, 300)),
        max_num_seqs=draw(st.integers(1, 24)),
        max_batched_tokens=draw(st.sampled_from([16, 64, 256, 1024])),
        arrival_rate=draw(st.floats(0.1, 2.0)),
        prompt_len=(1, prompt_max),
        output_len=(1, output_max),
        prefix_caching=draw(st.booleans()),
        shared_prefix_prob=draw(st.floats(0.0, 0.9)),
        dummy_every=draw(st.sampled_from([0, 0, 7, 19])),
        full_rows=draw(st.booleans()),
        snapshot_interval=draw(st.sampled_from([0, 10, 50])),
        zero_new_blocks=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_valid_streams_are_silent_and_fully_checked(config: SimConfig):
    sim = simulate(config)
    # A low arrival rate over few steps can bring no request at all (seed 907: none in 40 steps).
    steps = (e["body"][1] for e in sim.events if e["body"][0] == "kvledger.Step")
    assume(any((step.get("input") or {}).get("new_reqs") for step in steps))
    violations, ledger = run_ledger(sim.events)
    assert violations == []
    # An async stream's loads come from no peer engine in this input: their join is unchecked.
    loads = sim.stats["in_flight_loads"]
    assert ledger.coverage.unchecked == Counter({"transfer_peer_not_in_input": loads} if loads else {})
    assert ledger.coverage.checks["in_flight_load"] == loads
    assert ledger.coverage.checks["write"] > 0
    assert ledger.coverage.checks["read"] == ledger.coverage.checks["write"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.sampled_from(FAULTS), st.integers(5, 35), st.data())
def test_each_fault_is_caught_in_place(config: SimConfig, fault: str, step: int, data):
    if fault in MULTI_RANK_FAULTS:
        assume(config.tp_size * config.pp_size > 1)
    ranks = [(t, p) for p in range(config.pp_size) for t in range(config.tp_size)]
    tp, pp = data.draw(st.sampled_from(ranks)) if fault in MULTI_RANK_FAULTS else (0, 0)
    config = dataclasses.replace(config, faults=(FaultSpec(fault, step, tp_rank=tp, pp_rank=pp),))
    sim = simulate(config)
    assume(not sim.unplaced_faults)  # no target in this stream (e.g. no second live request)
    violations, _ = run_ledger(sim.events)
    for expected in sim.expected:
        assert any(matches(expected, v) for v in violations), (expected, violations)
    allowed = set(FAULT_KINDS[fault])
    assert {v.kind for v in violations} <= allowed, violations


REALISTIC = SimConfig(
    seed=11,
    steps=300,
    tp_size=2,
    groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 48)),
    block_size=16,
    num_blocks=90,
    max_num_seqs=12,
    max_batched_tokens=96,
    arrival_rate=0.8,
    prompt_len=(8, 180),
    output_len=(4, 60),
    dummy_every=23,
    zero_new_blocks=True,
)
PREFIX_HEAVY = dataclasses.replace(REALISTIC, groups=(GroupSpec(),), shared_prefix_prob=0.9, seed=5)


@pytest.mark.parametrize("config", [REALISTIC, PREFIX_HEAVY], ids=["sliding-window", "prefix-caching"])
def test_clean_streams_exercise_what_breaks_monitors(config):
    """The silence above means something: the streams really preempt, resume, chunk, share and slide."""
    sim = simulate(config)
    for stat in ("preemptions", "resumes", "chunked_prefills"):
        assert sim.stats[stat] > 0, sim.stats
    if config is REALISTIC:
        assert sim.stats["window_freed_blocks"] > 0
    else:
        assert sim.stats["prefix_hit_blocks"] > 0
    violations, ledger = run_ledger(sim.events)
    assert violations == []
    assert ledger.coverage.checks["rank_compare"] == config.steps


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_kind_and_place(fault):
    tp = 1 if fault in MULTI_RANK_FAULTS else 0
    base = PREFIX_HEAVY if fault in SHARING_FAULTS else REALISTIC  # shared blocks need prefix caching
    config = dataclasses.replace(base, faults=(FaultSpec(fault, 120, tp_rank=tp),))
    sim = simulate(config)
    assert not sim.unplaced_faults
    violations, _ = run_ledger(sim.events)
    primary = FAULT_KINDS[fault][0]
    assert any(v.kind == primary for v in violations)
    for expected in sim.expected:
        assert any(matches(expected, v) for v in violations), (expected, violations)
    assert {v.kind for v in violations} <= set(FAULT_KINDS[fault])


def test_divergent_rank_is_the_one_blamed():
    """With two ranks a tie is broken by the ranks' own checks: the faulty rank is named."""
    config = dataclasses.replace(REALISTIC, faults=(FaultSpec("slot_shift", 100, tp_rank=1),))
    violations, _ = run_ledger(simulate(config).events)
    divergent = [v for v in violations if v.kind == "rank_divergence"]
    assert divergent and all(v.tp_rank == 1 for v in divergent)


def test_violation_names_every_coordinate():
    config = dataclasses.replace(REALISTIC, faults=(FaultSpec("slot_shift", 100),))
    sim = simulate(config)
    violations, _ = run_ledger(sim.events)
    v = next(v for v in violations if v.kind == "write_target_mismatch")
    assert (v.engine_id, v.dp_rank, v.tp_rank, v.pp_rank) == ("sim-engine", 0, 0, 0)
    assert v.step == sim.expected[0].step and v.req_id == sim.expected[0].req_id and v.group == 0
    assert "expected slot" in v.detail and "actual slot" in v.detail
