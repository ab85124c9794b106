"""One stream worker on a real Kafka broker: step-events per second, and detection latency.

Throughput: a decode-heavy ledger (64 running requests, one token each per
step) is loaded into the events topic first, twice, side by side: as the
engines' Kafka sink writes it (several events per message, `LedgerEventBatch`,
fed to the sink 10 events at a time as a drain thread at 200 steps/s does)
and with one event per message; then one `kvledger stream` worker per copy
starts and the time from its first applied event to its last is measured
(from its /metrics). Latency: with the worker caught up, a live engine (a
real Delivery and Kafka sink) captures steps at a steady rate with a
fault every few dozen steps; each violation's latency is the time from
capturing the step that reveals it to reading the violation from the
violations topic.

    python bench/stream_throughput.py [--steps N] [--bootstrap HOST:PORT]

Without --bootstrap a private broker is started with infra/local-kafka.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import _root  # noqa: F401  (the checkout's root, for tests.synthetic)
from confluent_kafka import Consumer, Producer
from replay_throughput import STREAMS

from kvledger.producer.delivery import Delivery
from kvledger.producer.records import RankIdentity
from kvledger.producer.sinks import KAFKA_DEFAULTS, KafkaSink
from kvledger.schemas import LEDGER_EVENT, VIOLATION, SingleObjectCodec
from kvledger.stream_app.worker.topics import Topics, ensure_topics
from tests.synthetic.engine import FaultSpec, SimConfig, simulate

ROOT = Path(__file__).resolve().parents[1]
KVLEDGER = str(Path(sys.executable).with_name("kvledger"))
DECODE_HEAVY = STREAMS["decode-heavy"]  # the same stream the replay benchmark checks
TARGET_EVENTS_PER_S = 20_000
TARGET_P99_S = 1.0


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class LocalBroker:
    def __init__(self, state: Path):
        port, cport = free_ports(2)
        self.env = {
            **os.environ,
            "KVLEDGER_KAFKA_DIR": str(state),
            "KVLEDGER_KAFKA_PORT": str(port),
            "KVLEDGER_KAFKA_CONTROLLER_PORT": str(cport),
        }

    def run(self, cmd: str) -> str:
        proc = subprocess.run([str(ROOT / "infra" / "local-kafka"), cmd], env=self.env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"infra/local-kafka {cmd} failed: {proc.stderr.strip()}")
        return proc.stdout.strip().removeprefix("bootstrap=")


class WorkerProcess:
    def __init__(self, bootstrap: str, prefix: str, state: Path):
        (self.port,) = free_ports(1)
        args = [KVLEDGER, "stream", "--bootstrap", bootstrap, "--partitions", "1", "--topic-prefix", prefix,
                "--group", prefix, "--state-dir", str(state), "--web-port", str(self.port)]  # fmt: skip
        self.log = state.with_suffix(".log")
        state.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(args, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def events_applied(self) -> float | None:
        if self.proc.poll() is not None:
            raise SystemExit(f"the worker exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        return sum(float(v) for v in re.findall(r"^kvledger_events_total\{[^}]*\} (\S+)$", text, re.M))

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.events_applied() is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("the worker did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextlib.contextmanager
def broker(bootstrap: str | None, workdir: Path) -> Iterator[str]:
    """`bootstrap` as given, or a private broker (infra/local-kafka) for the duration."""
    if bootstrap is not None:
        yield bootstrap
        return
    local = LocalBroker(workdir / "kafka")
    try:
        yield local.run("up")
    finally:
        local.run("down")


DRAIN_WRITE = 10  # events per sink write: a drain thread's 50 ms at 200 steps/s


def produce_batched(bootstrap: str, topic: str, events: list[dict]) -> int:
    """Through the engines' Kafka sink; returns the number of messages it made."""
    sink = KafkaSink(bootstrap, topic)
    for i in range(0, len(events), DRAIN_WRITE):
        sink.write(events[i : i + DRAIN_WRITE])
    sink.close(60)
    assert sink.lost == 0, sink.lost
    return sink.messages


def produce_all(bootstrap: str, topic: str, events: list[dict]) -> None:
    codec = SingleObjectCodec(LEDGER_EVENT)
    producer = Producer({**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap})
    for event in events:
        while True:
            try:
                producer.produce(topic, key=event["engine_id"].encode(), value=codec.encode(event))
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(60) == 0


