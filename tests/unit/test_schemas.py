"""The Avro contract (schemas/README.md): docs, framings, bad input, evolution, interop, packing.

Every test here pins a promise other teams rely on; if one fails, the
contract changed and the README (and every reader out there) must follow.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import struct

import avro.datafile
import avro.io
import avro.schema
import fastavro
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.schemas import (
    LEDGER_EVENT,
    LEDGER_EVENT_BATCH,
    VIOLATION,
    BatchCodec,
    ConfluentCodec,
    DecodeError,
    EitherFraming,
    SingleObjectCodec,
    UnknownSchemaError,
    pack_i32,
    pack_i64,
    pack_u64,
    row_digest,
    unpack_digests,
    unpack_i32,
    unpack_i64,
    unpack_u64,
)
from kvledger.schemas.codec import schema_fingerprint
from kvledger.schemas.events import event_of, to_record
from kvledger.schemas.files import SegmentWriter, discover, rank_dir, read_segment
from kvledger.schemas.packing import length_term, mix_blocks, position_weights
from kvledger.schemas.registry import (
    CONNECTOR_EVENT,
    HEALTH,
    RANK_INFO,
    SNAPSHOT,
    STEP,
    raw_schema,
)
from kvledger.stream_app.core.rank_tables import expand_slot_runs
from tests.synthetic.engine import GroupSpec, SimConfig, simulate

SCHEMA_NAMES = ("ledger_event", "violation")
PARSED = {"ledger_event": LEDGER_EVENT, "violation": VIOLATION}
RANK = RankIdentity("prefill-0", dp_rank=1, tp_rank=0, pp_rank=0, incarnation=17)
M64 = (1 << 64) - 1


# -- fixtures ----------------------------------------------------------------------------------


def connector_events() -> list[dict]:
    full = {
        "step": 12,
        "connector": "MooncakeConnector",
        "kind": "RECV_FAILED",
        "req_id": "cmpl-7",
        "transfer_id": "xfer-7",
        "remote_engine_id": "decode-3",
        "block_ids": [pack_i32([4, 5, 6]), pack_i32([])],
        "num_tokens": 40,
        "digest": b"\x01\x02\x03",
        "detail": "timeout after 30 s",
        "prefix": {"block_sizes": [16, 0], "chains": [pack_u64([7, 9]), b""]},
    }
    sparse = {
        "step": 13,
        "connector": "MooncakeConnector",
        "kind": "SEND_INTENT",
        "req_id": None,
        "transfer_id": None,
        "remote_engine_id": None,
        "block_ids": [],
        "num_tokens": None,
        "digest": None,
        "detail": None,
        "prefix": None,
    }
    # Built by hand, not by the producer's builders: a record that leaves out what the schema defaults.
    rank = {"engine_id": RANK.engine_id, "dp_rank": 1, "tp_rank": 0, "pp_rank": 0, "incarnation": 17}
    return [
        rank | {"seq": 100, "emitted_at_us": 1_700_000_000_000_000, "body": (CONNECTOR_EVENT, full)},
        rank | {"seq": 101, "emitted_at_us": 1_700_000_000_000_001, "body": (CONNECTOR_EVENT, sparse)},
    ]


@pytest.fixture(scope="module")
def events() -> list[dict]:
    """Real streams: two ranks, two groups (one sliding window), dummy runs, full rows, snapshots."""
    sim = simulate(
        SimConfig(
            seed=3,
            steps=80,
            tp_size=2,
            groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 64)),
            num_blocks=128,
            arrival_rate=1.0,
            dummy_every=9,
            snapshot_interval=25,
            health_interval=30,
            full_rows=True,
        )
    )
    return sim.events + connector_events()


def violation(**over) -> dict:
    v = {
        "kind": "write_target_mismatch",
        "engine_id": "e/1",
        "dp_rank": 0,
        "tp_rank": 1,
        "pp_rank": 0,
        "step": 41,
        "req_id": "cmpl-3",
        "group": 0,
        "detail": "slot 17 expected, 18 written",
    }
    v.update(over)
    return v


def avro_body(schema, record) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO exactly as the Avro specification writes it (Schema Fingerprints)."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


# -- docs and names ----------------------------------------------------------------------------


def _records(node, path="$"):
    """Every record schema (with its JSON path) in a raw schema."""
    if isinstance(node, dict):
        if node.get("type") == "record":
            yield path, node
            for f in node["fields"]:
                yield from _records(f["type"], f"{path}.{node['name']}.{f['name']}")
        elif node.get("type") == "array":
            yield from _records(node["items"], path + "[]")
        elif node.get("type") == "map":
            yield from _records(node["values"], path + "{}")
        elif isinstance(node.get("type"), dict | list):
            yield from _records(node["type"], path)
    elif isinstance(node, list):
        for branch in node:
            yield from _records(branch, path)


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_field_has_a_doc(name):
    found = list(_records(raw_schema(name)))
    assert found, "no records found"
    missing = [
        f"{path}.{rec['name']}.{f['name']}"
        for path, rec in found
        for f in rec["fields"]
        if not (isinstance(f.get("doc"), str) and f["doc"].strip())
    ]
    assert not missing, f"fields without doc: {missing}"


def test_walker_sees_every_nested_record():
    text = json.dumps(raw_schema("ledger_event"))
    names = [rec["name"] for _, rec in _records(raw_schema("ledger_event"))]
    assert len(names) == len(set(names)) == text.count('"type": "record"')
    assert {"LedgerEvent", "RankInfo", "KvGroup", "Step", "GroupPlan", "SnapshotRequest", "Health"} <= set(names)


def test_body_union_branches_are_the_registry_names_in_order():
    body = next(f for f in raw_schema("ledger_event")["fields"] if f["name"] == "body")
    names = [f"kvledger.{b['name']}" for b in body["type"]]
    assert names == [RANK_INFO, STEP, CONNECTOR_EVENT, SNAPSHOT, HEALTH]


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_apache_avro_parses_the_schema_to_the_same_canonical_form(name):
    parsed = avro.schema.parse(json.dumps(raw_schema(name)))
    assert parsed.canonical_form == fastavro.schema.to_parsing_canonical_form(PARSED[name])


# -- framing -----------------------------------------------------------------------------------


def test_crc64_reference_matches_the_spec_test_vector():
    # share/test/data/schema-tests.txt of Apache Avro: "null" -> 7195948357588979594
    assert crc64_avro(b'"null"') == 7195948357588979594


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_fingerprint_is_crc64_avro_of_canonical_form_little_endian(name):
    canonical = avro.schema.parse(json.dumps(raw_schema(name))).canonical_form  # not fastavro's
    expected = crc64_avro(canonical.encode()).to_bytes(8, "little")
    assert schema_fingerprint(PARSED[name]) == expected
    assert bytes(avro.schema.parse(json.dumps(raw_schema(name))).fingerprint("CRC-64-AVRO")) == expected


def batch_schema_inlined() -> dict:
    batch = raw_schema("ledger_event_batch")
    batch["fields"][0]["type"]["items"] = raw_schema("ledger_event")
    return batch


def test_batch_framing_is_plain_avro(events):
    codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH)
    batch = events[:30]
    data = codec.encode(batch)
    assert data[:2] == b"\xc3\x01"
    canonical = avro.schema.parse(json.dumps(batch_schema_inlined())).canonical_form
    assert data[2:10] == crc64_avro(canonical.encode()).to_bytes(8, "little")  # covers LedgerEvent's definition
    assert data[10:] == avro_body(LEDGER_EVENT_BATCH, {"events": batch})  # built from bodies, as Avro writes it
    reader = avro.io.DatumReader(avro.schema.parse(json.dumps(batch_schema_inlined())))
    decoded = reader.read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))  # the reference implementation reads it
    assert [e["seq"] for e in decoded["events"]] == [e["seq"] for e in batch]
    assert codec.decode(data) == batch
    assert codec.decode(SingleObjectCodec(LEDGER_EVENT).encode(batch[0])) == [batch[0]]  # one event alone
    assert codec.decode(codec.encode([])) == []
    with pytest.raises(UnknownSchemaError):
        codec.decode(b"\xc3\x01" + b"\x00" * 8 + data[10:])
    with pytest.raises(DecodeError):
        codec.decode(data[:-40])


def test_batch_schema_fields_have_docs():
    batch = raw_schema("ledger_event_batch")
    assert batch["doc"] and all(f.get("doc") for f in batch["fields"])


def test_single_object_framing(events):
    fp = crc64_avro(fastavro.schema.to_parsing_canonical_form(LEDGER_EVENT).encode()).to_bytes(8, "little")
    codec = SingleObjectCodec(LEDGER_EVENT)
    for event in events[:20] + events[-2:]:
        data = codec.encode(event)
        assert data[:2] == b"\xc3\x01"
        assert data[2:10] == fp
        assert data[10:] == avro_body(LEDGER_EVENT, event)
    v = violation()
    data = SingleObjectCodec(VIOLATION).encode(v)
    assert data[:10] == b"\xc3\x01" + schema_fingerprint(VIOLATION)
    assert data[10:] == avro_body(VIOLATION, v)


def test_confluent_framing(events):
    codec = ConfluentCodec(LEDGER_EVENT, 42)
    for event in events[:20]:
        data = codec.encode(event)
        assert data[:5] == b"\x00\x00\x00\x00\x2a" == b"\x00" + struct.pack(">I", 42)
        assert data[5:] == avro_body(LEDGER_EVENT, event)
    assert ConfluentCodec(VIOLATION, 0x01020304).encode(violation())[:5] == b"\x00\x01\x02\x03\x04"


def test_stream_covers_every_body_kind(events):
    bodies = {e["body"][0] for e in events}
    assert bodies == {RANK_INFO, STEP, CONNECTOR_EVENT, SNAPSHOT, HEALTH}
    steps = [e["body"][1] for e in events if e["body"][0] == STEP]
    assert {s["kind"] for s in steps} == {"REAL", "DUMMY"}
    assert any(s["input"] is None for s in steps), "a dummy step without input"
    assert any(g["rows"] for s in steps if s["plan"] for g in s["plan"]["groups"]), "full rows"
    infos = [e["body"][1] for e in events if e["body"][0] == RANK_INFO]
    assert any(g["sliding_window"] for i in infos for g in i["kv_groups"])


@pytest.mark.parametrize("codec", [SingleObjectCodec(LEDGER_EVENT), ConfluentCodec(LEDGER_EVENT, 42)])
def test_round_trip(codec, events):
    for event in events:
        assert codec.decode(codec.encode(event)) == event


@pytest.mark.parametrize("codec", [SingleObjectCodec(VIOLATION), ConfluentCodec(VIOLATION, 7)])
def test_round_trip_violation(codec):
    for v in (violation(), violation(step=None, req_id=None, group=None, kind="rank_missing")):
        assert codec.decode(codec.encode(v)) == v


# -- bad input ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def samples(events) -> list[dict]:
    """One event of each body kind, plus a dummy step."""
    out = {}
    for e in events:
        key = (e["body"][0], e["body"][1].get("kind"))
        out.setdefault(key, e)
    return list(out.values())


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc3", b"\xc3\x01", b"\xc3\x01\x00\x00", b"\xc3\x02" + bytes(20), b"\x00" + bytes(20), b"{}"],
)
def test_single_object_rejects_bad_magic_and_short_input(data):
    with pytest.raises(DecodeError):
        SingleObjectCodec(LEDGER_EVENT).decode(data)


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x00\x00\x00", b"\x01\x00\x00\x00\x2a\x00", b"\xc3\x01"])
def test_confluent_rejects_bad_magic_and_short_input(data):
    with pytest.raises(DecodeError):
        ConfluentCodec(LEDGER_EVENT, 42).decode(data)


def test_unknown_writer_schema(samples):
    data = SingleObjectCodec(LEDGER_EVENT).encode(samples[0])
    for corrupt in (data[:2] + bytes(8) + data[10:], data[:2] + data[3:10] + b"\x99" + data[10:]):
        with pytest.raises(UnknownSchemaError):
            SingleObjectCodec(LEDGER_EVENT).decode(corrupt)
    # a Violation is not a LedgerEvent
    with pytest.raises(UnknownSchemaError):
        SingleObjectCodec(LEDGER_EVENT).decode(SingleObjectCodec(VIOLATION).encode(violation()))
    with pytest.raises(UnknownSchemaError):
        ConfluentCodec(LEDGER_EVENT, 42).decode(ConfluentCodec(LEDGER_EVENT, 43).encode(samples[0]))


def test_every_truncation_is_a_decode_error(samples):
    for codec, header in ((SingleObjectCodec(LEDGER_EVENT), 10), (ConfluentCodec(LEDGER_EVENT, 42), 5)):
        for event in samples:
            data = codec.encode(event)
            for cut in range(header, len(data)):
                with pytest.raises(DecodeError) as info:
                    codec.decode(data[:cut])
                assert not isinstance(info.value, UnknownSchemaError)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=300))
def test_garbage_body_never_raises_anything_but_decode_error(body):
    for codec in (SingleObjectCodec(LEDGER_EVENT), ConfluentCodec(LEDGER_EVENT, 42)):
        data = codec.encode(connector_events()[1])
        header = len(data) - len(avro_body(LEDGER_EVENT, connector_events()[1]))
        with contextlib.suppress(DecodeError):
            codec.decode(data[:header] + body)


# -- evolution ---------------------------------------------------------------------------------


def _find(node, pred):
    """The first dict in a raw schema for which pred holds (depth first)."""
    if isinstance(node, dict):
        if pred(node):
            return node
        children = list(node.values())
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = _find(child, pred)
        if found is not None:
            return found
    return None


def _record(raw, name):
    return _find(raw, lambda n: n.get("type") == "record" and n.get("name") == name)


def _enum(raw, name):
    return _find(raw, lambda n: n.get("type") == "enum" and n.get("name") == name)


def _body_union(raw):
    return next(f for f in raw["fields"] if f["name"] == "body")["type"]


def ledger_v2_raw() -> dict:
    """Allowed changes: a new Step field with a default, a new StepKind symbol at the end."""
    raw = copy.deepcopy(raw_schema("ledger_event"))
    _record(raw, "Step")["fields"].append(
        {"name": "attempt", "type": "int", "default": 0, "doc": "v2: retry count of the step."}
    )
    _enum(raw, "StepKind")["symbols"].append("SPECULATIVE")
    return raw


def violation_v2_raw() -> dict:
    raw = copy.deepcopy(raw_schema("violation"))
    raw["fields"].append({"name": "severity", "type": "string", "default": "error", "doc": "v2: severity."})
    return raw


def ledger_v3_raw() -> dict:
    """v2 plus a new branch at the end of the body union."""
    raw = ledger_v2_raw()
    _body_union(raw).append(
        {
            "type": "record",
            "name": "Marker",
            "doc": "v3: a marker.",
            "fields": [{"name": "note", "type": "string", "doc": "Free text."}],
        }
    )
    return raw


V1, V2, V3 = LEDGER_EVENT, fastavro.parse_schema(ledger_v2_raw()), fastavro.parse_schema(ledger_v3_raw())
VIOLATION_V2 = fastavro.parse_schema(violation_v2_raw())


def as_v2(event: dict, attempt: int = 7, kind: str | None = None) -> dict:
    name, body = event["body"]
    if name != STEP:
        return event
    body = {**body, "attempt": attempt}
    if kind:
        body["kind"] = kind
    return {**event, "body": (name, body)}


def test_old_reader_reads_new_writer(events):
    old_reader = SingleObjectCodec(V1, known=[V2], reader=V1)
    new_writer = SingleObjectCodec(V2)
    for event in events:
        assert old_reader.decode(new_writer.encode(as_v2(event))) == event
    # a symbol the old reader does not know resolves to the enum's default
    step = next(e for e in events if e["body"][0] == STEP and e["body"][1]["kind"] == "DUMMY")
    got = old_reader.decode(new_writer.encode(as_v2(step, kind="SPECULATIVE")))
    assert got["body"][1]["kind"] == "REAL"
    assert {k: v for k, v in got["body"][1].items() if k != "kind"} == {
        k: v for k, v in step["body"][1].items() if k != "kind"
    }
    # same through the Confluent framing, the writer schema found by id
    confluent_old = ConfluentCodec(V1, 1, lookup={2: ledger_v2_raw()}.__getitem__, reader=V1)
    assert confluent_old.decode(ConfluentCodec(V2, 2).encode(as_v2(step))) == step


def test_confluent_batches_and_a_newer_writer_by_registry_id(events):
    batch_v2 = {**batch_schema_inlined(), "fields": [{**batch_schema_inlined()["fields"][0]}]}
    batch_v2["fields"][0]["type"] = {"type": "array", "items": ledger_v2_raw()}
    registry = {1: batch_schema_inlined(), 2: batch_v2, 3: ledger_v2_raw(), 4: raw_schema("violation")}
    reader = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH, lookup=registry.__getitem__)
    writer = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH, schema_id=1)
    data = writer.encode(events[:30])
    assert data[:5] == b"\x00" + struct.pack(">I", 1)
    assert data[5:] == avro_body(LEDGER_EVENT_BATCH, {"events": events[:30]})  # what Confluent's serializer writes
    assert reader.decode(data) == writer.decode(data) == events[:30]
    newer = [as_v2(e) for e in events[:30]]
    assert reader.decode(BatchCodec(V2, fastavro.parse_schema(batch_v2), schema_id=2).encode(newer)) == events[:30]
    assert reader.decode(ConfluentCodec(V2, 3).encode(newer[0])) == [events[0]]  # one item alone
    assert reader.decode(BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH).encode(events[:3])) == events[:3]  # both framings
    for schema_id, error in ((4, UnknownSchemaError), (5, UnknownSchemaError)):  # a Violation; no such id
        with pytest.raises(error):
            reader.decode(b"\x00" + struct.pack(">I", schema_id) + data[5:])
    # Without a registry a Confluent header is as undecodable as before.
    with pytest.raises(DecodeError) as info:
        BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH).decode(data)
    assert not isinstance(info.value, UnknownSchemaError)
    either = EitherFraming(VIOLATION, known=[VIOLATION_V2], lookup={7: violation_v2_raw()}.__getitem__)
    v2 = {**violation(), "severity": "warning"}
    assert either.decode(ConfluentCodec(VIOLATION_V2, 7).encode(v2)) == violation()
    assert either.decode(SingleObjectCodec(VIOLATION_V2).encode(v2)) == violation()


def test_new_reader_reads_old_writer(events):
    new_reader = SingleObjectCodec(V2, known=[V1], reader=V2)
    old_writer = SingleObjectCodec(V1)
    for event in events:
        got = new_reader.decode(old_writer.encode(event))
        assert got == as_v2(event, attempt=0)  # the default
    assert new_reader.decode(new_reader.encode(as_v2(events[5], 3))) == as_v2(events[5], 3)


def test_violation_evolves_both_ways():
    v, v2 = violation(), {**violation(), "severity": "warning"}
    old = SingleObjectCodec(VIOLATION, known=[VIOLATION_V2], reader=VIOLATION)
    new = SingleObjectCodec(VIOLATION_V2, known=[VIOLATION], reader=VIOLATION_V2)
    assert old.decode(new.encode(v2)) == v
    assert new.decode(old.encode(v)) == {**v, "severity": "error"}


def test_new_union_branch_fails_old_readers_only_on_records_that_use_it(events):
    old_reader = SingleObjectCodec(V1, known=[V3], reader=V1)
    new_writer = SingleObjectCodec(V3)
    for event in events[:30]:
        assert old_reader.decode(new_writer.encode(as_v2(event))) == event
    marker = {**events[0], "body": ("kvledger.Marker", {"note": "hello"})}
    with pytest.raises(DecodeError):
        old_reader.decode(new_writer.encode(marker))
    assert SingleObjectCodec(V3).decode(new_writer.encode(marker)) == marker


def test_widening_reads_old_data_but_not_the_other_way():
    """int -> long: new readers read old writers; old readers cannot read a long: readers first."""
    wide_raw = copy.deepcopy(raw_schema("violation"))
    next(f for f in wide_raw["fields"] if f["name"] == "dp_rank")["type"] = "long"
    wide = fastavro.parse_schema(wide_raw)
    v = violation(dp_rank=3)
    assert SingleObjectCodec(wide, known=[VIOLATION], reader=wide).decode(SingleObjectCodec(VIOLATION).encode(v)) == v
    with pytest.raises(DecodeError):
        SingleObjectCodec(VIOLATION, known=[wide], reader=VIOLATION).decode(SingleObjectCodec(wide).encode(v))


def _violation_variant(mutate) -> dict:
    raw = copy.deepcopy(raw_schema("violation"))
    mutate(raw)
    return fastavro.parse_schema(raw)


def _field(raw, name):
    return next(f for f in raw["fields"] if f["name"] == name)


def _drop(raw, name):
    raw["fields"].remove(_field(raw, name))


FORBIDDEN = {
    # (writer, reader): a field without default the writer lacks
    "remove_field_without_default": (
        _violation_variant(lambda r: _drop(r, "detail")),
        VIOLATION,
    ),
    "add_field_without_default": (
        VIOLATION,
        _violation_variant(lambda r: r["fields"].append({"name": "rule", "type": "string", "doc": "no default"})),
    ),
    "string_to_int": (VIOLATION, _violation_variant(lambda r: _field(r, "kind").update(type="int"))),
    "long_to_int": (VIOLATION, _violation_variant(lambda r: _field(r, "step").update(type=["null", "int"]))),
    "rename_without_alias": (
        VIOLATION,
        _violation_variant(lambda r: _field(r, "detail").update(name="text")),
    ),
}


@pytest.mark.parametrize("change", sorted(FORBIDDEN))
def test_forbidden_change_fails_resolution(change):
    writer, reader = FORBIDDEN[change]
    data = SingleObjectCodec(writer).encode(
        {k: v for k, v in violation().items() if k in {f["name"] for f in writer["fields"]}}
    )
    with pytest.raises(DecodeError):
        SingleObjectCodec(reader, known=[writer], reader=reader).decode(data)


def test_rename_with_alias_resolves():
    def rename(raw):
        _field(raw, "detail").update(name="text", aliases=["detail"])

    reader = _violation_variant(rename)
    got = SingleObjectCodec(reader, known=[VIOLATION], reader=reader).decode(
        SingleObjectCodec(VIOLATION).encode(violation())
    )
    assert got["text"] == violation()["detail"]


def test_removed_union_branch_fails_on_old_records(samples):
    raw = copy.deepcopy(raw_schema("ledger_event"))
    union = _body_union(raw)
    union.remove(next(b for b in union if b["name"] == "Snapshot"))
    reader = fastavro.parse_schema(raw)
    snapshot = next(e for e in samples if e["body"][0] == SNAPSHOT)
    with pytest.raises(DecodeError):
        SingleObjectCodec(reader, known=[V1], reader=reader).decode(SingleObjectCodec(V1).encode(snapshot))


def _reordered_enum() -> dict:
    raw = copy.deepcopy(raw_schema("ledger_event"))
    _enum(raw, "StepKind")["symbols"].reverse()
    return raw


def _reordered_union() -> dict:
    raw = copy.deepcopy(raw_schema("ledger_event"))
    _body_union(raw).reverse()
    return raw


def _doc_only() -> dict:
    raw = copy.deepcopy(raw_schema("ledger_event"))
    raw["doc"] = "changed"
    _record(raw, "Step")["fields"][0]["doc"] = "changed too"
    return raw


def test_fingerprint_changes_with_every_encoding_change_but_not_with_docs():
    fp1 = schema_fingerprint(V1)
    changed = [ledger_v2_raw(), ledger_v3_raw(), _reordered_enum(), _reordered_union()]
    fps = {schema_fingerprint(fastavro.parse_schema(raw)) for raw in changed}
    assert len(fps) == len(changed) and fp1 not in fps
    assert schema_fingerprint(fastavro.parse_schema(_doc_only())) == fp1


def test_reordered_symbols_never_decode_silently_with_a_stale_schema(samples):
    """Enum/union data is positional: a reader without the reordered writer schema refuses it."""
    reordered = fastavro.parse_schema(_reordered_enum())
    dummy = next(e for e in samples if e["body"][0] == STEP and e["body"][1]["kind"] == "DUMMY")
    data = SingleObjectCodec(reordered).encode(dummy)
    with pytest.raises(UnknownSchemaError):
        SingleObjectCodec(V1).decode(data)
    # decoding the body with the stale schema anyway would misread it: why reorders are forbidden
    stale = fastavro.schemaless_reader(io.BytesIO(data[10:]), V1, None, return_record_name=True)
    assert stale["body"][1]["kind"] != "DUMMY"
    # with the writer schema known, resolution is by name and correct
    assert SingleObjectCodec(V1, known=[reordered], reader=V1).decode(data) == dummy


def _schema_without(record: str, field: str):
    """The ledger event schema as a writer from before `record.field` had it."""
    before = copy.deepcopy(raw_schema("ledger_event"))
    fields = _record(before, record)["fields"]
    fields[:] = [f for f in fields if f["name"] != field]
    return fastavro.parse_schema(before)


def without_draft_writes(event: dict) -> dict:
    """The event as a reader (or writer) from before StepPlan.draft_writes sees it."""
    name, body = event["body"]
    if name != STEP or body["plan"] is None:
        return event
    plan = {k: v for k, v in body["plan"].items() if k != "draft_writes"}
    return {**event, "body": (name, {**body, "plan": plan})}


def test_step_plan_draft_writes_evolve_both_ways(events):
    old = _schema_without("StepPlan", "draft_writes")
    assert schema_fingerprint(old) != schema_fingerprint(V1)
    draft = to_record(records.draft_pass(0, 1, [1, 1], [40, 9], np.array([72, 41, -1])))
    step = next(e for e in events if e["body"][0] == STEP and e["body"][1]["plan"] is not None)
    name, body = step["body"]
    drafted = {**step, "body": (name, {**body, "plan": {**body["plan"], "draft_writes": [draft]}})}
    # Old readers read new writers: the drafter's passes are skipped, the rest is intact.
    old_reader = SingleObjectCodec(old, known=[V1], reader=old)
    assert old_reader.decode(SingleObjectCodec(V1).encode(drafted)) == without_draft_writes(step)
    # New readers read old data: no passes recorded (null), never an empty list that would claim none ran.
    new_reader = SingleObjectCodec(V1, known=[old], reader=V1)
    old_writer = SingleObjectCodec(old)
    for event in events:
        assert new_reader.decode(old_writer.encode(without_draft_writes(event))) == event
    assert new_reader.decode(SingleObjectCodec(V1).encode(drafted)) == drafted


def without_content(event: dict) -> dict:
    """The event as a reader (or writer) from before Step.content sees it."""
    name, body = event["body"]
    if name != STEP:
        return event
    return {**event, "body": (name, {k: v for k, v in body.items() if k != "content"})}


def test_step_content_evolves_both_ways(events):
    old = _schema_without("Step", "content")
    assert schema_fingerprint(old) != schema_fingerprint(V1)
    step = next(e for e in events if e["body"][0] == STEP and e["body"][1]["plan"] is not None)
    name, body = step["body"]
    digests = to_record(records.block_digests([0, 0], [3, 7], np.array([5, -1], np.int64), ["SEALED", "SWEEP"]))
    digested = {**step, "body": (name, {**body, "content": digests})}
    # Old readers read new writers: the digests are skipped, the rest is intact.
    old_reader = SingleObjectCodec(old, known=[V1], reader=old)
    assert old_reader.decode(SingleObjectCodec(V1).encode(digested)) == without_content(step)
    # New readers read old data: no digests (null).
    new_reader = SingleObjectCodec(V1, known=[old], reader=V1)
    old_writer = SingleObjectCodec(old)
    for event in events:
        assert new_reader.decode(old_writer.encode(without_content(event))) == event
    decoded = new_reader.decode(SingleObjectCodec(V1).encode(digested))
    assert unpack_u64(decoded["body"][1]["content"]["digests"]).tolist() == [5, (1 << 64) - 1]


def without_in_flight(event: dict) -> dict:
    """The event as a reader (or writer) from before StepInput.in_flight_steps sees it."""
    name, body = event["body"]
    if name != STEP or body["input"] is None:
        return event
    inp = {k: v for k, v in body["input"].items() if k != "in_flight_steps"}
    return {**event, "body": (name, {**body, "input": inp})}


def test_step_input_in_flight_steps_evolves_both_ways(events):
    old = _schema_without("StepInput", "in_flight_steps")
    assert schema_fingerprint(old) != schema_fingerprint(V1)
    step = next(e for e in events if e["body"][0] == STEP and e["body"][1]["input"] is not None)
    name, body = step["body"]
    dispatched = {**step, "body": (name, {**body, "input": {**body["input"], "in_flight_steps": 1}})}
    # Old readers read new writers: the count is skipped, the rest is intact.
    old_reader = SingleObjectCodec(old, known=[V1], reader=old)
    assert old_reader.decode(SingleObjectCodec(V1).encode(dispatched)) == without_in_flight(step)
    # New readers read old data: not said (null), never 0, which would claim nothing was in flight.
    new_reader = SingleObjectCodec(V1, known=[old], reader=V1)
    old_writer = SingleObjectCodec(old)
    for event in events:
        assert new_reader.decode(old_writer.encode(without_in_flight(event))) == event
    assert new_reader.decode(SingleObjectCodec(V1).encode(dispatched)) == dispatched


def test_a_digest_reason_from_a_newer_writer_reads_as_other_and_is_counted_unchecked(events):
    newer = copy.deepcopy(raw_schema("ledger_event"))
    reasons = _enum(newer, "DigestReason")
    reasons["symbols"] = [*reasons["symbols"], "SCRUBBED"]
    new = fastavro.parse_schema(newer)
    info = next(e for e in events if e["body"][0] == RANK_INFO)
    content = to_record(records.block_digests([0], [3], np.array([5], np.int64), ["SEALED"]))
    content["reasons"] = ["SCRUBBED"]  # a reason this reader's model has no member for
    body = to_record(records.step(0, "REAL", None, None)) | {"content": content}
    step = {**info, "seq": info["seq"] + 1, "body": (STEP, body)}
    reader = SingleObjectCodec(V1, known=[new], reader=V1)
    decoded = reader.decode(SingleObjectCodec(new).encode(step))
    assert decoded["body"][1]["content"]["reasons"] == ["OTHER"]
    from kvledger.stream_app.core import Ledger

    ledger = Ledger()
    assert ledger.apply(event_of(info)) + ledger.apply(event_of(decoded)) == []
    assert ledger.coverage.unchecked["content_digest_of_unknown_reason"] == 1


def test_read_segment_resolves_a_segment_written_with_v2(tmp_path, events):
    seg = rank_dir(tmp_path, "eng v2", 0, 0, 0) / "5-000001.avro"
    seg.parent.mkdir(parents=True)
    with open(seg, "wb") as fo:
        fastavro.writer(fo, V2, [as_v2(e) for e in events], codec="deflate")
    [stream] = discover(tmp_path)
    # Read as the engine its events name (written with v2's schema too), the directory's name kept.
    assert (stream.engine_id, stream.laid_out_as) == (events[0]["engine_id"], ("eng v2", 0, 0, 0))
    problems = []
    assert list(read_segment(stream.segments[0], problems)) == events
    assert problems == []


# -- interop with Apache Avro (an independent implementation) ---------------------------------


def _apache_schema(name="ledger_event"):
    return avro.schema.parse(json.dumps(raw_schema(name)))


def test_apache_avro_reads_a_file_ledger_segment(tmp_path, events):
    writer = SegmentWriter(tmp_path, "decode/0", 0, 1, 0, 9)
    for i in range(0, len(events), 50):
        writer.write(events[i : i + 50])
    writer.close()
    [stream] = discover(tmp_path)
    [segment] = stream.segments
    with open(segment, "rb") as fo, avro.datafile.DataFileReader(fo, avro.io.DatumReader()) as reader:
        got = list(reader)
    assert len(got) == len(events)
    for mine, theirs in zip(events, got, strict=True):
        assert theirs["engine_id"] == mine["engine_id"]
        assert (theirs["tp_rank"], theirs["seq"], theirs["incarnation"]) == (
            mine["tp_rank"],
            mine["seq"],
            mine["incarnation"],
        )
        body = mine["body"][1]
        if mine["body"][0] == STEP:
            assert theirs["body"]["step"] == body["step"]
            assert theirs["body"]["kind"] == body["kind"]
            if body["plan"]:
                assert theirs["body"]["plan"]["groups"][0]["slot_runs"] == body["plan"]["groups"][0]["slot_runs"]
        elif mine["body"][0] == CONNECTOR_EVENT:
            assert theirs["body"]["block_ids"] == body["block_ids"]
            assert theirs["body"]["detail"] == body["detail"]


def test_apache_avro_decodes_a_single_object_body(samples):
    reader = avro.io.DatumReader(_apache_schema())
    codec = SingleObjectCodec(LEDGER_EVENT)
    for event in samples:
        data = codec.encode(event)
        theirs = reader.read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
        assert theirs["seq"] == event["seq"]
        assert theirs["body"].get("step") == event["body"][1].get("step")
        if event["body"][0] == SNAPSHOT:
            assert theirs["body"]["requests"] == event["body"][1]["requests"]


def test_our_codec_decodes_what_apache_avro_encodes():
    v = violation()
    buf = io.BytesIO()
    avro.io.DatumWriter(_apache_schema("violation")).write(v, avro.io.BinaryEncoder(buf))
    framed = b"\xc3\x01" + bytes(_apache_schema("violation").fingerprint("CRC-64-AVRO")) + buf.getvalue()
    assert SingleObjectCodec(VIOLATION).decode(framed) == v


# -- packed columns and the row digest --------------------------------------------------------


def test_packed_columns_are_little_endian():
    assert pack_i32([1, -1, 0x01020304]) == b"\x01\x00\x00\x00\xff\xff\xff\xff\x04\x03\x02\x01"
    assert pack_i64([1, -1]) == b"\x01" + bytes(7) + b"\xff" * 8
    assert pack_u64([1, M64]) == b"\x01" + bytes(7) + b"\xff" * 8
    assert struct.unpack("<3i", pack_i32([7, -2, 2**31 - 1])) == (7, -2, 2**31 - 1)
    for pack, unpack in ((pack_i32, unpack_i32), (pack_i64, unpack_i64), (pack_u64, unpack_u64)):
        assert pack([]) == b""
        assert unpack(b"").size == 0
        assert unpack(pack([0, 5, 9])).tolist() == [0, 5, 9]
        assert unpack(pack(np.array([3, 4]))).tolist() == [3, 4]
    assert unpack_u64(pack_u64([M64])).tolist() == [M64]


def reference_digest(row) -> int:
    """The README's definition, in plain Python integers."""
    p, k, m1 = 0x100000001B3, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
    total = 0
    for i, b in enumerate(row):
        x = ((b + 1) & M64) * m1 & M64
        total += (x ^ (x >> 31)) * pow(p, i + 1, 1 << 64)
    return (total + len(row) * k) & M64


