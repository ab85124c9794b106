"""Stream workers and the topics around them, as the tests drive them against the real broker.

Workers run as subprocesses of the installed console script (`kvledger
stream`), and what they publish is read back with `kvledger violations` or a
plain consumer, as users do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvledger.producer.sinks import KAFKA_DEFAULTS, KafkaSink
from kvledger.schemas import LEDGER_EVENT, LEDGER_EVENT_BATCH, BatchCodec, SingleObjectCodec
from kvledger.schemas.events import events_of
from kvledger.schemas.registry import STEP, VIOLATION
from kvledger.stream_app.core import Ledger, Violation
from tests.synthetic.engine import FaultSpec, SimConfig, SyntheticEngine

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


def online_violations(bootstrap: str, prefix: str, *options: str) -> tuple[list[dict], dict]:
    """`kvledger violations` over the topic from its start: the violations, and the summary line."""
    proc = kvledger(
        "violations", "--bootstrap", bootstrap, "--topic-prefix", prefix, "--from-beginning",
        "--idle-timeout", "3", "--format", "json", *options,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    *violations, summary = [json.loads(line) for line in proc.stdout.splitlines()]
    assert summary["type"] == "summary"
    assert proc.returncode == (1 if violations else 0), proc.stderr
    return violations, summary


def as_multiset(violations: list[dict]) -> Counter:
    return Counter(json.dumps(v, sort_keys=True) for v in violations)


# -- a soak: a fleet of engines that restart, against one worker ----------------------------------
# Engines of the soak: a small pool, so that requests preempt and blocks recycle over thousands of steps.
SOAK_ENGINE = {
    "num_blocks": 128,
    "max_num_seqs": 8,
    "max_batched_tokens": 128,
    "snapshot_interval": 64,
    "health_interval": 64,
}
MIN_LIFE = 16  # steps: room for a fault in each quarter of a life
DRAIN = 16  # events per sink write, as a rank's drain thread hands them over


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """`engines` engines at once, each running `steps` steps over the run and restarting between lives.

    Every restart is a new engine id and a new incarnation. Lives end alternately with a closing
    Health event and in silence (lives that end before `silent_from`, a fraction of the steps, all
    close). Engines 0, n, 2n, ... (n = `faulty_every`) carry faults in every life.
    """

    engines: int = 200
    tp: tuple[int, ...] = (8,)  # the TP degree of engine i is tp[i % len(tp)]
    steps: int = 6250
    lives: int = 3  # lives per engine, on average
    faulty_every: int = 10
    chunk_steps: int = 8  # steps of each engine per round of production
    silent_from: float = 0.0
    seed: int = 0

    def tp_of(self, engine: int) -> int:
        return self.tp[engine % len(self.tp)]

    @property
    def step_events(self) -> int:
        return self.steps * sum(self.tp_of(i) for i in range(self.engines))


@dataclasses.dataclass
class Life:
    engine_id: str
    closing: bool  # ends with a closing Health event on every rank, else it just goes silent
    events: int = 0
    ended: bool = False  # all its events were generated


def violation_key(v: Violation) -> str:
    """A violation as `kvledger check` / `kvledger violations --format json` print it (cf. as_multiset)."""
    return json.dumps({"type": "violation", **v.to_record()}, sort_keys=True)


def fault_key(kind: str, engine_id: str, dp: int, tp: int, pp: int, step: int | None) -> tuple:
    return (kind, engine_id, dp, tp, pp, step)


@dataclasses.dataclass
class Reference:
    """What an offline replay finds: every life through its own `Ledger`, then `finish()` at its end.

    `finish()` settles the steps still held for missing ranks, which is what a worker does when it
    retires an engine, whether its ranks closed or it went silent.
    """

    violations: Counter = dataclasses.field(default_factory=Counter)  # violation_key -> times found
    faults: list[tuple] = dataclasses.field(default_factory=list)  # fault_key of every fault placed
    unplaced: int = 0  # faults that found no target before their life ended
    lives: dict[str, Life] = dataclasses.field(default_factory=dict)


class SharedPlanEngine(SyntheticEngine):
    """The synthetic engine, with the plan its ranks share encoded once per step instead of once per
    rank (at TP=8 that encoding is most of its time); the records are the same."""

    _encoded: tuple[dict, dict] | None = None

    def _encode_plan(self, p: dict) -> dict:
        if self._encoded is None or self._encoded[0] is not p:
            self._encoded = (p, super()._encode_plan(p))
        return self._encoded[1]


def by_step(events: Iterable[dict]) -> Iterable[list[dict]]:
    """An engine's events, cut before each new step number: a cut never splits a step across ranks,
    so a pause between two cuts leaves no step waiting for a rank."""
    group: list[dict] = []
    step = None
    for event in events:
        name, body = event["body"]
        if name == STEP:
            if step is not None and body["step"] != step:
                yield group
                group = []
            step = body["step"]
        group.append(event)
    if group:
        yield group


def life_lengths(steps: int, lives: int, rng: random.Random) -> list[int]:
    mean = max(steps / max(lives, 1), MIN_LIFE)
    out: list[int] = []
    while sum(out) < steps:
        out.append(max(MIN_LIFE, round(rng.uniform(0.5, 1.5) * mean)))
    out[-1] -= sum(out) - steps
    if out[-1] < MIN_LIFE and len(out) > 1:
        last = out.pop()
        out[-1] += last
    return out


def life_faults(steps: int, tp: int, rng: random.Random) -> tuple[FaultSpec, ...]:
    """A fault in each quarter of the life, and a rank missing at its very last step: that step stays
    held until the engine is retired (closed or silent), so only retirement reports it."""
    faults = [FaultSpec("slot_shift", steps // 4), FaultSpec("block_swap", steps // 2, tp_rank=rng.randrange(tp))]
    if tp > 1:
        faults.append(FaultSpec("rank_divergence", 3 * steps // 4, tp_rank=rng.randrange(1, tp)))
        faults.append(FaultSpec("rank_missing", steps - 1, tp_rank=rng.randrange(tp)))
    return tuple(faults)


def life_configs(spec: FleetSpec, index: int, reference: Reference) -> list[SimConfig]:
    """Engine `index`'s lives, in order; each is registered in the reference."""
    rng = random.Random(f"{spec.seed}/{index}")
    tp, configs, start = spec.tp_of(index), [], 0
    for life, steps in enumerate(life_lengths(spec.steps, spec.lives, rng)):
        start += steps
        closing = start < spec.silent_from * spec.steps or (index + life) % 2 == 0
        faults = life_faults(steps, tp, rng) if index % spec.faulty_every == 0 else ()
        engine_id = f"soak-{index:03d}-{life + 1}"
        configs.append(
            SimConfig(
                seed=rng.randrange(1 << 30),
                engine_id=engine_id,
                incarnation=life + 1,  # a restart: a new incarnation, and a new engine id as vLLM names it
                steps=steps,
                tp_size=tp,
                faults=faults,
                close_at_end=closing,
                **SOAK_ENGINE,
            )
        )
        reference.lives[engine_id] = Life(engine_id, closing)
    return configs


