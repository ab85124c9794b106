"""Cluster mode end to end: real vLLM engines -> Kafka sink -> the real broker -> `kvledger stream`
-> the violations topic, read back with `kvledger violations`.

One clean engine and one with the slot mapping shifted at one step trace to
the same events topic; the worker must report exactly the injected fault,
with its kind, engine, step and request, and nothing for the clean engine.
The worker's status page, rendered by headless Chromium (infra/install-chromium),
must show both engines and the violation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from tests.e2e.test_vllm_trace import PRESSURE

KVLEDGER = str(Path(sys.executable).with_name("kvledger"))
ENV = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def rendered_page(url: str) -> str:
    """The DOM of `url` after its scripts ran, as headless Chromium renders it."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("no chromium on PATH (run infra/install-chromium)", pytrace=False)
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def events_per_engine(bootstrap: str, topic: str) -> Counter:
    """How many records each engine (the message key) has on the topic, start to end."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{uuid.uuid4().hex[:6]}"})
    counts: Counter = Counter()
    try:
        for p in admin.list_topics(topic, timeout=10).topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            while (message := consumer.poll(10)) is not None:
                assert message.error() is None, message.error()
                counts[message.key().decode()] += 1
                if message.offset() >= high - 1:
                    break
    finally:
        consumer.close()
    return counts


@pytest.fixture
def worker(kafka_bootstrap, tmp_path):
    prefix = f"e2e{uuid.uuid4().hex[:8]}"
    port = free_port()
    log = tmp_path / "worker.log"
    args = [
        KVLEDGER, "stream", "--bootstrap", kafka_bootstrap, "--partitions", "2", "--store", "memory",
        "--state-dir", str(tmp_path / "state"), "--web-port", str(port), "--group", prefix,
        "--topic-prefix", prefix, "--settle-after", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 90
    while get(port, "/metrics") is None:  # serving means its topics exist
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    try:
        yield prefix, port, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_engines_through_kafka_to_the_violations_topic(kafka_bootstrap, worker, engine):
    prefix, port, proc, log = worker
    topic = f"{prefix}.events"
    spec = {**PRESSURE, "max_tokens": 12, "num_blocks": 64}
    kv_trace = {"enabled": True, "sink": f"kafka://{kafka_bootstrap}/{topic}", "snapshot_interval": 16}
    engine({**spec, "kv_trace": kv_trace})
    faulty = engine({**spec, "kv_trace": kv_trace}, fault="slot_shift", fault_step=6)
    [injected] = faulty.faults

    # Wait until the worker has applied every record of both engines and holds no step.
    produced = events_per_engine(kafka_bootstrap, topic)
    assert len(produced) == 2, produced
    deadline = time.monotonic() + 120
    while True:
        engines = json.loads(get(port, "/engines") or "[]")
        applied = {e["engine_id"]: e["events"] for e in engines if e["held_steps"] == 0}
        if applied == dict(produced):
            break
        assert proc.poll() is None and time.monotonic() < deadline, (applied, produced, log.read_text()[-3000:])
        time.sleep(0.5)

    out = subprocess.run(
        [KVLEDGER, "violations", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix, "--from-beginning",
         "--idle-timeout", "3", "--format", "json"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    *violations, summary = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 1, out.stderr
    assert [(v["kind"], v["step"], v["req_id"]) for v in violations] == [
        ("write_target_mismatch", int(injected["step"]), injected["req"])
    ]
    assert summary["violations"] == {"write_target_mismatch": 1}

    # The status page, as a browser shows it: both engines' ranks, the violation in red.
    page = rendered_page(f"http://127.0.0.1:{port}/")
    engines_table = re.search(r'<table id="engines">(.*?)</table>', page, re.S)[1]
    violations_table = re.search(r'<table id="violations">(.*?)</table>', page, re.S)[1]
    assert all(engine_id in engines_table for engine_id in produced), engines_table
    assert re.search(r'<td class="bad">write_target_mismatch</td>', violations_table), violations_table
    assert injected["req"] in violations_table
    assert "1 recent violation(s)" in page
