"""The drafter's KV writes (EAGLE-style drafters): recorded per pass in StepPlan.draft_writes and
checked by the core with the target's write rule (the slot formula on the ledger's rows, at
positions the scheduler reserved, lookahead included); unavailable where the drafter cannot be
recorded, and then counted unchecked per planned step, never silent, never a violation."""

from __future__ import annotations

import random
import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.producer.vllm_v1 import AttachPoint, V1RunnerProbe, unmodelled_drafter
from kvledger.schemas import LEDGER_EVENT, SingleObjectCodec
from kvledger.schemas.events import event_of, events_of
from kvledger.stream_app.core import Ledger
from tests.e2e.conftest import vllm_python

BS = 4
K = 3  # draft tokens per step: passes 0 .. K-1, the scheduler reserves K lookahead slots
NUM_BLOCKS = 128


def slot_of(row: list[int], pos: int) -> int:
    return row[pos // BS] * BS + pos % BS


@dataclass
class Req:
    index: int
    prompt: int
    row: list[int] = field(default_factory=list)
    computed: int = 0


class Eagle:
    """A rank running an EAGLE-style drafter, as vLLM 0.32's V1 runner does: each step the target
    writes its scheduled tokens; drafter pass 0 writes the same slots, pass k > 0 one token per
    request at (its last accepted position + k), inside the K lookahead slots the scheduler added."""

    def __init__(self, drafter_recorded: bool = True, seed: int = 0, chunk: int = 8):
        self.rng = random.Random(seed)
        self.chunk = chunk
        self.rank, self.seq, self.events = RankIdentity("eagle", incarnation=5), 0, []
        self.next_block, self.step_no, self.live = 1, 0, []
        self.next_index = 0
        cap = ("drafter_kv_writes", True, None) if drafter_recorded else ("drafter_kv_writes", False, "test")
        info = records.rank_info(
            dp_size=1,
            tp_size=1,
            pp_size=1,
            kv_groups=[records.kv_group(0, "FULL_ATTENTION", BS, NUM_BLOCKS)],
            vllm_version="t",
            runner="v1",
            capabilities=[("step_input", True, None), ("step_plan", True, None), cap],
        )
        self.drafter_recorded = drafter_recorded
        self.add(info)

    def add(self, body) -> None:
        self.events.append(records.envelope(self.rank, self.seq, 0, body))
        self.seq += 1

    def arrive(self, prompt: int) -> None:
        self.live.append(Req(self.next_index, prompt))
        self.next_index += 1

    def _grant(self, req: Req, upto_tokens: int) -> list[int]:
        """Blocks so the row covers `upto_tokens` tokens (fresh ids, never reused here)."""
        need = -(-upto_tokens // BS) - len(req.row)
        blocks = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(blocks)
        req.row += blocks
        return blocks

    def step(self, fault=None) -> dict:
        """One step of every live request; `fault(step, passes, reqs)` may edit the draft passes."""
        n, new, cached, appends = self.step_no, [], [], []
        reqs, slots, last_valid = [], [], []
        for req in self.live:
            prefill = req.computed < req.prompt
            scheduled = min(req.prompt - req.computed, self.chunk) if prefill else 1 + K
            had_row = bool(req.row)
            granted = self._grant(req, req.computed + scheduled + K)
            if had_row:
                cached.append((req.index, req.computed, scheduled))
                if granted:
                    appends.append((req.index, 0, granted))
            else:
                new.append(
                    records.new_request(req.index, f"r{req.index}", [req.row], req.computed, req.prompt, scheduled)
                )
            accepted = scheduled - 1 if prefill else self.rng.randint(0, K)
            reqs.append((req, scheduled))
            slots += [slot_of(req.row, p) for p in range(req.computed, req.computed + scheduled)]
            last_valid.append(req.computed + accepted)
        passes = self._passes(reqs, slots, last_valid)
        if fault is not None:
            fault(n, passes, reqs)
        group = records.group_plan(0, np.array(slots), len(slots), [np.array(r.row) for r, _ in reqs])
        drafts = (
            [records.draft_pass(0, k, c, f, np.array(s)) for k, c, f, s in passes] if self.drafter_recorded else None
        )
        plan = records.step_plan(
            [r.index for r, _ in reqs], [t for _, t in reqs], [r.computed for r, _ in reqs], [group], drafts
        )
        inp = records.step_input(new_reqs=new, cached=cached, appends=appends)
        self.add(records.step(n, "REAL", inp, plan))
        for (req, _), lv in zip(reqs, last_valid, strict=True):
            req.computed = lv + 1  # a prefill chunk's tokens, or the sampled token and the accepted drafts
        self.step_no += 1
        return plan

    def _passes(self, reqs, slots, last_valid) -> list[tuple[int, list[int], list[int], list[int]]]:
        """(pass index, tokens per request, first positions, slot mapping with padding) per pass."""
        pad = [-1] * self.rng.randint(0, 2)  # batch padding after the real entries
        passes = [(0, [t for _, t in reqs], [r.computed for r, _ in reqs], slots + pad)]
        for k in range(1, K):
            positions = [lv + k for lv in last_valid]
            ks = [slot_of(r.row, p) for (r, _), p in zip(reqs, positions, strict=True)]
            passes.append((k, [1] * len(reqs), positions, ks + pad))
        return passes

    def dummy(self, slots: list[int]) -> None:
        """A dummy run whose drafter pass writes `slots` (all padding: it serves no request)."""
        plan = records.step_plan([], [], [], [], [records.draft_pass(0, 0, [], [], np.array(slots))])
        self.add(records.step(self.step_no, "DUMMY", None, plan))
        self.step_no += 1


def run(stream: Eagle, many: bool = False):
    ledger = Ledger()
    found = (
        ledger.apply_many(events_of(stream.events))
        if many
        else [v for e in stream.events for v in ledger.apply(event_of(e))]
    )
    found += ledger.finish()
    return found, ledger.coverage


def eagle_run(steps: int = 6, fault=None, fault_step: int = 3, **kw) -> Eagle:
    s = Eagle(**kw)
    s.arrive(11)
    s.arrive(5)
    for n in range(steps):
        s.step(fault if n == fault_step else None)
    return s


def shift(k: int, req_pos: int):
    """Move pass k's slot of the req_pos-th request by one slot inside its block."""

    def edit(step, passes, reqs):
        _, counts, _, slots = passes[k]
        t = sum(counts[:req_pos])
        slots[t] = slots[t] + 1 if (slots[t] + 1) % BS else slots[t] - 1

    return edit


# -- the core --------------------------------------------------------------------------------------
def test_clean_eagle_stream_is_silent_with_every_pass_checked():
    found, cov = run(eagle_run())
    assert found == []
    planned = 6 * 2  # requests per step, over six steps
    assert cov.checks["draft_write"] == cov.checks["draft_position"] == K * planned
    assert cov.checks["draft_padding"] == K * 6 and cov.checks["write"] == planned
    assert not cov.unchecked


def test_a_shifted_slot_of_a_later_pass_is_a_write_target_mismatch_there():
    found, _ = run(eagle_run(fault=shift(2, 1)))
    assert [(v.kind, v.step, v.req_id, v.group) for v in found] == [("write_target_mismatch", 3, "r1", 0)]
    assert found[0].detail.startswith("drafter pass 2: 1 token(s) written to the wrong slot; first: expected slot")


def test_a_shifted_slot_of_the_first_pass_is_caught_for_its_request():
    found, _ = run(eagle_run(fault=shift(0, 0)))
    assert [(v.kind, v.step, v.req_id, v.group) for v in found] == [("write_target_mismatch", 3, "r0", 0)]
    assert found[0].detail.startswith("drafter pass 0: ")


def test_a_pass_beyond_the_reserved_lookahead_is_a_position_fault():
    def past_lookahead(step, passes, reqs):
        k, _, first, slots = passes[1]
        req, scheduled = reqs[0]
        first[0] = req.computed + scheduled + k  # one past the last position pass 1 may write
        slots[0] = slot_of(req.row, first[0])  # an address consistent with that position

    found, _ = run(eagle_run(fault=past_lookahead))
    assert [(v.kind, v.step, v.req_id, v.group) for v in found] == [("write_target_mismatch", 3, "r0", None)]
    assert "drafter pass 1: writes position" in found[0].detail


def test_a_clamped_position_past_the_model_length_is_no_write():
    def clamp(step, passes, reqs):  # vLLM: position 0, slot -1 (the write is skipped)
        _, _, first, slots = passes[2]
        first[1], slots[1] = 0, -1

    assert run(eagle_run(fault=clamp))[0] == []

    def dropped(step, passes, reqs):  # slot -1 at a real position: the drafter's KV is lost
        _, _, _, slots = passes[2]
        slots[1] = -1

    found, _ = run(eagle_run(fault=dropped))
    assert [(v.kind, v.step, v.req_id) for v in found] == [("write_target_mismatch", 3, "r1")]


def test_a_dummy_runs_drafter_pass_writing_a_real_block_is_unowned():
    s = eagle_run(steps=2)
    s.dummy([0, 1, -1])  # the null block and padding: harmless
    assert run(s)[0] == []
    s.dummy([slot_of([2], 1)])  # a stale slot from an earlier pass, in block 2 (held by r0)
    found, _ = run(s)
    assert [(v.kind, v.step, v.group) for v in found] == [("unowned_write", 3, 0)]
    assert found[0].detail.startswith("drafter pass 0: 1 padding slot(s) write real blocks")


def test_a_malformed_pass_is_unchecked_not_a_violation():
    def malformed(step, passes, reqs):
        passes[1] = (1, [1], [5], [9, 10])  # one request's counts for a two-request plan

    found, cov = run(eagle_run(fault=malformed))
    assert found == [] and cov.unchecked["malformed_plan"] == 1


def test_an_unrecorded_drafter_is_counted_unchecked_per_planned_step():
    found, cov = run(eagle_run(drafter_recorded=False))
    assert found == []
    assert cov.unchecked["drafter_kv_writes"] == 6 and cov.checks["draft_write"] == 0
    assert cov.checks["write"] == 12  # the target's own writes are still checked


def test_draft_writes_round_trip_through_the_contract():
    codec = SingleObjectCodec(LEDGER_EVENT)
    s = eagle_run(steps=2)
    s.dummy([0, -1])
    steps = [e for e in s.events if e["body"][0] == "kvledger.Step"]
    assert all(codec.decode(codec.encode(e)) == e for e in steps)
    assert [len(e["body"][1]["plan"]["draft_writes"]) for e in steps] == [K, K, 1]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    prompts=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    steps=st.integers(1, 12),
    fault_at=st.one_of(st.none(), st.tuples(st.integers(0, 11), st.integers(0, K - 1), st.integers(0, 3))),
)
def test_fast_path_and_step_by_step_agree_on_draft_streams(seed, prompts, steps, fault_at):
    s = Eagle(seed=seed)
    for p in prompts:
        s.arrive(p)
    for n in range(steps):
        fault = shift(fault_at[1], fault_at[2] % len(prompts)) if fault_at and fault_at[0] == n else None
        s.step(fault)
    one, cov_one = run(s)
    many, cov_many = run(s, many=True)
    assert one == many and cov_one == cov_many
    faulted = fault_at is not None and fault_at[0] < steps
    assert [(v.kind, v.step) for v in one] == ([("write_target_mismatch", fault_at[0])] if faulted else [])
    assert cov_one.checks["draft_write"] == K * len(prompts) * steps


# -- the probe -------------------------------------------------------------------------------------
class SpecDecodeBaseProposer:
    """Stands in for vLLM's class of that name: the pass loop the probe models."""

    kv_cache_gid = 0
    _slot_mapping_buffer = positions = None

    def propose(self, *, common_attn_metadata=None): ...

    def _get_slot_mapping(self, num_tokens, slot_mapping=None): ...

    def _get_positions(self, num_tokens): ...


class NoSlotMappingProposer(SpecDecodeBaseProposer):
    _get_slot_mapping = None


def probe_of(drafter, method: str = "eagle", draft_kv: bool = True) -> V1RunnerProbe:
    spec = SimpleNamespace(method=method, uses_draft_kv_cache=lambda: draft_kv)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=spec,
    )
    runner = SimpleNamespace(vllm_config=config, speculative_config=spec, drafter=drafter, sample_tokens=lambda g: g)
    p = V1RunnerProbe(runner, SimpleNamespace())
    p.unavailable, p.connector_capabilities = {}, []
    p.drafter_capabilities = p._attach_drafter()
    return p


