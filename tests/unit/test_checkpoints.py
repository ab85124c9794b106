"""Checkpoints are data: Avro records of the core's state, restored exactly, never run.

A worker writes a checkpoint to a changelog topic and reads it back after a
restart or a rebalance: a ledger restored from one at any point must go on
exactly as the ledger it was taken from (same violations, same coverage,
same next checkpoint), and a record that is not a checkpoint (a pickle, bytes
of garbage, a record whose rows contradict themselves) is refused with its
reason, never executed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvledger.schemas import LEDGER_EVENT, SingleObjectCodec, checkpoint
from kvledger.schemas.checkpoint import EngineCheckpoint
from kvledger.schemas.events import event_of, events_of
from kvledger.schemas.kinds import Check, Unchecked
from kvledger.schemas.registry import ENGINE_CHECKPOINT
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.core.checkpoints import join_checkpoint, join_of, ledger_checkpoint, ledger_of
from kvledger.stream_app.core.transfers import TransferJoin
from kvledger.stream_app.worker.join import JoinProjection
from kvledger.stream_app.worker.projection import (
    CheckpointError,
    Decoder,
    EngineProjection,
    Record,
    ViolationIds,
    chunk_count,
    decode_checkpoint,
    join_chunks,
    split_checkpoint,
)
from tests.synthetic.engine import FaultSpec, PdConfig, SimConfig, simulate, simulate_pd_pair
from tests.unit.test_core import REALISTIC

CODEC = SingleObjectCodec(LEDGER_EVENT)

STREAMS = {
    # TP=2, a sliding-window group beside full attention, rank and plan faults, a lost rank.
    "tp2-hybrid": dataclasses.replace(REALISTIC, faults=(*REALISTIC.faults, FaultSpec("sequence_gap", 170, tp_rank=1))),
    # A tight pool: preemptions and resumes, prefix hits, zeroed new blocks, a recycled block.
    "preempting": SimConfig(
        seed=5,
        steps=260,
        num_blocks=48,
        max_num_seqs=12,
        arrival_rate=0.8,
        zero_new_blocks=True,
        faults=(FaultSpec("recycled_block", 120), FaultSpec("block_out_of_range", 150), FaultSpec("zero_shared", 200)),
    ),
}


def _violations(found) -> Counter:
    return Counter(json.dumps(v.to_record(), sort_keys=True) for v in found)


def _through_checkpoint(ledger: Ledger, engine_id: str) -> Ledger:
    """What a worker restores: the ledger's record, Avro-encoded, decoded, rebuilt."""
    blob = checkpoint.encode(ledger_checkpoint(ledger, engine_id))
    return ledger_of(decode_checkpoint(blob, EngineCheckpoint))


def _derived(ledger: Ledger) -> list:
    """What a checkpoint leaves out and a restore recomputes: block holders, pending-send holds, digests."""
    out = []
    for slot in ledger.ranks.values():
        for g in slot.state.groups if slot.state is not None else ():
            n = slot.state.num_rows
            out += [
                g.hold_count.tolist(),
                g.hold_sum.tolist(),
                g.hold_sumsq.tolist(),
                g.send_hold.tolist(),
                g.recv_hold.tolist(),
            ]
            out.append(g.digests[:n][g.lens[:n] > 0].tolist())
    return out


def _stream(name: str) -> list[dict]:
    if name == "pd-prefill":  # pending sends hold blocks across steps
        sim = simulate_pd_pair(PdConfig(seed=4, requests=8, send_lag=6, faults=(("send_reused", 3),)))
        return [e for e in sim.events if e["engine_id"] == "sim-prefill"]
    return simulate(STREAMS[name]).events


