"""Configurations the checks do not model: each is declared by the probe (a capability marked
unavailable in RankInfo, detected from the vLLM config) and its checks are counted unchecked by
the core under the declaration's name, never reported, while the checks it leaves stand."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.producer.vllm_mrv2 import MRV2RunnerProbe
from kvledger.producer.vllm_v1 import V1RunnerProbe
from kvledger.schemas.events import event_of, events_of
from kvledger.schemas.kinds import Declaration
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.core.declarations import DECLARATIONS
from tests.e2e.conftest import vllm_python

BS = 4


# -- probe side ----------------------------------------------------------------------------------
def vllm_config(*, dcp=1, pcp=1, async_scheduling=False, spec=None):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        speculative_config=spec,
    )


def speculative(method: str, draft_kv: bool):
    return SimpleNamespace(method=method, uses_draft_kv_cache=lambda: draft_kv)


def declared(config) -> dict[str, str]:
    return {name: reason for name, available, reason in records.config_declarations(config) if not available}


def test_each_configuration_is_declared_from_the_vllm_config():
    assert declared(vllm_config()) == {}
    assert list(declared(vllm_config(dcp=2))) == ["decode_context_parallel"]
    assert "size 2" in declared(vllm_config(dcp=2))["decode_context_parallel"]
    assert list(declared(vllm_config(pcp=4))) == ["prefill_context_parallel"]
    # Async scheduling alone, or speculation alone (ngram: no drafter KV), is modelled.
    assert declared(vllm_config(async_scheduling=True)) == {}
    assert declared(vllm_config(spec=speculative("ngram", False))) == {}
    assert list(declared(vllm_config(async_scheduling=True, spec=speculative("ngram", False)))) == ["async_spec_decode"]
    eagle = declared(vllm_config(async_scheduling=True, spec=speculative("eagle", True)))
    assert list(eagle) == ["async_spec_decode", "drafter_kv_writes"] and "eagle drafter" in eagle["drafter_kv_writes"]
    # Every name a probe can declare is one the core acts on.
    assert set(Declaration) == set(DECLARATIONS)


def probe(cls, config, **runner_attrs):
    p = cls(SimpleNamespace(vllm_config=config, **runner_attrs), SimpleNamespace())
    p.unavailable, p.connector_capabilities = {}, [("connector", False, "no KV connector configured")]
    return p


def test_both_runners_put_the_declarations_in_their_capabilities():
    names = [c[0] for c in probe(V1RunnerProbe, vllm_config(dcp=2)).capabilities()]
    assert names == ["step_input", "step_plan", "dummy_runs", "dummy_run_plans", "connector", "decode_context_parallel"]
    mrv2 = probe(MRV2RunnerProbe, vllm_config(pcp=2), adaptive_verification=object()).capabilities()
    assert [(c[0], c[1]) for c in mrv2[4:]] == [("prefill_context_parallel", False), ("adaptive_verification", False)]
    assert [c[0] for c in probe(MRV2RunnerProbe, vllm_config(), adaptive_verification=None).capabilities()] == [
        "step_input",
        "step_plan",
        "dummy_runs",
        "connector",
    ]


@pytest.mark.vllm
def test_the_config_attributes_read_exist_in_this_vllm():
    # The stand-in configs above mirror vLLM's own names: a rename there must fail here.
    script = (
        "from vllm.config import ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig\n"
        "from kvledger.producer.records import config_declarations\n"
        "fields = {**ParallelConfig.__dataclass_fields__, **SchedulerConfig.__dataclass_fields__}\n"
        "for name in ('decode_context_parallel_size', 'prefill_context_parallel_size', 'async_scheduling'):\n"
        "    assert name in fields, name\n"
        "assert callable(SpeculativeConfig.uses_draft_kv_cache)\n"
        "config = VllmConfig()\n"
        "assert config_declarations(config) == []\n"
        "config.parallel_config.decode_context_parallel_size = 2\n"
        "config.parallel_config.prefill_context_parallel_size = 2\n"
        "print([str(name) for name, _, _ in config_declarations(config)])\n"
    )
    proc = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['decode_context_parallel', 'prefill_context_parallel']"


# -- core side -----------------------------------------------------------------------------------
class Stream:
    """One rank's events: block size 4, one full-attention group of 16 blocks."""

    def __init__(self, *declared: str, tp: int = 0, tp_size: int = 1):
        self.rank, self.seq, self.events = RankIdentity("e1", tp_rank=tp, incarnation=1), 0, []
        caps = [("step_input", True, None), *((name, False, f"{name} (test)") for name in declared)]
        kv = [records.kv_group(0, "FULL_ATTENTION", BS, 16)]
        self.add(records.rank_info(dp_size=1, tp_size=tp_size, pp_size=1, kv_groups=kv, vllm_version="t", runner="t"))
        self.events[-1]["body"][1]["capabilities"] = [{"name": n, "available": a, "reason": r} for n, a, r in caps]

    def add(self, body) -> None:
        self.events.append(records.envelope(self.rank, self.seq, 0, body))
        self.seq += 1

    def step(self, n, *, new=(), cached=(), appends=(), slots, reqs, rows, padding=0) -> Stream:
        inp = records.step_input(
            new_reqs=[records.new_request(i, f"r{i}", [b], c, 64, t) for i, b, c, t in new],
            cached=cached,
            appends=[(i, 0, b) for i, b in appends],
        )
        slots = np.array([*slots, *([-1] * padding)])
        group = records.group_plan(0, slots, len(slots) - padding, [np.array(r) for r in rows])
        plan = records.step_plan([i for i, _, _ in reqs], [t for _, t, _ in reqs], [p for _, _, p in reqs], [group])
        self.add(records.step(n, "REAL", inp, plan))
        return self


