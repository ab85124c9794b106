"""Transfers joined across engines: silent on clean pairs, each fault named with its transfer and request.

Streams come from the synthetic prefill/decode pair (tests/synthetic/engine.py),
both engines' events interleaved at random, as a transfer-keyed stream
delivers them; hypothesis explores seeds and shapes.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.producer import records
from kvledger.schemas.events import event_of, events_of
from kvledger.schemas.kinds import ConnectorKind, Unchecked, ViolationKind
from kvledger.schemas.registry import CONNECTOR_EVENT, STEP
from kvledger.stream_app.core import Ledger, Violation
from kvledger.stream_app.core.transfers import TransferJoin, parse_digest
from tests.synthetic.engine import PD_FAULT_KINDS, PdConfig, simulate_pd_pair

TRANSFER_KINDS = {k for kinds in PD_FAULT_KINDS.values() for k in kinds} - {"foreign_block_write"}


def check(events, **ledger_args) -> tuple[list[Violation], Ledger]:
    ledger = Ledger(**ledger_args)
    found = ledger.apply_many(events_of(events))
    return found + ledger.finish(), ledger


def one_rank(engine_id: str):
    """A rank of one full-attention group (block size 4, 16 blocks) after its RankInfo: its events, and
    the function that appends the next one."""
    rank, seq, events = records.RankIdentity(engine_id, incarnation=1), iter(range(100)), []

    def add(body) -> None:
        events.append(records.envelope(rank, next(seq), 0, body))

    kv = [records.kv_group(0, "FULL_ATTENTION", 4, 16)]
    add(records.rank_info(dp_size=1, tp_size=1, pp_size=1, kv_groups=kv, vllm_version="t", runner="v1"))
    return events, add


def transfer_of(v: Violation) -> str | None:
    found = re.match(r"transfer (\S+):", v.detail)
    return found[1] if found else None


def test_new_kinds_are_known():
    assert TRANSFER_KINDS | {"transfer_content_mismatch"} <= set(ViolationKind)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    requests=st.integers(1, 12),
    block_size=st.sampled_from([4, 16, 32]),
    send_lag=st.integers(1, 6),
    digests=st.booleans(),
    shared=st.integers(0, 3),
)
def test_clean_pair_is_silent_and_every_transfer_joined(seed, requests, block_size, send_lag, digests, shared):
    cfg = PdConfig(
        seed=seed,
        requests=requests,
        block_size=block_size,
        send_lag=send_lag,
        digests=digests,
        shared_prefix_blocks=shared,
    )
    sim = simulate_pd_pair(cfg)
    found, ledger = check(sim.events)
    assert found == []
    checks = ledger.coverage.checks
    assert checks["transfer_join"] == checks["transfer_blocks"] == checks["transfer_read"] == requests
    assert checks["transfer_content"] == (requests if digests else 0)
    # Both sides' prefixes compared where the prompt has a full block; below one, nothing to compare.
    judged = sum(len(p) >= block_size for p in sim.prompts)
    assert checks["transfer_prefix"] == judged
    unchecked = ledger.coverage.unchecked
    assert unchecked["transfer_prefix_unknown"] == requests - judged
    assert not [k for k in unchecked if k.startswith("transfer") and k != "transfer_prefix_unknown"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    fault=st.sampled_from(sorted(set(PD_FAULT_KINDS) - {"stuck"})),
    victim=st.integers(0, 4),
    block_size=st.sampled_from([4, 16]),
    shared=st.integers(0, 2),
)
def test_each_fault_is_caught_with_its_transfer_and_request(seed, fault, victim, block_size, shared):
    cfg = PdConfig(seed=seed, requests=6, block_size=block_size, faults=((fault, victim),), shared_prefix_blocks=shared)
    sim = simulate_pd_pair(cfg)
    found, _ = check(sim.events)
    for e in sim.expected:
        assert any(
            (v.kind, v.engine_id, v.req_id, transfer_of(v)) == (e.kind, e.engine_id, e.req_id, e.transfer_id)
            for v in found
        ), (e, found)
    assert {v.kind for v in found} <= set(PD_FAULT_KINDS[fault]), found
    assert {transfer_of(v) for v in found if v.kind in TRANSFER_KINDS} == {sim.transfer_ids[victim]}


def test_a_prefix_hit_on_a_pending_send_is_a_read_not_a_reuse():
    """Every prompt starts with the same three full blocks: each later prefill request gets them
    from the prefix cache while the sends of earlier requests still read them."""
    sim = simulate_pd_pair(PdConfig(seed=3, requests=6, block_size=16, send_lag=4, shared_prefix_blocks=3))
    steps = [e["body"][1] for e in sim.events if e["engine_id"] == "sim-prefill" and e["body"][0] == STEP]
    hits = [r for s in steps if s["input"] for r in s["input"]["new_reqs"] if r["num_computed_tokens"] == 48]
    assert len(hits) == 5  # the scenario really happens: five requests read blocks of pending sends
    found, ledger = check(sim.events)
    assert found == []
    assert ledger.coverage.checks["exclusivity"] > 0 and ledger.coverage.checks["send_hold"] > 0
    # A block of a pending send handed out to be written is still a reuse.
    faulty = simulate_pd_pair(
        PdConfig(seed=3, requests=6, block_size=16, send_lag=4, shared_prefix_blocks=3, faults=(("send_reused", 2),))
    )
    found, _ = check(faulty.events)
    assert {(v.kind, v.req_id) for v in found} == {("send_block_reused", "p-2"), ("foreign_block_write", "p-3")}


def test_stuck_transfer_reported_on_both_sides_at_the_deadline():
    cfg = PdConfig(seed=5, requests=3, idle_steps=30, faults=(("stuck", 1),))
    sim = simulate_pd_pair(cfg)
    found, _ = check(sim.events, transfer_deadline_steps=20)
    assert {(v.kind, v.engine_id, v.req_id) for v in found} == {
        (e.kind, e.engine_id, e.req_id) for e in sim.expected
    }, found
    assert all("deadline 20 steps" in v.detail and transfer_of(v) == "tx-1" for v in found)
    # Without enough steps after it, the same transfer is only open at the end: counted, not reported.
    found, ledger = check(sim.events)
    assert found == [] and ledger.coverage.unchecked["transfer_open_at_end"] == 2


def test_join_is_order_independent_and_checkpointable():
    cfg = PdConfig(seed=9, requests=8, faults=(("content", 2), ("block_count", 5), ("recv_failed", 6)))
    sim = simulate_pd_pair(cfg)
    connector = [e for e in sim.events if e["body"][0] == CONNECTOR_EVENT]

    def run(events, split=None) -> set:
        join, out = TransferJoin(), []
        for n, event in enumerate(events):
            if n == split:
                join = copy.deepcopy(join)  # a checkpoint restored mid-stream
            out += join.apply(event_of(event))
        return {(v.kind, v.engine_id, v.req_id, v.step, v.detail) for v in out + join.finish()}

    expected = run(connector)
    assert {k for k, *_ in expected} == {"transfer_content_mismatch", "transfer_block_mismatch", "transfer_failed"}
    rng = np.random.default_rng(0)
    for _ in range(5):  # any interleaving of the two engines, even each engine's own order shuffled
        shuffled = [connector[i] for i in rng.permutation(len(connector))]
        assert run(shuffled, split=len(shuffled) // 2) == expected


def test_one_engine_alone_is_unchecked_not_orphaned():
    sim = simulate_pd_pair(PdConfig(seed=1, requests=4))
    prefill_only = [e for e in sim.events if e["engine_id"] == "sim-prefill"]
    found, ledger = check(prefill_only)
    assert found == [] and ledger.coverage.unchecked["transfer_peer_not_in_input"] == 4


def test_join_can_be_left_to_a_stream_worker():
    sim = simulate_pd_pair(PdConfig(seed=2, requests=4, faults=(("content", 1), ("send_reused", 2))))
    found, ledger = check(sim.events, join_transfers=False)
    assert ledger.transfer_join is None
    # The rank-local checks stay with the engine's projection; the join's kinds are gone.
    assert {v.kind for v in found} == {"send_block_reused", "foreign_block_write"}


def test_digest_layout_round_trips_and_tail_aligns():
    blob = records.transfer_digest(b"12345678", [1, 2, 2**64 - 1])
    parsed = parse_digest(blob)
    assert parsed.layout == b"12345678" and parsed.blocks.tolist() == [1, 2, 2**64 - 1]
    assert parse_digest(b"\x02" + blob[1:]) is None and parse_digest(None) is None
    with pytest.raises(ValueError):
        records.transfer_digest(b"short", [1])


def test_partial_pull_compares_the_tail_and_other_layouts_are_unchecked():
    def event(engine, kind, blocks, digest, **fields):
        body = records.connector_event(
            3, "test", kind, req_id=f"{engine}-r", transfer_id="t", block_ids=[blocks], digest=digest, **fields
        )
        return records.event(records.RankIdentity(engine), 0, 0, body)

    sent = records.transfer_digest(b"layout-a", [11, 12, 13])
    tail = records.transfer_digest(b"layout-a", [12, 13])
    join = TransferJoin()
    out = join.apply(event("p", "SEND_DONE", [1, 2, 3], sent))
    out += join.apply(event("d", "RECV_DONE", [7, 8], tail, remote_engine_id="p"))
    assert out == [] and join.coverage.checks["transfer_content"] == 1
    assert join.coverage.unchecked["transfer_partial_pull"] == 1
    other = TransferJoin()
    other.apply(event("p", "SEND_DONE", [1, 2], records.transfer_digest(b"layout-a", [1, 2])))
    assert other.apply(event("d", "RECV_DONE", [1, 2], records.transfer_digest(b"layout-b", [5, 6]))) == []
    assert other.coverage.unchecked["transfer_digest_layout_differs"] == 1


def join_all(events, **join_args) -> tuple[set, TransferJoin]:
    join, out = TransferJoin(**join_args), []
    for event in events:
        out += join.apply(event_of(event))
    return {(v.kind, v.engine_id, v.req_id, v.step, v.detail) for v in out}, join


def coarse_clock(events, every: int) -> list[dict]:
    """What a stream worker's join reads: connector events, and each rank's step only now and then."""
    out = []
    for event in events:
        name, body = event["body"]
        if name == CONNECTOR_EVENT or (name == STEP and body["step"] % every == 0):
            out.append(event)
    return out


def test_repeated_events_are_ignored():
    cfg = PdConfig(seed=4, requests=6, faults=(("recv_failed", 1), ("content", 3), ("block_count", 4)))
    connector = [e for e in simulate_pd_pair(cfg).events if e["body"][0] == CONNECTOR_EVENT]
    once, _ = join_all(connector)
    assert {k for k, *_ in once} == {"transfer_failed", "transfer_content_mismatch", "transfer_block_mismatch"}
    # A restarted worker re-sends a stretch of what it sent before: the same answers, reported once.
    again = connector[: len(connector) * 2 // 3] + connector[len(connector) // 3 :]
    join, out = TransferJoin(), []
    for event in again:
        out += join.apply(event_of(event))
    assert len(out) == len(once) and {(v.kind, v.engine_id, v.req_id, v.step, v.detail) for v in out} == once


def test_stuck_is_reported_at_the_deadline_step_however_coarse_the_clock():
    sim = simulate_pd_pair(PdConfig(seed=5, requests=4, idle_steps=60, faults=(("stuck", 1),)))
    fine, _ = join_all(sim.events, deadline_steps=20)
    assert {k for k, *_ in fine} == {"transfer_stuck"} and len(fine) == 2
    for every in (7, 25):
        coarse, _ = join_all(coarse_clock(sim.events, every), deadline_steps=20)
        assert coarse == fine


def test_closed_transfers_are_retired_and_late_repeats_stay_quiet():
    sim = simulate_pd_pair(PdConfig(seed=6, requests=10, idle_steps=80))
    events = sim.events
    found, join = join_all(events, deadline_steps=10)
    assert found == set()
    assert join.transfers == {} and join.retired == set(sim.transfer_ids)  # state gone, ids kept
    connector = [e for e in events if e["body"][0] == CONNECTOR_EVENT]
    assert all(join.apply(event_of(e)) == [] for e in connector)  # a late repeat is not a new, lone transfer
    assert join.transfers == {}
    # Long after, the ids go too.
    for engine_id in ("sim-prefill", "sim-decode"):
        last = copy.deepcopy(next(e for e in reversed(events) if e["engine_id"] == engine_id and e["body"][0] == STEP))
        last["body"][1]["step"] += 64 * 10  # FORGET_AFTER deadlines
        assert join.apply(event_of(last)) == []
    assert join.retired == set()


@pytest.mark.parametrize("ending", ["SEND_DONE", "EXPIRED", ConnectorKind.SEND_CANCELLED, None])
def test_a_send_that_ended_releases_its_blocks_and_one_still_pending_holds_them(ending):
    """Request p0 prefilled blocks 1-2 and finished; its send held them. Once the send ended, however it
    ended (done, expired, cancelled because the prefill request was aborted), the blocks are free: a
    later request granted them writes its own. While it is pending, that write is a foreign one."""
    events, add = one_rank("p")

    def prefill(step: int, index: int, blocks: list[int], finished=()) -> None:
        inp = records.step_input(
            new_reqs=[records.new_request(index, f"p{index}", [blocks], 0, 8, 8)], finished=finished
        )
        group = records.group_plan(0, np.arange(8) + blocks[0] * 4, 8, [np.array(blocks)])
        add(records.step(step, "REAL", inp, records.step_plan([index], [8], [0], [group])))

    prefill(0, 0, [1, 2])
    add(records.connector_event(0, "test", "SEND_INTENT", req_id="p0", transfer_id="t0", block_ids=[[1, 2]]))
    if ending is not None:
        add(records.connector_event(1, "test", ending, req_id="p0", transfer_id="t0"))
    prefill(1, 1, [1, 2], finished=["p0"])  # the scheduler hands p0's blocks to p1
    ledger = Ledger(join_transfers=False)
    found = [(v.kind, v.req_id) for e in events for v in ledger.apply(event_of(e))]
    if ending is None:
        assert (ViolationKind.FOREIGN_BLOCK_WRITE, "p1") in found
    else:
        assert found == [] and ledger.coverage.checks["exclusivity"] > 0


@pytest.mark.parametrize("ending", ["RECV_DONE", "RECV_FAILED", None])
def test_a_pending_receive_holds_its_blocks_until_it_ends(ending):
    """A decode rank pulls into blocks 1-2 (the transfer writes them). A request granted them to write
    while the pull is in flight writes under a late transfer (SGLang 32564: an abort freed them early);
    once the receive ended, done or failed, they are the scheduler's to hand out again."""
    events, add = one_rank("d")
    add(records.connector_event(0, "test", "RECV_INTENT", req_id="d0", transfer_id="t0", block_ids=[[1, 2]]))
    inp = records.step_input()
    add(records.step(0, "REAL", inp, None))
    if ending is not None:
        add(records.connector_event(0, "test", ending, req_id="d0", transfer_id="t0"))
    inp = records.step_input(new_reqs=[records.new_request(1, "d1", [[1, 2]], 0, 8, 8)])
    group = records.group_plan(0, np.arange(8) + 4, 8, [np.array([1, 2])])
    add(records.step(1, "REAL", inp, records.step_plan([1], [8], [0], [group])))
    ledger = Ledger(join_transfers=False)
    found = [(v.kind, v.req_id, v.step) for e in events for v in ledger.apply(event_of(e))]
    if ending is None:
        assert found == [(ViolationKind.FOREIGN_BLOCK_WRITE, "d1", 1)]
    else:
        assert found == [] and ledger.coverage.checks["exclusivity"] == 2