class EngineSlot:
    """One engine of the fleet: its lives back to back, generated lazily and replayed offline as they go."""

    def __init__(self, spec: FleetSpec, index: int, reference: Reference):
        self.reference = reference
        self.configs = life_configs(spec, index, reference)[::-1]  # popped from the end
        self.engine: SyntheticEngine | None = None
        self.ledger: Ledger | None = None
        self.steps: Iterator[list[dict]] = iter(())
        self.ahead: list[dict] | None = None  # the next step's events of the current life

    @property
    def done(self) -> bool:
        return self.ahead is None and not self.configs

    def take(self, steps: int) -> list[dict]:
        """The events of this engine's next `steps` steps (across a restart, if one falls among them)."""
        out: list[dict] = []
        while steps > 0 and (self.ahead is not None or self._next_life()):
            start = len(out)
            while steps > 0 and self.ahead is not None:
                out += self.ahead
                self.ahead = next(self.steps, None)
                steps -= 1
            self._replay(out[start:])
        return out

    def _next_life(self) -> bool:
        if not self.configs:
            return False
        self.engine = SharedPlanEngine(self.configs.pop())
        self.steps = iter(by_step(self.engine.events()))
        self.ledger = Ledger(join_transfers=False)  # as the worker's: transfers are joined elsewhere
        self.ahead = next(self.steps, None)
        return self.ahead is not None

    def _replay(self, events: list[dict]) -> None:
        config, life = self.engine.cfg, self.reference.lives[self.engine.cfg.engine_id]
        found = self.ledger.apply_many(events_of(events))
        life.events += len(events)
        if self.ahead is None:  # these were the life's last events
            found += self.ledger.finish()
            life.ended = True
            placed = self.engine.expected  # one expected violation per placed fault of these kinds
            self.reference.faults += [
                fault_key(e.kind, e.engine_id, e.dp_rank, e.tp_rank, e.pp_rank, e.step) for e in placed
            ]
            self.reference.unplaced += len(config.faults) - len(placed)
        self.reference.violations.update(violation_key(v) for v in found)


