"""Bug zoo plugin: sliding-window blocks freed on the optimistic computed count (vllm-ascend issue
13501, vllm PR 47728).

    ZOO_WINDOW_IN_FLIGHT=1   `allocate_slots` frees out-of-window blocks counting the tokens in flight

With async scheduling `request.num_computed_tokens` already counts the tokens of the steps still in
flight. `KVCacheManager.allocate_slots` frees a sliding-window group's out-of-window blocks
(`remove_skipped_blocks`) before allocating; vLLM 0.32 counts them on the settled basis,
`total_computed_tokens - request.num_in_flight_tokens` (the fix). Counted on the optimistic count,
the oldest block of the window is freed one step early: the in-flight step's query still reads it,
and a KV consumer can hand it to a pull as a load destination, overwritten mid-read.

Here `allocate_slots` runs with the request's `num_in_flight_tokens` read as 0, as before the fix
(the scheduler's other free, before a finished request's blocks go to the connector, keeps the
fix). What differs: the device (the serial CPU worker finished the in-flight step's read before the
load starts, so no KV is damaged) and the model (a two-layer Llama with one sliding-window layer,
not DeepSeek-V4). Logged: `ZOO window_freed req=R group=G blocks=B,...` when a call freed blocks of
a group while tokens of the request were in flight.
"""

import functools
import os
import sys


def register() -> None:
    if os.environ.get("ZOO_WINDOW_IN_FLIGHT") != "1":
        return
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if getattr(KVCacheManager, "_zoo_window_in_flight", False):
        return
    KVCacheManager._zoo_window_in_flight = True
    allocate = KVCacheManager.allocate_slots

    @functools.wraps(allocate)
    def allocate_on_optimistic_count(self, request, *args, **kwargs):
        in_flight = request.num_in_flight_tokens
        if not in_flight:
            return allocate(self, request, *args, **kwargs)
        before = self.get_block_ids(request.request_id)
        request.num_in_flight_tokens = 0  # the count before the fix: the in-flight tokens as computed
        try:
            return allocate(self, request, *args, **kwargs)
        finally:
            request.num_in_flight_tokens = in_flight
            after = self.get_block_ids(request.request_id)
            for group, (old, new) in enumerate(zip(before, after, strict=False)):
                freed = [b for b, n in zip(old, new, strict=False) if b != n and n == 0]
                if freed:
                    blocks = ",".join(map(str, freed))
                    print(f"ZOO window_freed req={request.request_id} group={group} blocks={blocks}", file=sys.stderr)

    KVCacheManager.allocate_slots = allocate_on_optimistic_count
