"""The Java consumer of the violations topic (`examples/java-violations`), run as its users run it.

A real stream worker publishes the violations of faulty synthetic engines; the Java program,
built with Maven, reads them with nothing of the project but `schemas/avro/` and must print what
`kvledger violations --format json` prints: the same violations, each once, and the same summary.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.stream_harness import (
    ENV,
    as_multiset,
    events_done,
    free_port,
    online_violations,
    produce,
    produce_batched,
    read_all,
    start_worker,
    wait_for,
)
from tests.synthetic.engine import FaultSpec, SimConfig, simulate

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "java-violations"
# Built outside the source tree, and kept: a rebuild only when the example's sources change.
BUILD = Path(os.environ.get("KVLEDGER_CACHE") or Path.home() / ".cache" / "kvledger") / "java-violations"
# A cold build fetches Avro, the Kafka client and the Maven plugins (~30 MB) into ~/.m2.
BUILD_TIMEOUT = 900
IDLE_TIMEOUT = "3"
UNKNOWN_FINGERPRINT = b"\xc3\x01" + b"\x00" * 8 + b"\x02"


def _sources_digest() -> str:
    files = [EXAMPLE / "pom.xml", *sorted((EXAMPLE / "src").rglob("*"))]
    digest = hashlib.sha256()
    for f in files:
        if f.is_file():
            digest.update(f.relative_to(EXAMPLE).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


@pytest.fixture(scope="module")
def java_consumer() -> Path:
    """The example's runnable jar (`mvn -q -B package`); fails, never skips, without Java or Maven."""
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not found: the Java consumer example needs Java 17 and Maven", pytrace=False
        )
    BUILD.mkdir(parents=True, exist_ok=True)
    target, stamp = BUILD / "target", BUILD / "sources.sha256"
    jar = target / "kvledger-violations.jar"
    with (BUILD / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel runs share the build
        digest = _sources_digest()
        if jar.is_file() and stamp.is_file() and stamp.read_text() == digest:
            return jar
        stamp.unlink(missing_ok=True)
        try:
            proc = subprocess.run(
                ["mvn", "-q", "-B", "package", f"-Dkvledger.build.directory={target}"],
                cwd=EXAMPLE, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"mvn package took longer than {BUILD_TIMEOUT}s", pytrace=False)
        if proc.returncode != 0 or not jar.is_file():
            pytest.fail(f"mvn package failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        stamp.write_text(digest)
    return jar


def java(jar: Path, *args: str) -> subprocess.Popen:
    # From the example's folder, as its README says: the program finds schemas/avro above it.
    command = ["java", "-jar", str(jar), *args]
    return subprocess.Popen(command, cwd=EXAMPLE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the Java consumer ran past {timeout}s:\n{err[-3000:]}")
    assert "\tat " not in err and "Exception in thread" not in err, err  # expected errors: one line, no stack
    return proc.returncode, out, err


def faulty_engine(engine_id: str, seed: int, steps: int = 80) -> list[dict]:
    faults = (
        FaultSpec("slot_shift", steps // 4),
        FaultSpec("rank_divergence", steps // 2, tp_rank=1),
        FaultSpec("duplicate_event", 3 * steps // 4),
        FaultSpec("rank_missing", steps - 1, tp_rank=1),  # held, then settled by the worker
    )
    config = SimConfig(
        seed=seed, engine_id=engine_id, steps=steps, tp_size=2, num_blocks=96, max_num_seqs=8,
        max_batched_tokens=128, snapshot_interval=32, faults=faults,
    )  # fmt: skip
    return simulate(config).events


def publish(bootstrap: str, work: Path, *worker_options: str) -> str:
    """A topic prefix whose violations topic a real worker filled, then stopped (so the topic stays as it is)."""
    prefix = f"j{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.violations"
    per_engine = {e: faulty_engine(e, seed) for seed, e in enumerate(["java-a", "java-b"], start=40)}
    worker = start_worker(
        bootstrap, prefix, work / "state", work / "worker.log",
        "--partitions", "2", "--settle-after", "1", "--session-timeout", "6", *worker_options,
    )  # fmt: skip
    try:
        for events in per_engine.values():
            produce_batched(bootstrap, f"{prefix}.events", events)
        expected = {e: len(events) for e, events in per_engine.items()}
        wait_for("all events", events_done([worker], expected), [worker])

        def all_on_topic() -> bool:  # stopped only then: nothing it published is left in flight
            return len(read_all(bootstrap, topic)) == worker.total("kvledger_violations_total")

        wait_for("its violations on the topic", all_on_topic, [worker])
    finally:
        worker.stop()
    return prefix


@pytest.fixture(scope="module")
def published(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Violations a worker published, plus a re-send of one (as a restarted worker does) and two
    undecodable records."""
    prefix = publish(kafka_bootstrap, tmp_path_factory.mktemp("java-consumer"))
    topic = f"{prefix}.violations"
    first = read_all(kafka_bootstrap, topic)[0]
    resent = (first.key(), first.value())
    produce(kafka_bootstrap, topic, [], [resent, (b"id-unknown", UNKNOWN_FINGERPRINT), (b"id-bad", b"not avro")])
    return prefix


def test_java_consumer_prints_what_kvledger_violations_prints(
    kafka_bootstrap: str, published: str, java_consumer: Path
) -> None:
    args = ("--bootstrap", kafka_bootstrap, "--topic-prefix", published, "--idle-timeout", IDLE_TIMEOUT)
    proc = java(java_consumer, *args)  # reads while the project's reader reads
    expected, expected_summary = online_violations(kafka_bootstrap, published)
    rc, out, err = finish(proc)
    *violations, summary = [json.loads(line) for line in out.splitlines()]

    assert rc == 1, err
    assert violations, "the faults must produce violations"
    assert as_multiset(violations) == as_multiset(expected)
    assert summary == expected_summary
    assert summary["violations"] == dict(sorted(Counter(v["kind"] for v in violations).items()))
    assert {"write_target_mismatch", "rank_divergence", "duplicate_event", "rank_missing"} <= set(summary["violations"])
    assert (summary["duplicates_dropped"], summary["undecodable"], summary["engines"]) == (1, 2, 2)
    assert summary["records"] == len(violations) + 3
    skipped = err.splitlines()
    assert len(skipped) == 2, err
    assert any("unknown writer schema fingerprint 0000000000000000" in line for line in skipped), err


def test_java_consumer_errors_are_one_line_and_exit_2(kafka_bootstrap: str, java_consumer: Path) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    cases = {
        f"no Kafka broker answers at {nobody}": ("--bootstrap", nobody),
        f"topic nosuch.violations does not exist (is a worker running against {kafka_bootstrap}?)": (
            "--bootstrap", kafka_bootstrap, "--topic-prefix", "nosuch",
        ),
        "no such schema file: /nonexistent/violation.avsc": (
            "--bootstrap", kafka_bootstrap, "--schemas", "/nonexistent",
        ),
        "unknown option --frob (see --help)": ("--bootstrap", kafka_bootstrap, "--frob", "1"),
    }  # fmt: skip
    running = {message: java(java_consumer, *args) for message, args in cases.items()}  # at once: each is a JVM
    for message, proc in running.items():
        rc, out, err = finish(proc)
        assert (rc, out, err.splitlines()) == (2, "", [f"kvledger-violations: error: {message}"])


def test_java_consumer_reads_the_registry_framing(
    kafka_bootstrap: str, schema_registry: str, java_consumer: Path, tmp_path: Path
) -> None:
    """A worker with --schema-registry publishes violations under registry ids; the Java program
    fetches the writer schema by id and prints what `kvledger violations --schema-registry` prints."""
    prefix = publish(kafka_bootstrap, tmp_path, "--schema-registry", schema_registry)
    messages = read_all(kafka_bootstrap, f"{prefix}.violations")
    assert messages and all(m.value()[:1] == b"\x00" for m in messages), "the Confluent framing: 00 + id"
    args = ("--bootstrap", kafka_bootstrap, "--topic-prefix", prefix, "--idle-timeout", IDLE_TIMEOUT)
    proc = java(java_consumer, *args, "--registry", schema_registry)
    expected, expected_summary = online_violations(kafka_bootstrap, prefix, "--schema-registry", schema_registry)
    rc, out, err = finish(proc)
    *violations, summary = [json.loads(line) for line in out.splitlines()]
    assert rc == 1, err
    assert len(violations) == len(messages) and as_multiset(violations) == as_multiset(expected)
    assert summary == expected_summary and summary["undecodable"] == 0
