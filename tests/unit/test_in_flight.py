"""Async scheduling's window (contract R29): a KV connector load into blocks a step still in flight
uses is `in_flight_reuse`; the step path and the fast path agree, and a synchronous rank costs nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvledger.producer import records
from kvledger.schemas.events import event_of
from kvledger.schemas.kinds import ViolationKind
from kvledger.stream_app.core import Ledger
from tests.synthetic.engine import FaultSpec, simulate

from .test_batch import DECODE_HEAVY, assert_same, fast_runs  # noqa: F401 (a fixture)
from .test_detectors import configs

RANK = records.RankIdentity("e1", 0, 0, 0, 7)
BS = 4


class Stream:
    """One rank's events, built step by step: r0 prefills 5 tokens into blocks 3 and 4, then decodes."""

    def __init__(self, kind: str = "FULL_ATTENTION", window: int | None = None):
        self.seq, self.events = 0, []
        group = records.kv_group(0, kind, BS, 16, window)
        info = records.rank_info(dp_size=1, tp_size=1, pp_size=1, kv_groups=[group], vllm_version="t", runner="t")
        self.emit(info)

    def emit(self, body) -> None:
        self.events.append(records.envelope(RANK, self.seq, 0, body))
        self.seq += 1

    def step(self, n: int, first: int, count: int, row: list[int], in_flight: int | None, new: bool = False, **kw):
        if new:
            inp = records.step_input(
                new_reqs=[records.new_request(0, "r0", [row], first, first + count, count)], in_flight_steps=in_flight
            )
        else:
            inp = records.step_input(cached=[(0, first, count)], in_flight_steps=in_flight, **kw)
        pos = np.arange(first, first + count)
        slots = np.array(row)[pos // BS] * BS + pos % BS
        group = records.group_plan(0, slots, count, [np.array(row)])
        self.emit(records.step(n, "REAL", inp, records.step_plan([0], [count], [first], [group])))

    def load(self, n: int, blocks: list[int], kind: str = "RECV_INTENT") -> None:
        self.emit(records.connector_event(n, "test", kind, req_id="r1", transfer_id="t1", block_ids=[blocks]))

    def idle(self, n: int, in_flight: int | None, finished=("r0",)) -> None:
        self.emit(records.step(n, "REAL", records.step_input(finished=list(finished), in_flight_steps=in_flight), None))


def replayed(events):
    """The violations and coverage of the step path; the fast path must find the same."""
    ledger = Ledger()
    found = [v for e in events for v in ledger.apply(event_of(e))]
    assert_same(events)
    return found, ledger.coverage


def decode_window(load: list[int], in_flight: int | None = 1, **stream) -> Stream:
    """r0 prefills at step 0 and decodes its 6th token at step 1 (in flight when step 2 was scheduled);
    step 2 finishes r0 and announces r1's load."""
    s = Stream(**stream)
    s.step(0, 0, 5, [3, 4], 0 if in_flight is not None else None, new=True)
    s.step(1, 5, 1, [3, 4], in_flight)
    s.load(2, load)
    s.idle(2, in_flight)
    s.load(2, load, "RECV_DONE")
    return s


def test_a_load_into_a_block_the_step_in_flight_writes_is_caught_with_its_coordinates():
    found, coverage = replayed(decode_window([4, 5]).events)
    assert [(v.kind, v.step, v.req_id, v.group) for v in found] == [(ViolationKind.IN_FLIGHT_REUSE, 2, "r1", 0)]
    assert "block 4 while step 1, still in flight, writes it for r0, which the scheduler freed" in found[0].detail
    assert coverage.checks["in_flight_load"] == 1


def test_a_block_the_step_in_flight_only_reads_counts_too():
    found, _ = replayed(decode_window([3]).events)
    assert [v.kind for v in found] == [ViolationKind.IN_FLIGHT_REUSE] and "reads it" in found[0].detail


def test_loads_into_blocks_no_step_in_flight_uses_are_silent():
    found, coverage = replayed(decode_window([5, 6]).events)
    assert found == [] and coverage.checks["in_flight_load"] == 1


def test_a_synchronous_rank_keeps_nothing_and_checks_nothing():
    s = decode_window([4, 5], in_flight=None)
    found, coverage = replayed(s.events)
    assert found == [] and coverage.checks["in_flight_load"] == 0
    ledger = Ledger()
    for e in s.events:
        ledger.apply(event_of(e))
    tables = ledger.tables_of(ledger.key_of("e1", 0, 0, 0))
    assert not tables.dispatched and not tables.loads


def test_a_sliding_window_step_uses_only_its_window():
    # Window 4: r0's query at position 5 reads keys 2..5 (blocks 3 and 4), so both are in use...
    found, _ = replayed(decode_window([3], kind="SLIDING_WINDOW", window=4).events)
    assert [v.kind for v in found] == [ViolationKind.IN_FLIGHT_REUSE]
    # ...window 2: keys 4..5, block 4 only; block 3 slid out (vLLM frees it on the processed count).
    found, _ = replayed(decode_window([3], kind="SLIDING_WINDOW", window=2).events)
    assert found == []


def test_a_state_group_in_flight_is_counted_unchecked():
    found, coverage = replayed(decode_window([4], kind="MAMBA").events)
    assert found == [] and coverage.unchecked["in_flight_unmodelled"] == 1


def test_an_async_decode_stream_goes_the_fast_way_and_a_reuse_the_step_way(fast_runs):  # noqa: F811
    config = dataclasses.replace(DECODE_HEAVY, in_flight=True)
    events = simulate(config).events
    assert assert_same(events) == []
    steps = sum(e["body"][0] == "kvledger.Step" for e in events)
    assert sum(fast_runs) > 0.8 * steps, (sum(fast_runs), steps)
    sim = simulate(dataclasses.replace(config, faults=(FaultSpec("in_flight_load", 250),)))
    found = assert_same(sim.events)
    [expected] = sim.expected
    assert [(v.kind, v.step, v.req_id, v.group) for v in found] == [
        (ViolationKind.IN_FLIGHT_REUSE, expected.step, expected.req_id, 0)
    ]


@pytest.mark.parametrize("depth", [2])
def test_steps_in_flight_the_reader_never_saw_are_unknown(depth):
    s = Stream()
    s.step(0, 0, 5, [3, 4], depth, new=True)  # the first step seen says two were in flight before it
    s.load(1, [4])
    s.idle(1, depth)
    found, coverage = replayed(s.events)  # step 0 is judged, the one before it is not known
    assert [v.kind for v in found] == [ViolationKind.IN_FLIGHT_REUSE]
    assert coverage.unchecked["in_flight_unknown"] == 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_async_streams_are_silent_and_both_paths_agree(config):
    """Any synthetic stream scheduled with a step in flight, loads beside the window included: the
    step path reports nothing, counts every load checked, and the fast path finds the same."""
    sim = simulate(dataclasses.replace(config, in_flight=True))
    found, coverage = replayed(sim.events)
    assert found == []
    assert coverage.checks["in_flight_load"] == sim.stats["in_flight_loads"]
