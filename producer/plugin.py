"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts. The one thing it does
is wrap `GPUModelRunner.initialize_kv_cache`: once a runner has its KV cache
(and so its layout), the wrapper reads the engine's `kv_trace` option and,
only when it is enabled, attaches probes to that runner instance
(`kvledger.producer.vllm_v1`). Engines without the option run untouched
runner code. An invalid option fails the engine start with the key's name.
"""

from __future__ import annotations

import atexit
import logging

from kvledger.producer.config import TraceConfig

log = logging.getLogger("kvledger.producer")
_probes: list = []


def register() -> None:
    try:
        from vllm.v1.worker import gpu_model_runner
    except Exception as exc:  # not a vLLM with the V1 runner: report, never break the engine
        log.warning("kv_trace: V1 model runner unavailable (%s); probes not installed", exc)
        return
    runner_class = gpu_model_runner.GPUModelRunner
    if getattr(runner_class, "_kvledger_hooked", False):
        return
    initialize_kv_cache = runner_class.initialize_kv_cache

    def initialize_kv_cache_then_trace(self, *args, **kwargs):
        result = initialize_kv_cache(self, *args, **kwargs)
        config = TraceConfig.from_additional_config(self.vllm_config.additional_config)
        if config.enabled:
            attach(self, config)
        return result

    runner_class.initialize_kv_cache = initialize_kv_cache_then_trace
    runner_class._kvledger_hooked = True


def attach(runner, config: TraceConfig):
    from kvledger.producer.vllm_v1 import V1RunnerProbe

    probe = V1RunnerProbe(runner, config)
    probe.attach()
    if not _probes:
        atexit.register(close_all)
    _probes.append(probe)
    log.info("kv_trace: recording %s to %s", probe.recorder.identity, config.sink)
    return probe


def close_all(timeout: float = 5.0) -> None:
    """Flush every probe of this process (at exit, within `timeout` seconds each)."""
    while _probes:
        _probes.pop().close(timeout)
