"""The worker's projections without Kafka: engines, then the transfer join over what they forward.

The engine projections forward connector events (keyed by transfer id) and,
at checkpoints, each rank's progress to every partition of the transfer
stream; the joins there must find exactly what one offline Ledger finds over
both engines, even when a restarted worker re-sends a stretch.
"""

from __future__ import annotations

import json
import random
import zlib
from collections import Counter

import pytest

from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec, SingleObjectCodec
from kvledger.schemas.events import Step, event_record, events_of
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.core.transfers import TransferJoin
from kvledger.stream_app.worker.join import JoinProjection
from kvledger.stream_app.worker.projection import Decoder, EngineProjection, Record
from tests.synthetic.engine import PdConfig, SimConfig, simulate, simulate_pd_pair

CODEC = SingleObjectCodec(LEDGER_EVENT)
DEADLINE = 20
PARTITIONS = 3


def offline(events) -> Counter:
    ledger = Ledger(transfer_deadline_steps=DEADLINE)
    return as_multiset(ledger.apply_many(events_of(events)))


def as_multiset(violations) -> Counter:
    return Counter(json.dumps(v.to_record(), sort_keys=True) for v in violations)


def online(events, seed: int, resend: bool = False) -> tuple[Counter, set[str]]:
    """Engines in batches (random sizes), checkpoints now and then, joins over what they forwarded."""
    rng = random.Random(seed)
    per_engine: dict[str, list[Record]] = {}
    for event in events:
        records = per_engine.setdefault(event["engine_id"], [])
        records.append(Record(0, len(records), event["engine_id"].encode(), CODEC.encode(event)))
    projections = {engine_id: EngineProjection(engine_id) for engine_id in per_engine}
    transfers: list[list[bytes]] = [[] for _ in range(PARTITIONS)]
    found, ids, decoder = [], set(), Decoder()
    cursor = dict.fromkeys(per_engine, 0)
    while any(cursor[e] < len(r) for e, r in per_engine.items()):
        engine_id = rng.choice([e for e, r in per_engine.items() if cursor[e] < len(r)])
        start = cursor[engine_id]
        batch = per_engine[engine_id][start : start + rng.randint(1, 40)]
        cursor[engine_id] += len(batch)
        split, dead = decoder.split(batch)
        assert not dead
        outcome = projections[engine_id].apply(split[engine_id])
        for tid, event in outcome.transfers:
            transfers[zlib.crc32(tid.encode()) % PARTITIONS].append(CODEC.encode(event_record(event)))
        found += outcome.violations
        if rng.random() < 0.3:  # a checkpoint: progress to every partition
            for event in projections[engine_id].progress():
                for partition in transfers:
                    partition.append(CODEC.encode(event_record(event)))
        if resend and rng.random() < 0.1:  # a restarted worker: a stretch of the transfers again
            for partition in transfers:
                partition += partition[-rng.randint(1, 10) :]
    for projection in projections.values():
        for event in projection.progress():
            for partition in transfers:
                partition.append(CODEC.encode(event_record(event)))
    for p, values in enumerate(transfers):
        join = JoinProjection(p, TransferJoin(deadline_steps=DEADLINE))
        half = len(values) // 2
        out = join.apply([Record(p, i, b"", v) for i, v in enumerate(values[:half])]).violations
        join = JoinProjection.restore(join.checkpoint())  # a checkpoint restored mid-stream
        out += join.apply([Record(p, i, b"", v) for i, v in enumerate(values)]).violations  # covered ones skipped
        found += out
    ids = {issued.id for issued in found}
    assert len(ids) == len(found)  # one id per fact
    return as_multiset(issued.violation for issued in found), ids


