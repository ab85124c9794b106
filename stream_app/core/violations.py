"""What the ledger reports: violations (typed in the contract, kvledger.schemas.events) and coverage."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvledger.schemas.events import RankKey, Violation

__all__ = ["Coverage", "RankKey", "Violation"]  # the contract's, as the core reports them


@dataclass
class Coverage:
    """Every check run and every check that could not run, by reason."""

    checks: Counter = field(default_factory=Counter)
    unchecked: Counter = field(default_factory=Counter)

    def merge(self, other: Coverage) -> None:
        self.checks.update(other.checks)
        self.unchecked.update(other.unchecked)