block_ids = st.integers(min_value=-1, max_value=2**31 - 1)
rows_st = st.lists(block_ids, max_size=40)


@settings(max_examples=200, deadline=None)
@given(row=rows_st)
def test_row_digest_matches_the_definition(row):
    assert row_digest(row) == reference_digest(row)
    assert row_digest(np.array(row, dtype=np.int32)) == row_digest(row)


def test_row_digest_of_empty_row_and_length():
    assert row_digest([]) == 0 == length_term(0)
    assert row_digest([0]) != row_digest([0, 0]) != row_digest([0, 0, 0])
    assert row_digest([5]) != row_digest([6])


@settings(max_examples=100, deadline=None)
@given(row=st.lists(block_ids, min_size=2, max_size=30, unique=True), data=st.data())
def test_row_digest_detects_swaps(row, data):
    i = data.draw(st.integers(0, len(row) - 2))
    j = data.draw(st.integers(i + 1, len(row) - 1))
    swapped = list(row)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert row_digest(swapped) != row_digest(row)


@settings(max_examples=100, deadline=None)
@given(row=rows_st, ext=rows_st)
def test_row_digest_updates_additively_on_append(row, ext):
    """digest(row + ext) from digest(row) without rehashing, as the ledger core does."""
    n = len(row)
    with np.errstate(over="ignore"):
        added = int((mix_blocks(np.array(ext, np.int64)) * position_weights(n, n + len(ext))).sum(dtype=np.uint64))
    expected = (row_digest(row) + added + len(ext) * length_term(1)) & M64
    assert row_digest(row + ext) == expected


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(block_ids, max_size=12), max_size=8))
def test_row_digests_equals_row_digest_per_row(rows):
    arrays = [np.array(r, dtype=np.int64) for r in rows]
    assert records.row_digests(arrays).tolist() == [row_digest(r) for r in rows]


