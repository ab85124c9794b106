"""The contract's test vectors (schemas/vectors/*.json) against the project's own implementation.

The schemas README embeds the small vector files and states the rules for writers; the rule
cases (rules.json) are event sequences whose violations and unchecked counts the ledger core
must reproduce exactly. A change to the implementation, to a vector or to the README's copy of
one fails here.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvledger.producer import records
from kvledger.schemas import (
    LEDGER_EVENT,
    LEDGER_EVENT_BATCH,
    VIOLATION,
    BatchCodec,
    ConfluentCodec,
    SingleObjectCodec,
    pack_digests,
    pack_i32,
    pack_i64,
    pack_u64,
    row_digest,
    unpack_i32,
    unpack_i64,
    unpack_u64,
)
from kvledger.schemas.codec import schema_fingerprint
from kvledger.schemas.events import event_of, events_of
from kvledger.schemas.packing import expand_slot_runs, mix_blocks
from kvledger.schemas.registry import CHECKPOINT
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.core.checks import slot_targets
from kvledger.stream_app.worker.projection import Decoder, Record

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
VECTORS = SCHEMAS / "vectors"
README = (SCHEMAS / "README.md").read_text()
EMBEDDED = ("fingerprints.json", "record.json", "row_digest.json", "packing.json", "slots.json")
M64 = (1 << 64) - 1


def vector(name: str) -> dict:
    return json.loads((VECTORS / name).read_text())


_DTYPES = {"i32": "<i4", "i64": "<i8", "u32": "<u4", "u64": "<u8"}


def from_json(value):
    """A vector's decoded form -> the record a decoder returns: typed columns to bytes, branches to tuples."""
    if isinstance(value, dict):
        if len(value) == 1 and (kind := next(iter(value))) in (*_DTYPES, "hex"):
            data = value[kind]
            return bytes.fromhex(data) if kind == "hex" else np.asarray(data, dtype=_DTYPES[kind]).tobytes()
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        if (
            len(value) == 2
            and isinstance(value[0], str)
            and value[0].startswith("kvledger.")
            and isinstance(value[1], dict)
        ):
            return (value[0], from_json(value[1]))
        return [from_json(v) for v in value]
    return value


# -- the README's copies ------------------------------------------------------------------------------
def test_every_vector_file_is_embedded_in_the_readme_verbatim():
    for name in EMBEDDED:
        match = re.search(rf"<!-- vector: {re.escape(name)} -->\n```json\n(.*?)```", README, re.S)
        assert match is not None, f"README lacks the fenced copy of {name}"
        assert match.group(1) == (VECTORS / name).read_text(), f"README's copy of {name} differs from the file"


def test_every_rule_case_is_cited_by_its_rule_and_every_citation_exists():
    cases = {c["id"]: c for c in vector("rules.json")["cases"]}
    blocks = re.findall(r"^\*\*R(\d+)\. (.*?)(?=^\*\*R\d+\. |^## |\Z)", README, re.S | re.M)
    assert [int(n) for n, _ in blocks] == list(range(1, len(blocks) + 1)), "rules are numbered 1, 2, ... in order"
    cited: dict[str, int] = {}
    for number, text in blocks:
        for names in re.findall(r"Vectors?:\s+((?:`[a-z_]+`(?:,\s+)?)+)", text):
            for cid in re.findall(r"`([a-z_]+)`", names):
                cited[cid] = int(number)
    assert set(cited) == set(cases) - {"clean"}, "each case is cited by exactly the rules that name it"
    for cid, number in cited.items():
        assert cases[cid]["rule"] == number, f"{cid} belongs to rule {cases[cid]['rule']}, cited by R{number}"
    assert cases["clean"]["rule"] == 0 and cases["clean"]["violations"] == []


# -- framing and encoding -----------------------------------------------------------------------------
def test_fingerprints():
    fps = vector("fingerprints.json")["schemas"]
    schemas = {
        "kvledger.LedgerEvent": LEDGER_EVENT,
        "kvledger.LedgerEventBatch": LEDGER_EVENT_BATCH,
        "kvledger.Violation": VIOLATION,
        "kvledger.checkpoint.Checkpoint": CHECKPOINT,
    }
    assert set(fps) == set(schemas)
    for name, schema in schemas.items():
        assert schema_fingerprint(schema).hex() == fps[name], name
        assert len(bytes.fromhex(fps[name])) == 8


