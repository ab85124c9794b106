"""The plugin's hooks into vLLM, on stand-ins for vLLM's classes (no vLLM here): the `kv_trace`
option checked where vLLM first holds it, the rings of engines being stopped marked first, the
plugin's log lines through vLLM's handlers, each rank's start line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import types
from pathlib import Path

import pytest

from kvledger.producer import plugin
from kvledger.producer.config import SinkSpec, TraceConfig, TraceConfigError
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring import Ring


def stand_in(monkeypatch, name: str, **attrs) -> types.ModuleType:
    """A module of vLLM's (and its packages) as a stand-in in sys.modules."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def engine_args(monkeypatch):
    """A stand-in for vLLM's EngineArgs, its create_engine_config wrapped by the plugin; what it made."""
    made = []

    class EngineArgs:
        def __init__(self, additional_config):
            self.additional_config = additional_config

        def create_engine_config(self, usage_context=None):
            made.append(usage_context)
            return "vllm-config"

    stand_in(monkeypatch, "vllm.engine.arg_utils", EngineArgs=EngineArgs)
    plugin.check_options_first()
    plugin.check_options_first()  # vLLM loads plugins in several places: wrapped once
    return EngineArgs, made


def test_a_bad_option_ends_the_process_that_parsed_it_in_one_line_and_status_2(engine_args, caplog):
    EngineArgs, made = engine_args
    bad = {"kv_trace": {"enabled": True, "ring_bytes": 4096, "sink": "s3://bucket"}}
    with caplog.at_level(logging.WARNING, logger="kvledger"), pytest.raises(SystemExit) as caught:
        EngineArgs(bad).create_engine_config("serve")
    # An exit, not an exception that would unwind through vLLM and the event loop as a traceback.
    assert caught.value.code == 2 and caught.value.__suppress_context__
    [line] = [r for r in caplog.records if r.name.startswith("kvledger")]
    message = line.getMessage()
    assert line.levelno == logging.ERROR and made == [] and "\n" not in message
    assert message.startswith("kv_trace: 2 invalid settings: kv_trace.sink: unsupported scheme 's3'")
    assert "kv_trace.ring_bytes: input should be greater than or equal to 1048576, got 4096" in message
    with caplog.at_level(logging.WARNING, logger="kvledger"), pytest.raises(SystemExit):
        EngineArgs({"kv_trace": {"enabled": True, "snapshot_intervall": 10}}).create_engine_config("serve")
    assert caplog.records[-1].getMessage().startswith("kv_trace.snapshot_intervall: unknown key, got 10")
    assert EngineArgs({"kv_trace": {"enabled": True}}).create_engine_config("serve") == "vllm-config"
    assert EngineArgs({}).create_engine_config() == "vllm-config"  # untraced engines: nothing to check
    assert made == ["serve", None]


def test_a_worker_still_raises_on_a_bad_option():
    """Where no options were parsed (a worker of an engine made without EngineArgs), the error is raised."""
    with pytest.raises(TraceConfigError, match=r"kv_trace\.snapshot_intervall: unknown key"):
        TraceConfig.from_additional_config({"kv_trace": {"enabled": True, "snapshot_intervall": 10}})


@pytest.mark.parametrize(
    ("additional_config", "warning"),
    [
        ({"kvtrace": {"on": 1}}, 'kv_trace: additional_config has "kvtrace", not "kv_trace": nothing is traced'),
        ({"KV-Trace": {"enabled": True}}, 'has "KV-Trace", not "kv_trace"'),
        ({"kv_traces": {}, "other_plugin": 1}, 'has "kv_traces", not "kv_trace"'),
        (
            {"kv_trace": {"sink": "file:///tmp/ledger", "action": "log"}},
            'kv_trace: options given without "enabled": true (action, sink): nothing is traced',
        ),
    ],
)
def test_options_that_look_meant_to_trace_and_do_not_are_warned_of_once(
    engine_args, caplog, additional_config, warning
):
    EngineArgs, made = engine_args
    with caplog.at_level(logging.DEBUG, logger="kvledger"):
        assert EngineArgs(additional_config).create_engine_config("serve") == "vllm-config"
        TraceConfig.from_additional_config(additional_config)  # a worker's own read: said once already
    [line] = [r for r in caplog.records if r.name.startswith("kvledger")]
    assert line.levelno == logging.WARNING and warning in line.getMessage(), line.getMessage()
    assert made == ["serve"]


@pytest.mark.parametrize(
    "additional_config",
    [
        {},
        {"kv_trace": {"enabled": True, "sink": "file:///tmp/ledger"}},
        {"kv_trace": {"enabled": False, "sink": "file:///tmp/ledger"}},  # off on purpose
        {"kv_trace": {}},
        {"kv_cache_extra": 1, "kv_tracing_other": 2, "trace": 3},  # not close enough to be a typo
    ],
)
def test_options_that_say_what_they_mean_are_not_warned_of(engine_args, caplog, additional_config):
    EngineArgs, _ = engine_args
    with caplog.at_level(logging.DEBUG, logger="kvledger"):
        EngineArgs(additional_config).create_engine_config("serve")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("kvledger")] == []