@pytest.mark.parametrize("name", [*sorted(STREAMS), "pd-prefill"])
def test_a_ledger_restored_anywhere_goes_on_as_the_original(name):
    events = _stream(name)
    engine_id = events[0]["engine_id"]
    reference = Ledger(join_transfers=False)
    expected = reference.apply_many(events_of(events))
    assert expected, "the stream's faults are found"
    for cut in (1, len(events) // 4, len(events) // 2, len(events) - 7):
        ledger = Ledger(join_transfers=False)
        found = ledger.apply_many(events_of(events[:cut]))
        derived = _derived(ledger)
        ledger = _through_checkpoint(ledger, engine_id)
        assert _derived(ledger) == derived, cut
        found += ledger.apply_many(events_of(events[cut:]))
        assert _violations(found) == _violations(expected), cut
        assert _content_as_unknown(ledger.coverage) == _content_as_unknown(reference.coverage), cut
        # Nothing is lost or added by a round trip: the next checkpoint is the same (its coverage as above).
        again, original = ledger_checkpoint(ledger, engine_id), ledger_checkpoint(reference, engine_id)
        assert msgspec.structs.replace(again, coverage=original.coverage) == original, cut


# What blocks hold (their prefix chains, how far executed steps wrote them) is not checkpointed: it
# grows with the pool's cached blocks, not with what is live. A restored ledger counts a prefix hit on
# a block computed before the checkpoint as unknown, never as a violation; the same hits, all told.
_CONTENT = ((Check.PREFIX_IDENTITY, Unchecked.PREFIX_UNKNOWN), (Check.READ_WRITTEN, Unchecked.FILL_UNKNOWN))


def _content_as_unknown(coverage) -> tuple[Counter, Counter]:
    checks, unchecked = Counter(coverage.checks), Counter(coverage.unchecked)
    for check, unknown in _CONTENT:
        unchecked[unknown] += checks.pop(check, 0)
    return checks, +unchecked


def test_a_join_restored_anywhere_goes_on_as_the_original():
    faults = (("recv_failed", 0), ("content", 1), ("block_count", 2), ("stuck", 4))
    sim = simulate_pd_pair(PdConfig(seed=2, requests=7, idle_steps=60, faults=faults))
    reference = TransferJoin(deadline_steps=20)
    expected = [v for e in sim.events for v in reference.apply(event_of(e))] + reference.finish()
    assert {"transfer_failed", "transfer_stuck", "transfer_content_mismatch"} <= {v.kind for v in expected}
    for cut in (len(sim.events) // 3, 2 * len(sim.events) // 3):
        join = TransferJoin(deadline_steps=20)
        found = [v for e in sim.events[:cut] for v in join.apply(event_of(e))]
        blob = JoinProjection(0, join).checkpoint()
        join = JoinProjection.restore(blob, 0).join
        found += [v for e in sim.events[cut:] for v in join.apply(event_of(e))] + join.finish()
        assert _violations(found) == _violations(expected), cut
        assert join_checkpoint(join, 0) == join_checkpoint(reference, 0)
        assert join_checkpoint(join_of(join_checkpoint(join, 0)), 0) == join_checkpoint(join, 0)


def test_one_table_per_engine_whatever_the_tp_degree():
    sim = simulate(dataclasses.replace(STREAMS["tp2-hybrid"], tp_size=8, faults=(), steps=120))
    ledger = Ledger(join_transfers=False)
    assert ledger.apply_many(events_of(sim.events)) == []
    engine_id = sim.events[0]["engine_id"]
    tables = [slot.table for slot in ledger_checkpoint(ledger, engine_id).ranks]
    assert len(tables) == 8 and tables[0].same_as is None and tables[0].requests.req_ids
    assert tables[1:] == [None] * 7  # the other ranks are compared with the lead, not replayed
    restored = _through_checkpoint(ledger, engine_id)
    assert ledger_checkpoint(restored, engine_id) == ledger_checkpoint(ledger, engine_id)
    lead = next(k for k in restored.ranks if (k.tp, k.pp) == (0, 0))
    assert all(restored.tables_of(key) is restored.ranks[lead].state is not None for key in restored.ranks)


def _projection_blob() -> bytes:
    sim = simulate(dataclasses.replace(STREAMS["preempting"], steps=80))
    records = [Record(0, i, b"sim-engine", CODEC.encode(e)) for i, e in enumerate(sim.events)]
    projection = EngineProjection("sim-engine")
    projection.apply(Decoder().split(records)[0]["sim-engine"])
    return projection.mark_checkpointed()


def test_an_engine_checkpoint_names_the_partition_its_records_come_from():
    """A worker assigned the partition loads the engine from it, though no record of it is left to read."""
    projection = EngineProjection.restore(_projection_blob(), "sim-engine")
    assert projection.partition is None  # never told: loaded at its next record
    projection.partition = 3
    assert EngineProjection.restore(projection.mark_checkpointed(), "sim-engine").partition == 3


def test_a_pickle_in_the_changelog_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(CheckpointError, match="not a checkpoint record"):
        EngineProjection.restore(pickle.dumps({"format": 2, "ledger": Exploit()}), "sim-engine")
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda blob: b"garbage" * 10,
        lambda blob: blob[:10] + b"\xff" * 40,  # the right schema, an undecodable body
        lambda blob: blob[: len(blob) // 2],  # cut short
    ],
)
def test_a_damaged_checkpoint_is_refused(damage):
    blob = _projection_blob()
    assert EngineProjection.restore(blob, "sim-engine").ledger.events > 0
    with pytest.raises(CheckpointError):
        EngineProjection.restore(damage(blob), "sim-engine")


def test_a_checkpoint_whose_rows_contradict_themselves_is_refused():
    body = decode_checkpoint(_projection_blob(), EngineCheckpoint)
    table = next(slot.table for slot in body.ranks if slot.table is not None)
    table.groups[0].lens = table.groups[0].lens[:-4]  # one row fewer than the table has
    with pytest.raises(CheckpointError, match="rows do not match"):
        EngineProjection.restore(checkpoint.encode(body), "sim-engine")
    with pytest.raises(CheckpointError, match="of engine 'sim-engine' under the key of 'other'"):
        EngineProjection.restore(_projection_blob(), "other")


@pytest.mark.parametrize(
    "ids", [[], [0, 1, 255], [256, 7], [70_000, 3], [1 << 24, 5], [(1 << 32) - 1], [-1, 4], [1 << 40, 2]]
)
def test_block_ids_pack_to_the_fewest_bytes_and_back(ids):
    from kvledger.stream_app.core.checkpoints import pack_ids, unpack_ids

    data, width = pack_ids(np.asarray(ids, np.int64))
    assert unpack_ids(data, width).tolist() == ids
    assert len(data) == width * len(ids) and width <= (8 if min(ids, default=0) < 0 or max(ids, default=0) >> 32 else 4)


def test_a_big_checkpoint_is_cut_into_pieces_and_put_back_together():
    blob = os.urandom(3 * 1000 + 17)
    pieces = split_checkpoint(blob, limit=1000)
    assert len(pieces) == 4 and all(len(p) <= 1000 for p in pieces) and chunk_count(pieces[0]) == 4
    assert join_chunks(pieces) == blob
    assert split_checkpoint(blob[:900], limit=1000) == [blob[:900]] and chunk_count(blob[:900]) == 1
    with pytest.raises(CheckpointError, match="missing"):
        join_chunks([pieces[0], None, *pieces[2:]])
    with pytest.raises(CheckpointError, match="do not add up"):
        join_chunks([pieces[0], pieces[2], pieces[1], pieces[3]])


def test_violation_ids_remember_a_bounded_number_of_facts():
    sim = simulate(STREAMS["tp2-hybrid"])
    found = Ledger(join_transfers=False).apply_many(events_of(sim.events))
    ids = ViolationIds(limit=3)
    issued = ids.issue(found + found[-1:])
    assert len(ids.issued) == 3
    assert issued[-1].id.endswith("/1")  # the same fact again, just issued: a repeat, by id
    assert ViolationIds.from_counts(ids.counts()).issued == ids.issued


# -- the schema --------------------------------------------------------------------------------
def test_every_checkpoint_field_has_a_doc_and_apache_avro_agrees_on_the_schema():
    import avro.schema
    import fastavro

    from kvledger.schemas.codec import schema_fingerprint
    from kvledger.schemas.registry import CHECKPOINT, checkpoint_raw, raw_schema
    from tests.unit.test_schemas import _records

    found = list(_records(raw_schema("checkpoint")))
    missing = [f"{path}.{r['name']}.{f['name']}" for path, r in found for f in r["fields"] if not f.get("doc")]
    assert found and not missing, missing
    parsed = avro.schema.parse(json.dumps(checkpoint_raw()))
    assert parsed.canonical_form == fastavro.schema.to_parsing_canonical_form(CHECKPOINT)
    assert bytes(parsed.fingerprint("CRC-64-AVRO")) == schema_fingerprint(CHECKPOINT)


def _with_table_field(raw: dict) -> dict:
    """A later version of the schema: an optional field added to Table (the evolution rules' allowed change)."""
    raw = json.loads(json.dumps(raw))
    engine = raw["fields"][0]["type"][0]
    slot = next(f for f in engine["fields"] if f["name"] == "ranks")["type"]["items"]
    table = next(f for f in slot["fields"] if f["name"] == "table")["type"][1]
    table["fields"].append({"name": "note", "type": ["null", "string"], "default": None, "doc": "Added later."})
    return raw


def test_checkpoints_evolve_both_ways():
    """A worker reads the checkpoints of the schema versions it was given: an upgraded worker reads an
    older one's, an older worker reads an upgraded one's; an unknown version is refused, not misread."""
    import fastavro

    from kvledger.schemas.registry import CHECKPOINT, checkpoint_raw

    newer = fastavro.parse_schema(_with_table_field(checkpoint_raw()))
    blob = _projection_blob()  # written by today's schema
    body = SingleObjectCodec(CHECKPOINT).decode(blob)["body"][1]
    upgraded = SingleObjectCodec(newer, known=[CHECKPOINT], reader=newer)
    kind, read = upgraded.decode(blob)["body"]
    assert all(slot["table"] is None or slot["table"]["note"] is None for slot in read["ranks"])
    new_blob = upgraded.encode({"body": (kind, read)})
    older = SingleObjectCodec(CHECKPOINT, known=[newer], reader=CHECKPOINT)
    assert older.decode(new_blob)["body"] == (ENGINE_CHECKPOINT, body)
    with pytest.raises(CheckpointError, match="unknown writer schema"):
        EngineProjection.restore(new_blob, "sim-engine")  # this worker was not given that version


# -- checkpoints written by earlier versions -----------------------------------------------------
GOLDEN = Path(__file__).with_name("checkpoint_golden.json")


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())))
def test_a_checkpoint_written_by_an_earlier_version_loads_and_writes_back_the_same_bytes(name):
    """Checkpoints as the worker wrote them before their records were typed (`checkpoint_golden.json`:
    a TP=2 x PP=2 engine with a lost rank, a gap, a closed rank, tables stored once for two ranks, held
    and early plans; both engines of a PD pair with sends and receives pending, done and failed; a
    transfer join) load, and a checkpoint of what they loaded is the same bytes: the schema is the one
    they were written with, and every field is read and written as it was."""
    blob = bytes.fromhex(json.loads(GOLDEN.read_text())[name])
    projection = JoinProjection if name.startswith("join") else EngineProjection
    assert projection.restore(blob).checkpoint() == blob
