"""The rules step plans and grants are checked by, each written once.

A rule compares what the runner (or the scheduler) did with what the ledger
says, over columns: one entry per request, token or granted block. Two paths
build those columns and run the same rules on them:

- step by step (rank.py): one step, from the tables as they stand; every
  entry a rule fails is reported as a violation;
- the fast path (batch.py): a run of steps at once, from the tables as they
  stood at each step; the run is taken only if no rule fails anywhere, else
  it goes step by step.

So a new rule is a function here, added to `plan_failures` (or to
`grant_failures`): both paths run it, and the step path's reporter for it
says what it found. The columns a rule reads are the facts below; a rule
that needs a new one adds it to the facts, and both builders fill it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvledger.schemas.packing import wire_digests
from kvledger.stream_app.core.tables import NULL_BLOCK, UNKNOWN_FILL

# -- the facts ------------------------------------------------------------------------------------


class TokenSpans(NamedTuple):
    """The plan's tokens cut where their request or its row position changes: one entry per request and
    block it writes into, in token order. What holds for a block holds for each of its tokens."""

    req: np.ndarray  # the request (index into the plan's requests)
    count: np.ndarray  # how many of its tokens fall in this block
    last: np.ndarray  # the position of the last of them
    block: np.ndarray  # the ledger's block there (the row's cell, if the position is inside the row)
    in_row: np.ndarray  # the position lies inside the row


@dataclass(slots=True)
class RequestFacts:
    """The plan's requests, one entry each (on the fast path: each request at each step of the run)."""

    first: np.ndarray  # the plan: first position it writes
    ntok: np.ndarray  # the plan: how many tokens it writes
    computed: np.ndarray  # the ledger: num_computed_tokens handed at that step
    scheduled: np.ndarray  # the ledger: tokens scheduled at that step
    known: np.ndarray | None = None  # requests the ledger knows (None: all); the others go unchecked


@dataclass(slots=True)
class GroupFacts:
    """One KV cache group's part of a plan, beside what the ledger's rows say. A rule whose columns a
    group lacks (a state group has no slots; a malformed part, no rows) does not run on it."""

    group_id: int
    block_size: int
    # Per token: the slot the plan writes; the slot its row in the ledger gives its position; whether
    # the position lies inside that row; the ledger's block there; whether the ledger knows its
    # request (None: all); which request it is (None: token i is request i) and its position.
    real: np.ndarray | None = None
    expected: np.ndarray | None = None
    in_row: np.ndarray | None = None
    block: np.ndarray | None = None
    tok_known: np.ndarray | None = None
    tok_req: np.ndarray | None = None
    pos: np.ndarray | None = None
    padding: np.ndarray | None = None  # slots past the scheduled tokens: owned by nobody
    shared: np.ndarray | None = None  # per token: its ledger block is full and held by two requests or more
    spans: TokenSpans | None = None  # the tokens a block at a time, where all are known and have a slot
    # Per request, the row attention reads: as the plan says (length, wire digest), as the ledger has
    # it (length, digest); whether the ledger knows the request (None: all).
    plan_lens: np.ndarray | None = None
    plan_digests: np.ndarray | None = None
    ledger_lens: np.ndarray | None = None
    ledger_digests: np.ndarray | None = None
    known: np.ndarray | None = None


@dataclass(slots=True)
class GrantFacts:
    """Blocks of the pool (the null block aside) the scheduler hands out in one step (on the fast path:
    at each step of the run), one entry each. A block id outside the pool fails before any rule."""

    elsewhere: np.ndarray  # another holder has it at another row position (after this step's grants)
    written: np.ndarray  # the grant writes it: at or past its request's computed tokens
    prior: np.ndarray  # live holders before this step's grants (one pool: counted across groups)
    writers: np.ndarray  # grants of this step that write it
    sending: np.ndarray  # a pending KV send still reads it


@dataclass(slots=True)
class ReadFacts:
    """Blocks a step hands out only to be read, below their request's computed tokens (a prefix hit, a
    resumed request's surviving prefix), one entry each."""

    block_chain: np.ndarray  # the prefix chain the block was handed out to compute (0: unknown)
    reader_chain: np.ndarray  # the reader's own chain at that row position (0: unknown)


# -- how the ledger's side is derived (the same arithmetic in both paths) ------------------------------


