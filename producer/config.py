"""The `kv_trace` engine option, validated up front.

    vllm serve MODEL --additional-config '{"kv_trace": {"enabled": true, "action": "log",
                                                         "sink": "kafka://127.0.0.1:9092"}}'

A bad value fails at engine start, never later, in one line that names every bad key and
its value: the object is validated by a pydantic model (`TraceOptions`), as vLLM validates its
own configs, and all its errors are reported together (`invalid_options`). The plugin checks the
option as soon as vLLM has read it (`kvledger.producer.plugin`), before any engine process starts.
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from kvledger.schemas.confluent import url_problem

log = logging.getLogger("kvledger.producer")

KEY = "kv_trace"  # the engine's additional_config key this plugin reads
DEFAULT_TOPIC = "kvledger.events"
DEFAULT_SEGMENT_BYTES = 64 << 20
# The SchedulerOutput attribute the engine core's batch queue sets (`plugin.note_in_flight`): the
# steps it had dispatched and not yet processed the output of when it scheduled this one.
IN_FLIGHT_ATTR = "kvledger_in_flight_steps"
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
    """An invalid `kv_trace` setting; the message, one line, names every bad key and its value."""


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
class RegistrySpec:
    """A Confluent-compatible Schema Registry the Kafka sink registers its schema with (then it frames
    messages in the Confluent wire format)."""

    url: str  # the Confluent API base, e.g. http://HOST:8081 (Apicurio: .../apis/ccompat/v7)
    settings: dict[str, Any] = field(default_factory=dict)  # passed to SchemaRegistryClient as is


@dataclass(frozen=True)
class TraceConfig:
    enabled: bool = False
    action: TraceAction = TraceAction.LOG  # the default follows the sink: TraceAction.default_for
    sink: SinkSpec = field(default_factory=lambda: SinkSpec("file", Path("kvledger-ledger").absolute()))
    kafka: dict[str, Any] = field(default_factory=dict)  # passed to the Kafka client as is
    schema_registry: RegistrySpec | None = None  # kafka sinks: Confluent framing, schema registered
    buffer_events: int = 4096  # records the recorder holds for its sink
    ring_bytes: int = DEFAULT_RING_BYTES  # the shared-memory ring between a rank and its recorder
    snapshot_interval: int = 256  # steps between snapshots (0: none)
    full_rows: bool = False
    transfer_digests: float = 0.0
    content_digests: float = 0.0  # share of sealed blocks whose bytes are digested (producer/content.py)
    content_sweep: int = 4  # sealed blocks the background sweep digests per step
    # The ledger's name for this engine, kept across restarts (else a new one at every start).
    engine_id: str | None = None

    @classmethod
    def from_additional_config(cls, additional_config: dict | None, *, warn: bool = False) -> TraceConfig:
        """The option's config; TraceConfigError for a bad value. With `warn` (once per engine, where
        its options are parsed), a WARNING when options look meant to trace and do not (`untraced`)."""
        if warn and (why := untraced(additional_config)) is not None:
            log.warning(why)
        raw = (additional_config or {}).get(KEY)
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise TraceConfigError(f"kv_trace: expected an object, got {type(raw).__name__}")
        try:
            options = TraceOptions.model_validate(raw)
        except ValidationError as exc:
            raise TraceConfigError(invalid_options(exc)) from None
        return options.config()


def untraced(additional_config: dict | None) -> str | None:
    """Why options that look meant to trace the engine trace nothing, in one line: a key close to
    `kv_trace` (a typo: vLLM passes additional_config's keys through unread), or `kv_trace` options
    without `enabled`. None when nothing looks amiss (no option at all, or `enabled` said either way)."""
    options = additional_config if isinstance(additional_config, dict) else {}
    others = {k.lower(): k for k in options if isinstance(k, str) and k != KEY}
    near = difflib.get_close_matches(KEY, others, n=1, cutoff=0.8)
    if near:
        return f'kv_trace: additional_config has "{others[near[0]]}", not "{KEY}": nothing is traced'
    raw = options.get(KEY)
    if isinstance(raw, dict) and raw and "enabled" not in raw:
        return f'kv_trace: options given without "enabled": true ({", ".join(sorted(raw))}): nothing is traced'
    return None


class TraceOptions(BaseModel):
    """The `kv_trace` object as written: strict types (no `true` for a number, no "5" for 5),
    no unknown keys. `config()` turns it into the `TraceConfig` the probes use."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    enabled: bool = False
    action: Annotated[TraceAction, Strict(False)] | None = None  # None: TraceAction.default_for(sink)
    sink: str | None = None
    kafka: dict[str, Any] = {}
    # A JSON file of client settings under `kafka` (the one a worker's --kafka-config takes): keeps
    # a password off the engine's command line and out of its logged arguments.
    kafka_config: str | None = None
    # Kafka sinks only.
    schema_registry: str | None = None
    schema_registry_config: dict[str, Any] | None = None
    buffer_events: int = Field(4096, ge=1)
    ring_bytes: int = Field(DEFAULT_RING_BYTES, ge=1 << 20, multiple_of=8)
    snapshot_interval: int = Field(256, ge=0)
    full_rows: bool = False
    transfer_digests: float = Field(0.0, ge=0.0, le=1.0)
    content_digests: float = Field(0.0, ge=0.0, le=1.0)
    content_sweep: int = Field(4, ge=0)
    engine_id: str | None = None
    # File sinks only.
    segment_bytes: int | None = Field(None, ge=1)
    retain_bytes: int | None = Field(None, ge=0)
    retain_hours: float | None = Field(None, ge=0.0)

    @field_validator("sink")
    @classmethod
    def _sink_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_sink(value)  # a bad URL fails here, under its key, beside the other keys' errors
        return value

    @field_validator("engine_id")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"expected a non-empty name, got {value!r}")
        return value

    @field_validator("kafka_config")
    @classmethod
    def _kafka_file(cls, value: str | None) -> str | None:
        if value is not None:
            _client_settings(value)  # unreadable: fails here, under its key
        return value

    def kafka_settings(self) -> dict[str, Any]:
        """The client's settings: the file's (its bootstrap.servers aside: the sink URL names the
        broker), then `kafka`'s, which win."""
        settings = _client_settings(self.kafka_config) if self.kafka_config else {}
        settings.pop("bootstrap.servers", None)
        return {**settings, **self.kafka}

    @field_validator("schema_registry")
    @classmethod
    def _registry_url(cls, value: str | None) -> str | None:
        if value is not None and (problem := url_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("schema_registry_config")
    @classmethod
    def _registry_settings(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and "url" in value:
            raise ValueError("the URL goes in kv_trace.schema_registry, not here")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TraceOptions:
        """The rules across keys (run once every key is valid on its own), every one broken reported."""
        sink = self.sink_spec()
        broken: list[tuple[str, str]] = []
        if self.schema_registry is not None and sink.kind != "kafka":
            broken.append(("schema_registry", f"applies to kafka sinks only (got a {sink.kind} sink)"))
        if self.kafka_config is not None and sink.kind != "kafka":
            broken.append(("kafka_config", f"applies to kafka sinks only (got a {sink.kind} sink)"))
        if self.schema_registry_config is not None and self.schema_registry is None:
            broken.append(("schema_registry_config", "needs kv_trace.schema_registry (the registry's URL)"))
        for key in ("segment_bytes", "retain_bytes", "retain_hours"):
            if getattr(self, key) is not None and sink.kind != "file":
                broken.append((key, f"applies to file sinks only (got a {sink.kind} sink)"))
        if sink.kind == "file":
            if 0 < sink.retain_bytes < sink.segment_bytes:
                broken.append(
                    ("retain_bytes", f"must be at least segment_bytes ({sink.segment_bytes}), got {sink.retain_bytes}")
                )
            if (sink.retain_bytes or sink.retain_hours) and not self.snapshot_interval:
                # The oldest segment kept is replayable only from a snapshot.
                key = "retain_bytes" if sink.retain_bytes else "retain_hours"
                broken.append((key, "retention needs snapshots (snapshot_interval > 0)"))
        if broken:
            raise _KeyErrors(broken)
        return self

    def sink_spec(self) -> SinkSpec:
        base = parse_sink(self.sink) if self.sink is not None else TraceConfig().sink
        return SinkSpec(
            base.kind,
            path=base.path,
            bootstrap=base.bootstrap,
            topic=base.topic,
            segment_bytes=self.segment_bytes or DEFAULT_SEGMENT_BYTES,
            retain_bytes=self.retain_bytes or 0,
            retain_hours=float(self.retain_hours or 0.0),
        )

    def config(self) -> TraceConfig:
        sink = self.sink_spec()
        return TraceConfig(
            enabled=self.enabled,
            action=self.action or TraceAction.default_for(sink),
            sink=sink,
            kafka=self.kafka_settings(),
            schema_registry=(
                RegistrySpec(self.schema_registry, dict(self.schema_registry_config or {}))
                if self.schema_registry is not None
                else None
            ),
            buffer_events=self.buffer_events,
            ring_bytes=self.ring_bytes,
            snapshot_interval=self.snapshot_interval,
            full_rows=self.full_rows,
            transfer_digests=float(self.transfer_digests),
            content_digests=float(self.content_digests),
            content_sweep=self.content_sweep,
            engine_id=self.engine_id,
        )


def _client_settings(path: str) -> dict[str, Any]:
    """A JSON object of Kafka client settings (librdkafka's names), or ValueError saying why not."""
    try:
        settings = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path!r}: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path!r}: expected a JSON object of client settings")
    return settings