def drafter_capability(p: V1RunnerProbe) -> list[tuple[str, bool, str | None]]:
    return [c for c in p.capabilities() if c[0] == "drafter_kv_writes"]


def test_the_drafter_is_recorded_and_its_declaration_dropped():
    p = probe_of(SpecDecodeBaseProposer())
    assert drafter_capability(p) == [("drafter_kv_writes", True, None)]
    assert p._drafter is not None


def test_a_drafter_the_probe_cannot_read_is_declared_with_the_reason():
    [(name, available, why)] = drafter_capability(probe_of(NoSlotMappingProposer()))
    assert (name, available) == ("drafter_kv_writes", False)
    assert why == "NoSlotMappingProposer._get_slot_mapping not found"
    parallel = SpecDecodeBaseProposer()
    parallel.needs_extra_input_slots = True
    assert "parallel drafting" in drafter_capability(probe_of(parallel))[0][2]
    # The rest of the probe's capabilities stand.
    assert [c[0] for c in probe_of(NoSlotMappingProposer()).capabilities()][:3] == [
        "step_input",
        "step_plan",
        "dummy_runs",
    ]


def test_drafters_without_kv_of_their_own_need_no_capability():
    assert drafter_capability(probe_of(SimpleNamespace(), method="ngram", draft_kv=False)) == []


