"""The producer's runtime: the kv_trace option, capture, buffering, loss accounting, the file sink."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvledger.producer.config import (
    DEFAULT_TOPIC,
    RegistrySpec,
    TraceAction,
    TraceConfig,
    TraceConfigError,
    parse_sink,
)
from kvledger.producer.delivery import Delivery
from kvledger.producer.records import RankIdentity
from kvledger.producer.sinks import FileSink
from kvledger.schemas.events import body_of, event_of
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.replay import replay
from tests.synthetic.engine import SimConfig, simulate

RANK = RankIdentity("eng-1", 0, 1, 0, incarnation=42)


# -- the kv_trace option ----------------------------------------------------------------------------
def test_disabled_unless_asked():
    assert TraceConfig.from_additional_config(None).enabled is False
    assert TraceConfig.from_additional_config({"other": 1}).enabled is False
    assert TraceConfig.from_additional_config({"kv_trace": {}}).enabled is False


def test_full_config():
    config = TraceConfig.from_additional_config(
        {
            "kv_trace": {
                "enabled": True,
                "action": "raise",
                "sink": "kafka://10.0.0.1:9093,10.0.0.2:9093/prod.kv",
                "kafka": {"security.protocol": "SASL_SSL"},
                "buffer_events": 64,
                "snapshot_interval": 0,
                "full_rows": True,
                "transfer_digests": 0.25,
            }
        }
    )
    assert config.enabled and config.action == "raise" and config.full_rows
    assert (config.sink.kind, config.sink.bootstrap, config.sink.topic) == (
        "kafka",
        "10.0.0.1:9093,10.0.0.2:9093",
        "prod.kv",
    )
    assert config.kafka == {"security.protocol": "SASL_SSL"}
    assert (config.buffer_events, config.snapshot_interval, config.transfer_digests) == (64, 0, 0.25)


def test_a_schema_registry_for_a_kafka_sink():
    raw = {"sink": "kafka://b:9092", "schema_registry": "https://registry:8081"}
    assert TraceConfig.from_additional_config({"kv_trace": raw}).schema_registry == RegistrySpec(
        "https://registry:8081"
    )
    auth = {**raw, "schema_registry_config": {"basic.auth.user.info": "u:p"}}
    spec = TraceConfig.from_additional_config({"kv_trace": auth}).schema_registry
    assert spec.settings == {"basic.auth.user.info": "u:p"}
    assert TraceConfig.from_additional_config({"kv_trace": {"sink": "kafka://b:9092"}}).schema_registry is None
    message = r"^kv_trace\.schema_registry: applies to kafka sinks only \(got a file sink\)$"
    with pytest.raises(TraceConfigError, match=message):
        TraceConfig.from_additional_config({"kv_trace": {"sink": "file:///kv", "schema_registry": "http://r"}})


def test_the_action_defaults_to_record_with_kafka_and_to_log_with_a_file_ledger():
    def action(**raw):
        return TraceConfig.from_additional_config({"kv_trace": raw}).action

    assert action(sink="kafka://127.0.0.1:9092") is TraceAction.RECORD  # the stream workers check
    assert action(sink="file:///var/lib/kvledger") is TraceAction.LOG
    assert action() is TraceAction.LOG  # the default sink is a file ledger
    assert action(sink="kafka://127.0.0.1:9092", action="log") is TraceAction.LOG
    assert action(sink="file:///var/lib/kvledger", action="record") is TraceAction.RECORD
    expected = r"^kv_trace\.action: input should be 'record', 'log' or 'raise', got 'panic'$"
    with pytest.raises(TraceConfigError, match=expected):
        action(action="panic")


def test_a_configured_engine_id_survives_restarts_and_agrees_with_the_connector():
    from kvledger.producer.config import resolve_engine_id

    config = TraceConfig.from_additional_config({"kv_trace": {"engine_id": "llama-70b-a"}})
    assert config.engine_id == "llama-70b-a"
    assert resolve_engine_id(config.engine_id, None, "1f3e") == "llama-70b-a"  # whatever the instance id
    assert resolve_engine_id(None, None, "1f3e") == "vllm-1f3e"  # new at every start
    assert resolve_engine_id(None, "prefill-0", "1f3e") == "prefill-0"  # a PD engine: its peers' name for it
    assert resolve_engine_id("prefill-0", "prefill-0", "1f3e") == "prefill-0"
    with pytest.raises(TraceConfigError, match=r"^kv_trace\.engine_id: 'a' differs from kv_transfer_config"):
        resolve_engine_id("a", "prefill-0", "1f3e")


def test_a_closing_recorder_says_so_in_its_last_event(tmp_path):
    recorder = Delivery(RANK, FileSink(tmp_path))
    recorder.close(step=3)
    result = replay(tmp_path)
    [slot] = result.ledger.ranks.values()
    assert slot.closed and result.ledger.closed


def test_sinks():
    assert parse_sink("file:///var/lib/kv").path == Path("/var/lib/kv")
    assert parse_sink("kafka://broker:9092").topic == DEFAULT_TOPIC


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"enabled": "yes"}, "enabled"),
        ({"action": "panic"}, "action"),
        ({"sink": "file://relative/dir"}, "sink"),
        ({"sink": "file:relative"}, "sink"),
        ({"sink": "s3://bucket"}, "sink"),
        ({"sink": "kafka:///topic-only"}, "sink"),
        ({"sink": 5}, "sink"),
        ({"kafka": "security.protocol=SSL"}, "kafka"),
        ({"buffer_events": 0}, "buffer_events"),
        ({"buffer_events": True}, "buffer_events"),
        ({"snapshot_interval": -1}, "snapshot_interval"),
        ({"transfer_digests": 1.5}, "transfer_digests"),
        ({"transfer_digest": 0.5}, "transfer_digest"),
        ({"engine_id": ""}, "engine_id"),
        ({"engine_id": 7}, "engine_id"),
        ({"engine_id": "  "}, "engine_id"),
        ({"ring_bytes": (1 << 20) + 4}, "ring_bytes"),
        ({"ring_bytes": 4096}, "ring_bytes"),
        ({"snapshot_interval": "256"}, "snapshot_interval"),
        ({"transfer_digests": float("nan")}, "transfer_digests"),
        ({"sink": "kafka://b:9092", "schema_registry": "b:8081"}, "schema_registry"),
        ({"sink": "kafka://b:9092", "schema_registry": "ftp://b:8081"}, "schema_registry"),
        ({"sink": "kafka://b:9092", "schema_registry": "http://"}, "schema_registry"),
        ({"sink": "file:///var/kv", "schema_registry": "http://b:8081"}, "schema_registry"),
        ({"schema_registry": "http://b:8081"}, "schema_registry"),  # the default sink is a file ledger
        ({"sink": "kafka://b:9092", "schema_registry_config": {"timeout": 5}}, "schema_registry_config"),
        (
            {"sink": "kafka://b:9092", "schema_registry": "http://b", "schema_registry_config": {"url": "x"}},
            "schema_registry_config",
        ),
        (
            {"sink": "kafka://b:9092", "schema_registry": "http://b", "schema_registry_config": "a:b"},
            "schema_registry_config",
        ),
    ],
)
def test_bad_settings_name_their_key(raw, key):
    with pytest.raises(TraceConfigError, match=rf"^kv_trace\.{key}: "):
        TraceConfig.from_additional_config({"kv_trace": {"enabled": True, **raw}})


def test_every_bad_key_and_value_in_one_line():
    raw = {"enabled": True, "ring_bytes": 4096, "sink": "s3://bucket/ledger", "snapshot_interval": "256"}
    with pytest.raises(TraceConfigError) as caught:
        TraceConfig.from_additional_config({"kv_trace": raw})
    assert str(caught.value) == (
        "kv_trace: 3 invalid settings: "
        "kv_trace.sink: unsupported scheme 's3' (use file:///abs/dir or kafka://HOST:PORT), got 's3://bucket/ledger'; "
        "kv_trace.ring_bytes: input should be greater than or equal to 1048576, got 4096; "
        "kv_trace.snapshot_interval: input should be a valid integer, got '256'"
    )


def test_unknown_keys_are_each_named_with_their_value_and_the_known_keys_once():
    raw = {"ringbytes": 1 << 24, "kafak": {"sasl.password": "secret"}, "action": "panic"}
    with pytest.raises(TraceConfigError) as caught:
        TraceConfig.from_additional_config({"kv_trace": raw})
    message = str(caught.value)
    assert message.startswith(
        "kv_trace: 3 invalid settings: kv_trace.action: input should be 'record', 'log' or 'raise', got 'panic'; "
        "kv_trace.ringbytes: unknown key, got 16777216; "
        "kv_trace.kafak: unknown key, got {'sasl.password': ...} (known keys: action, buffer_events, "
    )
    assert "secret" not in message  # an object's values may be credentials
    assert message.count("known keys") == 1 and "\n" not in message


def test_the_rules_across_keys_are_all_named_too():
    raw = {"sink": "kafka://b:9092", "segment_bytes": 1 << 20, "retain_hours": 2.0, "schema_registry_config": {}}
    with pytest.raises(TraceConfigError) as caught:
        TraceConfig.from_additional_config({"kv_trace": raw})
    assert str(caught.value) == (
        "kv_trace: 3 invalid settings: "
        "kv_trace.schema_registry_config: needs kv_trace.schema_registry (the registry's URL); "
        "kv_trace.segment_bytes: applies to file sinks only (got a kafka sink); "
        "kv_trace.retain_hours: applies to file sinks only (got a kafka sink)"
    )


def test_a_long_value_is_cut_in_the_message():
    with pytest.raises(
        TraceConfigError, match=r"^kv_trace\.engine_id: input should be a valid string, got \[0, 1, .*\.\.\.$"
    ):
        TraceConfig.from_additional_config({"kv_trace": {"engine_id": list(range(100))}})


def test_kv_trace_must_be_an_object():
    with pytest.raises(TraceConfigError, match=r"^kv_trace: expected an object"):
        TraceConfig.from_additional_config({"kv_trace": True})


# -- capture and loss accounting ------------------------------------------------------------------------
class ListSink:
    lost = 0

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.events: list[dict] = []
        self.gate, self.fail = gate, fail

    def write(self, events):
        if self.gate is not None:
            self.gate.wait()
        if self.fail:
            raise OSError("disk full")
        self.events += events

    def tick(self):
        pass

    def close(self, timeout):
        pass


def bodies(n: int):
    return [
        body_of(*e["body"])
        for e in simulate(SimConfig(seed=3, steps=n, snapshot_interval=0, health_interval=0)).events
        if e["tp_rank"] == 0
    ][:n]


def test_events_are_stamped_in_capture_order():
    sink = ListSink()
    recorder = Delivery(RANK, sink)
    for body in bodies(30):
        recorder.capture(body)
    recorder.close(step=29)
    assert [e["seq"] for e in sink.events] == list(range(31))  # 30 events and the closing Health
    assert {(e["engine_id"], e["dp_rank"], e["tp_rank"], e["pp_rank"], e["incarnation"]) for e in sink.events} == {
        ("eng-1", 0, 1, 0, 42)
    }
    name, health = sink.events[-1]["body"]
    assert name == "kvledger.Health" and health["events_captured"] == 30 and health["events_dropped"] == 0
    assert recorder.dropped == 0


def test_full_buffer_drops_and_counts_without_blocking():
    gate = threading.Event()  # the sink hangs until the test opens the gate
    sink = ListSink(gate)
    recorder = Delivery(RANK, sink, capacity=8, drain_interval=0.001)
    events = bodies(100)
    for body in events:  # would hang here (and time out) if capture ever waited for the sink
        recorder.capture(body)
    gate.set()
    recorder.close(step=99)
    assert recorder.captured == 101
    assert recorder.dropped_full == recorder.captured - len(sink.events) > 0
    # The ledger sees exactly that loss: gaps in the sequence, and the count in the last Health.
    ledger = Ledger()
    violations = [v for e in sink.events for v in ledger.apply(event_of(e))]
    assert {v.kind for v in violations} <= {"sequence_gap"} and violations
    assert sink.events[-1]["body"][1]["events_dropped"] == recorder.dropped_full
    assert ledger.producer_dropped == recorder.dropped_full


def test_a_failing_sink_is_counted_not_raised():
    recorder = Delivery(RANK, ListSink(fail=True))
    for body in bodies(10):
        recorder.capture(body)
    recorder.close(step=9)
    assert recorder.sink_failed == recorder.dropped == 11


def test_file_sink_end_to_end(tmp_path):
    sim = simulate(SimConfig(seed=5, steps=120, tp_size=2, snapshot_interval=30))
    recorders = {tp: Delivery(RankIdentity("sim-engine", 0, tp, 0, 1), FileSink(tmp_path)) for tp in (0, 1)}
    for event in sim.events:
        recorders[event["tp_rank"]].capture(body_of(*event["body"]))
    for recorder in recorders.values():
        recorder.close(step=119)
    result = replay(tmp_path)
    assert result.violations == []
    assert result.ledger.events == len(sim.events) + 2
    assert result.ledger.coverage.checks["write"] > 0 and not result.unchecked


def test_kafka_settings_from_a_file_keep_secrets_off_the_command_line(tmp_path):
    path = tmp_path / "kafka.json"
    path.write_text(json.dumps({"bootstrap.servers": "elsewhere:1", "sasl.password": "s", "linger.ms": 5}))
    raw = {"sink": "kafka://broker:9092", "kafka_config": str(path), "kafka": {"linger.ms": 50}}
    config = TraceConfig.from_additional_config({"kv_trace": raw})
    assert config.kafka == {"sasl.password": "s", "linger.ms": 50}  # the sink URL names the broker; inline wins
    assert config.sink.bootstrap == "broker:9092"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"^kv_trace\.kafka_config: cannot read '.*kafka\.json'"),
        ("{oops", r"^kv_trace\.kafka_config: cannot read"),
        ("[1]", r"^kv_trace\.kafka_config: '.*': expected a JSON object"),
    ],
)
def test_an_unusable_kafka_config_file_is_named(tmp_path, content, message):
    path = tmp_path / "kafka.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TraceConfigError, match=message):
        TraceConfig.from_additional_config({"kv_trace": {"sink": "kafka://b:9092", "kafka_config": str(path)}})


def test_a_kafka_config_file_needs_a_kafka_sink(tmp_path):
    path = tmp_path / "kafka.json"
    path.write_text("{}")
    with pytest.raises(TraceConfigError, match=r"^kv_trace\.kafka_config: applies to kafka sinks only"):
        TraceConfig.from_additional_config({"kv_trace": {"sink": "file:///tmp/l", "kafka_config": str(path)}})
