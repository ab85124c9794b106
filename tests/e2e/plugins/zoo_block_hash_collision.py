"""Bug zoo plugin: prefix-cache block hashes that collide (vLLM GHSA-rm76-4mrf-v9r8, PR 12621;
Megatron-LM PR 4158).

    ZOO_BLOCK_HASH_COLLISION=1   hash each block's tokens with a polynomial rolling hash

vLLM's prefix cache finds a request's cached blocks by a hash chained over each full block's
tokens and extra keys. Before PR 12621 the hash was Python's built-in `hash()`, whose start value
(`hash(None)`) became a predictable constant in Python 3.12: a prompt could be crafted to collide
with another tenant's, and read KV computed from their tokens (GHSA-rm76-4mrf-v9r8; vLLM moved to
SHA-256). Megatron-LM's block hash (PR 4158) was a polynomial rolling hash with multiplier 31, in
which two neighbouring tokens moved by +31 and -1 leave the hash unchanged: a collision by
arithmetic (folded as here, `h = 31 h + token`, the pair is +1 and -31).

Here vLLM 0.32's `hash_block_tokens` (`v1/core/kv_cache_utils.py`, where the block hash has lived
since) is given that polynomial pre-image: the block's tokens folded as `h = 31 h + token`
(mod 2^64), on top of its parent's hash, then put through vLLM's own hash function with the
extra keys. The collision of the original needed a predictable seed and a search; this one is
certain, so a test can craft it. Every collision the prefix cache meets is logged as
`ZOO collision first=... tokens=N`: the two blocks' first differing position.
"""

import functools
import os
import sys

_MASK = (1 << 64) - 1


def register() -> None:
    if not os.environ.get("ZOO_BLOCK_HASH_COLLISION"):
        return
    from vllm.v1.core import kv_cache_utils

    if getattr(kv_cache_utils, "_zoo_block_hash_collision", False):
        return
    kv_cache_utils._zoo_block_hash_collision = True
    seen: dict[bytes, tuple] = {}

    @functools.wraps(kv_cache_utils.hash_block_tokens)
    def polynomial_hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
        h = int.from_bytes(parent_block_hash or b"", "little") & _MASK
        for token in curr_block_token_ids:
            h = (h * 31 + token) & _MASK
        block_hash = kv_cache_utils.BlockHash(hash_function((h, extra_keys)))
        tokens = (parent_block_hash, tuple(curr_block_token_ids))
        earlier = seen.setdefault(block_hash, tokens)
        if earlier != tokens:
            first = next(i for i, (a, b) in enumerate(zip(earlier[1], tokens[1], strict=True)) if a != b)
            print(f"ZOO collision first={first} tokens={len(tokens[1])}", file=sys.stderr, flush=True)
        return block_hash

    kv_cache_utils.hash_block_tokens = polynomial_hash_block_tokens
