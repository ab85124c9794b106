"""The stream worker (`kvledger stream`) against the real broker, run as users run it.

Synthetic engines with injected faults are produced to the events topic with
the same keying as the Kafka sink; workers run as subprocesses of the
installed console script; what they publish is read back with `kvledger
violations` and compared with `kvledger check` on a file ledger of the same
events.
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
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.producer.sinks import KAFKA_DEFAULTS, FileSink
from kvledger.producer.synthetic import FaultSpec, GroupSpec, SimConfig, simulate
from kvledger.schemas import LEDGER_EVENT, SingleObjectCodec

pytestmark = pytest.mark.integration

KVLEDGER = str(Path(sys.executable).with_name("kvledger"))
ENV = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
CODEC = SingleObjectCodec(LEDGER_EVENT)
SETTLE_AFTER = 1.0


def engine_config(engine_id: str, seed: int, steps: int, faults: tuple[FaultSpec, ...] = ()) -> SimConfig:
    return SimConfig(
        seed=seed,
        engine_id=engine_id,
        steps=steps,
        tp_size=2,
        groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 48)),
        num_blocks=120,
        max_num_seqs=10,
        max_batched_tokens=128,
        snapshot_interval=40,
        faults=faults,
    )


def faulty_engines(steps: int, names: list[str]) -> dict[str, list[dict]]:
    """Events per engine: every engine has faults, one loses a rank at its very last step (held, then settled)."""
    out = {}
    for i, engine_id in enumerate(names):
        faults = (
            FaultSpec("slot_shift", steps // 4),
            FaultSpec("rank_divergence", steps // 2, tp_rank=1),
            FaultSpec("duplicate_event", 3 * steps // 4, tp_rank=i % 2),
        )
        if i == 0:
            faults += (FaultSpec("rank_missing", steps - 1, tp_rank=1),)
        out[engine_id] = simulate(engine_config(engine_id, 20 + i, steps, faults)).events
    return out


def interleave(per_engine: dict[str, list[dict]]) -> list[dict]:
    streams = list(per_engine.values())
    return [e for i in range(max(map(len, streams))) for s in streams if i < len(s) for e in [s[i]]]


# -- the broker -----------------------------------------------------------------------------------
def produce(bootstrap: str, topic: str, events: list[dict], raw: list[tuple[bytes | None, bytes]] = ()) -> None:
    # The engines' Kafka sink settings (lz4 batches, murmur2 keying): the worker must read what engines write.
    producer = Producer({**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap})
    for event in events:
        producer.produce(topic, key=event["engine_id"].encode(), value=CODEC.encode(event))
    for key, value in raw:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- workers --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Worker:
    proc: subprocess.Popen
    port: int
    log: Path

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
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


@pytest.fixture
def cluster(kafka_bootstrap, tmp_path):
    """Start workers of one group on fresh topics: `start(name)`; all stopped at the end."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    workers: list[Worker] = []

    def start(name: str, partitions: int = 3) -> Worker:
        port = free_port()
        log = tmp_path / f"{name}.log"
        args = [
            KVLEDGER,
            "stream",
            "--bootstrap",
            kafka_bootstrap,
            "--partitions",
            str(partitions),
            "--state-dir",
            str(tmp_path / f"state-{name}"),
            "--web-port",
            str(port),
            "--group",
            prefix,
            "--topic-prefix",
            prefix,
            "--settle-after",
            str(SETTLE_AFTER),
            "--session-timeout",
            "6",
            "--loglevel",
            os.environ.get("KVLEDGER_TEST_WORKER_LOGLEVEL", "warning"),
        ]
        proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
        worker = Worker(proc, port, log)
        workers.append(worker)
        # Serving /metrics means its topics exist (with `partitions`, not the broker's auto-create default).
        wait_for("the worker's web server", lambda: worker.get_ok("/metrics"), [worker])
        return worker

    start.prefix = prefix
    start.bootstrap = kafka_bootstrap
    try:
        yield start
    finally:
        for worker in workers:
            worker.stop()


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
    proc = kvledger(
        "violations", "--bootstrap", bootstrap, "--topic-prefix", prefix, "--from-beginning",
        "--idle-timeout", "3", "--format", "json",
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    *violations, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    assert summary["type"] == "summary"
    assert proc.returncode == (1 if violations else 0), proc.stderr
    return violations, summary


def offline_violations(events: list[dict], root: Path) -> list[dict]:
    with FileSink(root) as sink:
        sink.write(events)
    proc = kvledger("check", str(root), "--format", "json")
    *violations, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    assert summary["type"] == "summary"
    return violations


def as_multiset(violations: list[dict]) -> Counter:
    return Counter(json.dumps(v, sort_keys=True) for v in violations)


def assert_same_as_offline(bootstrap: str, prefix: str, events: list[dict], tmp_path: Path) -> list[dict]:
    online, summary = online_violations(bootstrap, prefix)
    offline = offline_violations(events, tmp_path / "ledger")
    assert offline, "the faults must produce violations"
    assert as_multiset(online) == as_multiset(offline)
    assert summary["violations"] == dict(sorted(Counter(v["kind"] for v in offline).items()))
    return online


# -- tests ----------------------------------------------------------------------------------------
def test_online_equals_offline_and_bad_records_go_to_dead_letters(cluster, tmp_path):
    per_engine = faulty_engines(160, ["eng-a", "eng-b", "eng-c"])
    events = interleave(per_engine)
    unknown = b"\xc3\x01" + b"\x00" * 8 + b"\x02"
    bad = [
        (b"eng-a", b"not avro at all"),  # undecodable
        (b"eng-b", unknown),  # unknown writer schema
        (b"someone-else", CODEC.encode(per_engine["eng-c"][5])),  # keyed by another engine
        (None, b""),
    ]
    worker = cluster("w1")
    produce(cluster.bootstrap, f"{cluster.prefix}.events", events[:200], bad[:2])
    produce(cluster.bootstrap, f"{cluster.prefix}.events", events[200:], bad[2:])
    expected = {e: len(evs) for e, evs in per_engine.items()}
    wait_for("all events", events_done([worker], expected), [worker])

    online = assert_same_as_offline(cluster.bootstrap, cluster.prefix, events, tmp_path)
    assert {"write_target_mismatch", "rank_divergence", "duplicate_event", "rank_missing"} <= {
        v["kind"] for v in online
    }

    dead = read_all(cluster.bootstrap, f"{cluster.prefix}.deadletter")
    reasons = Counter(dict(m.headers())["kvledger.reason"].decode() for m in dead)
    assert reasons == {"undecodable": 2, "unknown_schema": 1, "wrong_key": 1}
    assert Counter((m.key(), m.value() or b"") for m in dead) == Counter(bad)  # the original bytes, kept
    assert all(dict(m.headers())["kvledger.source"].startswith(f"{cluster.prefix}.events/".encode()) for m in dead)

    metrics = worker.metrics()
    assert worker.total("kvledger_events_total") == len(events)
    assert worker.total("kvledger_violations_total") == len(online)
    assert worker.total("kvledger_deadletter_total") == 4
    assert worker.total("kvledger_unchecked_total") >= 1  # the missing rank's step
    for name in ("kvledger_consumer_lag{", "kvledger_producer_dropped_events{"):
        assert any(k.startswith(name) for k in metrics), name
    assert "kvledger worker" in worker.get("/")
    assert len(json.loads(worker.get("/violations"))) == len(online)
    table = json.loads(worker.get("/block-table?engine=eng-a&req=req-1"))
    assert [r["rank"] for r in table["ranks"]] == ["dp0-tp0-pp0", "dp0-tp1-pp0"]


def test_sigkill_mid_stream_then_restart_loses_and_duplicates_nothing(cluster, tmp_path):
    per_engine = faulty_engines(400, ["crash-a", "crash-b"])
    events = interleave(per_engine)
    topic = f"{cluster.prefix}.events"
    first = cluster("first")
    produce(cluster.bootstrap, topic, events[: len(events) // 3])
    wait_for("a first batch", lambda: first.total("kvledger_events_total") > 0, [first])
    produce(cluster.bootstrap, topic, events[len(events) // 3 :])
    wait_for("more events", lambda: first.total("kvledger_events_total") > len(events) // 3, [first])
    first.kill()

    second = cluster("first")  # same state dir and group: a restarted worker
    expected = {e: len(evs) for e, evs in per_engine.items()}
    wait_for("all events after the restart", events_done([second], expected), [second])
    online = assert_same_as_offline(cluster.bootstrap, cluster.prefix, events, tmp_path)

    # Re-sent records carry the id of the violation they repeat, byte for byte.
    raw = read_all(cluster.bootstrap, f"{cluster.prefix}.violations")
    by_id: dict[bytes, set[bytes]] = {}
    for m in raw:
        by_id.setdefault(m.key(), set()).add(m.value())
    assert len(by_id) == len(online)
    assert all(len(values) == 1 for values in by_id.values())


def test_two_workers_share_partitions_and_one_takes_over_when_the_other_dies(cluster, tmp_path):
    names = [f"scale-{i}" for i in range(6)]
    per_engine = faulty_engines(240, names)
    # Cut between steps: a rank paused mid-step for longer than the watermark is (rightly) missing.
    cut = {
        e: next(i for i, ev in enumerate(evs) if ev["body"][1].get("step", -1) >= 120) for e, evs in per_engine.items()
    }
    first_half = interleave({e: evs[: cut[e]] for e, evs in per_engine.items()})
    second_half = interleave({e: evs[cut[e] :] for e, evs in per_engine.items()})
    topic = f"{cluster.prefix}.events"
    a = cluster("a", partitions=4)
    b = cluster("b", partitions=4)

    def shared() -> bool:
        held = [json.loads(w.get("/partitions")) for w in (a, b)]
        return all(held) and sorted(held[0] + held[1]) == [0, 1, 2, 3]

    wait_for("the two workers to share the partitions", shared, [a, b])
    produce(cluster.bootstrap, topic, first_half)
    wait_for("the first half", events_done([a, b], cut), [a, b])
    assert a.total("kvledger_events_total") > 0 and b.total("kvledger_events_total") > 0
    b.kill()
    produce(cluster.bootstrap, topic, second_half)
    # The group notices the dead worker after its session timeout, then the survivor takes every partition.
    wait_for("the survivor to take every partition", lambda: json.loads(a.get("/partitions")) == [0, 1, 2, 3], [a])
    expected = {e: len(evs) for e, evs in per_engine.items()}
    wait_for("the survivor to finish every engine", events_done([a], expected), [a], timeout=120)
    assert_same_as_offline(cluster.bootstrap, cluster.prefix, interleave(per_engine), tmp_path)


def test_unreachable_broker_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for args in (["stream"], ["violations", "--idle-timeout", "1"]):
        proc = kvledger(*args, "--bootstrap", f"127.0.0.1:{port}")
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"kvledger: error: no Kafka broker answers at 127.0.0.1:{port} "
            "(Failed to get metadata: Local: Broker transport failure)"
        ]