@pytest.mark.parametrize("resend", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_engines_then_join_find_what_one_offline_ledger_finds(seed, resend):
    faults = (("recv_failed", 0), ("content", 1), ("block_count", 2), ("send_reused", 3), ("stuck", 4))
    sim = simulate_pd_pair(PdConfig(seed=seed, requests=7, idle_steps=3 * DEADLINE, faults=faults))
    expected = offline(sim.events)
    kinds = {json.loads(v)["kind"] for v in expected}
    assert {"transfer_failed", "transfer_content_mismatch", "transfer_block_mismatch", "transfer_stuck"} <= kinds
    assert "send_block_reused" in kinds
    got, _ = online(sim.events, seed, resend=resend)
    assert got == expected


def test_engine_projection_leaves_the_join_to_the_transfer_stream():
    sim = simulate_pd_pair(PdConfig(seed=3, requests=4, faults=(("content", 1),)))
    projection = EngineProjection("sim-decode")
    records = [Record(0, i, b"sim-decode", CODEC.encode(e)) for i, e in enumerate(sim.events)]
    split, _ = Decoder().split(records)
    outcome = projection.apply(split["sim-decode"])
    assert projection.ledger.transfer_join is None and outcome.violations == []
    assert {tid for tid, _ in outcome.transfers} == set(sim.transfer_ids)
    progress = projection.progress()
    assert [p.body.step for p in progress] == [projection.ledger.ranks[k].last_step for k in projection.ledger.ranks]
    assert all(p.body.input is None and p.body.plan is None for p in progress)
    assert projection.progress() == []  # nothing moved since


def test_an_engine_outside_every_pd_pair_sends_the_join_no_clock():
    """Its ranks declare no PD role and it forwards no transfer: it is no transfer's side or peer."""
    events = simulate(SimConfig(seed=2, steps=30, tp_size=2)).events
    assert {e["body"][1]["pd_role"] for e in events if e["body"][0] == "kvledger.RankInfo"} == {"NONE"}
    projection = EngineProjection("sim-engine")
    records = [Record(0, i, b"sim-engine", CODEC.encode(e)) for i, e in enumerate(events)]
    split, _ = Decoder().split(records)
    outcome = projection.apply(split["sim-engine"])
    assert outcome.transfers == [] and projection.ledger.ranks
    assert not projection.joins_transfers and projection.progress() == []
    fresh = EngineProjection("sim-engine")  # a rank whose RankInfo is not in yet may be in a pair
    first_step = next(item for item in split["sim-engine"] if isinstance(item[1].body, Step))
    fresh.apply([first_step])
    assert fresh.joins_transfers


def broken(event: dict) -> dict:
    """A Step whose packed column cannot be unpacked: the core raises on it."""
    bad = CODEC.decode(CODEC.encode(event))  # a deep copy
    bad["body"][1]["input"]["cached_req_indices"] = b"\x01\x02\x03"
    return bad


def test_an_event_the_core_raises_on_is_set_aside_alone_even_inside_a_batch():
    sim = simulate_pd_pair(PdConfig(seed=8, requests=5))
    events = [e for e in sim.events if e["engine_id"] == "sim-decode"]
    steps = [i for i, e in enumerate(events) if e["body"][0] == "kvledger.Step" and e["body"][1]["input"]]
    first, second = steps[len(steps) // 3], steps[2 * len(steps) // 3]
    stream = list(events)
    stream[first], stream[second] = broken(events[first]), broken(events[second])
    batches = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH)
    # Messages of 7 events (the sink's framing); the broken ones sit inside two of them.
    records = [
        Record(0, n, b"sim-decode", batches.encode(stream[i : i + 7])) for n, i in enumerate(range(0, len(stream), 7))
    ]
    projection, decoder, dead, found, applied = EngineProjection("sim-decode"), Decoder(), [], [], 0
    for i, record in enumerate(records):
        split, undecodable = decoder.split([record])
        assert not undecodable
        outcome = projection.apply(split["sim-decode"])
        dead += outcome.dead_letters
        found += [issued.violation for issued in outcome.violations]
        applied += outcome.events["sim-decode"]
        if i == 1:
            projection.mark_checkpointed()  # both rebuilds start here: the second replays the first's batch
    assert [(d.reason, d.record.offset, d.index) for d in dead] == [
        ("rejected_by_ledger", first // 7, first % 7),
        ("rejected_by_ledger", second // 7, second % 7),
    ]
    # Every other event was applied once: the same state and findings as a ledger never given the two.
    assert projection.ledger.events == applied == len(events) - 2
    reference = Ledger(join_transfers=False)
    expected = reference.apply_many(events_of(e for i, e in enumerate(events) if i not in (first, second)))
    assert as_multiset(found) == as_multiset(expected) and expected  # their seq numbers are gaps
    assert projection.ledger.coverage.checks == reference.coverage.checks
