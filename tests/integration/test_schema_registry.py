"""The project's Avro schemas through a real Confluent-compatible Schema Registry.

`infra/schema-registry` runs Apicurio Registry in memory (fetched on first
use); the session fixture `schema_registry` (tests/conftest.py) gives it a
private state dir and a free port, and the tests talk to it only through
confluent_kafka's Confluent API client.
"""

import json
import logging
import uuid
from collections import Counter
from pathlib import Path

import fastavro
import pytest

try:
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
    from confluent_kafka.schema_registry.error import SchemaRegistryError
except ImportError as e:  # the client's HTTP stack is an extra of confluent-kafka
    raise ImportError(f"{e}: install confluent-kafka[schemaregistry]") from e

from kvledger.producer.config import RegistrySpec
from kvledger.producer.delivery import Delivery
from kvledger.producer.records import RankIdentity
from kvledger.producer.sinks import KafkaSink
from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
from kvledger.schemas.codec import confluent_header
from kvledger.schemas.events import body_of, events_of
from kvledger.schemas.registry import batch_raw, checkpoint_raw, raw_schema
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.worker.topics import Topics, ensure_topics
from tests.stream_harness import (
    Worker,
    as_multiset,
    events_done,
    free_port,
    kvledger,
    online_violations,
    produce,
    read_all,
    start_worker,
    wait_for,
)
from tests.synthetic.engine import FaultSpec, SimConfig, simulate

pytestmark = pytest.mark.integration


@pytest.fixture
def client(schema_registry) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry})


def _subject(name: str) -> str:
    return f"it-{name}-{uuid.uuid4().hex[:12]}-value"


def _avro(schema: dict) -> Schema:
    return Schema(json.dumps(schema), schema_type="AVRO")


def _canonical(schema_str: str) -> str:
    return fastavro.schema.to_parsing_canonical_form(fastavro.parse_schema(json.loads(schema_str)))


def registry_worker(bootstrap: str, prefix: str, tmp_path: Path, registry: str) -> Worker:
    """A worker that reads and publishes through the registry."""
    return start_worker(
        bootstrap, prefix, tmp_path / "state", tmp_path / "worker.log",
        "--store", "memory", "--settle-after", "1", "--schema-registry", registry,
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, schema",
    [
        ("ledger_event", raw_schema("ledger_event")),
        ("violation", raw_schema("violation")),
        ("checkpoint", checkpoint_raw()),
    ],
    ids=["ledger_event", "violation", "checkpoint"],
)
def test_registered_schema_comes_back_by_id(client, name, schema):
    subject = _subject(name)
    schema_id = client.register_schema(subject, _avro(schema))
    assert isinstance(schema_id, int) and schema_id > 0

    fetched = client.get_schema(schema_id)
    assert fetched.schema_type == "AVRO"
    assert _canonical(fetched.schema_str) == _canonical(json.dumps(schema))

    # Registering the same schema again is a no-op that returns the same id.
    assert client.register_schema(subject, _avro(schema)) == schema_id
    latest = client.get_latest_version(subject)
    assert (latest.schema_id, latest.version) == (schema_id, 1)


def test_backward_compatibility_of_an_evolved_violation(client):
    subject = _subject("violation")
    v1 = raw_schema("violation")
    client.set_compatibility(subject, "BACKWARD")
    assert client.get_compatibility(subject) == "BACKWARD"
    id1 = client.register_schema(subject, _avro(v1))

    # A new optional field (with a default) can read data written with v1: backward compatible.
    added = {"name": "severity", "type": ["null", "string"], "default": None, "doc": "Added in v2."}
    v2 = {**v1, "fields": [*v1["fields"], added]}
    assert client.test_compatibility(subject, _avro(v2)) is True

    # A new required field cannot: v1 data has no value for it.
    required = {"name": "severity", "type": "string"}
    bad = {**v1, "fields": [*v1["fields"], required]}
    assert client.test_compatibility(subject, _avro(bad)) is False
    with pytest.raises(SchemaRegistryError) as err:
        client.register_schema(subject, _avro(bad))
    assert err.value.http_status_code == 409

    id2 = client.register_schema(subject, _avro(v2))
    assert id2 != id1
    assert client.get_versions(subject) == [1, 2]
    assert _canonical(client.get_schema(id2).schema_str) == _canonical(json.dumps(v2))