def test_row_digests_with_trailing_empty_rows():
    rows = [np.array([1, 2]), np.array([], dtype=np.int64)]
    assert records.row_digests(rows).tolist() == [row_digest([1, 2]), row_digest([])]


def _slot_mapping():
    run = st.tuples(st.integers(0, 10**9), st.integers(1, 20)).map(lambda t: list(range(t[0], t[0] + t[1])))
    pad = st.integers(1, 10).map(lambda n: [-1] * n)
    single = st.integers(-1, 10**9).map(lambda x: [x])
    return st.lists(st.one_of(run, pad, single), max_size=12).map(
        lambda parts: list(itertools.chain.from_iterable(parts))
    )


@settings(max_examples=300, deadline=None)
@given(mapping=_slot_mapping())
def test_slot_runs_round_trip(mapping):
    packed = records.slot_runs(np.array(mapping, dtype=np.int64))
    assert expand_slot_runs(packed).tolist() == mapping
    runs = unpack_i64(packed).reshape(-1, 2)
    assert (runs[:, 1] >= 1).all()
    assert runs[:, 1].sum() == len(mapping)
    assert ((runs[:, 0] >= 0) | (runs[:, 0] == -1)).all()
    for (s1, l1), (s2, _) in itertools.pairwise(runs.tolist()):  # maximal runs
        assert not (s1 >= 0 and s2 == s1 + l1)
        assert not (s1 < 0 and s2 < 0)