class Fleet:
    """The soak's engines, generated engine by engine, a few steps at a time: memory stays flat."""

    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.reference = Reference()
        self.slots = [EngineSlot(spec, i, self.reference) for i in range(spec.engines)]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.slots)

    def round(self) -> Iterable[list[dict]]:
        """One round: each engine's next `chunk_steps` steps, one engine after the other."""
        for slot in self.slots:
            if not slot.done:
                yield slot.take(self.spec.chunk_steps)


# -- the worker process, from /proc ---------------------------------------------------------------
def rss_mb(pid: int) -> float | None:
    """A process's resident memory (VmRSS) in MB; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(m[1]) / 1024 if m else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def live_checkpoints(bootstrap: str, topic: str) -> set[str]:
    """Keys of a table's changelog whose latest record is not a tombstone (pieces named by their engine),
    read start to end without keeping the records."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex[:6]}"})
    latest: dict[bytes, bool] = {}
    try:
        ends = {}
        for p in admin.list_topics(topic, timeout=10).topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = (low, high)
        consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
        deadline = time.monotonic() + 600
        while ends:
            assert time.monotonic() < deadline, f"{topic}: partitions {sorted(ends)} not read to their end"
            for m in consumer.consume(1000, timeout=10):
                assert m.error() is None, m.error()
                latest[m.key()] = m.value() is not None
                if m.partition() in ends and m.offset() >= ends[m.partition()][1] - 1:
                    del ends[m.partition()]  # read to its end as it stood (it may have grown since)
    finally:
        consumer.close()
    return {key.split(b"\x00")[0].decode() for key, live in latest.items() if live}


# -- the soak itself ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sample:
    t: float  # seconds since the soak started
    worker: int  # which worker process: 1, then 2 after the first restart, ...
    applied: float  # events applied by all worker processes so far (a kill's re-applied tail counts again)
    rss_mb: float
    cpu_s: float  # CPU seconds of all worker processes so far


