"""Bug zoo plugin: a null block that is not block 0 (kvcached PR 398).

    ZOO_NULL_BLOCK_ELSEWHERE=1   the block pool's null block is its last block; block 0 is free

vLLM hard-codes the null block as block 0: `BlockPool` pops block 0 first, block tables are
filled with 0, state kernels skip index 0. kvcached's `ElasticBlockPool` took its null block from
its own allocator, which (racing its page-prealloc thread) could hand back another id; block 0
then went to a real request, whose state the kernels skipped as "null" (Qwen3.5 on H100:
garbled output). The fix reserves block 0 as the null block.

Here vLLM 0.32's `BlockPool.__init__` (`v1/core/block_pool.py`) is followed by the same mix-up:
block 0 goes back to the head of the free queue, to be handed to the next request, and the
pool's last block becomes the null block (the managers take it from the pool after this). The
original's trigger was a race; here it is certain. On a dense model's full-attention layers
block 0 is ordinary memory, so outputs stay right: what differs is that a row now holds block 0,
which vLLM's full-attention manager never puts there. Logged: `ZOO null_block id=N`.
"""

import functools
import os
import sys


def register() -> None:
    if not os.environ.get("ZOO_NULL_BLOCK_ELSEWHERE"):
        return
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    if getattr(BlockPool, "_zoo_null_block_elsewhere", False):
        return
    BlockPool._zoo_null_block_elsewhere = True
    init = BlockPool.__init__

    @functools.wraps(init)
    def init_with_null_elsewhere(self, *args, **kwargs):
        init(self, *args, **kwargs)
        zero, last = self.null_block, self.blocks[-1]
        zero.is_null = False
        self.free_block_queue.remove(last)
        last.is_null = True
        self.null_block = last
        self.free_block_queue = FreeKVCacheBlockQueue([zero, *self.free_block_queue.get_all_free_blocks()])
        print(f"ZOO null_block id={last.block_id}", file=sys.stderr, flush=True)

    BlockPool.__init__ = init_with_null_elsewhere
