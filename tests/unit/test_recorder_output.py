"""What the recorder writes, byte for byte: a fixed run of frames (admissions, decodes, chunked
prefills, preemptions and resumes, finished requests readmitted under the same id, two KV groups,
padding, a dummy run, drafter passes, content digests, snapshots, Health, built bodies) read back
by `FrameReader` and encoded as the sinks encode them, against digests of the records as the
recorder built them before its building was made cheaper (`recorder_golden.json`)."""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path
from types import SimpleNamespace

import fastavro
import numpy as np
import pytest

from kvledger.producer import records
from kvledger.producer.capture import (
    ContentCapture,
    DraftPassCapture,
    HealthCapture,
    PlanCapture,
    SnapshotCapture,
    StepCapture,
)
from kvledger.producer.delivery import Delivery
from kvledger.producer.frames import FrameKind, body_part, pack_parts, scheduler_fields
from kvledger.producer.recorder import FrameReader
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring import Ring
from kvledger.producer.sinks import FileSink
from kvledger.producer.staging import Staged
from kvledger.schemas import LEDGER_EVENT
from kvledger.schemas.events import avro_datum
from kvledger.schemas.packing import length_term, position_weights
from kvledger.stream_app.replay import iter_ledger

GOLDEN = Path(__file__).with_name("recorder_golden.json")
RANK = RankIdentity("golden", 1, 0, 1, 42)
BLOCK_SIZES = (16, 32)  # group 0: full attention; group 1: larger blocks
STEPS = 160