# -- the engines' sink, the worker and the reader through the registry -----------------------------
def faulty_engine(engine_id: str, seed: int, steps: int = 80) -> list[dict]:
    faults = (FaultSpec("slot_shift", steps // 4), FaultSpec("duplicate_event", steps // 2))
    config = SimConfig(seed=seed, engine_id=engine_id, steps=steps, num_blocks=96, max_num_seqs=8, faults=faults)
    return simulate(config).events


def expected_violations(*streams: list[dict]) -> Counter:
    """What the ledger core finds in each engine's stream, as `kvledger violations --format json` prints it."""
    return as_multiset(
        [{"type": "violation", **v.to_record()} for s in streams for v in Ledger().apply_many(events_of(s))]
    )


def write(sink: KafkaSink, events: list[dict], drain: int = 16) -> None:
    """As a rank's drain thread hands events to its sink."""
    for i in range(0, len(events), drain):
        sink.write(events[i : i + drain])
    sink.close(30)
    assert sink.lost == 0 and sink.delivered == len(events)


def newer_batch_schema(*, compatible: bool) -> dict:
    """The batch schema with a new LedgerEvent field: optional (a default), or required (none)."""
    batch = batch_raw()
    event = batch["fields"][0]["type"]["items"]
    if compatible:
        added = {"name": "host", "type": ["null", "string"], "default": None, "doc": "Added in a newer writer."}
    else:
        added = {"name": "host", "type": "string", "doc": "Required in a newer writer: old data has none."}
    event["fields"].insert(len(event["fields"]) - 1, added)
    return batch


@pytest.fixture
def prefix(kafka_bootstrap, schema_registry) -> str:
    prefix = f"sr{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, Topics(prefix), 2)
    return prefix


def test_a_fleet_mid_migration_through_the_worker_and_the_reader(
    kafka_bootstrap, schema_registry, client, prefix, tmp_path
):
    topic = f"{prefix}.events"
    framed, plain = faulty_engine("sr-framed", 51), faulty_engine("sr-plain", 52)
    sink = KafkaSink(kafka_bootstrap, topic, registry=RegistrySpec(schema_registry))
    write(sink, framed)  # an engine with kv_trace.schema_registry
    write(KafkaSink(kafka_bootstrap, topic), plain)  # one not moved yet: single-object
    unknown_id = confluent_header(987654) + BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH).encode(framed[:2])[10:]
    produce(kafka_bootstrap, topic, [], [(b"sr-framed", unknown_id)])

    # The subject the sink registered: <topic>-value, BACKWARD; every message of it in its framing.
    latest = client.get_latest_version(f"{topic}-value")
    assert latest.schema_id == sink.schema_id and client.get_compatibility(f"{topic}-value") == "BACKWARD"
    assert _canonical(latest.schema.schema_str) == _canonical(json.dumps(batch_raw()))
    messages = read_all(kafka_bootstrap, topic)
    heads = Counter((m.key(), m.value()[:5] if m.value()[:1] == b"\x00" else m.value()[:2]) for m in messages)
    assert set(heads) == {
        (b"sr-framed", confluent_header(sink.schema_id)),
        (b"sr-plain", b"\xc3\x01"),
        (b"sr-framed", confluent_header(987654)),
    }, heads

    worker = registry_worker(kafka_bootstrap, prefix, tmp_path, schema_registry)
    try:
        wait_for("every event", events_done([worker], {"sr-framed": len(framed), "sr-plain": len(plain)}), [worker])
        violations, summary = online_violations(kafka_bootstrap, prefix, "--schema-registry", schema_registry)
        assert as_multiset(violations) == expected_violations(framed, plain) and len(violations) >= 4
        assert summary["undecodable"] == 0

        # Published in the Confluent framing, under the id of <prefix>.violations-value.
        violation_id = client.get_latest_version(f"{prefix}.violations-value").schema_id
        published = read_all(kafka_bootstrap, f"{prefix}.violations")
        assert {m.value()[:5] for m in published} == {confluent_header(violation_id)}
        assert _canonical(client.get_schema(violation_id).schema_str) == _canonical(json.dumps(raw_schema("violation")))
        # A reader without the registry cannot read them, and says so in its summary.
        _, blind = online_violations(kafka_bootstrap, prefix)
        assert blind["undecodable"] == len(published) and blind["violations"] == {}

        # The id no registry knows: a dead letter, the reason and the registry's answer in its headers.
        [dead] = read_all(kafka_bootstrap, f"{prefix}.deadletter")
        headers = dict(dead.headers())
        assert headers["kvledger.reason"] == b"unknown_schema" and dead.value() == unknown_id
        assert b"987654" in headers["kvledger.detail"], headers
    finally:
        worker.stop()


def test_a_newer_writer_schema_is_read_by_the_current_worker_and_an_incompatible_one_refused(
    kafka_bootstrap, schema_registry, client, prefix, tmp_path, monkeypatch, caplog
):
    topic = f"{prefix}.events"
    subject = f"{topic}-value"
    current, newer = faulty_engine("sr-current", 61), faulty_engine("sr-newer", 62)
    sink = KafkaSink(kafka_bootstrap, topic, registry=RegistrySpec(schema_registry))
    write(sink, current)

    # A newer writer registers its schema under the subject's rule (BACKWARD, set by the first sink)...
    v2 = newer_batch_schema(compatible=True)
    v2_id = client.register_schema(subject, _avro(v2))
    assert v2_id != sink.schema_id and client.get_versions(subject) == [1, 2]
    # ... and writes with it: the new field set on every event.
    v2_codec = BatchCodec(
        fastavro.parse_schema(v2["fields"][0]["type"]["items"]), fastavro.parse_schema(v2), schema_id=v2_id
    )
    produce(
        kafka_bootstrap,
        topic,
        [],
        [
            (b"sr-newer", v2_codec.encode([{**e, "host": "node-7"} for e in newer[i : i + 16]]))
            for i in range(0, len(newer), 16)
        ],
    )

    # A writer whose schema an older reader could not read is refused (409), and loses its events, counted.
    bad = newer_batch_schema(compatible=False)
    with pytest.raises(SchemaRegistryError) as err:
        client.register_schema(subject, _avro(bad))
    assert err.value.http_status_code == 409
    monkeypatch.setattr("kvledger.producer.sinks.batch_raw", lambda: bad)
    with caplog.at_level(logging.ERROR, logger="kvledger.producer"):
        recorder = Delivery(
            RankIdentity("sr-refused", 0, 0, 0, 1),
            KafkaSink(kafka_bootstrap, topic, registry=RegistrySpec(schema_registry)),
        )
        for event in current[:40]:
            recorder.capture(body_of(*event["body"]))
        recorder.close(step=40, timeout=10)
    assert recorder.sink.schema_id is None and recorder.sink.delivered == 0
    assert recorder.dropped == recorder.sink.lost == recorder.captured == 41  # the closing Health too
    assert recorder.health(41).events_dropped == 41
    said = [r.getMessage() for r in caplog.records if "Schema Registry" in r.getMessage()]
    assert len(said) == 1 and "refused" in said[0] and subject in said[0] and "counts as lost" in said[0], said
    assert client.get_versions(subject) == [1, 2]

    # The current worker reads both versions through the registry, with its own (older) schema.
    worker = registry_worker(kafka_bootstrap, prefix, tmp_path, schema_registry)
    try:
        wait_for("every event", events_done([worker], {"sr-current": len(current), "sr-newer": len(newer)}), [worker])
        violations, _ = online_violations(kafka_bootstrap, prefix, "--schema-registry", schema_registry)
        assert as_multiset(violations) == expected_violations(current, newer)
        assert read_all(kafka_bootstrap, f"{prefix}.deadletter") == []
    finally:
        worker.stop()


def test_the_worker_without_its_registry_is_one_line_and_exit_2(kafka_bootstrap, prefix, tmp_path):
    port = free_port()  # nothing listens there
    proc = kvledger(
        "stream", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix, "--store", "memory",
        "--state-dir", str(tmp_path), "--web-port", str(free_port()), "--schema-registry", f"http://127.0.0.1:{port}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()[-1:]
    assert (
        line.startswith("kvledger: error: no Schema Registry answers at http://127.0.0.1:")
        and "Traceback" not in proc.stderr
    )
    bad = kvledger("violations", "--bootstrap", kafka_bootstrap, "--schema-registry", "registry:8081")
    assert bad.returncode == 2 and "expected the registry's http:// or https:// URL" in bad.stderr
