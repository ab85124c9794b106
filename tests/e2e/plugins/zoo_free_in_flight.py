"""Bug zoo plugin: blocks freed while an in-flight step still writes them (vllm PR 45357; the same
window as tpu-inference PR 3449 and the report behind vllm PR 45096).

    ZOO_FREE_IN_FLIGHT=1   a finished request's blocks go back to the pool at once under async scheduling

With async scheduling the engine core schedules step N+1 before step N's output is processed. A
request that stops on step N's output (a stop token the scheduler could not foresee) is still
carried by step N+1, which writes its next token's KV into its blocks. vLLM 0.32 fences that: on a
KV consumer with several batches in flight (`defer_block_free`), `Scheduler._free_request_blocks`
defers the return of the request's blocks until `update_from_output` has processed the newest step
that scheduled it (`deferred_frees`, `_request_blocks_can_be_freed`). The bug was the free at once:
the blocks went to a request waiting for remote KV, whose connector load (a NIC write, not ordered
with the device stream) and the stale write of step N+1 race.

Here `_request_blocks_can_be_freed` answers "yes" again, as before the fix. What differs: the
device. The CPU worker is serial, so step N+1 has finished before the load of step N+2 starts; the
stale write lands first and the load overwrites it, so no KV is damaged here. The scheduler's
contract is what breaks, and what the ledger judges. tpu-inference's `continue_decode` kept a
finished request as a masked row for whole windows; vLLM's V1 runner carries it one step.

Logged: `ZOO freed_in_flight req=R blocks=B,...` when a request's blocks are freed while a step
that scheduled it is unprocessed, `ZOO regranted req=S blocks=B,...` when such a block is handed
to another request.
"""

import functools
import os
import sys


def register() -> None:
    if os.environ.get("ZOO_FREE_IN_FLIGHT") != "1":
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_zoo_free_in_flight", False):
        return
    Scheduler._zoo_free_in_flight = True
    can_free, free_blocks, schedule = (
        Scheduler._request_blocks_can_be_freed,
        Scheduler._free_request_blocks,
        Scheduler.schedule,
    )

    def free_at_once(self, request) -> bool:
        return True

    @functools.wraps(free_blocks)
    def free_and_note(self, request):
        if not can_free(self, request):  # the fence would have held them: a step in flight still writes them
            blocks = sorted({b for group in self.kv_cache_manager.get_block_ids(request.request_id) for b in group})
            self._zoo_freed = getattr(self, "_zoo_freed", set()) | set(blocks)
            _log("freed_in_flight", request.request_id, blocks)
        return free_blocks(self, request)

    @functools.wraps(schedule)
    def schedule_and_note(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        freed = getattr(self, "_zoo_freed", set())
        for req_id in list(self.requests) if freed else ():
            got = sorted(freed.intersection(b for group in self.kv_cache_manager.get_block_ids(req_id) for b in group))
            if got:
                self._zoo_freed = freed = freed - set(got)
                _log("regranted", req_id, got)
        return output

    Scheduler._request_blocks_can_be_freed = free_at_once
    Scheduler._free_request_blocks = free_and_note
    Scheduler.schedule = schedule_and_note


def _log(what: str, req_id: str, blocks: list[int]) -> None:
    print(f"ZOO {what} req={req_id} blocks={','.join(map(str, blocks))}", file=sys.stderr, flush=True)
