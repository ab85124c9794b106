"""Recovery time of a restarted stream worker, for a ledger of 10^6 events.

Decode-heavy synthetic engines (64 running requests; one simulated stream of
20,000 events relabelled as many engines as it takes) fill the events topic
with N events, through the engines' Kafka sink (several events per message);
one `kvledger stream` worker processes them all, then is
killed with SIGKILL. Two restarts are timed, from process start to the
worker reporting (its /engines view) every event applied and no step held:

* warm: the same state directory (its local RocksDB tables survive);
* cold: an empty state directory (the tables come back from their changelog
  topic, as on a new machine).

    python bench/stream_recovery.py [--events 1000000] [--bootstrap HOST:PORT]

Without --bootstrap a private broker is started with infra/local-kafka.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import _root  # noqa: F401  (the checkout's root, for tests.synthetic)
from stream_throughput import DECODE_HEAVY, WorkerProcess, broker, produce_batched

from kvledger.stream_app.worker.topics import Topics, ensure_topics
from tests.synthetic.engine import SimConfig, simulate

PER_ENGINE = 20_000


def engines_view(worker: WorkerProcess) -> list[dict] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.port}/engines", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


def wait_caught_up(worker: WorkerProcess, total: int, timeout: float) -> float:
    """Seconds from now until the worker's state holds all `total` events, nothing held."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if worker.proc.poll() is not None:
            raise SystemExit(f"the worker exited:\n{worker.log.read_text()[-3000:]}")
        engines = engines_view(worker) or []
        if engines and sum(e["events"] for e in engines) >= total and all(e["held_steps"] == 0 for e in engines):
            return time.monotonic() - started
        time.sleep(0.1)
    raise SystemExit(f"not caught up within {timeout:.0f} s:\n{worker.log.read_text()[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--bootstrap", help="an existing broker (default: start one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, broker(args.bootstrap, Path(tmp)) as bootstrap:
        run(bootstrap, args.events, Path(tmp))


def run(bootstrap: str, events: int, work: Path) -> None:
    print(f"simulating {PER_ENGINE:,} events, relabelled to ~{events:,} ...", flush=True)
    sim = simulate(SimConfig(seed=3, steps=PER_ENGINE, snapshot_interval=500, health_interval=500, **DECODE_HEAVY))
    one = sim.events[:PER_ENGINE]
    engines = max(1, round(events / len(one)))
    # Round robin over the engines, as a fleet's events arrive.
    ledger = [{**e, "engine_id": f"engine-{i:03d}"} for e in one for i in range(engines)]
    total = len(ledger)
    prefix = f"recovery{uuid.uuid4().hex[:6]}"
    state = work / "state"
    ensure_topics(bootstrap, Topics(prefix), partitions=1)
    print(f"producing {total:,} events through the engines' Kafka sink ...", flush=True)
    messages = produce_batched(bootstrap, f"{prefix}.events", ledger)
    print(f"{messages:,} messages", flush=True)
    first = WorkerProcess(bootstrap, prefix, state)  # started once the whole ledger is on the topic
    seconds = wait_caught_up(first, total, timeout=3600)
    print(f"first pass, from the worker's start: {total:,} events in {seconds:.0f} s "
          f"({total / seconds:,.0f} events/s)", flush=True)  # fmt: skip
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)

    warm = WorkerProcess(bootstrap, prefix, state)
    warm_s = wait_caught_up(warm, total, timeout=1800)
    warm.proc.send_signal(signal.SIGKILL)
    warm.proc.wait(10)
    print(f"restart, same state directory: caught up {warm_s:.1f} s after start", flush=True)

    cold = WorkerProcess(bootstrap, prefix, work / "state-empty")
    cold_s = wait_caught_up(cold, total, timeout=1800)
    cold.stop()
    print(f"restart, empty state directory (tables from their changelog): caught up {cold_s:.1f} s after start")


if __name__ == "__main__":
    main()
