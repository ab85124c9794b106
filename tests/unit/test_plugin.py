"""The plugin's hooks into vLLM, on stand-ins for vLLM's classes (no vLLM here): the `kv_trace`
option checked where vLLM first holds it."""

from __future__ import annotations

import sys
import types

import pytest

from kvledger.producer import plugin
from kvledger.producer.config import TraceConfigError


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


def test_a_bad_option_fails_where_the_engine_config_is_made_before_any_engine(monkeypatch):
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
    bad = {"kv_trace": {"enabled": True, "ring_bytes": 4096, "sink": "s3://bucket"}}
    with pytest.raises(TraceConfigError) as caught:
        EngineArgs(bad).create_engine_config("serve")
    assert made == [] and "\n" not in str(caught.value)
    assert str(caught.value).startswith("kv_trace: 2 invalid settings: kv_trace.sink: unsupported scheme 's3'")
    assert "kv_trace.ring_bytes: input should be greater than or equal to 1048576, got 4096" in str(caught.value)
    assert EngineArgs({"kv_trace": {"enabled": True}}).create_engine_config("serve") == "vllm-config"
    assert EngineArgs({}).create_engine_config() == "vllm-config"  # untraced engines: nothing to check
    assert made == ["serve", None]


def test_no_check_where_no_engine_config_is_made(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm.engine.arg_utils", raising=False)
    plugin.check_options_first()  # a worker process: nothing to wrap, nothing imported