def token_positions(first: np.ndarray, ntok: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The request (index into first/ntok) and the position of every token; None for the request when
    each writes one token (decode): then token i is request i."""
    if (ntok == 1).all():
        return None, first
    tok_req = np.repeat(np.arange(ntok.size), ntok)
    return tok_req, first[tok_req] + (np.arange(tok_req.size) - (np.cumsum(ntok) - ntok)[tok_req])


def slot_targets(
    table: np.ndarray, rows: np.ndarray, row_lens: np.ndarray, first: np.ndarray, ntok: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, TokenSpans]:
    """Where the ledger says each token's KV goes: (slot, whether the position is inside the row, block),
    per token, and the same per block written (TokenSpans).

    Per request: its row, the row's length at its step (cells of `table` past it are never trusted), the
    first position it writes and how many. Looked up once per block, not per token: a prefill chunk's
    tokens share their blocks.
    """
    first = first.astype(np.int64)
    decode = bool((ntok == 1).all())  # a token per request: a span each
    if decode:
        req, col, lo, last, count = np.arange(first.size), first // block_size, first, first, ntok
    else:
        c0, c1 = first // block_size, (first + ntok - 1) // block_size
        nspan = np.where(ntok > 0, c1 - c0 + 1, 0)
        req = np.repeat(np.arange(nspan.size), nspan)
        col = c0[req] + (np.arange(req.size) - (np.cumsum(nspan) - nspan)[req])
        lo = np.maximum(col * block_size, first[req])
        last = np.minimum(col * block_size + block_size, (first + ntok)[req]) - 1
        count = last - lo + 1
        rows, row_lens = rows[req], row_lens[req]
    block = table[rows, np.minimum(col, table.shape[1] - 1)]
    in_row = col < row_lens
    spans = TokenSpans(req, count, last, block, in_row)
    slot = block * block_size + (lo - col * block_size)  # each span's first token's
    if decode:
        return slot, in_row, block, spans
    # Along a span, one slot more per token.
    expected = np.arange(int(count.sum())) + np.repeat(slot - (np.cumsum(count) - count), count)
    return expected, np.repeat(in_row, count), np.repeat(block, count), spans


# -- the rules ---------------------------------------------------------------------------------------------


def _only_known(bad: np.ndarray, known: np.ndarray | None) -> np.ndarray:
    return bad if known is None else bad & known


def position_failures(r: RequestFacts) -> np.ndarray:
    """The plan writes other tokens than the scheduler handed: another first position or count."""
    return _only_known((r.first != r.computed) | (r.ntok != r.scheduled), r.known)


def write_failures(g: GroupFacts) -> np.ndarray | None:
    """A token's KV goes to another slot than its row gives its position, or its position is past the row."""
    if g.real is None:
        return None
    return _only_known((g.real != g.expected) | ~g.in_row, g.tok_known)


def null_write_failures(g: GroupFacts) -> np.ndarray | None:
    """A row points at the null block where a real token is written: its KV goes nowhere."""
    if g.real is None:
        return None
    return _only_known((g.block == NULL_BLOCK) & (g.real == g.expected) & g.in_row, g.tok_known)


def padding_failures(g: GroupFacts) -> np.ndarray | None:
    """A padding slot writes a real block (slots 0 .. block_size-1 are the null block's)."""
    return None if g.padding is None else g.padding >= g.block_size


def read_failures(g: GroupFacts) -> np.ndarray | None:
    """Attention reads another row than the ledger's: its length or its digest differs."""
    if g.plan_lens is None:
        return None
    bad = (g.plan_lens != g.ledger_lens) | (g.plan_digests != wire_digests(g.ledger_digests))
    return _only_known(bad, g.known)


def shared_write_failures(g: GroupFacts) -> np.ndarray | None:
    """A token's KV goes, where its row says, into a full block another live request holds: vLLM
    shares only full blocks, computed once; writing one again changes what its other holders read.
    Part of the write check (Check.WRITE)."""
    if g.real is None or g.shared is None:
        return None
    return _only_known((g.real == g.expected) & g.in_row & g.shared, g.tok_known)


def draft_position_failures(pos, lo, hi, tok_known) -> np.ndarray:
    """A drafter pass writes outside the positions the scheduler reserved for it: pass k from the
    request's first scheduled position + k up to its last + k (num_lookahead_tokens)."""
    return ((pos < lo) | (pos > hi)) & tok_known


# In the order a step's violations are reported. Each name is also the step path's reporter for it.
REQUEST_RULES = {"positions": position_failures}
GROUP_RULES = {
    "writes": write_failures,
    "null_writes": null_write_failures,
    "padding": padding_failures,
    "reads": read_failures,
    "shared_writes": shared_write_failures,
}


def plan_failures(requests: RequestFacts | None, groups: list[GroupFacts]):
    """What every plan rule finds: (rule -> mask over the requests, per group: rule -> mask over
    its tokens or requests); a rule whose columns a group lacks is left out of its masks."""
    per_request = {} if requests is None else {name: rule(requests) for name, rule in REQUEST_RULES.items()}
    per_group = []
    for g in groups:
        masks = {}
        for name, rule in GROUP_RULES.items():
            if (mask := rule(g)) is not None:
                masks[name] = mask
        per_group.append(masks)
    return per_request, per_group


def plan_clean(requests: RequestFacts | None, groups: list[GroupFacts]) -> bool:
    """No plan rule fails anywhere: what the fast path needs to take a run."""
    per_request, per_group = plan_failures(requests, groups)
    return not any(m.any() for masks in (per_request, *per_group) for m in masks.values())


def grant_failures(f: GrantFacts) -> np.ndarray:
    """Blocks held elsewhere at another position, or written while reused: another holder had it
    before this step, a second grant of the step writes it, or a pending send reads it. Blocks only
    read (below the computed tokens) may be shared: a prefix hit, a received prefill."""
    return f.elsewhere | (f.written & ((f.prior > 0) | (f.writers > 1) | f.sending))


def null_grant_failures(blocks: np.ndarray, null_free: bool) -> np.ndarray:
    """A request handed the null block in a group whose manager never places it in rows (full
    attention, MLA): its tokens there would be written nowhere and read as garbage."""
    return (blocks == NULL_BLOCK) if null_free else np.zeros(blocks.size, bool)


def prefix_failures(f: ReadFacts) -> np.ndarray:
    """A block read as a prefix hit was computed from another prefix than its reader's at that position
    (token ids, LoRA adapter, multimodal items): the hash that matched them lied."""
    return (f.block_chain != 0) & (f.reader_chain != 0) & (f.block_chain != f.reader_chain)


def prefix_known(f: ReadFacts) -> np.ndarray:
    """The hits `prefix_failures` can judge: both chains known."""
    return (f.block_chain != 0) & (f.reader_chain != 0)


def unwritten_failures(fill: np.ndarray, block_size: int) -> np.ndarray:
    """A block read as computed that executed steps did not write to its end since it was handed out
    to be computed (its writes in the reader's own step count: a layer writes before it attends)."""
    return (fill != UNKNOWN_FILL) & (fill < block_size)


def overlapping_blocks(blocks: np.ndarray, mine, theirs, their_blocks: int):
    """The blocks of another group whose bytes meet those of `blocks`, page pair by page pair (`mine`,
    `theirs`: core/layout.Pages, entry i of each a pair on one allocation): (index into `blocks`, index
    of the page pair, the other group's block), one entry per meeting, the other group's pool only."""
    lo = mine.start[None, :] + blocks[:, None] * mine.stride[None, :]  # [blocks, page pairs]
    hi = lo + mine.size[None, :]
    first = np.maximum((lo - theirs.size - theirs.start) // theirs.stride + 1, 0)
    last = np.minimum(-((theirs.start - hi) // theirs.stride) - 1, their_blocks - 1)
    span = np.maximum(last - first + 1, 0).ravel()
    which = np.repeat(np.arange(span.size), span)
    steps = np.arange(which.size) - np.repeat(np.cumsum(span) - span, span)
    return which // mine.start.size, which % mine.start.size, first.ravel()[which] + steps


def layout_alias_failures(blocks: np.ndarray, others: np.ndarray, live: np.ndarray) -> np.ndarray:
    """A block handed out shares bytes with another block id, live in another group: a write to either
    overwrites the other's KV (block ids are one group's at a time; these bytes are two ids')."""
    return (others != blocks) & (others != NULL_BLOCK) & live


# -- async scheduling's window ---------------------------------------------------------------------
def in_flight_span(first: int, end: int, block_size: int, window: int | None) -> tuple[int, int]:
    """The row positions [lo, hi) of the blocks a dispatched step uses for one request whose query
    positions are [first, end): it writes from `first`'s block on and reads every block before (a
    sliding window: only those holding keys within `window` of its first query)."""
    lo = 0 if window is None else max(first - window + 1, 0) // block_size
    return lo, -(-end // block_size)


def in_flight_reuse_failures(loads: np.ndarray, used: np.ndarray) -> np.ndarray:
    """Per block a connector load writes at step T: whether a step still in flight at T uses it (for
    a request other than the load's). The load is not ordered with that step's kernels, as the
    step's own grants, zeroing and copies are (they run on the step's stream, after it)."""
    return np.isin(loads, used[used != NULL_BLOCK])
