"""The `kv_trace` engine option, validated up front.

    vllm serve MODEL --additional-config '{"kv_trace": {"enabled": true, "action": "log",
                                                         "sink": "kafka://127.0.0.1:9092"}}'

A bad value fails at engine start with the key it is about, never later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_TOPIC = "kvledger.events"
_FILE_KEYS = {"segment_bytes", "retain_bytes", "retain_hours"}  # file sinks only
_KEYS = {
    "enabled",
    "action",
    "sink",
    "kafka",
    "buffer_events",
    "ring_bytes",
    "snapshot_interval",
    "full_rows",
    "transfer_digests",
    "engine_id",
    *_FILE_KEYS,
}
DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_RING_BYTES = 16 << 20  # ~1,600 steps of 64 requests; ~80 of 8k-token prefills over 2 groups


class TraceAction(StrEnum):
    """What a rank does with its own events besides recording them."""

    RECORD = "record"  # nothing: the stream workers check (the default with a Kafka sink)
    LOG = "log"  # replay them through the ledger core off the engine thread, log violations (file sinks)
    RAISE = "raise"  # the same check on the engine thread: the step fails (a debugging mode)

    @classmethod
    def default_for(cls, sink: SinkSpec) -> TraceAction:
        """A fleet writing to Kafka has stream workers for the checking; a file ledger is read
        afterwards, so its engine says what it sees as it goes."""
        return cls.RECORD if sink.kind == "kafka" else cls.LOG


class TraceConfigError(ValueError):
    """An invalid `kv_trace` setting; the message names the key."""


@dataclass(frozen=True)
class SinkSpec:
    kind: str  # "file" or "kafka"
    path: Path | None = None  # file: the ledger root
    bootstrap: str | None = None  # kafka: HOST:PORT[,HOST:PORT...]
    topic: str = DEFAULT_TOPIC
    segment_bytes: int = DEFAULT_SEGMENT_BYTES  # file: a segment is rotated at this size
    retain_bytes: int = 0  # file: bytes kept per rank directory (0: unlimited)
    retain_hours: float = 0.0  # file: segments whose newest event is older go (0: unlimited)


@dataclass(frozen=True)
class TraceConfig:
    enabled: bool = False
    action: TraceAction = TraceAction.LOG  # the default follows the sink: TraceAction.default_for
    sink: SinkSpec = field(default_factory=lambda: SinkSpec("file", Path("kvledger-ledger").absolute()))
    kafka: dict[str, Any] = field(default_factory=dict)  # passed to the Kafka client as is
    buffer_events: int = 4096  # records the recorder holds for its sink
    ring_bytes: int = DEFAULT_RING_BYTES  # the shared-memory ring between a rank and its recorder
    snapshot_interval: int = 256  # steps between snapshots (0: none)
    full_rows: bool = False
    transfer_digests: float = 0.0
    # The ledger's name for this engine, kept across restarts (else a new one at every start).
    engine_id: str | None = None

    @classmethod
    def from_additional_config(cls, additional_config: dict | None) -> TraceConfig:
        raw = (additional_config or {}).get("kv_trace")
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise TraceConfigError(f"kv_trace: expected an object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise TraceConfigError(f"kv_trace.{unknown[0]}: unknown key (known: {', '.join(sorted(_KEYS))})")
        sink = _file_options(raw, parse_sink(raw["sink"]) if "sink" in raw else cls().sink)
        action = _choice(raw, "action", tuple(TraceAction), TraceAction.default_for(sink))
        config = cls(
            enabled=_typed(raw, "enabled", bool, False),
            action=TraceAction(action),
            sink=sink,
            kafka=_typed(raw, "kafka", dict, {}),
            buffer_events=_positive(raw, "buffer_events", 4096),
            ring_bytes=_ring_bytes(raw),
            snapshot_interval=_typed(raw, "snapshot_interval", int, 256, minimum=0),
            full_rows=_typed(raw, "full_rows", bool, False),
            transfer_digests=_fraction(raw, "transfer_digests"),
            engine_id=_engine_id(raw),
        )
        if (config.sink.retain_bytes or config.sink.retain_hours) and not config.snapshot_interval:
            # The oldest segment kept is replayable only from a snapshot.
            key = "retain_bytes" if config.sink.retain_bytes else "retain_hours"
            raise TraceConfigError(f"kv_trace.{key}: retention needs snapshots (snapshot_interval > 0)")
        return config


def _ring_bytes(raw: dict) -> int:
    value = _typed(raw, "ring_bytes", int, DEFAULT_RING_BYTES, minimum=1 << 20)
    if value % 8:
        raise TraceConfigError(f"kv_trace.ring_bytes: must be a multiple of 8, got {value}")
    return value


def _engine_id(raw: dict) -> str | None:
    value = raw.get("engine_id")
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise TraceConfigError(f"kv_trace.engine_id: expected a non-empty string, got {value!r}")
    return value


def resolve_engine_id(configured: str | None, connector_engine_id: str | None, instance_id: str) -> str:
    """The engine id the ledger uses: `kv_trace.engine_id`, else the KV connector's (the id its peers
    know it by, in PD pairs), else `vllm-<instance_id>`, new at every start. With a connector the two
    must agree: the transfer join matches engines by the connector's ids."""
    if configured is not None and connector_engine_id is not None and configured != connector_engine_id:
        raise TraceConfigError(
            f"kv_trace.engine_id: {configured!r} differs from kv_transfer_config.engine_id "
            f"{connector_engine_id!r}; a PD engine is known by its connector's id (leave it unset, or equal)"
        )
    return configured or connector_engine_id or f"vllm-{instance_id}"


