"""The content of sealed blocks: a block's bytes may not change once it is sealed.

Every other check compares address plans; this one compares bytes. A rank
digests a sampled block when it seals (full, and from then on only read: a
full block of a running request, or one the prefix cache keeps) and again
whenever it is read later (a prefix-cache hit, a resume), when a holder lets
it go, and in a background sweep (producer/content.py). Here each later
digest is compared with the one taken at sealing:

- `sealed_block_modified`: it changed. The report says whether any plan
  wrote into the block in between; none is the signature of a kernel writing
  where no plan said (vllm #43810, #53982).
- `block_not_zeroed`: a block the scheduler had zeroed is not zero.

Digests are compared per rank over time, never across ranks: TP and PP ranks
hold other heads or layers of the same blocks. A rank reseals a block
whenever it is handed out again, so the newest SEALED digest is the
reference; a rank that lost events (a gap) may have lost a reseal, so what it
sealed before is forgotten and its next reads count as unchecked until it
seals again.

Block ids name one pool for every KV cache group (a hybrid model's groups may
share tensors), so a plan's write into block b is noted for every group's b.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvledger.schemas.events import BlockDigests, StepPlan
from kvledger.schemas.kinds import Check, DigestReason, Unchecked, ViolationKind
from kvledger.schemas.packing import expand_slot_runs, unpack_i32, unpack_u64
from kvledger.stream_app.core.violations import Coverage, RankKey, Violation

_COMPARED = (DigestReason.READ, DigestReason.RELEASED, DigestReason.SWEEP)


@dataclass(slots=True)
class Sealed:
    """One rank's reference digest of one block of one group."""

    digest: int
    sealed_step: int  # the step its reference was taken at
    baseline: bool  # the reference is a later read's: the rank sealed it before its events reached us
    written_step: int | None = None  # the first step since then at which a plan wrote into the block


class ContentLedger:
    """The reference digests of one engine's DP rank group (its TP and PP ranks), by block."""

    def __init__(self, block_sizes: dict[int, int]) -> None:
        self.block_sizes = block_sizes  # group id -> tokens per block (the plans' slots name blocks by it)
        # block -> (tp, pp, group) -> reference. Keyed by block first: a plan's write names blocks.
        self.sealed: dict[int, dict[tuple[int, int, int], Sealed]] = {}

    def apply(
        self, key: RankKey, step: int, digests: BlockDigests, holders, out: list[Violation], cov: Coverage
    ) -> None:
        """Check a rank's digests of `step`; `holders(block)` names the requests holding a block."""
        columns = _columns(digests)
        if columns is None:
            cov.unchecked[Unchecked.CONTENT_COLUMNS_MISALIGNED] += 1
            return
        for gid, block, value, reason in columns:
            rank_group = (key.tp, key.pp, gid)
            if reason is DigestReason.SEALED:
                self.sealed.setdefault(block, {})[rank_group] = Sealed(value, step, baseline=False)
                cov.checks[Check.CONTENT_SEALED] += 1
            elif reason is DigestReason.ZEROED:
                cov.checks[Check.CONTENT_ZEROED] += 1
                self._forget(block, key)  # handed out again: what this rank sealed there is gone
                if value != 0:
                    names = holders(block)
                    detail = f"block {block} was to be zeroed at this step but its bytes are not zero ({_held(names)})"
                    out.append(
                        Violation.at(ViolationKind.BLOCK_NOT_ZEROED, key, step, detail, req_id=_first(names), group=gid)
                    )
            elif reason in _COMPARED:
                self._compare(key, step, gid, block, value, reason, holders, out, cov)
            else:
                cov.unchecked[Unchecked.CONTENT_DIGEST_OF_UNKNOWN_REASON] += 1

    def trial(self, blocks: set[int]) -> ContentLedger:
        """A copy of the references of `blocks`, for `apply` to try a run on before it is applied (the
        batched fast path: a run that would report anything goes step by step instead)."""
        copy = ContentLedger(self.block_sizes)
        copy.sealed = {b: {k: replace(r) for k, r in self.sealed[b].items()} for b in blocks if b in self.sealed}
        return copy

    def _compare(self, key, step, gid, block, value, reason, holders, out, cov) -> None:
        ref = self.sealed.setdefault(block, {}).get((key.tp, key.pp, gid))
        if ref is None:  # sealed before its events reached us: this read is the reference
            self.sealed[block][(key.tp, key.pp, gid)] = Sealed(value, step, baseline=True)
            cov.unchecked[Unchecked.CONTENT_WITHOUT_SEAL] += 1
            return
        cov.checks[Check.CONTENT_VERIFIED] += 1
        if value == ref.digest:
            return
        since = "first digested" if ref.baseline else "sealed"
        if ref.written_step is None:
            wrote = "no plan wrote into it since: a write outside every plan"
        else:
            wrote = f"a plan wrote into it at step {ref.written_step}"
        names = holders(block)
        detail = (
            f"block {block} ({since} at step {ref.sealed_step}) changed, found by a {reason.value.lower()} digest; "
            f"{wrote} ({_held(names)})"
        )
        out.append(
            Violation.at(ViolationKind.SEALED_BLOCK_MODIFIED, key, step, detail, req_id=_first(names), group=gid)
        )
        ref.digest, ref.sealed_step, ref.written_step = value, step, None  # one report per change

    def note_writes(self, step: int, plan: StepPlan) -> None:
        """Mark the references of blocks the plan (and its drafter) writes into at `step`, which
        come after that step's digests."""
        if not self.sealed:
            return
        writes = [(g.group_id, g.slot_runs, g.num_real) for g in plan.groups]
        writes += [(d.group_id, d.slot_runs, d.num_real) for d in plan.draft_writes or ()]
        for gid, runs, num_real in writes:
            block_size = self.block_sizes.get(gid)
            slots = expand_slot_runs(runs)[:num_real]
            if block_size is None or not slots.size:
                continue
            for block in np.unique(slots[slots >= 0] // block_size).tolist():
                for ref in self.sealed.get(block, {}).values():
                    if ref.written_step is None and ref.sealed_step <= step:
                        ref.written_step = step

    def forget_rank(self, key: RankKey) -> None:
        """A rank lost events (or restarted): its references may be stale."""
        for block in list(self.sealed):
            self._forget(block, key)

    def _forget(self, block: int, key: RankKey) -> None:
        refs = self.sealed.get(block)
        if refs is None:
            return
        for rank_group in [k for k in refs if k[:2] == (key.tp, key.pp)]:
            del refs[rank_group]
        if not refs:
            del self.sealed[block]


def _columns(digests: BlockDigests) -> list[tuple[int, int, int, DigestReason]] | None:
    """(group, block, digest, reason) per digest; None when the columns are not aligned."""
    groups, blocks = unpack_i32(digests.group_ids), unpack_i32(digests.block_ids)
    values = unpack_u64(digests.digests)
    if not groups.size == blocks.size == values.size == len(digests.reasons):
        return None
    return list(zip(groups.tolist(), blocks.tolist(), values.tolist(), digests.reasons, strict=True))


def _first(names: list[str]) -> str | None:
    return names[0] if names else None


def _held(names: list[str]) -> str:
    if not names:
        return "held by no live request"
    return f"held by {', '.join(names[:4])}{' and more' if len(names) > 4 else ''}"