def check(*streams: Stream, many: bool = False):
    ledger = Ledger()
    events = [e for s in streams for e in s.events]
    found = ledger.apply_many(events_of(events)) if many else [v for e in events for v in ledger.apply(event_of(e))]
    found += ledger.finish()
    return [(v.kind, v.step, v.req_id) for v in found], ledger.coverage


def prefill(stream: Stream, slots=(4, 5, 6, 7, 12), rows=((1, 3),)) -> Stream:
    # r0 prefills 5 tokens into blocks [1, 3]: slots 4..7 and 12 by the ledger's formula.
    return stream.step(0, new=[(0, [1, 3], 0, 5)], slots=slots, reqs=[(0, 5, 0)], rows=rows)


# What a DCP rank of two records: its tokens at positions 0, 1 (of each 2x4-token virtual block),
# the others padding; local positions 0, 1 in block 1 -> slots 4, 5; position 4 -> local 2.
DCP_SLOTS = (4, 5, -1, -1, 6)


def test_decode_context_parallel_voids_write_checks_only():
    assert check(prefill(Stream(), DCP_SLOTS))[0][0][0] == "write_target_mismatch"
    found, cov = check(prefill(Stream("decode_context_parallel"), DCP_SLOTS))
    assert found == [] and cov.unchecked["decode_context_parallel"] == 1 and cov.checks["write"] == 0
    assert cov.checks["read"] == 1 and cov.checks["position"] == 1 and cov.checks["padding"] == 1
    # Reads and padding are still checked: a wrong row and a stale padding slot are still caught.
    s = prefill(Stream("decode_context_parallel"), DCP_SLOTS, rows=((1, 5),))
    assert check(s)[0] == [("read_target_mismatch", 0, "r0")]
    s = Stream("decode_context_parallel").step(
        0, new=[(0, [1, 3], 0, 1)], slots=[4, 13], reqs=[(0, 1, 0)], rows=[[1, 3]]
    )
    s.events[-1]["body"][1]["plan"]["groups"][0]["num_real"] = 1
    s.events[-1]["body"][1]["plan"]["groups"][0]["num_padding"] = 1
    assert check(s)[0] == [("unowned_write", 0, None)]


def test_context_parallel_voids_what_blocks_hold():
    """A DCP rank's block spans block_size x ranks tokens: the prefix a block was computed from and how
    far it was written are not modelled there. A prefix hit, which elsewhere would be judged (here a
    block r0 wrote 3 of 4 slots of: unwritten_read), is counted under the declaration instead."""

    # r0 writes 3 tokens into block 1; r1 reads block 1 as a hit (4 computed tokens) in a step
    # nobody writes it, writing its own token into block 2.
    def hit(stream: Stream) -> Stream:
        stream.step(0, new=[(0, [1, 3], 0, 3)], slots=(4, 5, 6), reqs=[(0, 3, 0)], rows=((1, 3),))
        return stream.step(1, new=[(1, [1, 2], 4, 1)], slots=(8,), reqs=[(1, 1, 4)], rows=((1, 2),))

    assert check(hit(Stream()))[0] == [("unwritten_read", 1, "r1")]
    found, cov = check(hit(Stream("decode_context_parallel")))
    assert found == [] and cov.checks["read_written"] == 0
    assert cov.unchecked["decode_context_parallel"] == 2 + 1  # two plans' writes, one read block


def test_decode_context_parallel_ranks_are_not_compared_on_plans():
    # Two TP ranks of one DCP group: each holds its own share of the tokens.
    other = (-1, -1, 4, 5, -1)
    plain = [prefill(Stream(tp=0, tp_size=2), DCP_SLOTS), prefill(Stream(tp=1, tp_size=2), other)]
    assert ("rank_divergence", 0, None) in check(*plain)[0]
    both = [prefill(Stream("decode_context_parallel", tp=t, tp_size=2), s) for t, s in ((0, DCP_SLOTS), (1, other))]
    found, cov = check(*both)
    assert found == [] and cov.checks["rank_compare"] == 1 and cov.unchecked["decode_context_parallel"] == 4


