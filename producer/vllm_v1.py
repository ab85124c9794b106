"""Probes for vLLM's V1 model runner (vllm/v1/worker/gpu_model_runner.py), the CPU default.

Four attach points on one runner instance, nothing else touched:

* `execute_model(scheduler_output)`: the step's input, as the scheduler
  handed it to this worker, and the step counter (every call counts, so all
  ranks of an engine agree on step numbers);
* `_build_attention_metadata(..., slot_mappings=...)`: the plan attention
  used, read after the runner built it: the per-group slot mappings (the very
  tensors the KV write reads) and block-table rows. Never recomputed;
* `_dummy_run(...)`: dummy, profile and warm-up runs, recorded as such;
* `_get_slot_mappings(...)`, wrapped for the length of a dummy run only (a
  real step calls vLLM's own): the per-group slot mappings its forward context
  carries, read once the run is over (what its KV writes used), the plan of a
  dummy run that builds no attention metadata (every one on a runner without
  FULL CUDA graphs).

A drafter that writes KV (EAGLE-style, `runner.drafter`) is probed too: its
`propose` (each request's tokens in the first pass) and `_get_slot_mapping`
(called once per pass, right before the pass writes with the slots it
leaves in `_slot_mapping_buffer`); the runner's `sample_tokens`, where the
drafter runs, closes the step. Without them the capability
`drafter_kv_writes` is recorded unavailable and the rest still records.

On the hot path the probes copy a few arrays and write the step as one frame
into the rank's ring, right at the plan's capture when nothing joins the step
later (no drafter, no KV connector), else at the step's end; building, packing
and encoding happen in the rank's recorder process (`ring_writer`). A probe
never raises into the engine: a failure is logged once and the probe stops
recording.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvledger.producer import records
from kvledger.producer.capture import (
    ContentCapture,
    DraftPassCapture,
    PlanCapture,
    PlanHeader,
    RequestIndex,
    SnapshotCapture,
    StepCapture,
    StepHeader,
)
from kvledger.producer.chains import PrefixChains
from kvledger.producer.config import IN_FLIGHT_ATTR, TraceAction, TraceConfig, resolve_engine_id
from kvledger.producer.content import GroupRows, SealTracker, digest_blocks, group_pages
from kvledger.producer.frames import RepeatedIds, as_array, pack_parts, prefix_max, scheduler_fields
from kvledger.producer.records import RankIdentity
from kvledger.producer.ring_writer import SUPERVISE_EVERY, RingWriter
from kvledger.producer.staging import Staged, StagingFull, StagingPool
from kvledger.producer.vllm_connector import attach_connector_probe
from kvledger.schemas.events import KvPlacement, RankInfo
from kvledger.schemas.kinds import CONTENT_DIGESTS, STEP_INPUT, Declaration, Runner, StepKind

log = logging.getLogger("kvledger.producer")
REAL = StepKind.REAL  # read once: an enum member's lookup costs ~70 ns, on the engine thread every step


def kv_group_kind(spec: Any) -> tuple[str, int | None]:
    """(kind, sliding window) of a vLLM KV cache spec, by class name so any version reads."""
    names = {c.__name__ for c in type(spec).__mro__}
    window = getattr(spec, "sliding_window", None)
    if "MambaSpec" in names:
        return "MAMBA", None
    if "SlidingWindowSpec" in names or window:
        return "SLIDING_WINDOW", window
    # Only the exact classes: subclasses and other attention specs (chunked local, sinks, circular
    # buffers, sparse sources) have managers of their own, which may place the null block in rows
    # or address blocks otherwise: not modelled, counted unchecked (OTHER).
    exact = type(spec).__name__
    if exact == "MLAAttentionSpec":
        return "MLA", None
    if exact == "FullAttentionSpec":
        return "FULL_ATTENTION", None
    return "OTHER", None


def kv_layouts(kv_config: Any, bound: dict | None = None) -> list[list | None]:
    """Per KV cache group, where its layers keep their blocks (`KvPlacement`s), from the config the runner
    allocated by; None for a group whose placement cannot be read.

    vLLM's `KVCacheTensor` (0.32) places a run of layers in the rank's backing allocation: layer l's page
    of block b at `offset + l * layer_stride + b * block_stride`, the runner's per-layer views built from
    exactly these numbers (`allocate_kv_cache`). Older configs (`shared_by`: one raw tensor per layer
    position, reshaped by each layer) and layers without views (state groups addressing the allocation
    themselves) are not read: their groups' layouts stay unknown. Where the runner bound views to its
    layers (`bound`: the forward context's layers, their `kv_cache`), the first layer of each run must
    start where the placement says and stride blocks alike, else the group's layout is unknown: a
    platform that allocates otherwise than the config says is counted, never misjudged.
    """
    groups = kv_config.kv_cache_groups
    layouts: list[list | None] = [[] for _ in groups]
    group_of = {name: gid for gid, group in enumerate(groups) for name in group.layer_names}
    for tensor in getattr(kv_config, "kv_cache_tensors", None) or ():
        names = getattr(tensor, "layers", None)
        gid = group_of.get(names[0]) if names else None
        if gid is None or not hasattr(tensor, "block_stride"):
            return [None] * len(groups)
        spec = groups[gid].kv_cache_spec
        spec = getattr(spec, "kv_cache_specs", {}).get(names[0], spec)  # one spec of a uniform-type group
        layout = layouts[gid]
        if (
            layout is None
            or not getattr(spec, "has_layer_views", True)
            or not _view_agrees((bound or {}).get(names[0]), tensor, kv_config.num_blocks)
        ):
            layouts[gid] = None
            continue
        where = 1 if getattr(tensor, "host_resident", False) else 0  # a host pool is an allocation of its own
        stride, page = tensor.block_stride, spec.page_size_bytes
        layout.append(KvPlacement(where, tensor.offset, tensor.layer_stride, stride, len(names), page))
    return [layout or None for layout in layouts]


def _view_agrees(layer: Any, tensor: Any, num_blocks: int) -> bool:
    """The view a layer was bound (if any can be read) starts at the placement's offset and strides
    manager blocks by its block stride (a view of kernel blocks: `ratio` of them per manager block)."""
    view = getattr(layer, "kv_cache", None)
    if isinstance(view, (list, tuple)):
        view = view[0] if view else None
    if view is None or not hasattr(view, "untyped_storage") or view.dim() == 0:
        return True  # nothing bound to compare with: the config is what vLLM's allocator builds views from
    offset = view.data_ptr() - view.untyped_storage().data_ptr()
    ratio = max(view.shape[0] // num_blocks, 1)
    return offset == tensor.offset and view.stride(0) * view.element_size() * ratio == tensor.block_stride


class KVTraceViolation(RuntimeError):
    """`action: raise`: this step's KV addressing disagrees with the ledger."""

    def __init__(self, violations: list):
        self.violations = violations
        lines = [f"{v.where()}: {v.detail}" for v in violations[:5]]
        super().__init__(
            "kv_trace: " + "; ".join(lines) + (f" (+{len(violations) - 5} more)" if len(violations) > 5 else "")
        )


@dataclass(frozen=True)
class AttachPoint:
    """A runner method a probe wraps, and the capability it records."""

    method: str
    capability: str
    params: tuple[str, ...] = ()  # parameters the wrapper reads

    def missing(self, runner: Any) -> str | None:
        """Why this vLLM's runner cannot be probed here, or None."""
        where = f"{type(runner).__name__}.{self.method}"
        target = getattr(runner, self.method, None)
        if not callable(target):
            return f"{where} not found"
        try:
            names = inspect.signature(target).parameters
        except (TypeError, ValueError):  # a C function or the like: trust it
            return None
        absent = [p for p in self.params if p not in names]
        return f"{where} has no parameter {', '.join(absent)}" if absent else None


class V1RunnerProbe:
    """Records one runner's steps into a per-rank recorder."""

    runner_name = Runner.V1
    frame_at_plan = True  # this runner's plan capture may write the step's frame (`_frame_at_plan`)

    def __init__(self, runner: Any, config: TraceConfig):
        self.runner = runner
        self.config = config
        self.index = RequestIndex()
        self.step = -1
        self.recorder: RingWriter | None = None
        self._input: Any = None  # this step's SchedulerOutput, until its frame is written
        self._in_flight = -1  # steps the engine core had in flight when it scheduled this one; -1: not said
        self._traced = False  # this step is recorded (tracing was not paused when it began)
        # The step's frame is written when its plan is captured, while what the probe reads is still
        # warm in the caches, not at the step's end after the forward pass (13-15 us less of a
        # 64-request step's ~60 in a CPU engine): set at attach when nothing else joins or precedes
        # it later in the step (a drafter's passes, a KV connector's events).
        self._frame_at_plan = False
        self._writes_at_plan = False
        self._plan: PlanCapture | None = None
        self.staging = StagingPool()
        # Every buffer the plan reads is host memory (a CPU engine): copied at once, in one call.
        self._on_host = getattr(getattr(runner, "device", None), "type", "cpu") == "cpu"
        self._layout: PlanLayout | None = None  # where the plan is read, resolved once per input batch
        # The batch's request ids, in the runner's order and in the scheduler's: encoded only when
        # they change (a decoding batch keeps them step after step).
        self._batch_ids, self._scheduled_ids = RepeatedIds(), RepeatedIds()
        # Step-input fields this vLLM's SchedulerOutput lacks, as `scheduler_fields` reports them (this
        # step's; all seen so far), and the steps recorded without some: see `_fields_missing`.
        self._missing_now: set[str] = set()
        self.fields_missing: set[str] = set()
        self.steps_missing_fields = 0
        self._dummy_kind: str | None = None
        # Inside a dummy run: the slot mappings its forward context carries, by group (the tensors,
        # read once the run is over: what its KV writes went through, fill included).
        self._dummy_slots: dict[int, Any] | None = None
        # `_get_slot_mappings` as vLLM has it and as traced, swapped in for a dummy run only.
        self._slot_mappings: tuple[Callable, Callable] | None = None
        self._broken = False
        # Set by kvledger.producer.plugin.pause_tracing: steps are counted, nothing recorded
        # (the ledger resyncs at the next snapshot after resume_tracing).
        self.paused = False
        self._checker = None  # the ledger core, in raise mode
        self._chains: PrefixChains | None = None  # in raise mode, the new requests' prefix chains
        self._violations: list = []
        self._drafter: Any = None  # set when the drafter's KV writes are recorded
        self.drafter_capabilities: list[tuple[str, bool, str | None]] = []
        self._drafts: list[DraftPassCapture] = []  # this step's drafter passes
        self._draft_qsl: np.ndarray | None = None  # inside `propose`: the first pass's query starts
        self._next_pass = 0
        self._awaiting_sample = False  # execute_model left sampling (and drafting) to sample_tokens
        self._drafts_lost = False  # a pass of this step could not be copied
        self._draft_views: dict[str, tuple[Any, np.ndarray | None]] = {}  # drafter buffer -> host view
        self.content: ContentProbe | None = None  # set when sealed blocks are digested
        self.content_capabilities: list[tuple[str, bool, str | None]] = []
        self._content: ContentCapture | None = None  # this step's digests

    # -- attach ----------------------------------------------------------------------------
    def attach_points(self) -> list[tuple[AttachPoint, Callable]]:
        """The runner methods this adapter wraps, each with its wrapper factory."""
        return [
            (AttachPoint("execute_model", "step_input", ("scheduler_output",)), self._wrap_execute_model),
            (
                AttachPoint("_build_attention_metadata", "step_plan", ("num_tokens", "num_reqs", "slot_mappings")),
                self._wrap_build_metadata,
            ),
            (AttachPoint("_dummy_run", "dummy_runs", ("num_tokens", "is_profile")), self._wrap_dummy_run),
            (AttachPoint("_get_slot_mappings", "dummy_run_plans"), self._wrap_slot_mappings),  # reads its result
        ]

    def attach(self) -> None:
        self.unavailable: dict[str, str] = {}
        for point, wrap in self.attach_points():
            why = point.missing(self.runner)
            if why is not None:  # this vLLM lacks the target: report it, record the rest
                self.unavailable[point.capability] = why
                log.warning("kv_trace: %s not recorded: %s", point.capability, why)
                continue
            setattr(self.runner, point.method, wrap(getattr(self.runner, point.method)))
        self.drafter_capabilities = self._attach_drafter()
        self.content_capabilities = self._attach_content()
        # `raise` checks on the engine thread, so a step can fail; `log` in the recorder process,
        # off the engine's interpreter; `record` leaves the checking to the stream workers.
        if self.config.action is TraceAction.RAISE:
            from kvledger.stream_app.core import Ledger

            self._checker = Ledger()
        self.recorder = RingWriter(self._identity(), self.config)
        self.connector_capabilities = attach_connector_probe(self.runner, self._record, lambda: self.step)
        self.place_step_frames(no_connector=getattr(self.runner.vllm_config, "kv_transfer_config", None) is None)
        self._record(self._rank_info())

    def place_step_frames(self, no_connector: bool) -> None:
        """Where a step's frame is written, once the drafter, the checker and the digests are known:
        at the plan's capture when nothing joins or precedes it later in the step (a drafter's
        passes, a KV connector's events), and there of its pieces (`_capture_plan`) when nothing of
        it waits or is checked here (a host engine's plan, copied when taken; no `raise`; no digests)."""
        self._frame_at_plan = self.frame_at_plan and self._drafter is None and no_connector
        self._writes_at_plan = self._frame_at_plan and self._on_host and self._checker is None and self.content is None

    def capabilities(self) -> list[tuple[str, bool, str | None]]:
        points = [point.capability for point, _ in self.attach_points()]
        own = [(name, name not in self.unavailable, self.unavailable.get(name)) for name in points]
        own += self.drafter_capabilities + self.content_capabilities
        # Configurations the checks do not model, declared so the ledger counts them unchecked
        # (a probe here that records what a declaration would void speaks for itself).
        recorded = {name for name, _, _ in own}
        declared = [d for d in records.config_declarations(self.runner.vllm_config) if d[0] not in recorded]
        return own + self.connector_capabilities + declared

    def _wrap_execute_model(self, execute_model: Callable) -> Callable:
        def traced_execute_model(scheduler_output, *args, **kwargs):
            self._guard(self._before_step, scheduler_output)
            try:
                result = execute_model(scheduler_output, *args, **kwargs)
            except BaseException:
                self._guard(self._after_step)
                raise
            if result is None and self._drafts_follow():
                self._awaiting_sample = True  # recorded once the drafter has written too
                return result
            self._guard(self._after_step)
            self._raise_found()
            return result

        return traced_execute_model

    def _wrap_build_metadata(self, build_metadata: Callable) -> Callable:
        def traced_build_metadata(*args, **kwargs):
            result = build_metadata(*args, **kwargs)
            self._guard(self._capture_plan, kwargs)
            return result

        return traced_build_metadata

    def _wrap_dummy_run(self, dummy_run: Callable) -> Callable:
        def traced_dummy_run(num_tokens, *args, **kwargs):
            kind = (
                StepKind.PROFILE
                if kwargs.get("is_profile")
                else StepKind.WARMUP
                if kwargs.get("is_graph_capturing")
                else StepKind.DUMMY
            )
            self._guard(self._before_dummy, kind)
            try:
                return dummy_run(num_tokens, *args, **kwargs)
            finally:
                self._guard(self._after_dummy)

        return traced_dummy_run

    def _wrap_slot_mappings(self, get_slot_mappings: Callable) -> Callable:
        """vLLM's own, left in place: the traced one is swapped in by `_before_dummy` (every real
        step calls this method; only a dummy run's result is read)."""

        def traced_get_slot_mappings(*args, **kwargs):
            result = get_slot_mappings(*args, **kwargs)
            self._guard(self._hold_dummy_slots, result)
            return result

        self._slot_mappings = (get_slot_mappings, traced_get_slot_mappings)
        return get_slot_mappings

    def _hold_dummy_slots(self, result: tuple) -> None:
        """A dummy run's per-group slot mappings, the tensors its forward context's per-layer
        mapping points at, so that a run building no attention metadata (every dummy batch of a
        runner without FULL graphs) still has its writes recorded."""
        by_group, _ = result
        if by_group is not None:  # None before the KV cache exists (the profile run): nothing written
            self._dummy_slots = {g: by_group[g] for g in by_group}  # by key: the tensors themselves

    def _raise_found(self) -> None:
        """`raise`: fail the step, before its output is returned, with what the check found."""
        if self._violations:
            found, self._violations = self._violations, []
            raise KVTraceViolation(found)

    def close(self, timeout: float = 5.0) -> None:
        if self.steps_missing_fields:
            log.warning(
                "kv_trace: %d steps recorded without %s",
                self.steps_missing_fields,
                ", ".join(sorted(self.fields_missing)),
            )
        if self.recorder is not None:
            self.recorder.close(self.step, timeout)
            self.recorder = None

    def _guard(self, fn, *args) -> None:
        """Run a probe; on failure log once and go quiet, never raise into the engine."""
        if self._broken or self.recorder is None:
            return
        started = time.perf_counter_ns()
        try:
            fn(*args)
        except StagingFull as exc:  # device copies are behind: this step goes without its plan
            log.warning("kv_trace: step %d recorded without its plan: %s", self.step, exc)
        except Exception:
            self._broken = True
            log.exception("kv_trace: probe failed; this rank stops recording")
        self.recorder.probe_ns += time.perf_counter_ns() - started

    # -- identity and layout ---------------------------------------------------------------------
    def _identity(self) -> RankIdentity:
        from vllm.distributed import parallel_state

        vllm_config = self.runner.vllm_config
        kv_transfer = vllm_config.kv_transfer_config
        connector_id = kv_transfer.engine_id if kv_transfer is not None else None
        engine_id = resolve_engine_id(self.config.engine_id, connector_id, vllm_config.instance_id)
        return RankIdentity(
            engine_id,
            vllm_config.parallel_config.data_parallel_index,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pp_group().rank_in_group,
            incarnation=time.time_ns() ^ os.getpid(),
        )

    def _rank_info(self) -> tuple[str, dict]:
        import vllm

        vllm_config = self.runner.vllm_config
        parallel = vllm_config.parallel_config
        kv_config = self.runner.kv_cache_config
        groups = []
        bound = getattr(getattr(self.runner, "compilation_config", None), "static_forward_context", None)
        layouts = kv_layouts(kv_config, bound)
        for gid, group in enumerate(kv_config.kv_cache_groups):
            kind, window = kv_group_kind(group.kv_cache_spec)
            block_size, num_blocks = group.kv_cache_spec.block_size, kv_config.num_blocks
            groups.append(records.kv_group(gid, kind, block_size, num_blocks, window, layouts[gid]))
        kv_transfer = vllm_config.kv_transfer_config
        role = {"kv_producer": "PREFILL", "kv_consumer": "DECODE", "kv_both": "BOTH"}.get(
            getattr(kv_transfer, "kv_role", None), "NONE"
        )
        return records.rank_info(
            dp_size=parallel.data_parallel_size,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            kv_groups=groups,
            vllm_version=vllm.__version__,
            runner=self.runner_name,
            pd_role=role,
            capabilities=self.capabilities(),
            full_rows=self.config.full_rows,
            snapshot_interval=self.config.snapshot_interval,
        )

    # -- steps -------------------------------------------------------------------------------------
    # The engine thread only copies and writes frames; the records are built in the recorder
    # process, in frame order (or here, at once, in raise mode), so the request index is only
    # ever used in step order.
    def _before_step(self, scheduler_output) -> None:
        self.step += 1  # paused or not: step numbers stay those of the engine
        self._plan = self._input = None
        self._drafts, self._next_pass, self._awaiting_sample, self._drafts_lost = [], 0, False, False
        self._content = None
        self._traced = not self.paused
        if self.paused:
            if self.content is not None:
                self.content.stale = True
            return
        if self.content is not None:
            self.content.before_step(scheduler_output, self._held)
        self._input = scheduler_output  # its fields are encoded with the step's frame
        # Set by the engine core's batch queue (`plugin.note_in_flight`); absent on a synchronous one.
        self._in_flight = getattr(scheduler_output, IN_FLIGHT_ATTR, -1)

    def _record_input_step(self, written: tuple[PlanHeader, list] | None = None) -> None:
        """This step's frame: the scheduler's fields and the plan captured, if any; or, `written`,
        the plan's header and parts as a host engine's frame takes them at once (`_capture_plan`)."""
        scheduler_output, self._input = self._input, None
        fields = scheduler_fields(scheduler_output, self._scheduled_ids, self._missing_now)
        if self._missing_now:
            self._fields_missing()
        if written is None:
            self._record_step(REAL, fields)
            return
        plan, parts = written
        self.recorder.step_now(StepHeader(self.step, REAL, fields, plan, None, self._in_flight), parts)

    def _fields_missing(self) -> None:
        """This step's SchedulerOutput lacked fields the step input is read from (a vLLM without them,
        or one that renamed them). Read as nothing, they would tell the ledger "nothing preempted,
        zeroed or copied": the step is counted, and a field not missing before makes `step_input`
        (execute_model's capability) unavailable, naming them all, in a RankInfo recorded ahead of
        the step's frame."""
        self.steps_missing_fields += 1
        new = self._missing_now - self.fields_missing
        self._missing_now.clear()
        if not new:
            return
        self.fields_missing |= new
        why = (
            f"this vLLM's scheduler output has no {', '.join(sorted(self.fields_missing))} "
            "(absent in this version, or renamed): steps are recorded without them"
        )
        self.unavailable[STEP_INPUT] = why
        log.warning("kv_trace: step_input incomplete from step %d: %s", self.step, why)
        self._record(self._rank_info())

    def _after_step(self) -> None:
        if not self._traced:  # paused when the step began
            return
        step = self.step
        if self._input is not None:  # not written with its plan (`_frame_at_plan`), or it had none
            self._record_input_step()
        interval = self.config.snapshot_interval
        # A respawned recorder records under a new incarnation: announce the rank and resync now.
        respawned = step % SUPERVISE_EVERY == 0 and self.recorder.supervise()
        if respawned or (interval and step % interval == interval - 1):
            self._record(self._rank_info())
            self._record_snapshot()
            self._record_health(step)

    def _before_dummy(self, kind: str) -> None:
        self.step += 1
        self._plan, self._dummy_slots = None, None
        self._drafts, self._next_pass, self._drafts_lost = [], 0, False
        self._dummy_kind = kind
        if self._slot_mappings is not None:
            self.runner._get_slot_mappings = self._slot_mappings[1]

    def _after_dummy(self) -> None:
        kind, self._dummy_kind = self._dummy_kind, None
        held, self._dummy_slots = self._dummy_slots, None
        if self._slot_mappings is not None:
            self.runner._get_slot_mappings = self._slot_mappings[0]
        if self.paused:
            return
        if self._plan is None and held:  # no attention metadata built: the forward context's slots
            gids = sorted(held)
            self._plan = PlanCapture.of_dummy_run(gids, self._copy(PlanCapture.dummy_parts([held[g] for g in gids])))
        self._record_step(kind, None)

    def _record_step(self, kind: str, scheduler: tuple | None) -> None:
        """Record this step with the plan captured during it: as a frame the recorder builds, or
        built here in raise mode."""
        plan, self._plan = self._plan, None
        content, self._content = self._content, None
        in_flight = self._in_flight if scheduler is not None else -1
        capture = StepCapture(self.step, kind, scheduler, self._with_drafts(kind, plan), content, in_flight)
        if self._checker is None:
            self.recorder.step(capture)
        else:
            self._record(capture.record(self.index, self.config.full_rows, self._chains))

    def _record_snapshot(self) -> None:
        """The live requests now (`_snapshot`), as a frame the recorder builds, or built here in
        raise mode; none when the runner's rows could not be copied."""
        capture = self._snapshot()
        if capture is None:
            return
        if self._checker is None:
            self.recorder.snapshot(capture)
        else:
            self._record(capture.record(self.index))

    def _record_health(self, step: int) -> None:
        """A Health record, its counts completed by the recorder (the checker sees the rank's own)."""
        sent = self.recorder.health(step)
        if self._checker is not None and sent is not None:  # raise mode holds no frame
            body = sent.record(self.recorder.dropped, 0, 0)
            self._checker.apply(records.event(self.recorder.identity, sent.captured, 0, body))

    def _record(self, body, ready: Callable[[], bool] | None = None) -> None:
        """A built record, or a function building one: a connector's event, built now, or once
        `ready` says so (a transfer's digest, hashed off the engine thread; `raise` waits for it)."""
        if ready is not None and self._checker is None:
            self.recorder.body_when(ready, body)
            return
        body = body() if callable(body) else body
        seq = self.recorder.body(body)
        if self._checker is not None:  # raise: check on the engine thread, before the step returns
            if isinstance(body, RankInfo):  # the recorder's share is done here: chains at its groups
                self._chains = PrefixChains.of(body)
            found = self._checker.apply(records.event(self.recorder.identity, seq, 0, body))
            if found:
                self._violations += found

    def _capture_plan(self, kwargs: dict) -> None:
        """Copy what attention reads and writes this step (the buffers are reused next step)."""
        slot_mappings = kwargs.get("slot_mappings")
        num_reqs, num_tokens = kwargs.get("num_reqs"), kwargs.get("num_tokens")
        if self.paused or not slot_mappings or num_reqs is None or num_tokens is None:
            return
        runner = self.runner
        batch = runner.input_batch
        layout = self._layout
        if layout is None or not layout.serves(batch, runner.positions, slot_mappings):
            layout = self._layout = PlanLayout.of(runner, sorted(slot_mappings))
        if self._dummy_kind is not None:  # the batch's rows belong to real requests, not to this run
            slots = [slot_mappings[gid] for gid in layout.gids]  # tensors: `_copy` takes them either way
            self._plan = PlanCapture.of_dummy_run(layout.gids, self._copy(PlanCapture.dummy_parts(slots)))
            return
        groups = [g.parts(slot_mappings[g.gid], num_reqs) for g in layout.groups]
        qsl = (runner.query_start_loc.np, num_reqs + 1)
        parts = PlanCapture.plan_parts(qsl, layout.positions_prefix(num_tokens), groups)
        ids = self._batch_ids(batch.req_ids, num_reqs)
        if self._writes_at_plan and self._input is not None:  # the runner builds one plan per step
            # The step's frame now, of its pieces: no PlanCapture or StepCapture built, nothing
            # to wait for (13-16 us of a cold 64-request step, paired in a real engine); the
            # plan's parts packed in place in the frame (a list: a part of parts).
            self._record_input_step((PlanHeader(ids, num_tokens, layout.gids), [parts]))
            return
        arrays = self._copy(parts)
        if self.content is not None and self._input is not None and self._content is None:
            self._content = self.content.digest(batch, num_reqs, self.staging)
        self._plan = PlanCapture(ids, num_tokens, layout.gids, arrays)
        if self._frame_at_plan and self._input is not None:
            self._record_input_step()

    def _copy(self, parts: list) -> Any:
        """The plan's parts (host arrays, prefixes of them, tensors) copied now: on the host
        gathered into one frame part in one compiled call; on a device the tensors' copies
        started into one pinned buffer behind one event, without a stream synchronisation (the
        step's frame is written once they have landed)."""
        if self._on_host:  # a tensor among them (rare: a slot mapping not of its buffer) is viewed there
            return pack_parts(parts)
        tensors = [p for p in parts if hasattr(p, "is_cpu")]
        staged = iter(self.staging.stage_all(tensors) if tensors else ())  # one buffer, one event
        return [next(staged) if hasattr(p, "is_cpu") else np.array(as_array(p)) for p in parts]

    # -- content digests of sealed blocks ----------------------------------------------------------
    def _attach_content(self) -> list[tuple[str, bool, str | None]]:
        """Digest sealed blocks (kv_trace.content_digests), or say why this rank cannot."""
        if self.config.content_digests <= 0.0:
            return []
        why = self._content_unmodelled()
        if why is None:
            try:
                self.content = ContentProbe.of(self.runner, self.config)
            except (AttributeError, ValueError, RuntimeError) as exc:  # this vLLM lays its cache out otherwise
                why = f"the KV cache's pages cannot be located: {exc}"
        if why is not None:
            log.warning("kv_trace: %s not recorded: %s", CONTENT_DIGESTS, why)
            return [(CONTENT_DIGESTS, False, why)]
        return [(CONTENT_DIGESTS, True, None)]

    def _content_unmodelled(self) -> str | None:
        """Why this runner's sealed blocks cannot be told from those still written, or None."""
        tables = self.runner.input_batch.block_table
        return content_unmodelled(self.runner, [table.block_size for table in tables])

    def _held(self, req_id: str) -> tuple[Any, int] | None:
        """A live request's block ids per group and computed tokens, as the runner holds them."""
        state = self.runner.requests.get(req_id)
        return None if state is None else (state.block_ids, state.num_computed_tokens)

    # -- the drafter's KV writes -------------------------------------------------------------
    def drafter_attach_points(self, drafter: Any) -> list[tuple[Any, AttachPoint, Callable]]:
        """Where the drafter's writes are read: (object, method, wrapper factory)."""
        cap = Declaration.DRAFTER_KV_WRITES
        return [
            (self.runner, AttachPoint("sample_tokens", cap), self._wrap_sample_tokens),
            (drafter, AttachPoint("propose", cap, ("common_attn_metadata",)), self._wrap_propose),
            (drafter, AttachPoint("_get_slot_mapping", cap, ("num_tokens", "slot_mapping")), self._wrap_draft_slots),
        ]

    def _attach_drafter(self) -> list[tuple[str, bool, str | None]]:
        """Record the drafter's KV writes, or say why not; nothing for drafters without KV."""
        spec = getattr(self.runner, "speculative_config", None)
        uses_kv = getattr(spec, "uses_draft_kv_cache", None)
        if not callable(uses_kv) or not uses_kv() or not hasattr(self.runner, "drafter"):
            return []  # ngram, suffix, medusa write no KV; another runner: its declarations speak
        drafter = self.runner.drafter
        points = self.drafter_attach_points(drafter)
        why = unmodelled_drafter(drafter) or next((w for obj, p, _ in points if (w := p.missing(obj))), None)
        if why is not None:
            log.warning("kv_trace: %s not recorded: %s", Declaration.DRAFTER_KV_WRITES, why)
            return [(Declaration.DRAFTER_KV_WRITES, False, why)]
        for obj, point, wrap in points:
            setattr(obj, point.method, wrap(getattr(obj, point.method)))
        self._drafter = drafter
        return [(Declaration.DRAFTER_KV_WRITES, True, None)]

    def _drafts_follow(self) -> bool:
        """execute_model left sampling to sample_tokens, where the recorded drafter runs."""
        return self._drafter is not None and getattr(self.runner, "execute_model_state", None) is not None

    def _wrap_sample_tokens(self, sample_tokens: Callable) -> Callable:
        def traced_sample_tokens(*args, **kwargs):
            try:
                result = sample_tokens(*args, **kwargs)
            finally:
                if self._awaiting_sample:
                    self._awaiting_sample = False
                    self._guard(self._after_step)
            self._raise_found()
            return result

        return traced_sample_tokens

    def _wrap_propose(self, propose: Callable) -> Callable:
        def traced_propose(*args, **kwargs):
            self._guard(self._before_propose, kwargs.get("common_attn_metadata"))
            try:
                return propose(*args, **kwargs)
            finally:
                self._draft_qsl = None

        return traced_propose

    def _wrap_draft_slots(self, get_slot_mapping: Callable) -> Callable:
        def traced_get_slot_mapping(num_tokens, *args, **kwargs):
            result = get_slot_mapping(num_tokens, *args, **kwargs)
            self._guard(self._capture_draft_pass, num_tokens)
            return result

        return traced_get_slot_mapping

    def _recording(self) -> bool:
        live = self._input is not None or self._dummy_kind is not None
        return live and not self.paused and not self._drafts_lost

    def _before_propose(self, cad: Any) -> None:
        """The first pass runs over the target's tokens as `cad` lays them out; later passes over
        one token per request. A call without it leaves no layout: the step goes without its plan."""
        if not self._recording():
            return
        if cad is None:
            self._drafts_lost = True
            return
        self._draft_qsl = cad.query_start_loc_cpu.numpy()[: cad.num_reqs + 1].copy()
        self._next_pass = 0

    def _capture_draft_pass(self, num_tokens: int) -> None:
        """Copy the slots (and positions) the pass about to run writes with."""
        if not self._recording():
            return
        qsl, k = self._draft_qsl, self._next_pass
        try:
            slots = self._drafter_prefix("_slot_mapping_buffer", num_tokens)
            if qsl is None:  # outside `propose` (a dummy run): serves no request
                self._drafts.append(DraftPassCapture(k, slots, None, None, 0))
            else:
                num_real = int(qsl[-1]) if k == 0 else len(qsl) - 1
                positions = self._drafter_positions(num_real)
                self._drafts.append(DraftPassCapture(k, slots, positions, qsl, num_real))
        except StagingFull:  # a plan missing a pass would hide it: the step goes without its plan
            self._drafts_lost = True
            raise
        self._next_pass = k + 1

    def _drafter_prefix(self, name: str, n: int) -> Staged:
        """A copy of `drafter.<name>[:n]`, a buffer the drafter keeps across steps: on the host
        through a numpy view made once (a torch slice costs several times the copy)."""
        tensor = getattr(self._drafter, name)
        kept = self._draft_views.get(name)
        if kept is None or kept[0] is not tensor:  # first use, or vLLM replaced the buffer
            kept = self._draft_views[name] = (tensor, tensor.numpy() if tensor.is_cpu else None)
        view = kept[1]
        return Staged.host(view[:n].copy()) if view is not None else self.staging.stage(tensor[:n])

    def _drafter_positions(self, n: int) -> Staged:
        if not getattr(self._drafter, "uses_mrope", False):
            return self._drafter_prefix("positions", n)
        return self.staging.stage(self._drafter._get_positions(n)[0])  # M-RoPE: the text row

    def _with_drafts(self, kind: str, plan: PlanCapture | None) -> PlanCapture | None:
        """This step's plan carrying the drafter's passes (a dummy run's, on a plan of its own)."""
        drafts, self._drafts = self._drafts, []
        if self._drafts_lost:  # counted by the core as a step without its plan
            return None
        if not drafts:
            return plan
        if plan is None:
            if kind == StepKind.REAL:  # the target's plan is missing: so is the step's (counted as such)
                return None
            plan = PlanCapture.of_dummy_run([], PlanCapture.dummy_parts([]))
        plan.drafts, plan.draft_group = drafts, int(self._drafter.kv_cache_gid)
        return plan

    def _snapshot(self) -> SnapshotCapture | None:
        """The runner's request states, copied now (they change next step)."""
        states = self.runner.requests
        req_ids = list(states)
        groups = len(self.runner.kv_cache_config.kv_cache_groups)
        rows = [[states[r].block_ids[g] for r in req_ids] for g in range(groups)]
        return SnapshotCapture.of_rows(self.step, req_ids, [states[r].num_computed_tokens for r in req_ids], rows)


def _host_view(tensor: Any) -> np.ndarray | None:
    """A numpy view of a host tensor (None for a device's)."""
    return tensor.numpy() if tensor.is_cpu else None


@dataclass
class GroupLayout:
    """Where one KV cache group's plan is read: its block table's persistent buffers, with a numpy
    view of the rows in host memory made once (a torch slice and its `.numpy()` cost several times
    the copy)."""

    gid: int
    table: Any  # vLLM's BlockTable of the group
    lens: np.ndarray  # the rows' lengths (host)
    rows: np.ndarray | None  # every row attention reads (the device tensor's view; None on a device)

    @classmethod
    def of(cls, gid: int, table: Any) -> GroupLayout:
        # The rows attention reads: the device tensor, committed from the CPU mirror before this
        # step's slot mappings were built (a mirror that drifted misleads).
        rows = _host_view(table.get_device_tensor(1 << 30))  # all rows
        return cls(gid, table, table.num_blocks_per_row, rows)

    def parts(self, slots: Any, num_reqs: int) -> tuple[Any, Any, Any]:
        """(slot mapping, rows, row lengths) as `PlanCapture.plan_parts` takes a group's; the rows
        only as wide as the longest (far shorter than the table). On the host the slot mapping is
        read through its numpy view (one torch call: vLLM hands over a new slice every step), the
        width found as the rows are copied."""
        lens = (self.lens, num_reqs)
        if self.rows is not None:
            return slots.numpy(), (self.rows, num_reqs, self.lens), lens
        return slots, self.table.get_device_tensor(num_reqs)[:, : prefix_max(self.lens, num_reqs)], lens


@dataclass
class PlanLayout:
    """Where a V1 runner's plan is read, resolved once per input batch (vLLM replaces the batch,
    and its block tables with it, when it reinitialises the KV cache)."""

    batch: Any  # the runner's InputBatch these buffers belong to
    positions: Any  # the runner's positions buffer (a tensor)
    positions_view: np.ndarray | None  # its numpy view on the host
    gids: list[int]  # the KV cache groups with a slot mapping, in order
    groups: list[GroupLayout]
    gid_set: frozenset[int]  # the same, to compare a step's slot mappings with

    @classmethod
    def of(cls, runner: Any, gids: list[int]) -> PlanLayout:
        batch, positions = runner.input_batch, runner.positions
        groups = [GroupLayout.of(gid, batch.block_table[gid]) for gid in gids]
        return cls(batch, positions, _host_view(positions), gids, groups, frozenset(gids))

    def serves(self, batch: Any, positions: Any, slot_mappings: dict) -> bool:
        """Whether this layout is the runner's now, for these groups."""
        return batch is self.batch and positions is self.positions and slot_mappings.keys() == self.gid_set

    def positions_prefix(self, n: int) -> Any:
        view = self.positions_view
        return (view, n) if view is not None else self.positions[:n]


def unmodelled_drafter(drafter: Any) -> str | None:
    """Why this drafter's passes are not the ones the probe models, or None."""
    name = type(drafter).__name__
    positions = "_get_positions" if getattr(drafter, "uses_mrope", False) else "positions"
    for attr in ("_slot_mapping_buffer", "kv_cache_gid", positions):
        if not hasattr(drafter, attr):
            return f"{name}.{attr} not found"
    if drafter.kv_cache_gid < 0:
        return f"{name}'s layers are in no KV cache group"
    if getattr(drafter, "needs_extra_input_slots", False):
        return f"{name} adds input slots per request in its first pass (parallel drafting): not modelled"
    if getattr(drafter, "constant_draft_positions", False):
        return f"{name} keeps its positions across passes: not modelled"
    propose = getattr(type(drafter), "propose", None)
    if getattr(propose, "__qualname__", "") != "SpecDecodeBaseProposer.propose":
        return f"{name}.propose is its own, not the pass loop the probe models"
    return None


def content_unmodelled(runner: Any, kernel_block_sizes: list[int]) -> str | None:
    """Why a runner's sealed blocks cannot be told from those still written here, or None;
    `kernel_block_sizes`: per group, the block size its rows address."""
    vllm_config = runner.vllm_config
    if vllm_config.kv_transfer_config is not None:
        return "a KV connector writes blocks outside the runner's plan (loads, offloads): not modelled"
    spec = vllm_config.speculative_config
    if spec is not None and getattr(vllm_config.scheduler_config, "async_scheduling", False):
        return "async scheduling with speculative decoding: a request's computed tokens run ahead of its KV"
    if not getattr(runner, "kv_caches", None):
        return "the runner holds no KV cache tensors"
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if kernel_block_sizes[gid] != group.kv_cache_spec.block_size:
            return f"group {gid}'s kernel blocks ({kernel_block_sizes[gid]} tokens) split the scheduler's"
    return None


class ContentProbe:
    """What a runner's sealed-block digests read: its block tables, computed tokens and KV pages
    (each runner's adapter says where it holds them); the rules are content.SealTracker's."""

    def __init__(self, tracker: SealTracker, groups: list[tuple[int, int, bool, bool]], pages: dict[int, list]):
        self.tracker = tracker
        self.groups = groups  # per group: id, block size, seals, state
        self.pages = pages
        self.stale = False  # tracing was paused: every seal is forgotten at the next step
        self._reading: list[str] = []
        self._released: dict[int, list] = {}
        self._overwritten: list[int] = []
        self._zeroed: list[int] = []

    @classmethod
    def of(cls, runner: Any, config: TraceConfig) -> ContentProbe:
        kv_config = runner.kv_cache_config
        groups = []
        for gid, group in enumerate(kv_config.kv_cache_groups):
            kind, _ = kv_group_kind(group.kv_cache_spec)
            groups.append((gid, group.kv_cache_spec.block_size, kind in _SEALING, kind in _STATE))
        pages = group_pages(kv_config, runner.kv_caches[0])
        tracker = SealTracker(kv_config.num_blocks, config.content_digests, config.content_sweep)
        return cls(tracker, groups, pages)

    def before_step(self, so: Any, held: Callable[[str], tuple[Any, int] | None]) -> None:
        """Before the runner applies the step: who reads sealed blocks again, and what finished or
        preempted requests let go (their states are gone once the runner has applied it);
        `held(req_id)`: a live request's block ids per group and computed tokens, or None."""
        if self.stale:
            self.tracker.reset()
            self.stale = False
        self._reading = [r.req_id for r in so.scheduled_new_reqs if r.num_computed_tokens]
        self._reading += list(getattr(so.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        released: dict[int, list] = {}
        for req_id in (*so.finished_req_ids, *(getattr(so, "preempted_req_ids", None) or ())):
            state = held(req_id)
            if state is None:
                continue
            block_ids, computed = state
            for gid, block_size, seals, _ in self.groups:
                if seals:
                    released.setdefault(gid, []).extend(block_ids[gid][: computed // block_size])
        self._released = released
        copies = getattr(so, "kv_cache_block_copies", None) or ()
        dsts = [c.dst if hasattr(c, "dst") else tuple(c)[1] for c in copies]
        zero = list(getattr(so, "new_block_ids_to_zero", None) or ())
        self._overwritten = [*zero, *dsts]
        self._zeroed = sorted(set(zero) - set(dsts))  # a copy's destination is written after zeroing

    def digest(self, batch: Any, num_reqs: int, staging) -> ContentCapture | None:
        """The step's digests from the V1 runner's input batch (its rows' host mirrors)."""
        tables = []
        for gid, *_ in self.groups:
            table = batch.block_table[gid]
            lens = table.num_blocks_per_row[:num_reqs]
            width = int(lens.max()) if num_reqs else 0
            tables.append((table.block_table.np[:num_reqs, :width], lens))
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        return self.digest_rows(tables, computed, batch.req_ids[:num_reqs], staging)

    def digest_rows(
        self, tables: list[tuple[np.ndarray, np.ndarray]], computed: np.ndarray, req_ids: list[str], staging
    ) -> ContentCapture | None:
        """The step's digests, once the runner has applied it and before its forward pass: per
        group the batch's rows `[requests, widest]` and their lengths, each request's computed
        tokens and id, in batch order."""
        import torch

        rows = [
            GroupRows(gid, block_size, seals, state, row, lens)
            for (gid, block_size, seals, state), (row, lens) in zip(self.groups, tables, strict=True)
        ]
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        reading = np.fromiter((index[r] for r in self._reading if r in index), np.int64)
        released = {gid: np.asarray(b, np.int64) for gid, b in self._released.items()}
        due = self.tracker.due(
            rows,
            np.asarray(computed, np.int64),
            reading,
            released,
            np.asarray(self._overwritten, np.int64),
            np.asarray(self._zeroed, np.int64),
            req_ids,
        )
        if not due:
            return None
        parts = []
        for gid, blocks in zip(due.groups, due.blocks, strict=True):
            pages = self.pages[gid]
            parts.append(digest_blocks(pages, torch.from_numpy(blocks.astype(np.int64)).to(pages[0].device)))
        digests = staging.stage(torch.cat(parts))
        groups = np.repeat(np.asarray(due.groups, np.int32), [b.size for b in due.blocks])
        reasons = [r for r, b in zip(due.reasons, due.blocks, strict=True) for _ in range(b.size)]
        return ContentCapture(groups, np.concatenate(due.blocks).astype(np.int32), digests, reasons)


_SEALING = ("FULL_ATTENTION", "MLA")
_STATE = ("MAMBA", "OTHER")
