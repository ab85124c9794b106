"""What the ledger reports: violations and coverage."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvledger.schemas.events import RankKey
from kvledger.schemas.kinds import ViolationKind, read


@dataclass(frozen=True, slots=True)
class Violation:
    kind: ViolationKind
    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    step: int | None
    req_id: str | None
    group: int | None
    detail: str

    @classmethod
    def of(cls, record: dict[str, Any]) -> Violation:
        """A decoded `kvledger.Violation` record; a kind newer than this reader is OTHER."""
        return cls(**{**record, "kind": read(ViolationKind, record["kind"])})

    @classmethod
    def at(cls, kind: ViolationKind, rank: RankKey, step: int | None, detail: str, *, req_id=None, group=None):
        return cls(kind, rank.engine_id, rank.dp, rank.tp, rank.pp, step, req_id, group, detail)

    def where(self) -> str:
        """Where it is, as a rank's `log` and `raise` actions report it."""
        return f"{self.kind} at step {self.step}, req {self.req_id}, group {self.group}"

    def to_record(self) -> dict:
        """As the Avro `kvledger.Violation` record (and the JSON line, minus 'type')."""
        return asdict(self) | {"kind": str(self.kind)}


@dataclass
class Coverage:
    """Every check run and every check that could not run, by reason."""

    checks: Counter = field(default_factory=Counter)
    unchecked: Counter = field(default_factory=Counter)

    def merge(self, other: Coverage) -> None:
        self.checks.update(other.checks)
        self.unchecked.update(other.unchecked)