def _file_options(raw: dict, sink: SinkSpec) -> SinkSpec:
    """The file sink's rotation and retention keys, which mean nothing to another sink."""
    given = sorted(_FILE_KEYS & set(raw))
    if given and sink.kind != "file":
        raise TraceConfigError(f"kv_trace.{given[0]}: applies to file sinks only (got a {sink.kind} sink)")
    segment_bytes = _positive(raw, "segment_bytes", DEFAULT_SEGMENT_BYTES)
    retain_bytes = _typed(raw, "retain_bytes", int, 0, minimum=0)
    if 0 < retain_bytes < segment_bytes:
        raise TraceConfigError(
            f"kv_trace.retain_bytes: must be at least segment_bytes ({segment_bytes}), got {retain_bytes}"
        )
    retain_hours = _number(raw, "retain_hours", 0.0, minimum=0.0)
    return replace(sink, segment_bytes=segment_bytes, retain_bytes=retain_bytes, retain_hours=retain_hours)


def parse_sink(value: Any) -> SinkSpec:
    if not isinstance(value, str):
        raise TraceConfigError(f"kv_trace.sink: expected a string URL, got {type(value).__name__}")
    url = urlsplit(value)
    if url.scheme == "file":
        if url.netloc or not url.path.startswith("/"):
            raise TraceConfigError(f"kv_trace.sink: file sinks need an absolute path, file:///abs/dir (got {value!r})")
        return SinkSpec("file", path=Path(url.path))
    if url.scheme == "kafka":
        if not url.netloc:
            raise TraceConfigError(f"kv_trace.sink: kafka sinks need kafka://HOST:PORT[/topic] (got {value!r})")
        topic = url.path.strip("/") or DEFAULT_TOPIC
        return SinkSpec("kafka", bootstrap=url.netloc, topic=topic)
    raise TraceConfigError(
        f"kv_trace.sink: unsupported scheme {url.scheme!r} (use file:///abs/dir or kafka://HOST:PORT)"
    )


def _typed(raw: dict, key: str, kind: type, default: Any, *, minimum: int | None = None) -> Any:
    value = raw.get(key, default)
    # bool is an int in Python: do not let `true` pass as a number or 1 as a flag.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TraceConfigError(f"kv_trace.{key}: expected {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise TraceConfigError(f"kv_trace.{key}: must be >= {minimum}, got {value}")
    return value


def _number(raw: dict, key: str, default: float, *, minimum: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceConfigError(f"kv_trace.{key}: expected a number, got {value!r}")
    if not value >= minimum:  # NaN fails too
        raise TraceConfigError(f"kv_trace.{key}: must be >= {minimum}, got {value}")
    return float(value)


def _positive(raw: dict, key: str, default: int) -> int:
    return _typed(raw, key, int, default, minimum=1)


def _choice(raw: dict, key: str, choices: tuple[str, ...], default: str) -> str:
    value = raw.get(key, default)
    if value not in choices:
        raise TraceConfigError(f"kv_trace.{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _fraction(raw: dict, key: str) -> float:
    value = raw.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise TraceConfigError(f"kv_trace.{key}: expected a fraction between 0.0 and 1.0, got {value!r}")
    return float(value)