def test_one_record_in_both_framings_and_in_a_batch():
    v = vector("record.json")
    event = from_json(v["event"])
    single = SingleObjectCodec(LEDGER_EVENT)
    encoded = single.encode(event)
    assert encoded.hex() == v["single_object_hex"]
    assert encoded[:2] == b"\xc3\x01"
    assert encoded[2:10].hex() == vector("fingerprints.json")["schemas"]["kvledger.LedgerEvent"]
    assert encoded[10:].hex() == v["body_hex"]
    assert single.decode(bytes.fromhex(v["single_object_hex"])) == event

    confluent = ConfluentCodec(LEDGER_EVENT, v["confluent_schema_id"])
    assert confluent.encode(event).hex() == v["confluent_hex"]
    assert bytes.fromhex(v["confluent_hex"])[:5] == b"\x00" + v["confluent_schema_id"].to_bytes(4, "big")
    assert bytes.fromhex(v["confluent_hex"])[5:].hex() == v["body_hex"]
    assert confluent.decode(bytes.fromhex(v["confluent_hex"])) == event

    events = [from_json(e) for e in v["batch_events"]]
    batch = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH)
    data = bytes.fromhex(v["batch_hex"])
    assert batch.encode(events).hex() == v["batch_hex"]
    assert data[2:10].hex() == vector("fingerprints.json")["schemas"]["kvledger.LedgerEventBatch"]
    # The batch body is the Avro array: count (zig-zag varint 2 = 0x04), the items' own bodies, 0.
    bodies = [single.encode(e)[10:] for e in events]
    assert data[10:] == b"\x04" + b"".join(bodies) + b"\x00"
    assert batch.decode(data) == events
    assert batch.decode(encoded) == [event]


# -- packed columns, digests, slots ---------------------------------------------------------------------
def _digest_by_the_formula(row: list[int], p: int, k: int, m: int) -> int:
    """The README's definition, in plain integers (an independent implementation)."""
    total = 0
    for i, b in enumerate(row):
        x = (((b + 1) & M64) * m) & M64
        total = (total + (x ^ (x >> 31)) * pow(p, i + 1, 1 << 64)) & M64
    return (total + len(row) * k) & M64


def test_row_digests():
    v = vector("row_digest.json")
    p, k, m = (int(v["constants"][c], 16) for c in ("P", "K", "M"))
    for entry in v["mix"]:
        b = entry["block"]
        x = (((b + 1) & M64) * m) & M64
        assert int(mix_blocks(np.array([b]))[0]) == int(entry["mix"], 16) == x ^ (x >> 31)
    for entry in v["rows"]:
        row, digest = entry["row"], int(entry["digest"], 16)
        assert row_digest(row) == digest == _digest_by_the_formula(row, p, k, m), row
        assert entry["wire"] == digest & 0xFFFFFFFF
        assert records.row_digests([np.array(row, np.int64)]).tolist() == [digest]
    a = v["append"]
    extended = int(row_digest(a["row"]))
    for i, b in enumerate(a["appended"], start=len(a["row"])):
        x = (((b + 1) & M64) * m) & M64
        extended = (extended + (x ^ (x >> 31)) * pow(p, i + 1, 1 << 64) + k) & M64
    assert extended == int(a["digest"], 16) == row_digest(a["row"] + a["appended"])
    assert pack_digests([row_digest([3, 7]), row_digest([7, 3])]).hex() == v["packed_wire_hex"]


def test_packed_columns():
    v = vector("packing.json")
    pack = {"int32": pack_i32, "int64": pack_i64, "uint64": pack_u64}
    unpack = {"int32": unpack_i32, "int64": unpack_i64, "uint64": unpack_u64}
    for col in v["columns"]:
        if col["type"] == "uint32 digests":
            assert pack_digests([int(x, 16) for x in col["values"]]).hex() == col["hex"]
            continue
        assert pack[col["type"]](col["values"]).hex() == col["hex"]
        assert unpack[col["type"]](bytes.fromhex(col["hex"])).tolist() == col["values"]
    for case in v["slot_runs"]:
        data = bytes.fromhex(case["hex"])
        assert records.slot_runs(np.array(case["slots"], np.int64)).hex() == case["hex"]
        assert unpack_i64(data).tolist() == case["runs"]
        assert expand_slot_runs(data).tolist() == case["slots"]


