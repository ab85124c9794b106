"""Block tables of one rank and one KV cache group: rows, digests, block holders.

Rows are dense numpy arrays indexed by a row number the rank state assigns to
each live request. Per block we keep how many live rows hold it and the sum
and sum of squares of the row positions it is held at: all holders sit at one
position (a shared prefix) exactly when the variance of those positions is
zero, which checks exclusivity without per-block Python sets.
"""

from __future__ import annotations

import numpy as np

from kvledger.schemas.kinds import KvGroupKind
from kvledger.schemas.packing import block_terms, length_term, length_terms

NULL_BLOCK = 0
UNKNOWN_FILL = -1  # GroupTable.fill of a block whose writes the ledger did not see


def written_from(num_computed_tokens, block_size: int):
    """The first row position a grant writes, for a request with that many computed tokens.

    Blocks wholly below the computed tokens hold KV that already exists (a
    prefix-cache hit, a received prefill, a resumed request's surviving
    prefix): the request only reads them, so sharing them with another
    holder, or with a pending KV send, is no reuse. Works on arrays too.
    """
    return num_computed_tokens // block_size


def last_of_runs(*keys: np.ndarray) -> np.ndarray:
    """Where a run of equal `keys` (compared together, element by element) ends: in position order, the
    last write of a run is its highest."""
    n = keys[0].size
    last = np.ones(n, bool)
    if n > 1:
        ends = keys[0][1:] != keys[0][:-1]
        for k in keys[1:]:
            ends |= k[1:] != k[:-1]
        last[:-1] = ends
    return last


def positions_differ(count, pos_sum, pos_sumsq, pos) -> np.ndarray:
    """A block's holders sit at different row positions: the variance of their positions is not zero.

    `count`, `pos_sum`, `pos_sumsq`: the block's holders, the sum and the sum of squares of their
    positions; `pos`: the position one of them holds it at.
    """
    return (pos_sum != count * pos) | (pos_sumsq != count * pos * pos)