def test_no_check_where_no_engine_config_is_made(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm.engine.arg_utils", raising=False)
    plugin.check_options_first()  # a worker process: nothing to wrap, nothing imported


def test_the_rings_below_the_engines_being_stopped_are_marked_first(monkeypatch, tmp_path):
    calls = []

    class Proc:
        pid = os.getpid()

    class CoreEngineProcManager:
        def __init__(self):
            self.processes = [Proc()]

        def shutdown(self, timeout=None):
            calls.append((timeout, ring.stop_requested))

    stand_in(monkeypatch, "vllm.v1.engine.utils", CoreEngineProcManager=CoreEngineProcManager)
    monkeypatch.setattr("kvledger.producer.ring_writer.ring_dir", lambda: tmp_path)
    ring = Ring.create(tmp_path / f"kvledger-{os.getpid()}-dp0-tp0-pp0-0.ring", 4096)
    plugin.mark_stops_before_shutdown()
    plugin.mark_stops_before_shutdown()
    CoreEngineProcManager().shutdown(timeout=0)
    assert calls == [(0, True)]  # marked before vLLM signals its engines


def test_a_ranks_own_sigterm_marks_its_ring(tmp_path):
    ring = Ring.create(tmp_path / "kvledger-1-dp0-tp0-pp0-0.ring", 4096)
    probe = types.SimpleNamespace(recorder=types.SimpleNamespace(ring=ring))
    plugin._probes.append(probe)
    try:
        plugin.request_stop_all()
    finally:
        plugin._probes.remove(probe)
    assert ring.stop_requested


@pytest.fixture
def vllm_logger():
    """vLLM's logger as vLLM configures it (its own handler, INFO, not propagating); ours untouched."""
    theirs, ours = logging.getLogger("vllm"), logging.getLogger("kvledger")
    saved = (theirs.handlers[:], theirs.level, theirs.propagate, ours.handlers[:], ours.level, ours.propagate)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    theirs.handlers[:] = [handler]
    theirs.setLevel(logging.INFO)
    theirs.propagate = False
    ours.handlers[:], ours.propagate = [], True
    ours.setLevel(logging.NOTSET)
    try:
        yield records
    finally:
        theirs.handlers[:], theirs.level, theirs.propagate = saved[0], saved[1], saved[2]
        ours.handlers[:], ours.level, ours.propagate = saved[3], saved[4], saved[5]


@contextlib.contextmanager
def root_handlers(*handlers: logging.Handler):
    """The root logger's handlers as a process has them (pytest's capture set aside meanwhile)."""
    root = logging.getLogger()
    saved, root.handlers[:] = root.handlers[:], list(handlers)
    try:
        yield
    finally:
        root.handlers[:] = saved


def test_the_plugins_lines_go_where_vllms_go_at_its_level(vllm_logger):
    with root_handlers():  # none: vLLM configures its own logger only
        plugin.log_through_vllm()
    log = logging.getLogger("kvledger.producer")
    log.info("kv_trace: an info line")
    log.debug("kv_trace: a debug line")
    assert [r.getMessage() for r in vllm_logger] == ["kv_trace: an info line"]


def test_lines_logged_before_vllm_configures_its_logging_reach_it_once_it_has(vllm_logger):
    """vLLM configures its logger from its config, after the plugins load: an engine core in the
    driver's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) starts its ranks after that."""
    theirs = logging.getLogger("vllm")
    configured, theirs.handlers[:] = theirs.handlers[:], []
    with root_handlers():
        plugin.log_through_vllm()
    theirs.handlers[:] = configured
    logging.getLogger("kvledger.producer").info("kv_trace: recording to ...")
    assert [r.getMessage() for r in vllm_logger] == ["kv_trace: recording to ..."]


def test_an_application_that_configured_logging_keeps_its_own(vllm_logger):
    with root_handlers(logging.NullHandler()):
        plugin.log_through_vllm()
    assert logging.getLogger("kvledger").handlers == []


def test_each_rank_says_where_it_records_once_at_start(vllm_logger, monkeypatch):
    with root_handlers():
        plugin.log_through_vllm()
    ring = types.SimpleNamespace(capacity=64 << 20)
    recorder = types.SimpleNamespace(identity=RankIdentity("vllm-42", 1, 0, 0), ring=ring)

    class Probe:
        runner_name = "v1"

        def __init__(self, runner, config):
            self.recorder = recorder

        def attach(self):
            pass

    monkeypatch.setattr(plugin, "probe_class", lambda runner: Probe)
    monkeypatch.setattr(plugin, "install_exit_hooks", lambda: None)
    config = TraceConfig.from_additional_config(
        {"kv_trace": {"enabled": True, "sink": "kafka://10.0.0.5:9092/fleet.events", "ring_bytes": 64 << 20}}
    )
    probe = plugin.attach(object(), config)
    plugin._probes.remove(probe)
    assert [r.getMessage() for r in vllm_logger] == [
        "kv_trace: rank dp1-tp0-pp0 of engine vllm-42: recording to kafka://10.0.0.5:9092/fleet.events "
        "(action record, ring 64 MiB, v1 runner)"
    ]


def test_a_sink_is_named_as_the_option_spells_it():
    assert plugin.sink_url(SinkSpec("kafka", bootstrap="b1:9092,b2:9092", topic="t")) == "kafka://b1:9092,b2:9092/t"
    assert plugin.sink_url(SinkSpec("file", path=Path("/var/lib/kvledger"))) == "file:///var/lib/kvledger"
