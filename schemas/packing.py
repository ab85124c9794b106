"""Packed integer columns and the block-table row digest.

Hot per-request columns travel as little-endian integer arrays in Avro
`bytes` fields: a step with hundreds of requests then decodes with one
`frombuffer` per column instead of one Python object per element.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")


def pack_i32(values: Iterable[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=_I32).tobytes()


def pack_i64(values: Iterable[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=_I64).tobytes()


def pack_u64(values: Iterable[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=_U64).tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=_I32)


def unpack_i64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=_I64)


def unpack_u64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=_U64)


def expand_slot_runs(data: bytes) -> np.ndarray:
    """Packed (start, length) runs -> the slot mapping, -1 runs kept as -1."""
    runs = unpack_i64(data).reshape(-1, 2)
    starts, lengths = runs[:, 0], runs[:, 1]
    if lengths.size == 0 or (lengths == 1).all():
        return starts
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + offsets * np.repeat(starts >= 0, lengths)


# Row digest: sum over positions i of mix(block_i) * P^(i+1), plus len * K, all
# mod 2^64. Position-weighted so swaps change it, additive so a reader can
# update it when blocks are appended without rehashing the row.
_P = np.uint64(0x100000001B3)
_K = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_ONE, _SHIFT = np.uint64(1), np.uint64(31)
_powers = np.cumprod(np.full(1 << 12, _P, dtype=np.uint64), dtype=np.uint64)


def mix_blocks(block_ids: np.ndarray) -> np.ndarray:
    """Scramble block ids (any int array) into uint64 so nearby ids differ widely."""
    x = block_ids.astype(np.uint64)  # the id's int64 bits, as ever (the arithmetic is mod 2^64)
    x += _ONE  # in place: one array for the whole mix
    x *= _M1
    x ^= x >> _SHIFT
    return x


def position_weights(start: int, stop: int) -> np.ndarray:
    """The weights P^(i+1) of row positions start .. stop-1 (rows of any length)."""
    global _powers
    while stop > _powers.size:
        with np.errstate(over="ignore"):
            _powers = np.concatenate([_powers, _powers * _powers[-1]])
    return _powers[start:stop]


def block_terms(blocks: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Each block's term in its row's digest, at its row position `cols`.

    A row's digest is the sum (mod 2^64) of its blocks' terms and of `length_terms` of its length:
    the one definition every writer and reader of digests builds on, which extends on append.
    """
    end = int(cols.max()) + 1 if cols.size else 0
    return mix_blocks(blocks) * position_weights(0, end)[cols]  # arrays: wraps mod 2^64, no warning


def length_terms(lengths: np.ndarray | int) -> np.ndarray:
    """The part of rows' digests that depends on their lengths only (uint64 array)."""
    return np.asarray(lengths, dtype=np.int64).reshape(-1).astype(np.uint64) * _K


def row_digest(row: np.ndarray | Iterable[int]) -> int:
    """Digest of one block-table row (its block ids, in order)."""
    arr = np.asarray(row, dtype=np.int64)
    with np.errstate(over="ignore"):
        return int(block_terms(arr, np.arange(arr.size)).sum(dtype=np.uint64) + length_terms(arr.size)[0])


def pack_digests(digests: Iterable[int] | np.ndarray) -> bytes:
    """Row digests as they travel: the low 32 bits of each, packed uint32.

    32 bits keep a decode step near 5 bytes per request; a wrong row still
    goes unnoticed only with probability 2^-32. The arithmetic stays mod 2^64
    (so readers extend digests on append) and is cut only at the comparison.
    """
    return np.asarray(digests, dtype=np.uint64).astype(_U32).tobytes()


def unpack_digests(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=_U32)


def wire_digests(digests: np.ndarray) -> np.ndarray:
    """Full (mod 2^64) digests cut to what the ledger carries, for comparison."""
    return digests.astype(_U32)


def length_term(n: int) -> int:
    """The part of a digest that depends on the row length only."""
    return int(np.uint64(n) * _K)


# -- prefix chains: what a full block's KV was computed from ---------------------------------------
# chain[i] identifies everything the KV of block i of a request depends on: the token ids of blocks
# 0 .. i and the request's extra keys (a LoRA adapter; the multimodal items placed in those blocks).
# It is computed by the probes, independently of vLLM's own block hashes (a bug in those is what it
# exists to catch); readers only compare chains. Mod 2^64: each block's tokens are weighted per
# column and scrambled with the block's position (row term), and chain[i] is the scrambled running
# sum of row terms 0 .. i, so one vectorised pass computes every chain of a prompt. Never 0 (0 says
# "unknown" in the ledger's tables).
_M2 = np.uint64(0x94D049BB133111EB)
_SHIFT2, _SHIFT3 = np.uint64(27), np.uint64(33)


def _scramble(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's), in place: nearby inputs give unrelated outputs."""
    x ^= x >> _SHIFT3
    x *= _M1
    x ^= x >> _SHIFT2
    x *= _M2
    x ^= x >> _SHIFT
    return x


# Column k of a block weighs its token by an odd constant: scramble(k + 1) | 1 (block sizes to 4096).
_COLUMN_WEIGHTS = _scramble(np.arange(1, 4097, dtype=np.uint64)) | _ONE


def text_key(text: str) -> int:
    """A string key (a LoRA name, a multimodal item's hash) as a uint64 term."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def prefix_chain(
    tokens: np.ndarray | list[int],
    block_size: int,
    seed: int = 0,
    items: Iterable[tuple[int, int, int]] = (),
) -> np.ndarray:
    """The chain (uint64) of every full block of `tokens` at `block_size`.

    `seed`: the request-wide extra key (`text_key` of its LoRA adapter, or 0); `items`: per
    multimodal item, (key, first position, length), mixed into every block the item overlaps.
    """
    if block_size > _COLUMN_WEIGHTS.size:
        raise ValueError(f"block size {block_size} above the {_COLUMN_WEIGHTS.size} a chain supports")
    toks = np.asarray(tokens, dtype=np.int64)
    n = toks.size // block_size
    with np.errstate(over="ignore"):
        rows = toks[: n * block_size].reshape(n, block_size).astype(np.uint64) @ _COLUMN_WEIGHTS[:block_size]
        rows ^= np.uint64(seed)
        for key, first, length in items:
            lo, hi = first // block_size, min((first + max(length, 1) - 1) // block_size + 1, n)
            rows[lo:hi] ^= _scramble(np.array([key], np.uint64))[0]
        rows += (np.arange(1, n + 1, dtype=np.uint64)) * _K
        chains = _scramble(np.cumsum(_scramble(rows), dtype=np.uint64))
    chains[chains == 0] = _ONE
    return chains
