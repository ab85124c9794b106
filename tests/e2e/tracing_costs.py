"""What tracing costs a worker process, read inside it: the counters of the paired on/off runs.

`engine_run.py` starts an engine whose driver pauses and resumes tracing in turn (`ab_rounds`,
`bench/engine_overhead.py --ab-only`, `bench/recorder_policy.py`). Its workers are extended with
`TracingCosts` (vLLM mixes the class named by `worker_extension_cls` into every worker): the
producer's pause and resume, and `kvledger_process_counters`, which the driver calls through
`collective_rpc` after each run. The engine's processes import this module by its name,
`tracing_costs`: whoever starts the engine has this folder on `sys.path` (a script run from it
does), and multiprocessing hands that path on to the processes it starts.

None of this is in the producer: it is the benchmarks' instrument, not tracing's.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from kvledger.producer import plugin

_SCHEDSTAT = Path("/proc/self/schedstat").exists()  # the kernel keeps each thread's CPU time in ns
_counting_s = 0.0  # CPU seconds this process spent in `process_counters` waiting for its recorders


def recorder_cpu_s(pid: int | None) -> float:
    """CPU seconds a live recorder process has used, all its threads (0 if it is gone): from the
    scheduler's nanosecond counts where the kernel keeps them (a benchmark's few seconds are a few
    clock ticks of utime + stime)."""
    if pid is None:
        return 0.0
    if _SCHEDSTAT:  # one unit for every reading: a thread that ended meanwhile is skipped
        ns = 0
        for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                ns += int(task.read_text().split()[0])
        return ns / 1e9
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def process_counters() -> tuple[float, int, float, float]:
    """What tracing costs, once the recorders read what the probes wrote: (CPU seconds of this
    whole process, all its threads, less what these calls spent waiting for the recorders; steps
    its probes counted; seconds the probes spent on the engine thread; CPU seconds of the recorder
    processes)."""
    global _counting_s
    # The wait polls the rings every ms until a recorder's next look (up to 100 ms: ~1.5 ms of CPU
    # on a 2-core VM): the benchmark's own cost, not tracing's, and only the traced arm has it.
    started = time.process_time()
    plugin.flush_all(timeout=2.0)
    now = time.process_time()
    _counting_s += now - started
    steps, probes, recorders = 0, 0.0, 0.0
    for probe in plugin._probes:  # this process's probes, as the plugin attached them
        steps += probe.step + 1
        if probe.recorder is not None:
            probes += probe.recorder.probe_ns / 1e9
            recorders += recorder_cpu_s(probe.recorder.recorder_pid)
    return now - _counting_s, steps, probes, recorders


class TracingCosts(plugin.TracingExtension):
    """The producer's worker methods (pause, resume) and the benchmarks' counters."""

    def kvledger_process_counters(self) -> tuple[float, int, float, float]:
        return process_counters()