@pytest.mark.parametrize("lost", [True, False])
def test_a_transfer_pending_at_a_gap_is_forgotten_and_counted(lost):
    """A decode rank pulls into blocks 1-2; its events 3..4 are lost, the receive's end among them. After
    the resync the scheduler hands the blocks out again: were the receive still held, that would read
    as a foreign write the ledger cannot prove. Forgotten at the gap, counted. Without the gap the end
    arrives and releases them the same way."""
    events, add = one_rank("d")
    add(records.connector_event(0, "test", "RECV_INTENT", req_id="d0", transfer_id="t0", block_ids=[[1, 2]]))
    add(records.step(0, "REAL", records.step_input(), None))
    add(records.connector_event(0, "test", "RECV_DONE", req_id="d0", transfer_id="t0"))
    add(records.step(1, "REAL", records.step_input(), None))
    if lost:
        del events[3:5]  # the receive's end and a step: a sequence gap
    add(records.snapshot(1, []))
    inp = records.step_input(new_reqs=[records.new_request(1, "d1", [[1, 2]], 0, 8, 8)])
    group = records.group_plan(0, np.arange(8) + 4, 8, [np.array([1, 2])])
    add(records.step(2, "REAL", inp, records.step_plan([1], [8], [0], [group])))
    ledger = Ledger(join_transfers=False)
    found = [v.kind for e in events for v in ledger.apply(event_of(e))]
    if lost:
        assert found == [ViolationKind.SEQUENCE_GAP]
        assert ledger.coverage.unchecked[Unchecked.TRANSFERS_FORGOTTEN] == 1
    else:
        assert found == [] and Unchecked.TRANSFERS_FORGOTTEN not in ledger.coverage.unchecked
    assert ledger.coverage.checks["exclusivity"] == 2  # the grant was judged, and found clean