@dataclasses.dataclass
class SoakResult:
    spec: FleetSpec
    prefix: str
    reference: Reference
    events: int = 0
    step_events: int = 0
    messages: int = 0
    produced_from: float = 0.0  # t of the first event produced
    read_by: float = 0.0  # t by which the worker had read (and committed) every event
    longest_round: float = 0.0  # seconds: the longest an engine waited between two of its chunks
    samples: list[Sample] = dataclasses.field(default_factory=list)
    kills: list[float] = dataclasses.field(default_factory=list)  # t of each SIGKILL
    retired_before_kill: set[str] = dataclasses.field(default_factory=set)  # by the killed workers
    violations: dict[bytes, bytes] = dataclasses.field(default_factory=dict)  # id -> the record first read
    resent: int = 0  # records under an id read before
    resent_differing: list[bytes] = dataclasses.field(default_factory=list)  # ids re-sent with other bytes
    live_checkpoints: set[str] = dataclasses.field(default_factory=set)  # left in the changelog at the end
    engines: list[dict] = dataclasses.field(default_factory=list)  # the last worker's /engines
    engines_gauge: float = -1.0  # ... and its kvledger_engines
    at_kill: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (live in /engines, gauge)
    engine_series: int = 0  # kvledger_events_total{engine=...} series the last worker exports
    dead_letters: Counter = dataclasses.field(default_factory=Counter)  # reason -> records dead-lettered
    logs: list[Path] = dataclasses.field(default_factory=list)  # every worker process's log, in order

    @property
    def elapsed(self) -> float:
        return self.read_by - self.produced_from


