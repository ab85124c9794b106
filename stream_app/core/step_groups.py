"""The ranks of one engine and DP rank that must agree step by step: what the ledger holds of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvledger.schemas.events import Step, StepPlan
from kvledger.stream_app.core.violations import RankKey, Violation


@dataclass
class LeadStep:
    """What the lead rank's step said and what its checks found, for the other ranks to match."""

    input_fp: bytes
    plan_fp: bytes
    checked: bool  # the lead's tables were in sync: its findings below are the whole truth
    found_input: list[Violation]  # what applying the step's input revealed
    found_plan: list[Violation]  # what checking its plan revealed
    # The step itself, while pending (not in checkpoints): a rank whose step equals it needs no hashing.
    body: Step | None = field(default=None, compare=False)


@dataclass
class StepGroup:
    """The ranks of one engine and DP rank that must agree step by step.

    They get the same scheduler output and run the same plan, so only the lead
    (the lowest TP/PP rank) replays the block tables; every other rank is
    compared with it by fingerprints of its input and plan. A rank that agrees
    gets the lead's findings; one whose plan differs is checked against the
    lead's tables at that step (when the lead's step came first, or the rank's
    plan waits for it), else counted unchecked (`rank_plan_unverified`).
    """

    expected: frozenset[tuple[int, int]]  # (tp, pp) ranks
    # step -> rank -> (input fingerprint, plan fingerprint, whether the rank's own checks passed:
    # None when they could not run)
    pending: dict[int, dict[tuple[int, int], tuple[bytes, bytes, bool | None]]] = field(default_factory=dict)
    lead_steps: dict[int, LeadStep] = field(default_factory=dict)  # steps still pending, as the lead saw them
    early: dict[int, dict[tuple[int, int], StepPlan]] = field(default_factory=dict)  # plans that came before the lead's
    last_step: dict[tuple[int, int], int] = field(default_factory=dict)
    missing_since: dict[tuple[int, int], int] = field(default_factory=dict)  # open runs of missed steps
    # Steps a rank's records were lost for, (after, before) exclusive: not the rank's fault.
    lost: dict[tuple[int, int], list[tuple[int, float]]] = field(default_factory=dict)
    settled_through: int = -1  # a watermark settled every step up to here: later records for them are late

    @property
    def lead(self) -> tuple[int, int]:
        return min(self.expected)


def rekeyed(found: list[Violation], key: RankKey) -> list[Violation]:
    """The lead's findings as another rank of its group would have made them."""
    return [msgspec.structs.replace(v, tp_rank=key.tp, pp_rank=key.pp) for v in found]
