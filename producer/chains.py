"""The prefix chains of new requests' prompts (the contract's `packing.prefix_chain`).

Computed in the rank's recorder, off the engine thread: the probe hands over the prompt's token ids
and the request's extra keys as the scheduler gave them to the worker (`frames.scheduler_fields`).
A prompt given as embeddings has no chain: its token ids do not say what its KV was computed from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvledger.schemas.events import RankInfo
from kvledger.schemas.packing import pack_u64, prefix_chain, text_key

# (LoRA name or None, [(multimodal item identifier, first position, length)], prompt as embeddings),
# or () for a request with none of them.
ExtraKeys = tuple


class PrefixChains:
    """Chains at each KV cache group's block size (None for a group that does not address slots)."""

    def __init__(self, block_sizes: Sequence[int | None]):
        self.block_sizes = list(block_sizes)

    @classmethod
    def of(cls, info: RankInfo) -> PrefixChains:
        return cls([g.block_size if g.kind.addresses_slots else None for g in info.kv_groups])

    def __call__(self, prompt: Sequence[int], extras: ExtraKeys) -> list[bytes] | None:
        if (extras and extras[2]) or not any(self.block_sizes):
            return None
        seed, items = 0, ()
        if extras:
            lora, mm, _ = extras
            seed = text_key(lora) if lora else 0
            items = [(text_key(identifier), offset, length) for identifier, offset, length in mm]
        tokens = np.asarray(prompt, np.int64)
        by_size: dict[int, bytes] = {}
        for bs in self.block_sizes:
            if bs and bs not in by_size:
                by_size[bs] = pack_u64(prefix_chain(tokens, bs, seed, items))
        return [by_size[bs] if bs else b"" for bs in self.block_sizes]
