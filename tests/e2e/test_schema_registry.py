"""Cluster mode with a Schema Registry end to end: a real vLLM engine with `kv_trace.schema_registry`
-> the Kafka sink (Confluent framing) -> the real broker -> `kvledger stream --schema-registry`
-> the violations topic (Confluent framing), read back with `kvledger violations --schema-registry`.

One engine run, its slot mapping shifted at one step: the worker must report exactly that fault
(the run's other steps and requests are the clean part), and every message on both topics must
carry the id the registry gave the schema of its subject.
"""

from __future__ import annotations

import json
import urllib.parse
import uuid
from collections import Counter

from confluent_kafka.schema_registry import SchemaRegistryClient

from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec
from kvledger.schemas.codec import confluent_header
from kvledger.schemas.confluent import SchemaRegistry
from tests.e2e.test_vllm_trace import PRESSURE
from tests.stream_harness import events_done, online_violations, read_all, start_worker, wait_for


def test_an_engine_traces_through_the_registry_to_the_violations_topic(
    kafka_bootstrap, schema_registry, engine, tmp_path
):
    prefix = f"e2esr{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.events"
    worker = start_worker(
        kafka_bootstrap, prefix, tmp_path / "state", tmp_path / "worker.log",
        "--partitions", "2", "--store", "memory", "--settle-after", "1", "--schema-registry", schema_registry,
    )  # fmt: skip
    try:
        kv_trace = {
            "enabled": True,
            "sink": f"kafka://{kafka_bootstrap}/{topic}",
            "snapshot_interval": 16,
            "schema_registry": schema_registry,
        }
        faulty = engine(
            {**PRESSURE, "max_tokens": 12, "num_blocks": 64, "kv_trace": kv_trace}, fault="slot_shift", fault_step=6
        )
        [injected] = faulty.faults
        assert "kv_trace: Kafka sink" not in faulty.log and " lost " not in faulty.log, faulty.log[-3000:]

        # Every event message in the Confluent framing, with the id of <topic>-value.
        client = SchemaRegistryClient({"url": schema_registry})
        batch_id = client.get_latest_version(f"{topic}-value").schema_id
        messages = read_all(kafka_bootstrap, topic)
        assert messages and {m.value()[:5] for m in messages} == {confluent_header(batch_id)}
        codec = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH, lookup=SchemaRegistry(schema_registry).writer_schema)
        produced = Counter()
        for m in messages:
            produced[m.key().decode()] += len(codec.decode(m.value()))
        assert len(produced) == 1, produced

        wait_for("every event applied", events_done([worker], dict(produced)), [worker], timeout=120)
        violations, summary = online_violations(kafka_bootstrap, prefix, "--schema-registry", schema_registry)
        assert [(v["kind"], v["step"], v["req_id"]) for v in violations] == [
            ("write_target_mismatch", int(injected["step"]), injected["req"])
        ]
        assert summary["violations"] == {"write_target_mismatch": 1} and summary["undecodable"] == 0

        # Time travel reads the registry framing too, and outlives the engine (closed, so retired: its
        # state is gone): the step's plan, the wrong slot where the detail says.
        [v] = violations
        wait_for("the closed engine retired", lambda: _retired(worker, v["engine_id"]), [worker])
        query = urllib.parse.urlencode({"engine": v["engine_id"], "req": v["req_id"], "step": v["step"]})
        travelled = json.loads(worker.get(f"/block-table?{query}", timeout=60))
        [group] = travelled["ranks"][0]["plan"]["groups"]
        wrong = [(e, w) for e, w, bad in zip(group["expected"], group["written"], group["wrong"], strict=True) if bad]
        assert f"expected slot {wrong[0][0]}, actual slot {wrong[0][1]}" in v["detail"], (wrong, v["detail"])

        # ... and published the same way, under <prefix>.violations-value.
        violation_id = client.get_latest_version(f"{prefix}.violations-value").schema_id
        [published] = read_all(kafka_bootstrap, f"{prefix}.violations")
        assert published.value()[:5] == confluent_header(violation_id) and violation_id != batch_id
    finally:
        worker.stop()


def _retired(worker, engine_id: str) -> bool:
    return any(e["engine_id"] == engine_id and e["state"] == "retired" for e in json.loads(worker.get("/engines")))
