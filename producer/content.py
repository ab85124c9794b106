"""Content digests of sealed KV blocks (`kv_trace.content_digests`), on the rank.

A block is sealed once it is full and will only be read: a full block of a
running request (every position below the request's computed tokens), and
every full block the prefix cache keeps after that. Its bytes may never
change until the scheduler hands it out again; a kernel writing where no plan
said (vllm #43810, #53982) changes them. The address checks cannot see that;
these digests can.

Per step, before the forward pass writes anything (`SealTracker.due`):

1. blocks this step writes or overwrites are no longer sealed: every block a
   row's write region holds (from its computed tokens on; the whole row of a
   state group), the blocks to zero and the destinations of block copies;
2. sampled blocks that became full are sealed and digested (SEALED);
3. sealed blocks read again are digested (READ: a prefix-cache hit or a
   resume), and those a finished or preempted request let go (RELEASED);
4. a bounded sweep digests a few more sealed blocks (SWEEP);
5. sampled blocks the runner zeroed are digested once zeroed, and must be 0
   (ZEROED).

The ledger's core compares each later digest with the SEALED one
(stream_app/core/content.py). Blocks are sampled by block id, so every rank
of an engine samples the same ones; each rank digests its own heads or
layers. Only attention groups that address slots are sealed; a block id names
one pool, so writes of every group unseal.

The digest (`digest_blocks`) is plain tensor arithmetic: per layer, the
block's 32-bit words times fixed odd weights, summed mod 2^64, the layers
weighted in turn. It runs where the cache lives (a device: no
synchronisation, the result staged like the plan) and is 0 for a block of
zeros.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvledger.schemas.packing import mix_blocks

NULL_BLOCK = 0


class Reason:
    """The contract's DigestReason symbols, in the order a step's digests are listed."""

    SEALED = "SEALED"
    READ = "READ"
    RELEASED = "RELEASED"
    SWEEP = "SWEEP"
    ZEROED = "ZEROED"


def sampled_blocks(num_blocks: int, fraction: float) -> np.ndarray:
    """Which block ids are digested: a fixed draw per id, the same on every rank."""
    if fraction >= 1.0:
        out = np.ones(num_blocks, bool)
    else:
        draw = mix_blocks(np.arange(num_blocks, dtype=np.int64)) >> np.uint64(11)  # 53 bits: exact as a float
        out = draw < np.uint64(int(fraction * (1 << 53)))
    out[NULL_BLOCK] = False
    return out


@dataclass(slots=True)
class GroupRows:
    """One KV cache group's block-table rows for the step's requests, as the runner holds them."""

    group_id: int
    block_size: int
    seals: bool  # a full-attention group: its full blocks seal
    state: bool  # a state group (Mamba): every block of a row is rewritten, none is ever sealed
    table: np.ndarray  # [requests, width] block ids (cells past a row's length are not read)
    lens: np.ndarray  # blocks in each row


@dataclass(slots=True)
class Due:
    """What to digest at this step: block ids, their groups and why, in one list."""

    groups: list[int] = field(default_factory=list)
    blocks: list[np.ndarray] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # one per array in `blocks`

    def add(self, group: int, blocks: np.ndarray, reason: str) -> None:
        if blocks.size:
            self.groups.append(group)
            self.blocks.append(blocks)
            self.reasons.append(reason)

    def __bool__(self) -> bool:
        return bool(self.blocks)


_UNSEALED, _WRITTEN = -1, -2  # sealed_in's states besides the group a block is sealed in


class SealTracker:
    """Which sampled blocks one rank holds sealed, and what each step must digest."""

    def __init__(self, num_blocks: int, fraction: float, sweep: int, sweep_window: int = 4096):
        self.sampled = sampled_blocks(num_blocks, fraction)
        # block -> the group it is sealed in, or _UNSEALED (_WRITTEN while a step is planned): a
        # block id names one pool.
        self.sealed_in = np.full(num_blocks, _UNSEALED, np.int16)
        self.sweep = sweep  # blocks per step
        self.sweep_window = sweep_window  # block ids looked at per step to find them
        self._cursor = 1
        self.sealed_total = 0  # blocks sealed so far (a count for Health and the tests)
        # Per batch row: its request and, per sealing group, how many of its blocks were looked
        # at to seal: a row that keeps its request only needs its newly full blocks looked at.
        self._row_ids: list = []
        self._looked: dict[int, np.ndarray] = {}

    def reset(self) -> None:
        """Forget every seal (tracing resumed: what happened meanwhile is unknown)."""
        self.sealed_in[:] = _UNSEALED
        self._row_ids = []

    def due(
        self,
        rows: Sequence[GroupRows],
        computed: np.ndarray,
        reading: np.ndarray,
        released: dict[int, np.ndarray],
        overwritten: np.ndarray,
        zeroed: np.ndarray | None = None,
        row_ids: Sequence | None = None,
    ) -> Due:
        """The step's digests. `computed`: each row's computed tokens at this step; `reading`: rows
        of requests that read blocks sealed before (new with a prefix-cache hit, resumed);
        `released`: per group the full blocks of requests that finished or were preempted;
        `overwritten`: blocks zeroed or copied into this step; `zeroed`: those of them the
        runner has zeroed by now and nothing else writes before the forward pass (ZEROED, in
        every sealing group: the runner zeroes attention layers); `row_ids`: each row's request
        (None: every row looked at whole)."""
        sealed_in, sampled = self.sealed_in, self.sampled
        fresh = self._fresh_rows(row_ids, computed.size)
        written, spans = [], []
        for g in rows:
            # Attention writes a row from its computed tokens on (a sliding window's stale cells lie
            # before them); a state group rewrites its blocks.
            full = np.zeros_like(computed) if g.state else np.minimum(computed // g.block_size, g.lens)
            written.append(_cells(g.table, full, g.lens))
            if g.seals:
                looked = self._looked_at(g.group_id, computed.size)
                spans.append((g, np.where(fresh, 0, np.minimum(looked, full)), full))
                looked[:] = full
        # Written at this step (a grant, a state block, a zeroing, a copy): not sealed, and not
        # sealable at this step either (a prefix hit may already read a block another request
        # is computing in the same step).
        for cells in (*written, overwritten):
            sealed_in[cells] = _WRITTEN
        out = Due()
        if zeroed is not None and zeroed.size:
            zeroed = np.unique(zeroed[sampled[zeroed]])
            for g, _, _ in spans:
                out.add(g.group_id, zeroed, Reason.ZEROED)
        for g, start, full in spans:
            if reading.size:  # the rows reading what was sealed before: READ
                again = _cells(g.table[reading], np.zeros(reading.size, full.dtype), full[reading])
                out.add(g.group_id, np.unique(again[sealed_in[again] == g.group_id]), Reason.READ)
            cells = _cells(g.table, start, full)
            cells = cells[sampled[cells]]
            new = np.unique(cells[sealed_in[cells] == _UNSEALED])
            sealed_in[new] = g.group_id
            self.sealed_total += int(new.size)
            out.add(g.group_id, new, Reason.SEALED)
        for cells in (*written, overwritten):
            sealed_in[cells] = _UNSEALED
        for gid, blocks in released.items():
            blocks = np.unique(blocks)
            out.add(gid, blocks[sealed_in[blocks] == gid], Reason.RELEASED)
        self._sweep(out)
        return out

    def _fresh_rows(self, row_ids: Sequence | None, n: int) -> np.ndarray:
        """Rows whose request changed since the last step (moved, new, resumed): looked at whole."""
        if row_ids is None:
            self._row_ids = []
            return np.ones(n, bool)
        prev, self._row_ids = self._row_ids, list(row_ids)
        fresh = np.ones(n, bool)
        if prev == self._row_ids:  # the usual decode step, compared in C
            fresh[:] = False
        else:
            same = min(n, len(prev))
            fresh[:same] = list(map(operator.ne, self._row_ids[:same], prev[:same]))
        return fresh

    def _looked_at(self, group_id: int, n: int) -> np.ndarray:
        looked = self._looked.get(group_id)
        if looked is None or looked.size < n:
            grown = np.zeros(max(n, 2 * (0 if looked is None else looked.size)), np.int64)
            if looked is not None:
                grown[: looked.size] = looked
            looked = self._looked[group_id] = grown
        return looked[:n]

    def _sweep(self, out: Due) -> None:
        """The next few sealed blocks after the cursor, wrapping around the pool."""
        if self.sweep <= 0:
            return
        n = self.sealed_in.size
        start = self._cursor
        window = self.sealed_in[start : start + self.sweep_window]
        found = np.flatnonzero(window >= 0)[: self.sweep]
        self._cursor = start + (int(found[-1]) + 1 if found.size == self.sweep else window.size)
        if self._cursor >= n:
            self._cursor = 1
        if found.size:
            blocks = found + start
            groups = self.sealed_in[blocks]
            for gid in np.unique(groups).tolist():
                out.add(gid, blocks[groups == gid], Reason.SWEEP)


def _cells(table: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """The block ids `table[r, start[r]:stop[r]]` of every row r, concatenated."""
    counts = np.maximum(stop - start, 0)
    total = int(counts.sum())
    if not total:
        return np.empty(0, table.dtype)
    rows = np.repeat(np.arange(counts.size), counts)
    cols = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(start, counts)
    return table[rows, cols]


# -- the pages of a group ----------------------------------------------------------------------------
def group_pages(kv_cache_config, backing) -> dict[int, list]:
    """Per KV cache group, one [blocks, 32-bit words] view per layer of its pages in the backing
    allocation. vLLM places every layer's page of block b at `offset + l * layer_stride + b *
    block_stride` bytes of one allocation (vllm/v1/kv_cache_interface.py, KVCacheTensor), whatever
    the attention backend's own view; `backing` is any tensor on that allocation."""
    import torch

    storage = backing.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=backing.device).set_(storage)
    group_of = {name: gid for gid, g in enumerate(kv_cache_config.kv_cache_groups) for name in g.layer_names}
    num_blocks = kv_cache_config.num_blocks
    out: dict[int, list] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for k, name in enumerate(tensor.layers):
            gid = group_of.get(name)
            if gid is None:
                continue
            spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            spec = getattr(spec, "kv_cache_specs", {}).get(name, spec)  # UniformTypeKVCacheSpecs
            page = int(spec.page_size_bytes)
            start = int(tensor.offset) + k * int(tensor.layer_stride)
            if page % 4 or tensor.block_stride % 4 or start % 4:
                raise ValueError(f"layer {name}: pages not aligned to 32-bit words")
            view = flat.as_strided((num_blocks, page), (int(tensor.block_stride), 1), start)
            out.setdefault(gid, []).append(view.view(torch.int32))
    return out


# -- the digest ------------------------------------------------------------------------------------
_WEIGHTS: dict[tuple[int, object], object] = {}


def _weights(words: int, device) -> object:
    """Odd 64-bit weights per word position (as int64), made once per size and device."""
    import torch

    key = (words, device)
    w = _WEIGHTS.get(key)
    if w is None:
        raw = mix_blocks(np.arange(words, dtype=np.int64)) | np.uint64(1)
        w = _WEIGHTS[key] = torch.from_numpy(raw.view(np.int64)).to(device)
    return w


def digest_blocks(layers: Sequence, block_ids) -> object:
    """Digests (int64 tensor, one per block, on the cache's device) of `block_ids` (an int64 tensor
    on that device) over `layers` (each [blocks, words], as `group_pages` gives)."""
    import torch

    total = torch.zeros(block_ids.shape[0], dtype=torch.int64, device=block_ids.device)
    for k, words in enumerate(layers):
        x = words.index_select(0, block_ids).to(torch.int64)
        per_layer = (x * _weights(x.shape[1], x.device)).sum(dim=1)
        total += per_layer * int(_LAYER_WEIGHTS[k % _LAYER_WEIGHTS.size])
    return total


_LAYER_WEIGHTS = (mix_blocks(np.arange(1 << 10, dtype=np.int64) + (1 << 20)) | np.uint64(1)).view(np.int64)