def test_slot_formula():
    for case in vector("slots.json")["cases"]:
        row, bs, pos = np.array([case["row"]], np.int64), case["block_size"], np.array(case["positions"], np.int64)
        expected = [case["row"][p // bs] * bs + p % bs for p in case["positions"]]
        ones, rows = np.ones(pos.size, np.int64), np.zeros(pos.size, np.int64)
        slots, in_row, _, _ = slot_targets(row, rows, np.full(pos.size, row.shape[1]), pos, ones, bs)
        assert slots.tolist() == expected == case["slots"]
        assert in_row.all()


# -- the rules --------------------------------------------------------------------------------------------
RULE_CASES = vector("rules.json")["cases"]


def _decoded(events: list[dict]) -> list[dict]:
    """Each event as a reader gets it: encoded by the contract's codec and decoded again."""
    codec = SingleObjectCodec(LEDGER_EVENT)
    out = []
    for e in events:
        record = from_json(e)
        decoded = codec.decode(codec.encode(record))
        assert decoded == record
        out.append(decoded)
    return out


@pytest.mark.parametrize("case", RULE_CASES, ids=[c["id"] for c in RULE_CASES])
def test_rule_case(case):
    events = _decoded(case["events"])
    ledger = Ledger(**case["ledger"])
    found = []
    for i, event in enumerate(events):
        found += [(v, i) for v in ledger.apply(event_of(event))]
    found += [(v, None) for v in ledger.finish()]
    got = [[v.kind, f"{v.engine_id}/dp{v.dp_rank}-tp{v.tp_rank}-pp{v.pp_rank}", v.step, v.req_id, v.group, i]
           for v, i in found]  # fmt: skip
    assert got == case["violations"]
    assert dict(ledger.coverage.unchecked) == case["unchecked"]
    # The batched entry point finds the same.
    batched = Ledger(**case["ledger"])
    again = batched.apply_many(events_of(events)) + batched.finish()
    assert [[v.kind, v.step, v.req_id, v.group] for v in again] == [[k, s, r, g] for k, _, s, r, g, _ in got]


def test_the_rule_cases_cover_every_per_rank_violation_kind():
    kinds = {v[0] for c in RULE_CASES for v in c["violations"]}
    assert kinds == {
        "duplicate_event",
        "sequence_gap",
        "write_target_mismatch",
        "read_target_mismatch",
        "unowned_write",
        "foreign_block_write",
        "block_out_of_range",
        "rank_divergence",
        "rank_missing",
        "sealed_block_modified",
        "block_not_zeroed",
        "null_block_grant",
        "prefix_hit_mismatch",
        "unwritten_read",
        "shared_block_write",
        "layout_alias",
        "in_flight_reuse",
    }


def test_numbers_the_rules_state():
    assert Ledger().rank_window == 256
    from kvledger.producer.sinks import KafkaSink

    params = inspect.signature(KafkaSink.__init__).parameters
    assert params["batch_events"].default == 128
    assert params["batch_bytes"].default == 512 << 10
    assert "256 steps" in README and "128 events" in README and "512 KiB" in README


# -- transport: what a reader sets aside ----------------------------------------------------------------
def _message(events: list[dict]) -> bytes:
    return BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH).encode(events)


def test_messages_a_reader_sets_aside():
    event = from_json(vector("record.json")["event"])
    other_rank = {**event, "tp_rank": 1}
    decoder = Decoder()
    ok = decoder.decode(Record(0, 0, b"e1", _message([event, other_rank])))
    assert ok == [event_of(event), event_of(other_rank)]  # one engine, several ranks: accepted
    wrong = decoder.decode(Record(0, 1, b"e2", _message([event])))
    assert wrong.reason == "wrong_key"
    empty = decoder.decode(Record(0, 2, b"e1", _message([])))
    assert empty.reason == "undecodable"
    unknown = SingleObjectCodec(VIOLATION).encode(
        {"kind": "x", "engine_id": "e1", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "detail": ""}
    )
    assert decoder.decode(Record(0, 3, b"e1", unknown)).reason == "unknown_schema"
    mixed = decoder.decode(Record(0, 4, b"e1", _message([event, {**event, "engine_id": "e2"}])))
    assert mixed.reason == "wrong_key"
