"""The soak in short (bench/soak.py is the long one): one worker, a fleet of engines that restart.

20 engines of 2-4 TP ranks run 100 steps each, restarting under new engine
ids and incarnations; every fourth carries faults in every life. The worker
is SIGKILLed once mid-run and restarted with the same state dir and group.
What it publishes must be exactly what an offline replay of the same events
finds, life by life, with every injected fault once; at the end it holds
state for no engine.
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from tests.stream_harness import (
    SOAK_ENGINE,
    FleetSpec,
    Soak,
    as_multiset,
    judge,
    live_checkpoints,
    online_violations,
    produce_batched,
    read_all,
    start_worker,
    wait_for,
)
from tests.synthetic.engine import FaultSpec, SimConfig, simulate

pytestmark = pytest.mark.integration

# Lives that end before half of the run all close, so that the kill at 40 % comes once every engine that
# stopped so far has been retired: an engine that stopped just before a kill is the next test's case.
SPEC = FleetSpec(engines=20, tp=(2, 3, 4), steps=100, lives=2, faulty_every=4, silent_from=0.5)
RETIRE_AFTER = 6.0


def test_a_restarting_fleet_and_a_killed_worker_lose_and_duplicate_nothing(kafka_bootstrap, tmp_path):
    soak = Soak(kafka_bootstrap, SPEC, tmp_path, partitions=3, settle_after=1, retire_after=RETIRE_AFTER)
    result = soak.run(kills=(0.4,), quiesce_before_kill=True)
    lives = result.reference.lives

    # It really was a restarting fleet, with faults, and the worker really died mid-run.
    assert len(lives) >= 2 * SPEC.engines and result.step_events >= 0.99 * SPEC.step_events
    assert {life.closing for life in lives.values()} == {True, False}
    assert {f[0] for f in result.reference.faults} == {
        "write_target_mismatch", "read_target_mismatch", "rank_divergence", "rank_missing",
    }  # fmt: skip
    assert len(result.kills) == 1 and result.retired_before_kill
    assert result.longest_round < RETIRE_AFTER  # no live engine was ever silent long enough to retire
    assert result.resent_differing == []  # a re-sent violation is the same record under the same id
    assert not result.dead_letters  # every record was the core's to take

    verdict = judge(result)
    assert not verdict.lost and not verdict.extra, (verdict.lost, verdict.extra)
    assert verdict.faults_not_once == []
    online, _ = online_violations(kafka_bootstrap, result.prefix)  # as users read it: each id once
    assert as_multiset(online) == result.reference.violations

    # Memory: the worker holds state for live engines only.
    assert all(live == gauge for live, gauge in result.at_kill), result.at_kill
    assert result.engines_gauge == 0 and all(e["state"] == "retired" for e in result.engines)
    retired = {e["engine_id"]: e for e in result.engines}
    for life in lives.values():
        if life.engine_id not in result.retired_before_kill:
            assert retired[life.engine_id]["reason"] == ("closed" if life.closing else "silent"), life
            assert retired[life.engine_id]["events"] == life.events, life
    assert not result.live_checkpoints  # every engine's checkpoint is a tombstone now
    assert len({s.worker for s in result.samples}) == 2 and all(s.rss_mb > 0 for s in result.samples)


def committed_to_end(bootstrap: str, group: str, topic: str) -> bool:
    """The group has committed every record of `topic` (a restart re-reads none of them)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        try:
            committed = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        except KafkaException as exc:  # the group's coordinator is still loading: ask again
            if exc.args[0].retriable() or exc.args[0].code() == KafkaError.NOT_COORDINATOR:
                return False
            raise
        ends = [consumer.get_watermark_offsets(tp, timeout=10) for tp in committed]
        return all(max(tp.offset, low) >= high for tp, (low, high) in zip(committed, ends, strict=True))
    finally:
        consumer.close()


def test_an_engine_that_stopped_just_before_a_restart_is_still_settled_and_retired(kafka_bootstrap, tmp_path):
    settle_after, retire_after = 8.0, 10.0  # time enough to see its records committed, then kill it
    faults = (FaultSpec("rank_missing", 39, tp_rank=1),)  # its last step: held until it is settled
    events = simulate(SimConfig(engine_id="stopped", steps=40, tp_size=2, faults=faults, **SOAK_ENGINE)).events
    prefix = f"t{uuid.uuid4().hex[:8]}"
    options = ("--partitions", "2", "--settle-after", str(settle_after), "--retire-after", str(retire_after),
               "--session-timeout", "6")  # fmt: skip
    changelog = f"{prefix}-checkpoints-changelog"
    worker = start_worker(kafka_bootstrap, prefix, tmp_path / "state", tmp_path / "w1.log", *options)
    produce_batched(kafka_bootstrap, f"{prefix}.events", events)
    started = time.monotonic()
    wait_for("the records committed", lambda: committed_to_end(kafka_bootstrap, prefix, f"{prefix}.events"), [worker])
    worker.kill()
    if time.monotonic() - started >= settle_after or read_all(kafka_bootstrap, f"{prefix}.violations"):
        pytest.fail("the worker settled the held step before it was killed: nothing to test")

    restarted = start_worker(kafka_bootstrap, prefix, tmp_path / "state", tmp_path / "w2.log", *options)
    try:
        deadline = time.monotonic() + retire_after + 6
        while live_checkpoints(kafka_bootstrap, changelog) and time.monotonic() < deadline:
            time.sleep(1)
        online, _ = online_violations(kafka_bootstrap, prefix)
        assert [v["kind"] for v in online] == ["rank_missing"]  # settled, late but not lost
        assert not live_checkpoints(kafka_bootstrap, changelog)  # and retired: its checkpoint a tombstone
    finally:
        restarted.stop()
