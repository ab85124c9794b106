"""The stream worker (`kvledger stream`) against the real broker, run as users run it.

Synthetic engines with injected faults are produced to the events topic with
the same keying as the Kafka sink; workers run as subprocesses of the
installed console script; what they publish is read back with `kvledger
violations` and compared with `kvledger check` on a file ledger of the same
events.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path

import pytest

from kvledger.producer.sinks import FileSink
from tests.stream_harness import (
    CODEC,
    Worker,
    as_multiset,
    events_done,
    free_port,
    kvledger,
    online_violations,
    produce,
    produce_batched,
    read_all,
    start_worker,
    wait_for,
)
from tests.synthetic.engine import FaultSpec, GroupSpec, SimConfig, simulate

pytestmark = pytest.mark.integration

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


@pytest.fixture
def cluster(kafka_bootstrap, tmp_path):
    """Start workers of one group on fresh topics: `start(name)`; all stopped at the end."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    workers: list[Worker] = []

    def start(name: str, partitions: int = 3, *options: str) -> Worker:
        worker = start_worker(
            kafka_bootstrap, prefix, tmp_path / f"state-{name}", tmp_path / f"{name}.log",
            "--partitions", str(partitions), "--settle-after", str(SETTLE_AFTER), "--session-timeout", "6",
            *options,
        )  # fmt: skip
        workers.append(worker)
        return worker

    start.prefix = prefix
    start.bootstrap = kafka_bootstrap
    try:
        yield start
    finally:
        for worker in workers:
            worker.stop()


def offline_violations(events: list[dict], root: Path) -> list[dict]:
    with FileSink(root) as sink:
        sink.write(events)
    proc = kvledger("check", str(root), "--format", "json")
    *violations, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    assert summary["type"] == "summary"
    return violations


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
    produce(cluster.bootstrap, f"{cluster.prefix}.events", events[:200], bad[:2])  # one event per message
    produce_batched(cluster.bootstrap, f"{cluster.prefix}.events", events[200:])  # as the Kafka sink writes
    produce(cluster.bootstrap, f"{cluster.prefix}.events", [], bad[2:])
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
    assert_time_travel_matches_offline(worker, tmp_path / "ledger")


def offline_query(ledger: Path, engine_id: str, req_id: str, step: int | None = None) -> list[dict]:
    args = ["query", str(ledger), "--engine", engine_id, "--req", req_id, "--format", "json"]
    proc = kvledger(*args, *(["--step", str(step)] if step is not None else []))
    return [json.loads(line) for line in proc.stdout.splitlines()]


def assert_time_travel_matches_offline(worker: Worker, ledger: Path) -> None:
    """A request's block table at past steps, from the worker, equals `kvledger query` over the file ledger."""
    for req_id in ("req-1", "req-6"):
        live = offline_query(ledger, "eng-a", req_id)[0]
        first, last = live["first_seen"], live["last_seen"]
        assert first is not None and last > first, live
        for step in (first, (first + last) // 2, last):
            offline = offline_query(ledger, "eng-a", req_id, step)
            online = json.loads(worker.get(f"/block-table?engine=eng-a&req={req_id}&step={step}", timeout=60))
            assert [(r["rank"], r["step"], r["rows"]) for r in online["ranks"]] == [
                (f"dp{v['dp_rank']}-tp{v['tp_rank']}-pp{v['pp_rank']}", v["step"], v["rows"]) for v in offline
            ], (req_id, step, online["start_offset"])
            assert any(r["rows"] for r in online["ranks"]), (req_id, step)


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
    port = free_port()  # nothing listens there
    for args in (["stream"], ["violations", "--idle-timeout", "1"]):
        proc = kvledger(*args, "--bootstrap", f"127.0.0.1:{port}")
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"kvledger: error: no Kafka broker answers at 127.0.0.1:{port} "
            "(Failed to get metadata: Local: Broker transport failure)"
        ]