class Soak:
    """One worker against a fleet of restarting engines, SIGKILLed and restarted along the way.

    Production is paced to the worker: a round goes out once the worker has read the one before, as
    a fleet within its worker's capacity leaves it caught up now and then (only then does a worker
    settle and retire engines that went silent).
    """

    def __init__(
        self, bootstrap: str, spec: FleetSpec, work: Path, *, partitions: int = 4, settle_after: float = 5.0,
        retire_after: float = 30.0, sample_every: float = 2.0, on_sample: Callable[[Sample], None] | None = None,
        worker_options: tuple[str, ...] = (),
    ):  # fmt: skip
        self.bootstrap, self.spec, self.work = bootstrap, spec, work
        self.prefix = f"soak{uuid.uuid4().hex[:6]}"
        self.partitions, self.retire_after = partitions, retire_after
        self.options = (
            "--partitions", str(partitions), "--settle-after", str(settle_after),
            "--retire-after", str(retire_after), "--session-timeout", "6", *worker_options,
        )  # fmt: skip
        self.sample_every, self.on_sample = sample_every, on_sample
        self.workers: list[Worker] = []
        self.lock = threading.Lock()  # the worker list and the counts of the killed ones, for the sampler
        self.base_applied = self.base_cpu = 0.0
        self.t0 = time.monotonic()
        self.result = SoakResult(spec, self.prefix, Reference())

    # -- workers --------------------------------------------------------------------------------
    @property
    def worker(self) -> Worker:
        return self.workers[-1]

    def _start(self) -> None:
        log = self.work / f"worker-{len(self.workers) + 1}.log"
        worker = start_worker(self.bootstrap, self.prefix, self.work / "state", log, *self.options)
        with self.lock:
            self.workers.append(worker)
        self.first_round = True

    def _kill_and_restart(self) -> None:
        """SIGKILL mid-stream, then the same state dir and group again."""
        w = self.worker
        view = json.loads(w.get("/engines"))
        self.result.retired_before_kill |= {e["engine_id"] for e in view if e["state"] == "retired"}
        self.result.at_kill.append((sum(e["state"] == "live" for e in view), w.total("kvledger_engines")))
        applied, cpu = w.total("kvledger_events_total"), cpu_seconds(w.proc.pid) or 0.0
        w.kill()
        self.result.kills.append(time.monotonic() - self.t0)
        with self.lock:
            self.base_applied += applied
            self.base_cpu += cpu
        self._start()

    def sample(self) -> Sample | None:
        with self.lock:
            w, n, applied, cpu = self.worker, len(self.workers), self.base_applied, self.base_cpu
        rss, own_cpu, metrics = rss_mb(w.proc.pid), cpu_seconds(w.proc.pid), w.metrics()
        if rss is None or own_cpu is None or not metrics:
            return None  # between a kill and the restart's web server
        own = sum(v for k, v in metrics.items() if k.startswith("kvledger_events_total"))
        s = Sample(time.monotonic() - self.t0, n, applied + own, rss, cpu + own_cpu)
        self.result.samples.append(s)
        if self.on_sample is not None:
            self.on_sample(s)
        return s

    def _sampling(self, stop: threading.Event) -> None:
        while not stop.wait(self.sample_every):
            self.sample()

    # -- pacing ---------------------------------------------------------------------------------
    def _behind(self, offsets: Consumer, committed: bool = False) -> int:
        """Messages of the events topic the worker has not read: from its lag metric once it reports
        every partition (as of its last fetch), else, or when `committed`, from its group's committed
        offsets (those trail what it read by a checkpoint and a commit, a second or two)."""
        lags = [v for k, v in self.worker.metrics().items() if k.startswith("kvledger_consumer_lag{")]
        if len(lags) == self.partitions and not committed:
            return int(sum(lags))
        topic = f"{self.prefix}.events"
        parts = [TopicPartition(topic, p) for p in range(self.partitions)]
        behind = 0
        for tp in offsets.committed(parts, timeout=10):
            low, high = offsets.get_watermark_offsets(tp, timeout=10)
            behind += high - max(tp.offset, low)
        return behind

    def _wait_behind(self, offsets: Consumer, at_most: int, what: str, committed: bool = False) -> None:
        # Polled gently: every scrape of /metrics costs the worker (a few series per engine id ever seen).
        deadline = time.monotonic() + 300
        while self._behind(offsets, committed) > at_most:
            if self.worker.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no longer waiting for {what}:\n{self.worker.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def _wait_retired(self, engine_ids: set[str], timeout: float) -> None:
        def retired() -> bool:
            view = json.loads(self.worker.get("/engines"))
            return engine_ids <= {e["engine_id"] for e in view if e["state"] == "retired"}

        wait_for(f"{len(engine_ids)} engines to retire", retired, [self.worker], timeout=timeout)

    # -- the run --------------------------------------------------------------------------------
    def run(self, kills: tuple[float, ...] = (0.2, 0.4), quiesce_before_kill: bool = False) -> SoakResult:
        """Produce the whole fleet, killing the worker when the step-events produced pass each fraction
        in `kills`; with `quiesce_before_kill`, only once every life ended so far is retired."""
        fleet = Fleet(self.spec)
        r = self.result
        r.reference = fleet.reference
        sink = KafkaSink(self.bootstrap, f"{self.prefix}.events")
        offsets = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.prefix, "enable.auto.commit": False})
        self._start()
        stop = threading.Event()
        sampler = threading.Thread(target=self._sampling, args=(stop,), daemon=True)
        sampler.start()
        r.produced_from, pending = time.monotonic() - self.t0, sorted(kills)
        try:
            batch = list(fleet.round())
            while batch:
                round_started = time.monotonic()
                self._produce_round(batch, sink)
                ended = {life.engine_id for life in fleet.reference.lives.values() if life.ended}
                # The next round is generated (and replayed offline) while the worker reads this one.
                batch = list(fleet.round())
                self._wait_behind(offsets, 0, "the worker to read the round")
                kill = bool(pending) and r.step_events >= pending[0] * self.spec.step_events
                if kill and quiesce_before_kill:
                    self._wait_behind(offsets, 0, "the worker to catch up", committed=True)
                    self._wait_retired(ended, timeout=self.retire_after + 30)
                # How long live engines went without a record; not in a worker's first round, which
                # waits for it to join its group (no engine is loaded yet: its silence counts from then).
                if not self.first_round:
                    r.longest_round = max(r.longest_round, time.monotonic() - round_started)
                self.first_round = False
                if kill:
                    pending.pop(0)
                    self._kill_and_restart()
            sink.close(60)
            assert sink.lost == 0, f"the sink lost {sink.lost} events"
            r.messages = sink.messages
            self._wait_behind(offsets, 0, "the worker to read everything", committed=True)
            r.read_by = time.monotonic() - self.t0
            self.sample()
            self._wait_all_retired()
        finally:
            stop.set()
            sampler.join()
            offsets.close()
        self._collect()
        return r

    def _produce_round(self, batch: list[list[dict]], sink: KafkaSink) -> None:
        r, before = self.result, self.result.events
        for events in batch:
            for i in range(0, len(events), DRAIN):
                sink.write(events[i : i + DRAIN])
            r.events += len(events)
            r.step_events += sum(e["body"][0] == STEP for e in events)
        sink.flush()
        # The client's queue is bounded (and a full one drops): at most a round in flight.
        while r.events - sink.delivered - sink.failed > r.events - before:
            sink.tick()
            time.sleep(0.02)

    def _wait_all_retired(self) -> None:
        """Every life has ended: the worker holds no engine once the silent ones were silent long enough."""

        def none_live() -> bool:
            live = [e for e in json.loads(self.worker.get("/engines")) if e["state"] == "live"]
            return not live and self.worker.total("kvledger_engines") == 0

        wait_for("every engine to retire", none_live, [self.worker], timeout=self.retire_after + 60)

    def _collect(self) -> None:
        r = self.result
        r.engines = json.loads(self.worker.get("/engines"))
        r.engines_gauge = self.worker.total("kvledger_engines")
        r.engine_series = sum(k.startswith("kvledger_events_total{") for k in self.worker.metrics())
        self.worker.stop()
        r.logs = [w.log for w in self.workers]
        for m in read_all(self.bootstrap, f"{self.prefix}.deadletter"):
            r.dead_letters[dict(m.headers() or ()).get("kvledger.reason", b"?").decode()] += 1
        for m in read_all(self.bootstrap, f"{self.prefix}.violations"):
            key, value = m.key(), m.value()
            if key not in r.violations:
                r.violations[key] = value
                continue
            r.resent += 1  # a re-send after a kill: the same id, and it must be the same record
            if r.violations[key] != value:
                r.resent_differing.append(key)
        r.live_checkpoints = live_checkpoints(self.bootstrap, f"{self.prefix}-checkpoints-changelog")


