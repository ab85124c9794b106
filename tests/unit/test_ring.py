"""The shared-memory ring between a rank's probes and its recorder process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvledger.producer.ring import Ring, RingError


def record(seq: int, size: int) -> np.ndarray:
    """A record that says which it is and carries its own checksum: seq, size, sum, then bytes."""
    body = (np.arange(size, dtype=np.int64) * 2654435761 + seq).astype(np.uint8)
    return np.concatenate([np.array([seq, size, int(body.sum())], np.int64).view(np.uint8), body])


def check(rec: memoryview) -> int:
    seq, size, total = np.frombuffer(rec, np.int64, 3)
    body = np.frombuffer(rec, np.uint8, offset=24)
    assert body.size == size and int(body.sum()) == total, f"record {seq} corrupt"
    return int(seq)


def test_records_come_out_in_order_and_intact_across_many_wraps(tmp_path):
    ring = Ring.create(tmp_path / "r", 4096)
    consumer = Ring.attach(tmp_path / "r")
    sizes = np.random.default_rng(7).integers(0, 900, 2000)
    seen = []
    for seq, size in enumerate(sizes):
        assert ring.write(record(seq, int(size)))
        if seq % 3 == 2:  # the consumer lags a few records behind
            seen += [check(r) for r in consumer.records()]
    seen += [check(r) for r in consumer.records()]
    assert seen == list(range(len(sizes))) and ring.dropped == 0 and consumer.pending == 0
    assert consumer.published == len(sizes)  # many times the ring's size went through it
    ring.close()
    consumer.close(unlink=True)
    assert not (tmp_path / "r").exists()


def test_a_full_ring_drops_and_counts_without_waiting(tmp_path):
    ring = Ring.create(tmp_path / "r", 1024)
    written = [ring.write(record(seq, 200)) for seq in range(10)]
    assert written == [True] * 4 + [False] * 6 and ring.dropped == 6  # 4 x 232 bytes fit in 1024
    assert not ring.write(np.zeros(2000, np.uint8))  # larger than the ring: never fits
    consumer = Ring.attach(tmp_path / "r")
    assert [check(r) for r in consumer.records()] == [0, 1, 2, 3]
    assert ring.write(record(10, 200))  # room again once the consumer let go
    assert [check(r) for r in consumer.records()] == [10] and consumer.dropped == 7


def test_what_is_not_a_ring_is_refused(tmp_path):
    (tmp_path / "junk").write_bytes(b"\x00" * 200)
    with pytest.raises(RingError, match="not a kvledger ring"):
        Ring.attach(tmp_path / "junk")
    (tmp_path / "short").write_bytes(b"\x00" * 8)
    with pytest.raises(RingError, match="shorter than a ring's header"):
        Ring.attach(tmp_path / "short")
    with pytest.raises(ValueError, match="multiple of 8"):
        Ring.create(tmp_path / "odd", 1001)


CONSUMER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kvledger.producer.ring import Ring
    ring = Ring.attach(sys.argv[1])
    out = open(sys.argv[2], "a")
    while True:
        for rec in ring.records():
            seq, size, total = np.frombuffer(rec, np.int64, 3)
            body = np.frombuffer(rec, np.uint8, offset=24)
            ok = body.size == size and int(body.sum()) == total
            out.write(f"{seq} {int(ok)}\\n"); out.flush()
        if ring.producer_closed and not ring.pending:
            break
        time.sleep(0.0005)
    """
)


def test_a_consumer_killed_mid_stream_costs_the_producer_nothing_and_a_new_one_takes_over(tmp_path):
    path, out = tmp_path / "r", tmp_path / "seen"
    ring = Ring.create(path, 1 << 16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def consumer():
        return subprocess.Popen([sys.executable, "-c", CONSUMER, str(path), str(out)], env=env)

    first = consumer()
    time.sleep(1.0)  # imported and polling
    outcomes, slowest = [], 0.0
    for seq in range(6000):
        if seq == 2000:
            first.send_signal(signal.SIGKILL)
            first.wait()
        if seq == 4000:
            second = consumer()
        started = time.perf_counter()
        outcomes.append(ring.write(record(seq, 100 + seq % 400)))
        slowest = max(slowest, time.perf_counter() - started)
        time.sleep(0.0002)
    ring.close_producer()
    assert second.wait(timeout=60) == 0
    pairs = [tuple(map(int, line.split())) for line in out.read_text().splitlines()]
    seen = [seq for seq, _ in pairs]
    assert all(ok for _, ok in pairs), "a record came out corrupt"
    assert seen == sorted(seen), "records out of order"
    dropped = outcomes.count(False)
    assert ring.dropped == dropped > 0  # the dead consumer's ring filled up: counted, not waited on
    # Each record was read at most twice (the one the killed consumer held when it died is read
    # again), every record the ring took was read, in order, and nothing it refused was.
    taken = [seq for seq, ok in enumerate(outcomes) if ok]
    assert sorted(set(seen)) == taken and len(seen) - len(set(seen)) <= 1
    assert slowest < 0.05, f"a write took {slowest * 1e3:.1f} ms"
