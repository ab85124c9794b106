"""Configurations the checks do not model: what a rank's declarations void, and a plan checked under them.

A rank running such a configuration reports it as an unavailable capability named by a
`kvledger.schemas.kinds.Declaration`; the checks it voids are counted unchecked under that name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvledger.schemas.events import RankInfo, StepPlan
from kvledger.schemas.kinds import STEP_INPUT, Check, Declaration, ViolationKind
from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.core.rank_tables import RankTables
from kvledger.stream_app.core.violations import Coverage, Violation

# A rank declares a configuration whose addressing the checks do not model as an unavailable
# capability of that name (kvledger.schemas.kinds.Declaration). Each voids some checks, which
# are then counted unchecked under the declaration's name and never reported:
#   plan: the whole plan check (counted per request); writes / positions: those checks;
#   behind: the position check of a request whose plan is behind the scheduler's computed
#   tokens (async speculative decoding); steps: counted once per checked step (writes that are
#   not in the plan); rank_plans: the cross-rank compare of plans (each rank's differs); content:
#   what blocks hold (prefix identity, writes to a block's end: a block spans its tokens over ranks).
DECLARATIONS: dict[Declaration, tuple[str, ...]] = {
    Declaration.DECODE_CONTEXT_PARALLEL: ("writes", "rank_plans", "content"),
    Declaration.PREFILL_CONTEXT_PARALLEL: ("plan", "rank_plans", "content"),
    Declaration.ASYNC_SPEC_DECODE: ("behind",),
    Declaration.ADAPTIVE_VERIFICATION: ("positions", "writes"),
    Declaration.DRAFTER_KV_WRITES: ("steps",),
}
# A probe's capability that voids checks when it is unavailable: a rank whose scheduler output lacks
# fields the step input is read from (a vLLM the probe was not written for) records incomplete inputs,
# so its tables, and every check against them, cannot be trusted (`input`: counted once per step).
VOIDING_PROBES: dict[str, tuple[str, ...]] = {STEP_INPUT: ("input",)}


@dataclass(frozen=True)
class Declared:
    """What a rank's declarations void: each field names the declaration voiding it, or None."""

    plan: str | None = None
    writes: str | None = None
    positions: str | None = None
    behind: str | None = None
    steps: str | None = None
    rank_plans: str | None = None
    input: str | None = None
    content: str | None = None

    @classmethod
    def of(cls, info: RankInfo) -> Declared | None:
        voids: dict[str, str] = {}
        for cap in info.capabilities:
            if not cap.available:
                for effect in DECLARATIONS.get(cap.name, ()) or VOIDING_PROBES.get(cap.name, ()):
                    voids.setdefault(effect, cap.name)
        return cls(**voids) if voids else None


def content_voided(info: RankInfo) -> str | None:
    """The declaration that voids a rank's checks of what its blocks hold, if any."""
    declared = Declared.of(info)
    return declared.content if declared is not None else None


def _is_position(v: Violation) -> bool:
    return v.kind == ViolationKind.WRITE_TARGET_MISMATCH and v.group is None


def _is_write(v: Violation) -> bool:
    # The writes a rank's layout leaves unmodelled, and what is judged from them (which blocks were written).
    kinds = (
        ViolationKind.FOREIGN_BLOCK_WRITE,
        ViolationKind.BLOCK_OUT_OF_RANGE,
        ViolationKind.SHARED_BLOCK_WRITE,
        ViolationKind.UNWRITTEN_READ,
    )
    return v.kind in kinds or (v.kind == ViolationKind.WRITE_TARGET_MISMATCH and v.group is not None)


def _behind(state: RankTables, plan: StepPlan) -> set[str]:
    """Requests whose plan starts before the scheduler's computed tokens, with its token count."""
    indices = unpack_i32(plan.req_indices).astype(np.int64)
    inside = (indices >= 0) & (indices < state.row_of.size)
    rows = np.where(inside, state.row_of[np.where(inside, indices, 0)], -1)
    known = rows >= 0
    rows = np.where(known, rows, 0)
    first, num_tokens = unpack_i32(plan.first_positions), unpack_i32(plan.num_tokens)
    behind = known & (first < state.computed[rows]) & (num_tokens == state.scheduled[rows])
    return {state.req_id(int(i)) for i in indices[behind]}


def check_declared_plan(state: RankTables, declared: Declared, step: int, plan: StepPlan, out, cov: Coverage) -> None:
    """`RankTables.check_plan` under a rank's declarations: voided checks counted, never reported."""
    if declared.plan:
        cov.unchecked[declared.plan] += len(unpack_i32(plan.req_indices))
        return
    if declared.steps:
        cov.unchecked[declared.steps] += 1
    tolerated = _behind(state, plan) if declared.behind else set()
    found: list[Violation] = []
    own = Coverage()
    state.check_plan(step, plan, found, own)
    for v in found:
        if (declared.writes and _is_write(v)) or (_is_position(v) and (declared.positions or v.req_id in tolerated)):
            continue
        out.append(v)
    voids = (
        (declared.writes, (Check.WRITE, Check.DRAFT_WRITE, Check.READ_WRITTEN)),
        (declared.positions, (Check.POSITION, Check.DRAFT_POSITION)),
    )
    for voided, checks in voids:
        for check in checks if voided else ():
            own.unchecked[voided] += own.checks.pop(check, 0)
    if tolerated and not declared.positions:
        own.checks[Check.POSITION] -= len(tolerated)
        own.unchecked[declared.behind] += len(tolerated)
    cov.merge(own)
