"""The Kafka sink over SASL_SSL (SCRAM-SHA-512, TLS with a test CA) against the real broker.

The session broker of infra/local-kafka listens with SASL_SSL beside PLAINTEXT; `kafka_sasl`
holds the client settings the script wrote. Right credentials deliver every event; wrong ones
lose them, counted, with an error that names the cause, and never an exception. The stream
worker and `kvledger violations` take the same settings (`--kafka-config`); refused ones are
one line and exit 2.
"""

from __future__ import annotations

import json
import logging
import subprocess
import uuid

import pytest
from confluent_kafka import Consumer

from kvledger.producer.delivery import Delivery
from kvledger.producer.records import RankIdentity
from kvledger.producer.sinks import KafkaSink
from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
from kvledger.schemas.events import body_of
from tests.stream_harness import KVLEDGER, events_done, free_port, kvledger, start_worker, wait_for
from tests.synthetic.engine import FaultSpec, SimConfig, simulate

pytestmark = pytest.mark.integration


def sink_settings(sasl: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(bootstrap, the rest): what a user writes as the sink URL and as `kv_trace.kafka`."""
    settings = dict(sasl)
    return settings.pop("bootstrap.servers"), settings


def record(bootstrap: str, topic: str, settings: dict) -> Delivery:
    events = simulate(SimConfig(seed=3, steps=40, snapshot_interval=20)).events
    recorder = Delivery(RankIdentity("sasl-engine", 0, 0, 0, 1), KafkaSink(bootstrap, topic, settings))
    for event in events:
        recorder.capture(body_of(*event["body"]))
    recorder.close(step=39, timeout=20)
    return recorder


def test_events_reach_the_broker_over_sasl_ssl(kafka_sasl):
    bootstrap, settings = sink_settings(kafka_sasl)
    topic = f"kvledger.events.{uuid.uuid4().hex[:8]}"
    recorder = record(bootstrap, topic, settings)
    assert recorder.sink.delivered == recorder.captured > 40 and recorder.sink.lost == 0
    codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH)
    group = f"t-{uuid.uuid4().hex[:6]}"
    consumer = Consumer({**kafka_sasl, "group.id": group, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    received: list[dict] = []
    try:
        while len(received) < recorder.captured:
            message = consumer.poll(15)
            assert message is not None and message.error() is None, message and message.error()
            received += codec.decode(message.value())
    finally:
        consumer.close()
    assert [e["seq"] for e in received] == list(range(recorder.captured))


def test_the_plaintext_settings_do_not_reach_the_sasl_listener(kafka_sasl, caplog):
    bootstrap, _ = sink_settings(kafka_sasl)
    with caplog.at_level(logging.ERROR, logger="kvledger.producer"):
        recorder = record(bootstrap, f"kvledger.events.{uuid.uuid4().hex[:8]}", {"message.timeout.ms": 3000})
    assert recorder.sink.delivered == 0 and recorder.sink.lost == recorder.captured


def test_wrong_credentials_lose_events_counted_and_say_why(kafka_sasl, caplog):
    bootstrap, settings = sink_settings(kafka_sasl)
    wrong = {**settings, "sasl.password": "not-the-password", "message.timeout.ms": 3000}
    with caplog.at_level(logging.ERROR, logger="kvledger.producer"):
        recorder = record(bootstrap, f"kvledger.events.{uuid.uuid4().hex[:8]}", wrong)
    assert recorder.sink.delivered == 0 and recorder.sink.lost == recorder.captured > 40
    said = [r.getMessage() for r in caplog.records if "Kafka sink" in r.getMessage()]
    assert len(said) == 1 and "authentication failed: check kv_trace.kafka's sasl.* settings" in said[0], said
    assert "invalid credentials" in said[0]


def test_the_worker_and_the_violations_reader_over_sasl_ssl(kafka_sasl, tmp_path):
    config = tmp_path / "kafka.json"
    config.write_text(json.dumps(kafka_sasl))
    bootstrap, settings = sink_settings(kafka_sasl)
    prefix = f"sasl{uuid.uuid4().hex[:8]}"
    worker = start_worker(bootstrap, prefix, tmp_path / "state", tmp_path / "worker.log", "--kafka-config", str(config))
    try:
        faulty = SimConfig(
            seed=3, engine_id="sasl-eng", steps=40, snapshot_interval=20, faults=(FaultSpec("slot_shift", 10),)
        )
        events = simulate(faulty).events
        sink = KafkaSink(bootstrap, f"{prefix}.events", settings)
        sink.write(events)
        sink.close(20)
        assert sink.delivered == len(events)
        wait_for("the worker to apply the events", events_done([worker], {"sasl-eng": len(events)}), [worker])
    finally:
        worker.stop()
    proc = kvledger(
        "violations", "--kafka-config", str(config), "--topic-prefix", prefix, "--from-beginning",
        "--idle-timeout", "3", "--format", "json",
    )  # fmt: skip
    *found, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(v["kind"], v["step"]) for v in found] == [("write_target_mismatch", 10)], proc.stderr
    assert summary["violations"] == {"write_target_mismatch": 1}


@pytest.mark.parametrize("command", ["stream", "violations"])
def test_refused_credentials_are_one_line_and_exit_2(kafka_sasl, tmp_path, command):
    config = tmp_path / "kafka.json"
    config.write_text(json.dumps({**kafka_sasl, "sasl.password": "not-the-password"}))
    extra = ["--web-port", str(free_port()), "--state-dir", str(tmp_path / "s")] if command == "stream" else []
    proc = subprocess.run(
        [KVLEDGER, command, "--kafka-config", str(config), *extra], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("kvledger: error:")]
    assert f"the broker at {kafka_sasl['bootstrap.servers']} refused the credentials (see --kafka-config)" in line
    assert "Traceback" not in proc.stderr