class Engine:
    """A deterministic stand-in for a scheduler and a V1 runner over two KV groups: what each step
    hands the probes (a SchedulerOutput's fields, the plan's arrays as the runner holds them)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.step = 0
        self.next_block = 1
        self.next_req = 0
        self.running: list[str] = []  # the runner's batch order
        self.waiting: list[str] = []  # preempted, to be resumed
        self.blocks: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.finished_ids: list[str] = []  # finished ids, some readmitted later under the same id

    def _take(self, n: int) -> list[int]:
        got = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return got

    def _grow(self, req_id: str, upto: int) -> list[list[int]]:
        """Blocks each group needs to hold `upto` tokens, appended to the request's rows."""
        added = []
        for g, bs in enumerate(BLOCK_SIZES):
            need = -(-upto // bs) - len(self.blocks[req_id][g])
            new = self._take(max(need, 0))
            self.blocks[req_id][g] += new
            added.append(new)
        return added

    def _chunk(self, req_id: str) -> int:
        left = self.prompt[req_id] - self.computed[req_id]
        return min(left, 48) if left > 0 else 1

    def next(self) -> tuple[SimpleNamespace, list[str], dict[str, int]]:
        """The next step's SchedulerOutput, its batch (runner order) and tokens per request."""
        rng, step = self.rng, self.step
        self.step += 1
        stable = 20 <= step < 60 or 100 <= step < 130  # plain decode stretches: nothing comes or goes
        finished, preempted, resumed_ids, new = set(), set(), set(), []
        if not stable:
            for r in list(self.running):
                if rng.random() < 0.06 and len(self.running) > 2:
                    finished.add(r)
                    self.running.remove(r)
                    self.finished_ids.append(r)
                elif rng.random() < 0.03 and len(self.running) > 2:
                    preempted.add(r)
                    self.running.remove(r)
                    self.waiting.append(r)
                    self.blocks[r] = [[], []]
                    self.computed[r] = 0
        cached_ids = list(self.running)
        if not stable and self.waiting and rng.random() < 0.5:
            r = self.waiting.pop(0)
            resumed_ids.add(r)
            cached_ids.append(r)
        num_scheduled = {r: self._chunk(r) for r in cached_ids}
        new_block_ids = []
        for r in cached_ids:
            added = self._grow(r, self.computed[r] + num_scheduled[r])
            if r in resumed_ids:
                new_block_ids.append(tuple(self.blocks[r]))
            else:
                new_block_ids.append(tuple(added) if any(added) else None)
        if not stable and (step < 5 or rng.random() < 0.3):
            for _ in range(rng.randint(1, 20 if step < 5 else 3)):
                if self.finished_ids and self.finished_ids[0] not in finished and rng.random() < 0.3:
                    r = self.finished_ids.pop(0)  # the same id, a new request
                else:
                    r, self.next_req = f"req-{self.next_req}", self.next_req + 1
                hit = rng.choice((0, 0, 16))  # a prefix-cache hit: tokens already computed
                self.prompt[r], self.computed[r], self.blocks[r] = rng.randint(20, 140), hit, [[], []]
                num_scheduled[r] = self._chunk(r)
                self._grow(r, hit + num_scheduled[r])
                blocks = tuple(list(g) for g in self.blocks[r])
                new.append(
                    SimpleNamespace(
                        req_id=r, block_ids=blocks, num_computed_tokens=hit, prompt_token_ids=[7] * self.prompt[r]
                    )
                )
        so = SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=cached_ids,
                resumed_req_ids=resumed_ids,
                new_block_ids=new_block_ids,
                num_computed_tokens=[self.computed[r] for r in cached_ids],
            ),
            num_scheduled_tokens=dict(num_scheduled),
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            new_block_ids_to_zero=[3, 9] if step % 17 == 5 else None,
            kv_cache_block_copies=[(4, 5), SimpleNamespace(src=6, dst=7)] if step % 23 == 7 else (),
        )
        # The runner: resumed requests go to the batch's end, new ones after them.
        for r in cached_ids:
            if r not in self.running:
                self.running.append(r)
        self.running += [n.req_id for n in new]
        return so, list(self.running), num_scheduled

    def plan(self, batch: list[str], num_scheduled: dict[str, int], pad: int) -> PlanCapture:
        counts = np.array([num_scheduled[r] for r in batch], np.int32)
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        positions = np.concatenate([self.computed[r] + np.arange(num_scheduled[r]) for r in batch]).astype(np.int64)
        owner = np.repeat(np.arange(len(batch)), counts)
        groups = []
        for g, bs in enumerate(BLOCK_SIZES):
            lens = np.array([len(self.blocks[r][g]) for r in batch], np.int32)
            width = int(lens.max()) if lens.size else 0
            rows = np.full((len(batch), width), 0, np.int32)
            for i, r in enumerate(batch):
                rows[i, : lens[i]] = self.blocks[r][g]
            if width:
                rows[:, -1] += np.where(lens < width, 77, 0).astype(np.int32)  # stale entries past a row's end
            slots = rows[owner, positions // bs].astype(np.int64) * bs + positions % bs
            slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
            groups.append((slots, rows, lens))
        num_tokens = int(counts.sum())
        for r in batch:
            self.computed[r] += num_scheduled[r]
        return PlanCapture(list(batch), num_tokens, [0, 1], pack_parts(PlanCapture.plan_parts(qsl, positions, groups)))


def drafts(plan: PlanCapture, rng: random.Random) -> list[DraftPassCapture]:
    """An EAGLE-like drafter's passes: the first over the step's tokens, then one token per request,
    then a pass serving no request."""
    n = len(plan.req_ids)
    base = np.array([rng.randint(100, 4000) for _ in range(n)], np.int64)
    qsl = np.arange(n + 1, dtype=np.int32) * 2
    first_pos = np.repeat(base, 2) + np.tile([0, 1], n)
    passes = [DraftPassCapture(0, Staged.host(first_pos * 3), Staged.host(first_pos), qsl, 2 * n)]
    passes.append(
        DraftPassCapture(1, Staged.host(np.concatenate([base * 5, [-1, -1]])), Staged.host(base + 2), None, n)
    )
    passes.append(DraftPassCapture(2, Staged.host(np.full(4, -1, np.int64)), None, None, 0))
    return passes


def frames(seed: int) -> list[tuple[FrameKind, list]]:
    """The run's frames in order, as a rank's probes write them."""
    engine, rng, out = Engine(seed), random.Random(seed + 1), []
    info = records.rank_info(
        dp_size=2,
        tp_size=1,
        pp_size=2,
        kv_groups=[records.kv_group(g, "FULL_ATTENTION", bs, 4096) for g, bs in enumerate(BLOCK_SIZES)],
        vllm_version="0.32.0",
        runner="v1",
        capabilities=[("content_digests", True, None)],
        snapshot_interval=40,
    )
    out.append((FrameKind.BODY, [body_part(info)]))
    out.append((FrameKind.STEP, StepCapture(0, "WARMUP", None, None).to_parts()))  # neither input nor plan
    for step in range(STEPS):
        so, batch, num_scheduled = engine.next()
        plan = engine.plan(batch, num_scheduled, pad=step % 3)
        if step % 11 == 4:
            plan.drafts, plan.draft_group = drafts(plan, rng), 0
        content = None
        if step % 13 == 6:
            k = rng.randint(0, 5)
            content = ContentCapture(
                np.array([i % 2 for i in range(k)], np.int32),
                np.array([rng.randint(1, 900) for _ in range(k)], np.int32),
                Staged.host(np.array([rng.randint(-(1 << 63), (1 << 63) - 1) for _ in range(k)], np.int64)),
                [rng.choice(("SEALED", "READ", "RELEASED", "ZEROED")) for _ in range(k)],
            )
        if step % 31 == 12:  # a step whose plan was not captured
            plan = None
        out.append((FrameKind.STEP, StepCapture(step, "REAL", scheduler_fields(so), plan, content).to_parts()))
        if step % 29 == 9:  # a padded run without requests
            dummy = pack_parts(PlanCapture.dummy_parts([np.full(8, -1, np.int64), np.array([-1, -1, 5], np.int64)]))
            out.append(
                (FrameKind.STEP, StepCapture(step, "DUMMY", None, PlanCapture.of_dummy_run([0, 1], dummy)).to_parts())
            )
        if step % 40 == 39:
            rows = [[engine.blocks[r][g] for r in batch] for g in range(2)]
            snap = SnapshotCapture.of_rows(step, batch, [engine.computed[r] for r in batch], rows)
            out.append((FrameKind.SNAPSHOT, snap.to_parts()))
        if step % 50 == 0:
            out.append((FrameKind.HEALTH, HealthCapture(step, step * 3, step * 1000).to_parts()))
    out.append((FrameKind.HEALTH, HealthCapture(STEPS, STEPS * 3, 5, closing=True).to_parts()))
    return out


class Collect:
    """A sink that keeps what it is handed."""

    lost = 0

    def __init__(self) -> None:
        self.events: list[dict] = []

    def write(self, events: list[dict]) -> None:
        self.events += events

    def tick(self) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


def recorded(tmp_path: Path, full_rows: bool, seed: int = 3, look: int = 1) -> list[dict]:
    """The run's frames through a ring, `FrameReader` and a `Delivery`, as the recorder process
    reads them, up to `look` frames at a time: the events handed to its sink."""
    path = tmp_path / f"ring-{full_rows}-{look}"
    ring, sink = Ring.create(path, 1 << 24), Collect()
    recorder = Delivery(RANK, sink, capacity=1 << 16, drain_interval=3600)
    reader = FrameReader(Ring.attach(path), recorder, full_rows)
    first = max(look - 3, 1)  # the first read of a look takes less than it finds: the rest waits
    for seq, (kind, parts) in enumerate(frames(seed)):
        assert ring.write_frame(kind, seq, 1_000_000 + 1000 * seq, parts)
        if (seq + 1) % look == 0:
            assert reader.read(first) == first and reader.read(look) == look - first
    assert reader.read(look) == (seq + 1) % look
    recorder.finish(5.0)
    assert recorder.sink_failed == 0
    return sink.events


def encoded(event: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, LEDGER_EVENT, event)
    return out.getvalue()


def digests(events: list[dict]) -> list[list[str]]:
    """Per event: the digest of its Avro body and of its Python form (types included, as the
    in-process checks read it)."""
    return [
        [hashlib.sha256(encoded(e)).hexdigest()[:16], hashlib.sha256(repr(e).encode()).hexdigest()[:16]] for e in events
    ]


@pytest.mark.parametrize("look", [1, 7])  # frames read one by one, or several in a look
@pytest.mark.parametrize("full_rows", [False, True])
def test_the_recorder_writes_the_same_bytes_as_before(tmp_path, full_rows, look):
    events = recorded(tmp_path, full_rows, look=look)
    golden = json.loads(GOLDEN.read_text())[str(full_rows)]
    got = digests(events)
    assert len(got) == len(golden)
    for k, (have, want) in enumerate(zip(got, golden, strict=True)):
        assert have == want, f"event {k} ({events[k]['body'][0]}, seq {events[k]['seq']}) differs"


def test_the_sinks_named_branches_change_no_byte(tmp_path):
    events = recorded(tmp_path, full_rows=False)
    assert any(e["body"][1].get("plan", {}) and e["body"][1]["plan"]["draft_writes"] for e in events)
    for event in events:
        assert encoded(avro_datum(event)) == encoded(event)
    # Through the file ledger: what a reader gets back is what the plain records encode to.
    with FileSink(tmp_path / "ledger") as sink:
        sink.write(events)
    _, stored = iter_ledger(tmp_path / "ledger", problems := [])
    stored = [event for _, event in stored]
    assert problems == [] and len(stored) == len(events)
    for event, back in zip(events, stored, strict=True):
        assert encoded(back) == encoded(event)


def old_slot_runs(slots: np.ndarray) -> bytes:
    """The slot runs as first written: the reference for any mapping, odd ones included."""
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size == 0:
        return b""
    prev, cur = slots[:-1], slots[1:]
    continues = ((prev >= 0) & (cur == prev + 1)) | ((prev < 0) & (cur < 0))
    starts = np.flatnonzero(np.concatenate([[True], ~continues]))
    lengths = np.diff(np.append(starts, slots.size))
    run_starts = np.where(slots[starts] < 0, -1, slots[starts])
    return np.column_stack([run_starts, lengths]).ravel().astype("<i8").tobytes()


def old_table_digests(table: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The row digests as first written (with the mix as first written)."""
    width, lens = table.shape[1], np.asarray(lens, dtype=np.int64)
    with np.errstate(over="ignore"):
        x = (table.astype(np.int64) + 1).astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
        terms = (x ^ (x >> np.uint64(31))) * position_weights(0, width)
        terms[np.arange(width) >= lens[:, None]] = 0
        return terms.sum(axis=1, dtype=np.uint64) + lens.astype(np.uint64) * np.uint64(length_term(1))


def test_slot_runs_and_row_digests_match_their_first_form_on_any_input():
    rng = np.random.default_rng(7)
    edges = [-1, -5, 0, 1, 2, 3, 1 << 40, np.iinfo(np.int64).max, np.iinfo(np.int64).min]
    for trial in range(2000):
        n = int(rng.integers(0, 40))
        slots = [
            rng.integers(-3, 6, n),  # short runs, padding among them
            np.cumsum(rng.integers(0, 3, n)) - 2,  # long runs
            rng.choice(edges, n),  # int64's ends: a run wraps from its max to its min
            np.where(rng.random(n) < 0.3, -1, np.arange(n) * 16 + 5),  # decoding requests, padded
        ][trial % 4].astype(np.int64)
        assert records.slot_runs(slots) == old_slot_runs(slots), slots
        rows, width = int(rng.integers(0, 12)), int(rng.integers(0, 300 if trial % 50 == 0 else 30))
        dtype = np.int32 if trial % 3 else np.int64
        table = rng.integers(-5, 1 << 20, (rows, width)).astype(dtype)
        if trial % 7 == 0:
            table[:] = rng.choice([np.iinfo(dtype).min, np.iinfo(dtype).max, -1, 0], table.shape)
        odd = trial % 5 == 0  # lengths past either end of a row
        lens = rng.integers(-2 if odd else 0, width + (3 if odd else 1), rows).astype(np.int32)
        got, want = records.table_digests(table, lens), old_table_digests(table, lens)
        assert got.dtype == want.dtype and (got == want).all(), (table, lens)


def main() -> None:
    """Write the golden digests (only from a recorder known good)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        golden = {str(full_rows): digests(recorded(Path(tmp), full_rows)) for full_rows in (False, True)}
    GOLDEN.write_text(json.dumps(golden, indent=0) + "\n")


if __name__ == "__main__":
    main()