def test_prefill_context_parallel_voids_the_plan_check():
    # A PCP rank runs its partition of the prompt: 3 of the 5 tokens, from position 2.
    part = dict(new=[(0, [1, 3], 0, 5)], slots=[6, 7, 12], reqs=[(0, 3, 2)], rows=[[1, 3]])
    assert check(Stream().step(0, **part))[0] == [("write_target_mismatch", 0, "r0")]
    found, cov = check(Stream("prefill_context_parallel").step(0, **part))
    assert found == [] and cov.unchecked["prefill_context_parallel"] == 1
    assert cov.checks["write"] == cov.checks["read"] == cov.checks["position"] == 0
    assert cov.checks["exclusivity"] == 2  # the step input is still applied and checked


def decode(stream: Stream, first: int, tokens: int = 3) -> Stream:
    """After a 5-token prefill, a decode step the scheduler sends with 7 computed tokens (two
    drafts assumed accepted) and 3 tokens; the plan runs `tokens` tokens from `first`."""
    prefill(stream)
    blocks = (1, 3, 6)
    slots = [blocks[p // BS] * BS + p % BS for p in range(first, first + tokens)]
    return stream.step(
        1, cached=[(0, 7, 3)], appends=[(0, [6])], slots=slots, reqs=[(0, tokens, first)], rows=[[1, 3, 6]]
    )


def test_async_spec_decode_tolerates_a_plan_behind_the_scheduler_only():
    # Both drafts of the last step were rejected: the worker starts at 5, not the scheduler's 7.
    assert check(decode(Stream(), 5))[0] == [("write_target_mismatch", 1, "r0")]
    found, cov = check(decode(Stream("async_spec_decode"), 5))
    assert found == [] and cov.unchecked["async_spec_decode"] == 1 and cov.checks["position"] == 1  # prefill's
    assert cov.checks["write"] == 2  # the slots still match the plan's own positions
    # Ahead of the scheduler, or with another token count, is still a fault.
    assert check(decode(Stream("async_spec_decode"), 8))[0] == [("write_target_mismatch", 1, "r0")]
    assert check(decode(Stream("async_spec_decode"), 5, tokens=2))[0] == [("write_target_mismatch", 1, "r0")]
    # All drafts accepted: checked like any step.
    found, cov = check(decode(Stream("async_spec_decode"), 7))
    assert found == [] and cov.checks["position"] == 2 and not cov.unchecked


def test_drafter_kv_writes_are_counted_per_step_and_the_rest_still_checked():
    found, cov = check(decode(Stream("drafter_kv_writes"), 7))
    assert found == [] and cov.unchecked["drafter_kv_writes"] == 2 and cov.checks["write"] == 2
    shifted = prefill(Stream("drafter_kv_writes"), slots=(4, 5, 6, 7, 13))
    assert check(shifted)[0] == [("write_target_mismatch", 0, "r0")]


def test_adaptive_verification_voids_positions_and_writes():
    assert check(decode(Stream(), 5, tokens=2))[0] == [("write_target_mismatch", 1, "r0")]
    found, cov = check(decode(Stream("adaptive_verification"), 5, tokens=2))
    assert found == [] and cov.unchecked["adaptive_verification"] == 4  # 2 steps x (position, write)
    assert cov.checks["read"] == 2 and cov.checks["write"] == 0


def test_declared_ranks_get_the_same_answers_from_the_batched_path():
    # A clean run the batched path would prove at once, and runs it would hand back anyway.
    streams = [
        decode(Stream("drafter_kv_writes"), 7),
        prefill(Stream("decode_context_parallel"), DCP_SLOTS),
        decode(Stream("async_spec_decode"), 5),
    ]
    for s in streams:
        assert check(s, many=True) == check(s)


def test_a_rank_whose_step_inputs_are_incomplete_is_not_checked_against_them():
    """The probe reads a scheduler output without a field it reads the input from (a vLLM it was not
    written for): it declares `step_input` unavailable. Tables built from incomplete inputs would
    report what did not happen (a preempted request never dropped), so the rank's steps go unchecked,
    counted under the capability's name, on the step path and the batched path alike."""
    for many in (False, True):
        assert check(prefill(Stream(), DCP_SLOTS), many=many)[0][0][0] == "write_target_mismatch"
        found, cov = check(prefill(Stream("step_input"), DCP_SLOTS), many=many)
        assert found == [] and cov.unchecked["step_input"] == 1 and cov.checks["write"] == 0