@pytest.mark.vllm
def test_the_drafters_attach_points_exist_in_this_vllm():
    # The stand-ins above mirror vLLM's own names: a rename there must fail here.
    script = (
        "import inspect\n"
        "from vllm.v1.spec_decode.eagle import EagleProposer\n"
        "from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "from kvledger.producer.vllm_v1 import AttachPoint\n"
        "assert EagleProposer.propose is SpecDecodeBaseProposer.propose\n"
        "print(SpecDecodeBaseProposer.propose.__qualname__)\n"
        "for obj, name, params in ((EagleProposer, 'propose', ('common_attn_metadata',)),\n"
        "        (EagleProposer, '_get_slot_mapping', ('num_tokens', 'slot_mapping')),\n"
        "        (EagleProposer, '_get_positions', ('num_tokens',)), (GPUModelRunner, 'sample_tokens', ())):\n"
        "    assert AttachPoint(name, 'x', params).missing(obj) is None, name\n"
        "init = inspect.getsource(SpecDecodeBaseProposer.__init__)\n"
        "for attr in ('self._slot_mapping_buffer', 'self.kv_cache_gid', 'self.positions'):\n"
        "    assert attr in init, attr\n"
        "assert 'execute_model_state' in inspect.getsource(GPUModelRunner.sample_tokens)\n"
    )
    proc = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "SpecDecodeBaseProposer.propose"
    assert unmodelled_drafter(SpecDecodeBaseProposer()) is None
    assert AttachPoint("propose", "x", ("common_attn_metadata",)).missing(SpecDecodeBaseProposer()) is None
