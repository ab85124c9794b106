"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts. The one thing it does
is wrap `WorkerWrapperBase.initialize_from_config`, which every worker of
every executor goes through once its KV cache layout is known (and its KV
connector exists). The wrapper reads the engine's `kv_trace` option and,
only when it is enabled, attaches the probes of the worker's model runner:
the V1 runner (`kvledger.producer.vllm_v1`) or Model Runner V2 and its
subclasses such as vllm-ascend's NPU runner (`kvledger.producer.vllm_mrv2`).
Engines without the option run untouched code.

An invalid option fails the engine start at once, in one line naming every bad key
and its value: `register()` also wraps `EngineArgs.create_engine_config`, the first
place vLLM hands a plugin the engine's options (in the process that parsed them,
before any engine process starts), which logs that line and exits with status 2; the
worker checks them again, for engines configured without `EngineArgs`, and raises. The
same wrapper warns, once, of options that look meant to trace and trace nothing: a key
close to `kv_trace`, or `kv_trace` options without `enabled`.

Each rank says, once, at INFO in vLLM's log, where it records: `kv_trace: rank
dp0-tp0-pp0 of engine E: recording to kafka://HOST:PORT/TOPIC (action record, ring
16 MiB, v1 runner)`. The plugin's loggers (`kvledger`) write through vLLM's own handlers, at
vLLM's level and in its format, unless the application configured logging itself.

Shutdown: a probe closes (a last Health event, the ledger confirmed complete)
when vLLM shuts its worker down (`WorkerWrapperBase.shutdown`, on every clean
stop and after an engine failure), else at the exit of its process (atexit,
and multiprocessing's exit hooks for vLLM's engine-core and worker processes,
which skip atexit). A worker killed outright loses nothing it wrote: each
rank's recorder process runs in its own session, drains the ring once its
rank is gone and closes the ledger. SIGTERM and SIGINT first give the
recorders a moment to read the rings (within `SIGNAL_FLUSH_S`), then run
vLLM's own handler unchanged.

A stop asked for is not a crash: vLLM's server SIGKILLs its engine processes
right after their SIGTERM (at once unless `--shutdown-timeout` says
otherwise), before a worker can close. So the rings of the ranks being
stopped are marked first (`Ring.request_stop`): by the process manager that
stops the engines (`CoreEngineProcManager.shutdown`, wrapped here: every rank
in the engine processes' trees), and by a rank's own SIGTERM/SIGINT handler.
A marked rank that dies without closing gets its closing Health from its
recorder, after all it wrote (`recorder`); one that dies unasked does
not.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from typing import Any

from kvledger.producer.config import IN_FLIGHT_ATTR, SinkSpec, TraceConfig, TraceConfigError

log = logging.getLogger("kvledger.producer")
_probes: list = []
BAD_OPTION_EXIT = 2  # a process whose `kv_trace` option is invalid exits so, as a usage error does
SIGNAL_FLUSH_S = 0.25  # how long a SIGTERM/SIGINT may wait for the probes' flush before vLLM's handler
_exit_hooks_installed = False
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
    log_through_vllm()
    check_options_first()
    mark_stops_before_shutdown()
    note_in_flight()
    initialize_from_config = WorkerWrapperBase.initialize_from_config
    shutdown = getattr(WorkerWrapperBase, "shutdown", None)  # absent: the exit hooks still close

    def initialize_from_config_then_trace(self, *args, **kwargs):
        result = initialize_from_config(self, *args, **kwargs)
        config = TraceConfig.from_additional_config(self.vllm_config.additional_config)
        if config.enabled:
            runner = getattr(getattr(self, "worker", None), "model_runner", None)
            if runner is None:
                log.warning("kv_trace: this worker has no model runner; nothing recorded")
            else:
                self._kvledger_probe = attach(runner, config)
        return result

    def close_trace_then_shutdown(self, *args, **kwargs):
        probe = getattr(self, "_kvledger_probe", None)
        if probe is not None:  # before the worker goes: a clean stop closes the ledger
            self._kvledger_probe = None
            close_probe(probe)
        return shutdown(self, *args, **kwargs)

    WorkerWrapperBase.initialize_from_config = initialize_from_config_then_trace
    if shutdown is not None:
        WorkerWrapperBase.shutdown = close_trace_then_shutdown
    else:
        log.warning("kv_trace: WorkerWrapperBase.shutdown not found; ledgers close at process exit only")
    WorkerWrapperBase._kvledger_hooked = True


def check_options_first() -> None:
    """Validate `kv_trace` where vLLM first holds the engine's options: `EngineArgs` turning into
    a `VllmConfig`, in the process that parsed them (the server's, the `LLM`'s), seconds after
    start instead of after the engine processes and their workers are up. vLLM loads the plugins
    from `EngineArgs` itself (arguments, `__post_init__`), so a process that makes an engine's
    config has `vllm.engine.arg_utils` imported by now; one that has not (a worker) needs no check."""
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    engine_args = getattr(arg_utils, "EngineArgs", None)
    create = getattr(engine_args, "create_engine_config", None)
    if create is None or getattr(create, "_kvledger_checks", False):
        return

    def check_options_then_create(self, *args, **kwargs):
        options = getattr(self, "additional_config", None)
        if isinstance(options, dict):
            try:
                TraceConfig.from_additional_config(options, warn=True)
            except TraceConfigError as exc:
                # The one line, and an exit: raised, it would end the server under a traceback
                # through vLLM's and the event loop's frames, its line last of dozens.
                log.error("%s", exc)
                raise SystemExit(BAD_OPTION_EXIT) from None
        return create(self, *args, **kwargs)

    check_options_then_create._kvledger_checks = True
    engine_args.create_engine_config = check_options_then_create


def note_in_flight() -> None:
    """Tell each traced worker which earlier steps were still in flight when a step was scheduled.

    An engine core with a batch queue (async scheduling, pipeline parallel: `step_with_batch_queue`)
    schedules step T while steps it dispatched before are unprocessed: their outputs have not reached
    the scheduler, which may have freed their requests' blocks already. The queue's length when it
    hands step T to the executor is that count; it travels to the workers on the SchedulerOutput
    (`IN_FLIGHT_ATTR`, one int; the probe records it as StepInput.in_flight_steps). A synchronous
    engine core (`step`) is untouched and its steps say nothing."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception as exc:  # another vLLM: steps say nothing of the window
        log.debug("kv_trace: no engine core to hook (%s)", exc)
        return
    step = getattr(EngineCore, "step_with_batch_queue", None)
    if step is None or getattr(step, "_kvledger_in_flight", False):
        return

    def step_noting_in_flight(self):
        if not hasattr(self, "_kvledger_traced"):  # once per engine core: only traced engines are told
            self._kvledger_traced = TraceConfig.from_additional_config(self.vllm_config.additional_config).enabled
            if self._kvledger_traced:
                execute, queue = self.model_executor.execute_model, self.batch_queue

                def execute_noting(scheduler_output, *args, **kwargs):
                    # Before this step joins the queue: what it holds is dispatched and unprocessed.
                    setattr(scheduler_output, IN_FLIGHT_ATTR, len(queue))
                    return execute(scheduler_output, *args, **kwargs)

                self.model_executor.execute_model = execute_noting
        return step(self)

    step_noting_in_flight._kvledger_in_flight = True
    EngineCore.step_with_batch_queue = step_noting_in_flight


def mark_stops_before_shutdown() -> None:
    """Before vLLM's engine process manager stops its engines (SIGTERM, then SIGKILL for those
    still there), mark the rings of every rank below them as stopped on purpose."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager
    except Exception as exc:  # another vLLM: a killed rank's ledger then ends unclosed, as before
        log.debug("kv_trace: no engine process manager to hook (%s)", exc)
        return
    shutdown = CoreEngineProcManager.shutdown
    if getattr(shutdown, "_kvledger_marks", False):
        return

    def mark_then_shutdown(self, *args, **kwargs):
        try:
            pids = [p.pid for p in getattr(self, "processes", ()) if getattr(p, "pid", None)]
            if pids:
                from kvledger.producer.ring_writer import request_stop_of

                request_stop_of(pids)
        except Exception:  # never keep vLLM from stopping its engines
            log.exception("kv_trace: could not mark the rings of the engines being stopped")
        return shutdown(self, *args, **kwargs)

    mark_then_shutdown._kvledger_marks = True
    CoreEngineProcManager.shutdown = mark_then_shutdown


def log_through_vllm() -> None:
    """The plugin's records in vLLM's log, as vLLM's own (its handlers, level, format and process
    names), unless the application configured logging: `kvledger` has a handler or a level, or
    the root logger has handlers (then ours reach them as before). Without this, nothing below
    WARNING would be shown: vLLM configures its own logger only."""
    ours = logging.getLogger("kvledger")
    if ours.handlers or ours.level != logging.NOTSET or logging.getLogger().handlers:
        return
    ours.addHandler(ThroughVllm())
    ours.setLevel(logging.DEBUG)  # vLLM's level decides, record by record (ThroughVllm)
    ours.propagate = False


class ThroughVllm(logging.Handler):
    """Hands a record to vLLM's logger's handlers at vLLM's level, as they are when it is emitted:
    vLLM configures its logging from its config after the plugins load (an engine core in the
    driver's process logs before that) and may configure it again (`--logging-config`). Until
    then, or with vLLM's logging off, a record goes where Python would have sent it."""

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        if not theirs.handlers:  # not configured (yet): the root's handlers, or Python's last resort
            theirs = logging.getLogger()
        if record.levelno < theirs.getEffectiveLevel():
            return
        for handler in theirs.handlers or [logging.lastResort]:
            if handler is not None and record.levelno >= handler.level:
                handler.handle(record)


def sink_url(sink: SinkSpec) -> str:
    """Where a sink writes, as the `sink` option spells it."""
    if sink.kind == "kafka":
        return f"kafka://{sink.bootstrap}/{sink.topic}"
    return f"file://{sink.path}"


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
    install_exit_hooks()
    _probes.append(probe)
    recorder = probe.recorder
    if recorder is not None:
        rank = recorder.identity
        log.info(
            "kv_trace: rank %s of engine %s: recording to %s (action %s, ring %s, %s runner)",
            rank.label,
            rank.engine_id,
            sink_url(config.sink),
            config.action,
            _mib(recorder.ring.capacity),
            probe.runner_name,
        )
    return probe


def _mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB"


def pause_tracing() -> int:
    """Stop recording in this process's probes (steps still counted); returns how many."""
    for probe in _probes:
        probe.paused = True
    return len(_probes)


def resume_tracing() -> int:
    """Record again; each rank's ledger resyncs at its next snapshot."""
    for probe in _probes:
        probe.paused = False
    return len(_probes)


class TracingExtension:
    """Worker methods for the driver, the way vLLM lets a plugin add them.

    Start the engine with `worker_extension_cls="kvledger.producer.plugin.TracingExtension"`
    (vLLM mixes it into every worker's class), then call the methods by name:
    `llm.collective_rpc("kvledger_pause_tracing")` returns one count of probes per worker.
    An engine with its own extension class derives it from this one too.
    """

    def kvledger_pause_tracing(self) -> int:
        return pause_tracing()

    def kvledger_resume_tracing(self) -> int:
        return resume_tracing()


def close_probe(probe: Any, timeout: float = 5.0) -> None:
    if probe in _probes:
        _probes.remove(probe)
    probe.close(timeout)


def close_all(timeout: float = 5.0) -> None:
    """Close every probe of this process (at exit, within `timeout` seconds each)."""
    while _probes:
        _probes.pop().close(timeout)


def request_stop_all() -> None:
    """Mark this process's rings as stopped on purpose (from a signal handler: stores only)."""
    for probe in _probes:
        ring = getattr(getattr(probe, "recorder", None), "ring", None)
        if ring is not None:
            with contextlib.suppress(ValueError):  # unmapped: that rank closed already
                ring.request_stop()


def flush_all(timeout: float = SIGNAL_FLUSH_S) -> None:
    """Deliver what every probe of this process captured, now (within `timeout` seconds in all)."""
    deadline = time.monotonic() + timeout
    for probe in list(_probes):
        recorder = getattr(probe, "recorder", None)
        if recorder is not None:
            recorder.flush(max(deadline - time.monotonic(), 0.0))


def _forget_inherited() -> None:
    """In a forked child: the parent's probes (their threads did not follow) are not ours to close."""
    global _exit_hooks_installed
    _probes.clear()
    _exit_hooks_installed = False


os.register_at_fork(after_in_child=_forget_inherited)


def install_exit_hooks() -> None:
    """Once per process: close at exit, flush on SIGTERM/SIGINT."""
    global _exit_hooks_installed
    if _exit_hooks_installed:
        return
    _exit_hooks_installed = True
    atexit.register(close_all)
    # vLLM's engine-core and worker processes end through multiprocessing, which runs
    # its own exit hooks but not atexit's (os._exit after a forked child's target).
    multiprocessing.util.Finalize(None, close_all, exitpriority=100)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            chain_signal(signum)


def chain_signal(signum: int) -> None:
    """Flush the probes on `signum`, then do what the handler installed before ours did."""
    previous = signal.getsignal(signum)
    if previous is None:  # installed outside Python: ours could not hand over to it
        return

    def flush_then_chain(sig: int, frame: Any) -> None:
        try:
            request_stop_all()
            flush_all()
        except Exception:  # never keep vLLM's own handler from running
            log.exception("kv_trace: flush on signal %d failed", sig)
        if callable(previous):
            previous(sig, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)  # the default action, as if we had never been here

    signal.signal(signum, flush_then_chain)