def test_a_pickle_or_garbage_in_the_changelog_is_refused_and_the_engine_rebuilt(cluster, tmp_path):
    """Anyone who can write the changelog topic can put anything there: the worker reads
    checkpoints as Avro data, sets aside what is not one (dead letter, with its reason) and
    rebuilds the engine from the events topic; nothing in a record is ever run."""
    import os
    import pickle

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    per_engine = faulty_engines(120, ["ck-pickle", "ck-garbage"])
    events = interleave(per_engine)
    from confluent_kafka.admin import AdminClient

    changelog = f"{cluster.prefix}-checkpoints-changelog"
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    worker = cluster("w")  # creates the topics, the changelog included (with the events' partitions)
    wait_for("the changelog topic", lambda: changelog in admin.list_topics(timeout=5).topics, [worker])
    assert len(admin.list_topics(timeout=5).topics[changelog].partitions) == 3
    worker.stop()
    planted = [(b"ck-pickle", pickle.dumps({"format": 2, "ledger": Exploit()})), (b"ck-garbage", os.urandom(300))]
    produce(cluster.bootstrap, changelog, [], planted)  # keyed like the events: the engines' partitions
    produce(cluster.bootstrap, f"{cluster.prefix}.events", events)

    worker = cluster("w")  # restores its tables from the changelog, planted records included
    expected = {e: len(evs) for e, evs in per_engine.items()}
    wait_for("all events", events_done([worker], expected), [worker])
    assert_same_as_offline(cluster.bootstrap, cluster.prefix, events, tmp_path)
    assert not marker.exists()

    dead = read_all(cluster.bootstrap, f"{cluster.prefix}.deadletter")
    assert sorted((m.key(), dict(m.headers())["kvledger.reason"]) for m in dead) == [
        (b"ck-garbage", b"checkpoint_refused"),
        (b"ck-pickle", b"checkpoint_refused"),
    ]
    assert Counter((m.key(), m.value()) for m in dead) == Counter(planted)  # kept as data
    assert all(dict(m.headers())["kvledger.source"].startswith(changelog.encode()) for m in dead)
    assert worker.total("kvledger_deadletter_total") == 2
    assert worker.metrics().get('kvledger_unchecked_total{reason="checkpoint_refused"}') == 2


def test_engines_whose_ranks_closed_or_went_silent_are_retired_and_may_come_back(cluster, tmp_path):
    """A month-long worker holds only live engines: one whose ranks all said they shut down is
    retired at once, a silent one after --retire-after; both say so in /engines and a metric, their
    checkpoints are deleted (tombstones), and an engine id that comes back starts afresh."""
    import dataclasses

    closing = simulate(dataclasses.replace(engine_config("retire-closed", 31, 80), close_at_end=True)).events
    silent = simulate(engine_config("retire-silent", 32, 80)).events
    worker = cluster("w", 3, "--retire-after", "4")
    produce(cluster.bootstrap, f"{cluster.prefix}.events", interleave({"a": closing, "b": silent}))

    def retired() -> dict[str, str]:
        return {e["engine_id"]: e["reason"] for e in json.loads(worker.get("/engines")) if e["state"] == "retired"}

    wait_for("the closed engine to retire", lambda: "retire-closed" in retired(), [worker])
    assert "retire-silent" not in retired()  # it still has time: silent for less than 4 s
    wait_for("the silent engine to retire", lambda: retired().get("retire-silent") == "silent", [worker])
    assert retired() == {"retire-closed": "closed", "retire-silent": "silent"}
    views = {e["engine_id"]: e for e in json.loads(worker.get("/engines"))}
    assert views["retire-closed"]["events"] == len(closing) and views["retire-silent"]["events"] == len(silent)
    assert worker.total("kvledger_engines_retired_total") == 2 and worker.total("kvledger_engines") == 0

    latest = {}
    for m in read_all(cluster.bootstrap, f"{cluster.prefix}-checkpoints-changelog"):
        latest[m.key()] = m.value()
    # The silent engine was checkpointed while it waited: a tombstone now. The closed one retired at
    # once (maybe before its first checkpoint): nothing, or a tombstone.
    assert b"retire-silent" in latest and latest[b"retire-silent"] is None
    assert latest.get(b"retire-closed") is None

    again = simulate(dataclasses.replace(engine_config("retire-closed", 33, 40), incarnation=2)).events
    produce(cluster.bootstrap, f"{cluster.prefix}.events", again)

    def back() -> dict | None:
        live = [e for e in json.loads(worker.get("/engines")) if e["state"] == "live"]
        return live[0] if live and live[0]["events"] == len(again) and live[0]["held_steps"] == 0 else None

    wait_for("the engine id to come back", back, [worker])
    engine = back()
    assert engine["engine_id"] == "retire-closed" and all(r["in_sync"] for r in engine["ranks"])