# -- what a soak shows ----------------------------------------------------------------------------
@dataclasses.dataclass
class SoakVerdict:
    lost: Counter  # found offline, never published
    extra: Counter  # published, not found offline
    faults_not_once: list[tuple[tuple, int, int]]  # (fault, times published, times found offline) unless 1, 1
    by_kind: Counter  # published violations by kind

    @property
    def exact(self) -> bool:
        return not self.lost and not self.extra and not self.faults_not_once


def judge(result: SoakResult) -> SoakVerdict:
    codec = SingleObjectCodec(VIOLATION)
    online = [Violation(**codec.decode(value)) for value in result.violations.values()]
    published = Counter(violation_key(v) for v in online)
    offline = result.reference.violations
    at = Counter(fault_key(v.kind, v.engine_id, v.dp_rank, v.tp_rank, v.pp_rank, v.step) for v in online)
    at_offline = Counter(fault_key(*[json.loads(k)[f] for f in _FAULT_FIELDS]) for k in offline.elements())
    odd = [(f, at[f], at_offline[f]) for f in result.reference.faults if (at[f], at_offline[f]) != (1, 1)]
    return SoakVerdict(offline - published, published - offline, odd, Counter(v.kind for v in online))


_FAULT_FIELDS = ("kind", "engine_id", "dp_rank", "tp_rank", "pp_rank", "step")


def memory_flat(samples: list[Sample], until: float, ratio: float = 1.25) -> tuple[bool, float, float]:
    """The last worker's resident memory over its life up to `until`: flat when its maximum over the last
    third stays within `ratio` of its value at the end of the first third. (flat, that value, that max)"""
    mine = [s for s in samples if s.worker == samples[-1].worker and s.t <= until]
    t0, t1 = mine[0].t, mine[-1].t
    first = [s.rss_mb for s in mine if s.t <= t0 + (t1 - t0) / 3][-1]
    last = max(s.rss_mb for s in mine if s.t >= t0 + 2 * (t1 - t0) / 3)
    return last <= ratio * first, first, last
