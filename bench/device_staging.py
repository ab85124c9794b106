"""A device engine's plan copies: their host time per step, the current path against the last.

Model Runner V2 builds block tables and slot mappings on the device; the probe
gathers a step's plan (every group's rows up to the widest, slot mappings,
positions) into one device staging buffer by one kernel, copies it to a pinned
host buffer in one transfer behind one event (producer/staging.py
`PlanGather`), and the step's frame is written once the copy has landed. The
copies queue behind whatever the stream already holds: with async scheduling
that is the previous step's forward pass. This drives the real MRV2 probe
(`MRV2RunnerProbe._capture_mrv2_plan`, `_after_step`) over device tensors
shaped as `prepare_attn` returns them, around a stand-in forward pass of a set
length on the same stream, the host one step ahead as vLLM's async scheduling
keeps it, and measures side by side, in alternating rounds:

* gather: the plan gathered by one kernel (`plan_gather`, what the probe does);
* per-tensor: each tensor sliced and staged on its own, the path before
  (`plan_gather = False`: `StagingPool.stage_all`);
* off: no probe, the same loop (the step's wall time without tracing);
* waited (`--waited`): the gather, each step's end waiting for its copies.

Every `--snapshot-every` steps the probe also snapshots the live requests from
the device's block tables (`MRV2RunnerProbe._snapshot`), counted in the step's
end. `--prefill-tokens N` adds the same three arms for a prefill step (N
tokens spread over the requests). Before timing it counts each path's host
calls per step (torch operations dispatched, and kernel launches) over 1 and
4 KV groups and 1, 64 and 256 requests.

It also checks every frame read back from the ring against what the device
held when the copy was queued (the next step rewrites the same device
tensors before the copy has run on the host's clock).

    python bench/device_staging.py [--steps 400] [--forward-ms 8] [--requests 64] [--groups 4]
        [--snapshot-every 16] [--prefill-tokens 2048] [--waited]

Needs torch with an accelerator (CUDA, or any backend of torch.accelerator);
`--device cpu` runs the same loop on the host (CPU tensors through the same
gather and staging, the per-tensor path through its device branch), which
checks the script and counts its host calls.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch

from kvledger.producer.capture import SnapshotCapture, StepCapture
from kvledger.producer.config import TraceAction, TraceConfig
from kvledger.producer.frames import FrameKind, read_frame, unpack_parts
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring_writer import MAX_HELD, RingWriter
from kvledger.producer.staging import StagingPool
from kvledger.producer.vllm_mrv2 import MRV2RunnerProbe

MAX_BLOCKS = 256
PAD = 8  # CUDA-graph padding of the token count
ARMS = ("gather", "per-tensor", "off")


def scheduler_output(req_ids: list[str], tokens: int = 1) -> SimpleNamespace:
    """A decode (or prefill: `tokens` each) step's SchedulerOutput, as far as the probe reads it."""
    cached = SimpleNamespace(
        req_ids=req_ids,
        resumed_req_ids=set(),
        new_block_ids=[None] * len(req_ids),
        num_computed_tokens=[0] * len(req_ids),
    )
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(req_ids, tokens),
        finished_req_ids=set(),
        preempted_req_ids=set(),
        new_block_ids_to_zero=None,
        kv_cache_block_copies=(),
    )


