"""Bug zoo plugin: the block pool's null block is not block 0, and block 0 goes to a request.

Report: kvcached PR 398 (docs/bugs.md entry 6). kvcached's `ElasticBlockPool`, which replaces
vLLM's `BlockPool`, took its null block from its allocator without checking the id it got:
the null block was some other block, and block 0 was handed to a real request. Kernels that
treat index 0 as "no block" (state and sliding-window kernels skip it) then never read or
write that request's block 0.

Where: vLLM 0.32's `BlockPool.__init__` (`vllm/v1/core/block_pool.py`) takes the null block
as the first block of its free queue, block 0, which the rest of vLLM (padded block-table rows,
`NULL_BLOCK_ID`) and kvledger's ledger take for granted. The plugin builds the pool as vLLM
does, then makes the last block the null block and puts block 0 first in the free queue, as a
pool that trusted its allocator's answer would have it.

    ZOO_NULL_BLOCK_LAST=1   every BlockPool: the last block is the null block; block 0 is free

What differs from the original, and why: the model. The harm in the report needs a kernel that
skips block 0 (state pools, sliding windows); the tiny Llama here is full attention only, whose
CPU kernels read and write block 0 like any other, so the request's KV and its tokens are
right: what remains is a pool whose null block disagrees with everything that assumes 0.

It prints, on stderr: `ZOO null block=N blocks=M` (the pool's null block and its size).
"""

import functools
import os
import sys


def register() -> None:
    if os.environ.get("ZOO_NULL_BLOCK_LAST") != "1":
        return
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    if getattr(BlockPool, "_zoo_null_block", False):
        return
    BlockPool._zoo_null_block = True
    init = BlockPool.__init__

    @functools.wraps(init)
    def null_block_last(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.null_block.is_null = False
        self.null_block = self.blocks[-1]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[:-1])  # block 0 first in line
        print(f"ZOO null block={self.null_block.block_id} blocks={len(self.blocks)}", file=sys.stderr, flush=True)

    BlockPool.__init__ = null_block_last