def test_slot_runs_examples():
    assert records.slot_runs(np.array([], np.int64)) == b""
    assert unpack_i64(records.slot_runs(np.array([16, 17, 18, 40, -1, -1]))).tolist() == [16, 3, 40, 1, -1, 2]
    assert expand_slot_runs(pack_i64([-1, 3, 5, 2])).tolist() == [-1, -1, -1, 5, 6]


def test_group_plans_of_real_streams_are_consistent(events):
    """The packed columns of every simulated plan agree with each other and with the digest."""
    checked = 0
    for e in events:
        if e["body"][0] != STEP or e["body"][1]["plan"] is None:
            continue
        plan = e["body"][1]["plan"]
        n_req = unpack_i32(plan["req_indices"]).size
        assert unpack_i32(plan["num_tokens"]).size == unpack_i32(plan["first_positions"]).size == n_req
        for g in plan["groups"]:
            slots = expand_slot_runs(g["slot_runs"])
            assert slots.size == g["num_real"] + g["num_padding"]
            assert g["num_real"] == unpack_i32(plan["num_tokens"]).sum()
            assert (slots[g["num_real"] :] == -1).all()
            lens = unpack_i32(g["row_lens"])
            digests = unpack_digests(g["row_digests"])
            assert lens.size == digests.size == n_req
            rows = np.split(unpack_i32(g["rows"]), np.cumsum(lens)[:-1]) if n_req else []
            assert [row_digest(r) & 0xFFFFFFFF for r in rows] == digests.tolist()
            checked += 1
    assert checked > 50


@given(st.lists(st.lists(st.integers(0, 5000), max_size=12), min_size=1, max_size=8), st.integers(0, 4))
def test_table_digests_equal_row_digests(rows, extra_width):
    width = max(len(r) for r in rows) + extra_width
    table = np.full((len(rows), width), 77, dtype=np.int32)  # stale ids beyond each row's length
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    lens = np.array([len(r) for r in rows], np.int32)
    assert records.table_digests(table, lens).tolist() == [row_digest(r) for r in rows]
    plan = records.group_plan_from_table(0, np.arange(3), 3, table, lens, full_rows=True)
    assert plan == records.group_plan(0, np.arange(3), 3, [np.array(r, np.int32) for r in rows], full_rows=True)