class Engine:
    """Device tensors as MRV2's `prepare_attn` leaves them, rewritten each step on the stream."""

    def __init__(self, device: torch.device, num_reqs: int, groups: int, tokens: int = 1):
        self.device, self.num_reqs, self.groups, self.tokens = device, num_reqs, groups, tokens
        self.num_tokens = num_reqs * tokens  # `tokens` per request: 1 decoding, more in a prefill
        self.padded = -(-self.num_tokens // PAD) * PAD
        rows_padded = -(-num_reqs // PAD) * PAD
        rng = np.random.default_rng(0)
        self.lens = rng.integers(1, MAX_BLOCKS, size=(groups, num_reqs)).astype(np.int32)
        self.host_rows = np.arange(num_reqs * MAX_BLOCKS, dtype=np.int32).reshape(num_reqs, -1)
        self.base_rows = torch.from_numpy(self.host_rows).to(device)
        self.tables = [torch.zeros(rows_padded, MAX_BLOCKS, dtype=torch.int32, device=device) for _ in range(groups)]
        self.slots = torch.zeros(groups, self.padded, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.padded, dtype=torch.int64, device=device)
        self.req_ids = [f"req-{i}" for i in range(num_reqs)]
        # Request states: request i in state i, its rows in row i of every group's device table.
        self.runner = SimpleNamespace(
            device=device,
            block_tables=SimpleNamespace(
                num_blocks=SimpleNamespace(np=self.lens), block_tables=[SimpleNamespace(gpu=t) for t in self.tables]
            ),
            req_states=SimpleNamespace(
                req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
                num_computed_tokens_np=np.arange(num_reqs, dtype=np.int32),
            ),
        )
        self.batch = SimpleNamespace(
            num_reqs=num_reqs,
            num_tokens=self.num_tokens,
            num_tokens_after_padding=self.padded,
            idx_mapping_np=np.arange(num_reqs),
            query_start_loc_np=np.arange(num_reqs + 1, dtype=np.int32) * tokens,
            positions=self.positions,
            req_ids=self.req_ids,
        )

    def prepare(self, step: int) -> tuple[list, torch.Tensor]:
        """The step's gather and slot-mapping kernels: every value says which step wrote it."""
        for g, table in enumerate(self.tables):
            table[: self.num_reqs].copy_(self.base_rows + (step * 1000 + g))
        self.slots.copy_(torch.arange(self.padded, device=self.device) + step * 10_000)
        self.positions.copy_(torch.arange(self.padded, device=self.device) + step)
        return self.tables, self.slots

    def expected(self, step: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, slots) of `group` as the plan must carry them at `step`."""
        width = int(self.lens[group].max())
        rows = self.host_rows[:, :width] + (step * 1000 + group)  # never a device sync: it would pace the loop
        return rows, np.arange(self.padded) + step * 10_000

    def expected_blocks(self, step: int, group: int) -> np.ndarray:
        """The blocks of `group` a snapshot after `step` must carry: each request's row, its length long."""
        rows = self.host_rows + (step * 1000 + group)
        return np.concatenate([rows[i, :n] for i, n in enumerate(self.lens[group])])


_MATMUL_N = 8192
_MATMUL: list = []  # (operand, ms per product), made once


def forward(device: torch.device, ms: float) -> None:
    """A stand-in forward pass of about `ms` on the current stream: bf16 matrix products."""
    if device.type == "cpu":
        return
    if not _MATMUL:
        a = torch.ones(_MATMUL_N, _MATMUL_N, dtype=torch.bfloat16, device=device)
        start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
        torch.mm(a, a)
        start.record()
        for _ in range(10):
            torch.mm(a, a)
        end.record()
        end.synchronize()
        _MATMUL.append((a, start.elapsed_time(end) / 10))
    a, per_product = _MATMUL[0]
    for _ in range(max(1, round(ms / per_product))):
        torch.mm(a, a)


def make_probe(engine: Engine, arm: str, max_held: int = MAX_HELD) -> MRV2RunnerProbe:
    """The MRV2 probe over `engine`, staging as `arm` does."""
    config = TraceConfig(enabled=True, action=TraceAction.RECORD, snapshot_interval=0, ring_bytes=1 << 26)
    probe = MRV2RunnerProbe(engine.runner, config)
    probe.recorder = RingWriter(RankIdentity("bench", 0, 0, 0, 1), config, spawn=False, max_held=max_held)
    probe.plan_gather = arm != "per-tensor"
    if engine.device.type == "cpu":  # the per-tensor path's device branch, on CPU tensors
        probe._on_host, probe.staging = False, StagingPool(host_copies=False)
    return probe


def run(engine: Engine, steps: int, forward_ms: float, arm: str, snapshot_every: int) -> dict[str, list[float]]:
    """Per step, in us: the probes' time at the step's start, plan, end (with a snapshot every
    `snapshot_every` steps) and in all (what Health reports), and the wall time. Checks every
    frame against the device. `off`: the same loop without a probe (the wall time only)."""
    if arm == "off":
        return run_off(engine, steps, forward_ms)
    probe = make_probe(engine, "gather" if arm == "waited" else arm, 0 if arm == "waited" else MAX_HELD)
    stream_events: list = []
    times: dict[str, list[float]] = {k: [] for k in ("start", "plan", "end", "probes", "wall")}
    checked = snapshots = 0
    clock = time.perf_counter_ns

    try:
        for _ in range(steps):
            started, probe_ns = clock(), probe.recorder.probe_ns
            probe._guard(probe._before_step, scheduler_output(engine.req_ids, engine.tokens))
            t0 = clock()
            result = engine.prepare(probe.step)
            t1 = clock()
            probe._guard(probe._capture_mrv2_plan, engine.batch, result)
            t2 = clock()
            forward(engine.device, forward_ms)
            if engine.device.type != "cpu":
                done = torch.Event(device=engine.device)
                done.record(torch.accelerator.current_stream(engine.device))
                stream_events.append(done)
            t3 = clock()
            step = probe.step
            probe._guard(probe._after_step)
            if snapshot_every and step % snapshot_every == snapshot_every - 1:
                probe._guard(probe._record_snapshot)  # as `_after_step` does (its RankInfo needs vLLM)
                snapshots += 1
            t4 = clock()
            # Async scheduling: the host waits for the step before this one, never for this one.
            if len(stream_events) >= 2:
                stream_events.pop(0).synchronize()
            for key, ns in (("start", t0 - started), ("plan", t2 - t1), ("end", t4 - t3)):
                times[key].append(ns / 1000)
            times["probes"].append((probe.recorder.probe_ns - probe_ns) / 1000)  # what Health reports
            times["wall"].append((clock() - started) / 1000)
            checked += check_frames(probe.recorder.ring, engine)
        probe.recorder.drain(wait=True)
        checked += check_frames(probe.recorder.ring, engine)
        assert not probe._broken, "the probe failed; see the log"
        assert checked == steps + snapshots, f"{checked} of {steps} steps and {snapshots} snapshots read back"
    finally:
        probe.recorder.ring.close(unlink=True)
    return times


def run_off(engine: Engine, steps: int, forward_ms: float) -> dict[str, list[float]]:
    """The loop without tracing: the step's wall time."""
    stream_events: list = []
    walls = []
    clock = time.perf_counter_ns
    for step in range(steps):
        started = clock()
        engine.prepare(step)
        forward(engine.device, forward_ms)
        if engine.device.type != "cpu":
            done = torch.Event(device=engine.device)
            done.record(torch.accelerator.current_stream(engine.device))
            stream_events.append(done)
        if len(stream_events) >= 2:
            stream_events.pop(0).synchronize()
        walls.append((clock() - started) / 1000)
    return {"wall": walls}


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch operations dispatched while it is active (views, copies, kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def host_calls(device: torch.device, arm: str, requests: int, groups: int, tokens: int = 1) -> tuple[int, int]:
    """(torch operations, kernel launches) one step's plan and one snapshot take on `arm`'s path,
    warm (the gather's buffers and indices made by the step before)."""
    engine = Engine(device, requests, groups, tokens)
    probe = make_probe(engine, arm)
    found = []
    try:
        for _ in range(3):
            probe._before_step(scheduler_output(engine.req_ids, tokens))
            result = engine.prepare(probe.step)
            gather = probe._gatherer()
            launches = gather.launches
            with OpCounter() as counted:
                probe._capture_mrv2_plan(engine.batch, result)
                snapshot = probe._snapshot()
            found.append((counted.count, gather.launches - launches))
            probe._after_step()
            assert snapshot is not None and not probe._broken
            for r in snapshot.rows or []:
                r.numpy()
        probe.recorder.drain(wait=True)
        check_frames(probe.recorder.ring, engine)
    finally:
        probe.recorder.ring.close(unlink=True)
    return found[-1]


def check_frames(ring, engine: Engine) -> int:
    """Read the ring's frames; each step's plan must hold what its step wrote on the device, each
    snapshot the rows as its step left them."""
    n = 0
    for record in ring.records():
        frame = read_frame(bytes(record))
        record.release()
        if frame.kind is FrameKind.SNAPSHOT:
            n += check_snapshot(SnapshotCapture.from_parts(frame.parts), engine)
        if frame.kind is not FrameKind.STEP:
            continue
        capture = StepCapture.from_parts(frame.parts)
        qsl, positions, *groups = unpack_parts(capture.plan.part())
        step = capture.step
        assert np.array_equal(qsl, engine.batch.query_start_loc_np), f"step {step}: query starts"
        assert np.array_equal(positions, np.arange(engine.num_tokens) + step), f"step {step}: positions"
        for g in range(engine.groups):
            slots, rows, lens = groups[3 * g : 3 * g + 3]
            want_rows, want_slots = engine.expected(step, g)
            assert np.array_equal(lens, engine.lens[g]), f"step {step} group {g}: row lengths"
            assert np.array_equal(rows.reshape(want_rows.shape), want_rows), f"step {step} group {g}: rows"
            assert np.array_equal(slots, want_slots), f"step {step} group {g}: slots"
        n += 1
    return n


def check_snapshot(snapshot: SnapshotCapture, engine: Engine) -> int:
    step = snapshot.step
    assert snapshot.req_ids == engine.req_ids, f"snapshot {step}: requests"
    for g in range(engine.groups):
        assert np.array_equal(snapshot.lens[g], engine.lens[g]), f"snapshot {step} group {g}: row lengths"
        assert np.array_equal(snapshot.blocks[g], engine.expected_blocks(step, g)), f"snapshot {step} group {g}: rows"
    return 1


def measure(engine: Engine, arms: list[str], args) -> dict[str, dict[str, list[float]]]:
    """Each arm's times, alternating rounds (a warm-up run of each first)."""
    found: dict[str, dict[str, list[float]]] = {a: {} for a in arms}
    for arm in arms:
        run(engine, 20, args.forward_ms, arm, args.snapshot_every)  # warm up: pinned buffers, kernels, caches
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else reversed(arms):
            for key, values in run(engine, args.steps, args.forward_ms, arm, args.snapshot_every).items():
                found[arm].setdefault(key, []).extend(values[10:])
    return found


TARGET_PROBES_US = 100.0  # the probes' host time per step on a device, at 64 requests and 4 groups and at 256


def table(found: dict[str, dict[str, list[float]]], device: torch.device | None = None) -> None:
    print("us per step, median (p99):")
    print(f"{'arm':>10} {'step start':>16} {'plan':>16} {'step end':>16} {'probes':>16} {'wall':>16}")
    for arm, times in found.items():
        cells = [
            f"{np.median(times[k]):.1f} ({np.percentile(times[k], 99):.0f})" if k in times else "-"
            for k in ("start", "plan", "end", "probes", "wall")
        ]
        print(f"{arm:>10} " + " ".join(f"{c:>16}" for c in cells))
    if device is not None and device.type != "cpu" and "gather" in found:
        probes = np.median(found["gather"]["probes"])
        verdict = "met" if probes <= TARGET_PROBES_US else "NOT met"
        print(f"    gather: probes {probes:.1f} us per step, target <= {TARGET_PROBES_US:.0f} us: {verdict}")
    if "off" in found:
        off = np.median(found["off"]["wall"])
        for arm, times in found.items():
            if arm != "off":
                print(f"{arm:>10}: wall {np.median(times['wall']) / off - 1:+.1%} against off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each arm")
    parser.add_argument("--forward-ms", type=float, default=8.0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--snapshot-every", type=int, default=16, help="steps between snapshots (0: none)")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="also a prefill step of N tokens (0: none)")
    parser.add_argument("--waited", action="store_true", help="also the gather with each step's end waiting")
    parser.add_argument("--no-counts", action="store_true", help="skip the host-call counts")
    parser.add_argument("--device", default=None, help="default: the accelerator torch finds")
    args = parser.parse_args()
    if args.device is None:
        if not torch.accelerator.is_available():
            raise SystemExit("no accelerator here: this benchmark measures device copies (--device cpu checks it)")
        args.device = torch.accelerator.current_accelerator().type
    device = torch.device(args.device)
    if device.type == "cpu":  # one thread: on a busy host torch's parallel copies wait for descheduled threads
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(
        f"{name}: {args.requests} requests, {args.groups} KV groups, forward pass {args.forward_ms} ms, "
        f"a snapshot every {args.snapshot_every or 'no'} steps"
    )
    if not args.no_counts:
        print("host calls per step (a plan and a snapshot): torch operations + kernel launches")
        print(f"{'groups':>6} {'requests':>8} {'per-tensor':>12} {'gather':>12}")
        for groups in (1, 4):
            for requests in (1, 64, 256):
                cells = [host_calls(device, arm, requests, groups) for arm in ("per-tensor", "gather")]
                print(f"{groups:>6} {requests:>8} " + " ".join(f"{f'{o} + {k}':>12}" for o, k in cells))
    arms = [*ARMS, "waited"] if args.waited else list(ARMS)
    found = measure(Engine(device, args.requests, args.groups), arms, args)
    print(f"every frame read back matched the device ({args.rounds} rounds of {args.steps} steps per arm)")
    table(found, device)
    if args.prefill_tokens:
        tokens = max(1, args.prefill_tokens // args.requests)
        print(f"prefill steps: {tokens} tokens for each of {args.requests} requests")
        table(measure(Engine(device, args.requests, args.groups, tokens), list(ARMS), args))


if __name__ == "__main__":
    main()
