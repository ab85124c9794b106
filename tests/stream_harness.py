"""Stream workers and the topics around them, as the tests drive them against the real broker.

Workers run as subprocesses of the installed console script (`kvledger
stream`), and what they publish is read back with `kvledger violations` or a
plain consumer, as users do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.producer.sinks import KAFKA_DEFAULTS, KafkaSink
from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec, SingleObjectCodec

KVLEDGER = str(Path(sys.executable).with_name("kvledger"))
ENV = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
CODEC = SingleObjectCodec(LEDGER_EVENT)
BATCHES = BatchCodec(LEDGER_EVENT, LEDGER_EVENT_BATCH)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the broker -----------------------------------------------------------------------------------
def produce(bootstrap: str, topic: str, events: Iterable[dict], raw: Iterable[tuple[bytes | None, bytes]] = ()) -> None:
    # The engines' Kafka sink settings (lz4 batches, murmur2 keying): the worker must read what engines write.
    producer = Producer({**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap})
    for event in events:
        producer.produce(topic, key=event["engine_id"].encode(), value=CODEC.encode(event))
    for key, value in raw:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def produce_batched(bootstrap: str, topic: str, events: list[dict], drain: int = 16) -> None:
    """As engines' Kafka sinks append: several events per message, written `drain` at a time."""
    sink = KafkaSink(bootstrap, topic)
    for i in range(0, len(events), drain):
        sink.write(events[i : i + drain])
    sink.close(30)
    assert sink.lost == 0 and sink.delivered == len(events)


def read_all(bootstrap: str, topic: str) -> list:
    """Every message of `topic` as it stands (all partitions, start to end)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex[:6]}"})
    out = []
    try:
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            while True:
                message = consumer.poll(10)
                assert message is not None and message.error() is None
                out.append(message)
                if message.offset() >= high - 1:
                    break
    finally:
        consumer.close()
    return out


def events_per_engine(bootstrap: str, topic: str) -> Counter:
    """How many events each engine (the message key) has on the topic (a message may hold several)."""
    counts: Counter = Counter()
    for m in read_all(bootstrap, topic):
        counts[m.key().decode()] += len(BATCHES.decode(m.value()))
    return counts


# -- workers --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Worker:
    proc: subprocess.Popen
    port: int
    log: Path

    def get(self, path: str, timeout: float = 5) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as response:
            return response.read().decode()

    def get_ok(self, path: str) -> bool:
        try:
            self.get(path)
        except OSError:
            return False
        return True

    def metrics(self) -> dict[str, float]:
        try:
            text = self.get("/metrics")
        except OSError:
            return {}
        return {m[1]: float(m[2]) for m in re.finditer(r"^(kvledger_\S+) (\S+)$", text, re.M)}

    def total(self, name: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def start_worker(bootstrap: str, prefix: str, state_dir: Path, log: Path, *options: str) -> Worker:
    """`kvledger stream` in group and topic prefix `prefix`; returns once it serves (its topics exist)."""
    port = free_port()
    args = [
        KVLEDGER, "stream", "--bootstrap", bootstrap, "--state-dir", str(state_dir), "--web-port", str(port),
        "--group", prefix, "--topic-prefix", prefix,
        "--loglevel", os.environ.get("KVLEDGER_TEST_WORKER_LOGLEVEL", "warning"), *options,
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
    worker = Worker(proc, port, log)
    # Serving /metrics means its topics exist (with its partitions, not the broker's auto-create default).
    wait_for("the worker's web server", lambda: worker.get_ok("/metrics"), [worker])
    return worker


def wait_for(what: str, condition: Callable[[], bool], workers: list[Worker], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for w in workers:
            if w.proc.poll() is not None:
                pytest.fail(f"worker exited with {w.proc.returncode}:\n{w.log.read_text()[-3000:]}")
        time.sleep(0.2)
    logs = "\n".join(w.log.read_text()[-2000:] for w in workers)
    views = [w.get("/engines") for w in workers if w.proc.poll() is None and w.get_ok("/engines")]
    pytest.fail(f"timed out waiting for {what}\nengines: {views}\n{logs}")


def events_done(workers: list[Worker], expected: dict[str, int]) -> Callable[[], bool]:
    """Every engine's ledger (restored state included) counts all its valid events, no step held."""

    def done() -> bool:
        seen = {}
        for w in workers:
            try:
                for engine in json.loads(w.get("/engines")):
                    if engine["held_steps"] == 0:
                        seen[engine["engine_id"]] = engine["events"]
            except OSError:
                continue
        return seen == expected

    return done


# -- what the CLI reads back ----------------------------------------------------------------------
def kvledger(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([KVLEDGER, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def online_violations(bootstrap: str, prefix: str) -> tuple[list[dict], dict]:
    """`kvledger violations` over the topic from its start: the violations, and the summary line."""
    proc = kvledger(
        "violations", "--bootstrap", bootstrap, "--topic-prefix", prefix, "--from-beginning",
        "--idle-timeout", "3", "--format", "json",
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    *violations, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    assert summary["type"] == "summary"
    assert proc.returncode == (1 if violations else 0), proc.stderr
    return violations, summary


def as_multiset(violations: list[dict]) -> Counter:
    return Counter(json.dumps(v, sort_keys=True) for v in violations)
