"""What the ledger reports: violations and coverage."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

WRITE_TARGET_MISMATCH = "write_target_mismatch"
READ_TARGET_MISMATCH = "read_target_mismatch"
UNOWNED_WRITE = "unowned_write"
FOREIGN_BLOCK_WRITE = "foreign_block_write"
BLOCK_OUT_OF_RANGE = "block_out_of_range"
RANK_DIVERGENCE = "rank_divergence"
RANK_MISSING = "rank_missing"
SEQUENCE_GAP = "sequence_gap"
DUPLICATE_EVENT = "duplicate_event"
# Transfers between engines (core/transfers.py).
TRANSFER_BLOCK_MISMATCH = "transfer_block_mismatch"
TRANSFER_FAILED = "transfer_failed"
TRANSFER_STUCK = "transfer_stuck"
READ_BEFORE_TRANSFER = "read_before_transfer"
SEND_BLOCK_REUSED = "send_block_reused"
ORPHAN_TRANSFER = "orphan_transfer"
TRANSFER_CONTENT_MISMATCH = "transfer_content_mismatch"
# The content of sealed blocks (core/content.py).
SEALED_BLOCK_MODIFIED = "sealed_block_modified"
BLOCK_NOT_ZEROED = "block_not_zeroed"

KINDS = (
    WRITE_TARGET_MISMATCH,
    READ_TARGET_MISMATCH,
    UNOWNED_WRITE,
    FOREIGN_BLOCK_WRITE,
    BLOCK_OUT_OF_RANGE,
    RANK_DIVERGENCE,
    RANK_MISSING,
    SEQUENCE_GAP,
    DUPLICATE_EVENT,
    TRANSFER_BLOCK_MISMATCH,
    TRANSFER_FAILED,
    TRANSFER_STUCK,
    READ_BEFORE_TRANSFER,
    SEND_BLOCK_REUSED,
    ORPHAN_TRANSFER,
    TRANSFER_CONTENT_MISMATCH,
    SEALED_BLOCK_MODIFIED,
    BLOCK_NOT_ZEROED,
)


class RankKey(NamedTuple):
    """One rank of one engine. A tuple: it keys most of the core's dicts, hashed several times per
    event, and a tuple hashes in C."""

    engine_id: str
    dp: int
    tp: int
    pp: int

    def __str__(self) -> str:
        return f"{self.engine_id}/dp{self.dp}-tp{self.tp}-pp{self.pp}"


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    step: int | None
    req_id: str | None
    group: int | None
    detail: str

    @classmethod
    def at(cls, kind: str, rank: RankKey, step: int | None, detail: str, *, req_id=None, group=None):
        return cls(kind, rank.engine_id, rank.dp, rank.tp, rank.pp, step, req_id, group, detail)

    def where(self) -> str:
        """Where it is, as a rank's `log` and `raise` actions report it."""
        return f"{self.kind} at step {self.step}, req {self.req_id}, group {self.group}"

    def to_record(self) -> dict:
        """As the Avro `kvledger.Violation` record (and the JSON line, minus 'type')."""
        return asdict(self)


@dataclass
class Coverage:
    """Every check run and every check that could not run, by reason."""

    checks: Counter = field(default_factory=Counter)
    unchecked: Counter = field(default_factory=Counter)

    def merge(self, other: Coverage) -> None:
        self.checks.update(other.checks)
        self.unchecked.update(other.unchecked)