class GroupTable:
    def __init__(self, group_id: int, kind: KvGroupKind, block_size: int, num_blocks: int, window: int | None):
        self.group_id = group_id
        self.kind = kind
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.window = window if kind == KvGroupKind.SLIDING_WINDOW else None
        self.table = np.zeros((8, 16), dtype=np.int64)
        self.lens = np.zeros(8, dtype=np.int64)
        self.digests = np.full(8, length_term(0), dtype=np.uint64)
        # Leading positions of a row that the scheduler has freed (sliding window, spent states).
        self.released = np.zeros(8, dtype=np.int64)
        self.hold_count = np.zeros(num_blocks, dtype=np.int64)
        self.hold_sum = np.zeros(num_blocks, dtype=np.int64)
        self.hold_sumsq = np.zeros(num_blocks, dtype=np.int64)
        # Blocks a pending KV transfer still uses, whoever holds them now: a send reads them, a
        # receive writes them (its request reads them once it is done).
        self.send_hold = np.zeros(num_blocks, dtype=np.int64)
        self.recv_hold = np.zeros(num_blocks, dtype=np.int64)
        # What each block's KV holds, as far as the ledger saw it written: the prefix chain of the
        # prompt block it was handed out to compute (0: unknown, or not a prompt block), and how far
        # executed steps wrote it since (the highest offset written + 1; UNKNOWN_FILL when it was
        # never handed out to be written while the ledger watched: before a resync, say).
        self.chain = np.zeros(num_blocks, dtype=np.uint64)
        self.fill = np.full(num_blocks, UNKNOWN_FILL, dtype=np.int32)

    # -- capacity -------------------------------------------------------------------
    def ensure_rows(self, n: int) -> None:
        if n <= self.table.shape[0]:
            return
        grow = max(n, 2 * self.table.shape[0]) - self.table.shape[0]
        self.table = np.vstack([self.table, np.zeros((grow, self.table.shape[1]), np.int64)])
        self.lens = np.concatenate([self.lens, np.zeros(grow, np.int64)])
        self.digests = np.concatenate([self.digests, np.full(grow, length_term(0), np.uint64)])
        self.released = np.concatenate([self.released, np.zeros(grow, np.int64)])

    def _ensure_cols(self, n: int) -> None:
        if n > self.table.shape[1]:
            grow = max(n, 2 * self.table.shape[1]) - self.table.shape[1]
            self.table = np.hstack([self.table, np.zeros((self.table.shape[0], grow), np.int64)])

    # -- the state changes, each written once (the step path and the batched run path use them) ------
    def place(self, rows: np.ndarray, cols: np.ndarray, blocks: np.ndarray) -> None:
        """Write blocks into cells; a cell past its row's end is read by nothing until `extend`."""
        self._ensure_cols(int(cols.max()) + 1 if cols.size else 0)
        self.table[rows, cols] = blocks

    def extend(self, rows: np.ndarray, counts: np.ndarray, digest_terms: np.ndarray) -> None:
        """Rows (distinct) grow by counts[i] placed blocks, whose terms add digest_terms[i] to the digest."""
        self.lens[rows] += counts
        with np.errstate(over="ignore"):
            self.digests[rows] += digest_terms

    def reset(self, rows: np.ndarray | int) -> None:
        """Rows emptied (their holds already dropped): a row a new request may take."""
        self.lens[rows] = 0
        self.released[rows] = 0
        self.digests[rows] = length_term(0)

    # -- holders ----------------------------------------------------------------------
    def in_pool(self, blocks: np.ndarray) -> np.ndarray:
        return (blocks >= 0) & (blocks < self.num_blocks)

    def ownable(self, blocks: np.ndarray) -> np.ndarray:
        """Ids a request can hold and a write can fill: in the pool, not the null block."""
        return (blocks > NULL_BLOCK) & (blocks < self.num_blocks)

    def hold(self, blocks: np.ndarray, positions: np.ndarray, sign: int) -> None:
        """Blocks (at their row positions) gain (+1) or lose (-1) a holder; ids outside the pool and the
        null block are nobody's."""
        keep = self.ownable(blocks)
        if not keep.all():
            blocks, positions = blocks[keep], positions[keep]
        np.add.at(self.hold_count, blocks, sign)
        np.add.at(self.hold_sum, blocks, sign * positions)
        np.add.at(self.hold_sumsq, blocks, sign * positions * positions)

    def held_elsewhere(self, blocks: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Which blocks (in the pool, held at `positions`) another holder has at another position."""
        return positions_differ(self.hold_count[blocks], self.hold_sum[blocks], self.hold_sumsq[blocks], positions)

    def hold_for_transfer(self, receive: bool, blocks: np.ndarray, sign: int) -> None:
        blocks = blocks[self.ownable(blocks)]
        np.add.at(self.recv_hold if receive else self.send_hold, blocks, sign)

    def in_transfer(self, blocks: np.ndarray) -> np.ndarray:
        """A pending transfer uses each block: a write to it races the transfer."""
        return (self.send_hold[blocks] > 0) | (self.recv_hold[blocks] > 0)

    # -- what blocks hold ----------------------------------------------------------------------
    def mark_fresh(self, blocks: np.ndarray, chains: np.ndarray) -> None:
        """Blocks handed out to be computed anew, each from the prefix `chains` gives (0: unknown)."""
        self.chain[blocks] = chains
        self.fill[blocks] = 0

    def mark_written(self, blocks: np.ndarray, offsets: np.ndarray) -> None:
        """Executed writes at `offsets` of `blocks` (in position order: the last write of a block is its
        highest, so only the last of each run of one block is looked at)."""
        if blocks.size > 1:
            last = last_of_runs(blocks)
            blocks, offsets = blocks[last], offsets[last]
        keep = self.fill[blocks] != UNKNOWN_FILL
        blocks, offsets = blocks[keep], offsets[keep]
        self.fill[blocks] = np.maximum(self.fill[blocks], offsets + 1)

    def mark_received(self, blocks: np.ndarray) -> None:
        """Blocks a KV transfer filled: their writes happened elsewhere, their prefix is not known here."""
        self.chain[blocks] = 0
        self.fill[blocks] = self.block_size

    def copy_content(self, src: np.ndarray, dst: np.ndarray) -> None:
        """The worker copied whole blocks: each destination holds what its source held."""
        self.chain[dst], self.fill[dst] = self.chain[src], self.fill[src]

    def forget_content(self) -> None:
        """Nothing known of any block's content any more (a resync: writes were missed)."""
        self.chain[:] = 0
        self.fill[:] = UNKNOWN_FILL

    def sealed_and_shared(self, blocks: np.ndarray) -> np.ndarray:
        """Blocks written to their end and held by two live requests or more: vLLM shares only full
        blocks, which nobody writes again."""
        return (self.fill[blocks] >= self.block_size) & (self.hold_count[blocks] >= 2)

    # -- row edits ------------------------------------------------------------------------
    def append_many(self, rows: np.ndarray, counts: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Append counts[i] blocks to rows[i] (rows distinct), taken in order from `blocks`.

        Returns the row position each block landed at.
        """
        starts = self.lens[rows]
        if rows.size == 1:
            row_of_block = np.full(blocks.size, rows[0])
            cols = starts[0] + np.arange(blocks.size)
        else:
            row_of_block = np.repeat(rows, counts)
            cols = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(blocks.size)
        self.place(row_of_block, cols, blocks)
        self.lens[rows] += counts  # `extend`, with the digest's terms added where they fall (the hot path)
        with np.errstate(over="ignore"):
            np.add.at(self.digests, row_of_block, block_terms(blocks, cols))
            self.digests[rows] += length_terms(counts)
        self.hold(blocks, cols, +1)
        return cols

    def load_rows(self, lens: np.ndarray, released: np.ndarray, blocks: np.ndarray) -> None:
        """Fill empty rows 0 .. len(lens)-1 (a checkpoint's): lens[i] blocks each, taken in order
        from `blocks`, the first released[i] of them already freed by the scheduler."""
        rows = np.flatnonzero(lens)
        if rows.size:
            self.append_many(rows, lens[rows], blocks)
            self._release_leading(np.arange(lens.size), released)

    def clear(self, row: int) -> None:
        n, start = int(self.lens[row]), int(self.released[row])
        if n > start:
            self.hold(self.table[row, start:n], np.arange(start, n), -1)
        self.reset(row)

    def row(self, row: int) -> np.ndarray:
        return self.table[row, : self.lens[row]]

    def release_freed(self, rows: np.ndarray, tokens_done: np.ndarray) -> None:
        """Forget holders of blocks the scheduler frees from live requests without telling workers.

        Rows keep such blocks (workers are never told), so only the holders go.
        Releasing as early as the scheduler could have (from the tokens done
        after this step) keeps a legitimate reuse of such a block from looking
        foreign. Full-attention groups free nothing before a request ends.
        """
        if self.window is not None:
            self.release_out_of_window(rows, tokens_done)
        elif self.kind == KvGroupKind.MAMBA:
            self.release_spent_states(rows, tokens_done)

    def release_out_of_window(self, rows: np.ndarray, tokens_done: np.ndarray) -> None:
        """Sliding window: the blocks whose tokens all slid out of the window of the next token."""
        self._release_leading(rows, np.maximum(tokens_done - self.window + 1, 0) // self.block_size)

    def release_spent_states(self, rows: np.ndarray, tokens_done: np.ndarray) -> None:
        """Mamba-style state group: every block before the one holding the latest state.

        vLLM's Mamba manager skips all but the last computed token (prefix
        caching's `align` mode keeps one state per block and frees the older
        ones; without prefix caching a row is one block, never freed early).
        """
        self._release_leading(rows, np.maximum(tokens_done - 1, 0) // self.block_size)

    def _release_leading(self, rows: np.ndarray, upto: np.ndarray) -> None:
        """Drop the holds of row positions below upto[i] in rows[i] (once each)."""
        upto = np.minimum(upto, self.lens[rows])
        moved = upto > self.released[rows]
        for row, new in zip(rows[moved].tolist(), upto[moved].tolist(), strict=True):
            old = int(self.released[row])
            self.hold(self.table[row, old:new], np.arange(old, new), -1)
            self.released[row] = new
