"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts. The one thing it does
is wrap `WorkerWrapperBase.initialize_from_config`, which every worker of
every executor goes through once its KV cache layout is known (and its KV
connector exists). The wrapper reads the engine's `kv_trace` option and,
only when it is enabled, attaches the probes of the worker's model runner:
the V1 runner (`kvledger.producer.vllm_v1`) or Model Runner V2 and its
subclasses such as vllm-ascend's NPU runner (`kvledger.producer.vllm_mrv2`).
Engines without the option run untouched code. An invalid option fails the
engine start with the key's name.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from kvledger.producer.config import TraceConfig

log = logging.getLogger("kvledger.producer")
_probes: list = []
V1_MODULE = "vllm.v1.worker.gpu_model_runner"
MRV2_MODULE = "vllm.v1.worker.gpu.model_runner"


def register() -> None:
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except Exception as exc:  # not a vLLM with V1 workers: report, never break the engine
        log.warning("kv_trace: vLLM's V1 worker is unavailable (%s); probes not installed", exc)
        return
    if getattr(WorkerWrapperBase, "_kvledger_hooked", False):
        return
    initialize_from_config = WorkerWrapperBase.initialize_from_config

    def initialize_from_config_then_trace(self, *args, **kwargs):
        result = initialize_from_config(self, *args, **kwargs)
        config = TraceConfig.from_additional_config(self.vllm_config.additional_config)
        if config.enabled:
            runner = getattr(getattr(self, "worker", None), "model_runner", None)
            if runner is None:
                log.warning("kv_trace: this worker has no model runner; nothing recorded")
            else:
                attach(runner, config)
        return result

    WorkerWrapperBase.initialize_from_config = initialize_from_config_then_trace
    WorkerWrapperBase._kvledger_hooked = True


def probe_class(runner: Any) -> type | None:
    """The adapter for a model runner, by the vLLM class it derives from."""
    modules = [c.__module__ for c in type(runner).__mro__]
    if MRV2_MODULE in modules:
        from kvledger.producer.vllm_mrv2 import MRV2RunnerProbe

        return MRV2RunnerProbe
    if V1_MODULE in modules:
        from kvledger.producer.vllm_v1 import V1RunnerProbe

        return V1RunnerProbe
    return None


def attach(runner, config: TraceConfig):
    adapter = probe_class(runner)
    if adapter is None:
        log.warning("kv_trace: no probes for model runner %s; nothing recorded", type(runner).__qualname__)
        return None
    probe = adapter(runner, config)
    probe.attach()
    if not _probes:
        atexit.register(close_all)
    _probes.append(probe)
    log.info("kv_trace: recording %s to %s (%s runner)", probe.recorder.identity, config.sink, probe.runner_name)
    return probe


def pause_tracing(worker: Any = None) -> int:
    """Stop recording in this process's probes (steps still counted); returns how many.

    From a driver: `llm.collective_rpc(pause_tracing)` reaches every worker (vLLM sends a
    function only with VLLM_ALLOW_INSECURE_SERIALIZATION=1).
    """
    for probe in _probes:
        probe.paused = True
    return len(_probes)


def resume_tracing(worker: Any = None) -> int:
    """Record again; each rank's ledger resyncs at its next snapshot."""
    for probe in _probes:
        probe.paused = False
    return len(_probes)


def close_all(timeout: float = 5.0) -> None:
    """Flush every probe of this process (at exit, within `timeout` seconds each)."""
    while _probes:
        _probes.pop().close(timeout)