def throughput(bootstrap: str, events: list[dict], batched: bool, workdir: Path) -> tuple[float, int]:
    """Step-events per second of one worker over `events`, and the number of messages they took."""
    step_events = sum(e["body"][0] == "kvledger.Step" for e in events)
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    # The whole ledger is on the topic before the worker starts: the worker, not the producer, sets the pace.
    ensure_topics(bootstrap, Topics(prefix), partitions=1)
    if batched:
        messages = produce_batched(bootstrap, f"{prefix}.events", events)
    else:
        produce_all(bootstrap, f"{prefix}.events", events)
        messages = len(events)
    worker = WorkerProcess(bootstrap, prefix, workdir / f"state-{prefix}")
    try:
        worker.wait_ready()
        total = len(events)
        first_at = first_count = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            applied = worker.events_applied() or 0
            now = time.monotonic()
            if applied and first_at is None:
                first_at, first_count = now, applied
            if applied >= total:
                break
            time.sleep(0.05)
        else:
            raise SystemExit("the worker did not finish in 10 minutes")
        rate = (applied - first_count) / (now - first_at) * step_events / total
        return rate, messages
    finally:
        worker.stop()


def latency(bootstrap: str, steps: int, rate: float, workdir: Path) -> list[float]:
    faults = tuple(FaultSpec("slot_shift", s) for s in range(50, steps, 25))
    sim = simulate(
        SimConfig(seed=2, steps=steps, faults=faults, snapshot_interval=0, health_interval=0, **DECODE_HEAVY)
    )
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(bootstrap, prefix, workdir / "state-latency")
    produced_at: dict[int, float] = {}
    seen_at: dict[int, float] = {}
    codec = SingleObjectCodec(VIOLATION)
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"{prefix}-reader", "auto.offset.reset": "earliest"}
    )
    done = threading.Event()

    def read_violations() -> None:
        consumer.subscribe([f"{prefix}.violations"])
        while not done.is_set():
            message = consumer.poll(0.05)
            if message is not None and message.error() is None:
                step = codec.decode(message.value())["step"]
                seen_at.setdefault(step, time.monotonic())

    try:
        worker.wait_ready()
        reader = threading.Thread(target=read_violations, daemon=True)
        reader.start()
        time.sleep(3)  # the reader joins its group
        # A live engine rank: its recorder's drain thread feeds the Kafka sink, as in vLLM.
        recorder = Delivery(RankIdentity(sim.events[0]["engine_id"]), KafkaSink(bootstrap, f"{prefix}.events"))
        start = time.monotonic()
        for i, event in enumerate(sim.events):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))  # a live engine's pace
            recorder.capture(event["body"])
            if event["body"][0] == "kvledger.Step":
                produced_at.setdefault(event["body"][1]["step"], time.monotonic())
        recorder.close(step=steps, timeout=30)
        wanted = {e.step for e in sim.expected}
        deadline = time.monotonic() + 30
        while not wanted <= seen_at.keys() and time.monotonic() < deadline:
            time.sleep(0.1)
        return [seen_at[s] - produced_at[s] for s in sorted(wanted & seen_at.keys())]
    finally:
        done.set()
        worker.stop()
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="steps of the throughput ledger")
    parser.add_argument("--latency-steps", type=int, default=1_500)
    parser.add_argument("--latency-rate", type=float, default=200.0, help="steps per second of the live engine")
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, broker(args.bootstrap, Path(tmp)) as bootstrap:
        workdir = Path(tmp)
        sim = simulate(SimConfig(seed=1, steps=args.steps, snapshot_interval=500, health_interval=500, **DECODE_HEAVY))
        for batched in (True, False, True, False):  # alternated: the machine's noise falls on both
            rate, messages = throughput(bootstrap, sim.events, batched, workdir)
            framing = "sink batches" if batched else "one event per message"
            print(f"throughput (decode-heavy, 64 req/step, one worker, {framing}, {messages:,} messages): "
                  f"{rate:,.0f} step-events/s over {args.steps:,} steps "
                  f"(target >= {TARGET_EVENTS_PER_S:,})")  # fmt: skip
        lat = latency(bootstrap, args.latency_steps, args.latency_rate, workdir)
        if not lat:
            raise SystemExit("no violation came back: latency not measured")
        p50 = statistics.median(lat)
        p99 = statistics.quantiles(lat, n=100, method="inclusive")[98] if len(lat) >= 2 else lat[0]
        print(f"detection latency, produce -> violation on topic ({len(lat)} violations at "
              f"{args.latency_rate:.0f} steps/s): p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
              f"max {max(lat) * 1000:.0f} ms (target p99 <= {TARGET_P99_S * 1000:.0f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