class _KeyErrors(ValueError):
    """Rules across keys, each reported under the key the user should change."""

    def __init__(self, broken: list[tuple[str, str]]):
        super().__init__("; ".join(f"{key}: {message}" for key, message in broken))
        self.broken = broken


MAX_VALUE_CHARS = 80  # a value longer than this is shown cut, in an error


def _shown(value: Any) -> str:
    """A value as an error shows it: an object's keys only (its values may be credentials), cut short."""
    text = "{" + ", ".join(f"{k!r}: ..." for k in value) + "}" if isinstance(value, dict) else repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def invalid_options(exc: ValidationError) -> str:
    """Every error of a `kv_trace` object, in one line: `kv_trace.KEY: what is wrong, got VALUE`,
    joined by "; " (after a count when there are several), the known keys named once after an
    unknown one. An object's values are not shown (a misspelt `kafka` may hold a password)."""
    problems: list[str] = []
    unknown = False
    for error in exc.errors(include_url=False):
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, _KeyErrors):
            problems += [f"kv_trace.{key}: {message}" for key, message in cause.broken]
            continue
        key = ".".join(str(part) for part in error["loc"])
        if isinstance(cause, TraceConfigError):  # parse_sink's, already under its key
            problem = str(cause)
        elif cause is not None:  # a field validator's own words
            problem = f"kv_trace.{key}: {cause}"
        elif error["type"] == "extra_forbidden":
            unknown = True
            problem = f"kv_trace.{key}: unknown key"
        else:
            problem = f"kv_trace.{key}: {error['msg'][0].lower()}{error['msg'][1:]}"
        if "input" in error and repr(error["input"]) not in problem:
            problem += f", got {_shown(error['input'])}"
        problems.append(problem)
    line = (
        "; ".join(problems)
        if len(problems) == 1
        else f"kv_trace: {len(problems)} invalid settings: " + "; ".join(problems)
    )
    if unknown:
        line += f" (known keys: {', '.join(sorted(TraceOptions.model_fields))})"
    return line


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
        f"kv_trace.sink: unsupported scheme {url.scheme!r} (use file:///abs/dir or kafka://HOST:PORT), got {value!r}"
    )
