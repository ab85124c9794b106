"""A real engine traces to Kafka over SASL_SSL (SCRAM-SHA-512 over TLS, infra/local-kafka's test
CA), its credentials in a file (`kv_trace.kafka_config`); with a wrong password (`kv_trace.kafka`
wins over the file) it serves the same tokens, its log says why, and the rank counts every event
it lost."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

from kvledger.schemas.events import events_of
from kvledger.stream_app.core import Ledger
from tests.e2e.test_vllm_trace import PRESSURE
from tests.stream_harness import BATCHES, read_all


def traced_over_sasl(config: Path, topic: str, **inline: str | int) -> dict:
    """The credentials from a file (`kv_trace.kafka_config`, off the command line); `inline` wins."""
    bootstrap = json.loads(config.read_text())["bootstrap.servers"]
    kv_trace = {"enabled": True, "sink": f"kafka://{bootstrap}/{topic}", "kafka_config": str(config), "kafka": inline}
    return {**PRESSURE, "max_tokens": 8, "num_blocks": 64, "kv_trace": kv_trace}


def test_an_engine_traces_over_sasl_ssl_and_wrong_credentials_cost_only_events(
    kafka_sasl, kafka_bootstrap, engine, tmp_path
):
    topic = f"kvledger.events.{uuid.uuid4().hex[:8]}"
    config = tmp_path / "kafka.json"
    config.write_text(json.dumps(kafka_sasl))
    run = engine(traced_over_sasl(config, topic))
    # Read back over the same broker's PLAINTEXT listener: what the engine wrote over SASL_SSL.
    events = [e for m in read_all(kafka_bootstrap, topic) for e in BATCHES.decode(m.value())]
    ledger = Ledger()
    assert ledger.apply_many(events_of(events)) + ledger.finish() == []
    assert ledger.coverage.checks["write"] > 10 and ledger.closed

    wrong = engine(traced_over_sasl(config, topic, **{"sasl.password": "wrong", "message.timeout.ms": 2000}))
    assert wrong.outputs == run.outputs
    assert "kv_trace: Kafka sink: authentication failed: check kv_trace.kafka's sasl.* settings" in wrong.log
    [(lost, captured)] = re.findall(r"kv_trace: .* lost (\d+) of (\d+) captured event", wrong.log)
    assert lost == captured and int(captured) > 10
    assert sum(len(BATCHES.decode(m.value())) for m in read_all(kafka_bootstrap, topic)) == len(events)
