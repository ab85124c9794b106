"""Bug zoo plugin: an abort frees a decode request's blocks while the transfer into them is in flight.

Reports: SGLang PR 32564 ("[PD] Don't release KV pages while Mooncake transfers are in flight";
also 31357, 35049). A decode request aborted, or timed out, during its prefill-to-decode
transfer has its KV pages freed at once, but the transfer is not cancelled: the pages go to the
next request, and the earlier transfer's write lands on that request's KV. vLLM's counterpart
of the fix is in `Scheduler.finish_requests` (vLLM PR 32255, "Delay freeing blocks of aborted
async loads"): a request still `WAITING_FOR_REMOTE_KVS` keeps its blocks until its receive
reports finished (`delay_free_blocks`), and `_update_from_kv_xfer_finished` frees them then.

    ZOO_ABORT_MARKERS=DIR   the directory both engines' plugins meet in (a pair shares a host)
    ZOO_ABORT_REVERT=1      decode: revert the fix: an aborted request waiting for its KV frees
                            its blocks at once, and the receive's late completion is ignored
    ZOO_ABORT_VICTIM=PREFIX decode: the request (its id's prefix) that gets the freed blocks

Where: the decode engine's scheduler (`Scheduler.finish_requests`, vLLM 0.32): the plugin marks
an aborted request still waiting for remote KV as if its receive had finished, so the original
code frees its blocks at once (the check the fix added reads `finished_recving_kv_req_ids`);
the receive that still completes later is then dropped (`_update_from_kv_xfer_finished`
asserts its request is known, which the fix guaranteed).

What differs from the original, and why: the window. A transfer in flight lasts microseconds
on one host over TCP; the plugin holds the prefill side's write (`MooncakeConnectorWorker.
_send_blocks`) until the decode engine has handed the freed blocks to the victim and run its
prefill, and holds the victim's next step until the write has landed: the order the report's
timeline describes (abort, free, reallocation, late write, decode), made certain rather than
likely. Both holds are in place with the fix too (ZOO_ABORT_REVERT unset), so a clean run
takes the same path. The abort itself is the client's (`LLMEngine.abort_request`), as a client
disconnect or a timeout aborts a request.

It prints, on stderr: `ZOO pull`, when the decode engine's pull reaches the prefill side;
`ZOO freed req=R blocks=B,...` (decode: an aborted request's blocks freed at once);
`ZOO victim req=R blocks=B,...` (decode: the victim ran its prefill on those blocks);
`ZOO landed`, once the held write is done; `ZOO late req=R` (decode: the freed request's
receive completed, ignored).
"""

import functools
import os
import sys
import time
from pathlib import Path

WAIT_S = 120


def _say(line: str) -> None:
    print(f"ZOO {line}", file=sys.stderr, flush=True)


def _wait_for(marker: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {marker.name} within {WAIT_S} s")
        time.sleep(0.01)


def register() -> None:
    markers = os.environ.get("ZOO_ABORT_MARKERS")
    if not markers:
        return
    markers = Path(markers)
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    if getattr(mc, "_zoo_abort_in_flight", False):
        return
    mc._zoo_abort_in_flight = True
    _hold_the_write(mc.MooncakeConnectorWorker, markers)
    victim = os.environ.get("ZOO_ABORT_VICTIM")
    if victim:
        _decode_side(markers, victim, revert=os.environ.get("ZOO_ABORT_REVERT") == "1")


def _hold_the_write(worker_cls, markers: Path) -> None:
    """Prefill side: the first write waits for the victim's prefill, then says it landed."""
    send_blocks = worker_cls._send_blocks

    @functools.wraps(send_blocks)
    def held_send_blocks(self, *args, **kwargs):
        if (markers / "landed").exists():
            return send_blocks(self, *args, **kwargs)
        (markers / "pull").touch()
        _say("pull")
        _wait_for(markers / "victim")
        try:
            return send_blocks(self, *args, **kwargs)
        finally:
            (markers / "landed").touch()
            _say("landed")

    worker_cls._send_blocks = held_send_blocks


def _decode_side(markers: Path, victim: str, revert: bool) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    finish_requests, update_from_kv = Scheduler.finish_requests, Scheduler._update_from_kv_xfer_finished
    update_from_output, schedule = Scheduler.update_from_output, Scheduler.schedule
    freed: set[str] = set()

    @functools.wraps(finish_requests)
    def freeing_finish_requests(self, request_ids, finished_status):
        if revert:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            for req_id in ids:
                request = self.requests.get(req_id)
                if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    blocks = self.kv_cache_manager.get_block_ids(req_id)[0]
                    self.finished_recving_kv_req_ids.add(req_id)  # as if received: freed at once
                    freed.add(req_id)
                    _say(f"freed req={req_id} blocks={','.join(map(str, blocks))}")
        return finish_requests(self, request_ids, finished_status)

    @functools.wraps(update_from_kv)
    def ignoring_late_receives(self, kv_connector_output):
        late = freed.intersection(kv_connector_output.finished_recving or ())
        if late:
            kv_connector_output.finished_recving = set(kv_connector_output.finished_recving) - late
            for req_id in sorted(late):
                freed.discard(req_id)
                _say(f"late req={req_id}")
        return update_from_kv(self, kv_connector_output)

    @functools.wraps(update_from_output)
    def noting_the_victim(self, scheduler_output, *args, **kwargs):
        result = update_from_output(self, scheduler_output, *args, **kwargs)
        if not (markers / "victim").exists():
            for req_id, request in self.requests.items():
                if req_id.startswith(victim) and request.num_computed_tokens >= request.num_prompt_tokens:
                    blocks = self.kv_cache_manager.get_block_ids(req_id)[0]
                    _say(f"victim req={req_id} blocks={','.join(map(str, blocks))}")
                    (markers / "victim").touch()
        return result

    @functools.wraps(schedule)
    def waiting_for_the_write(self, *args, **kwargs):
        if (markers / "victim").exists():
            _wait_for(markers / "landed")
        return schedule(self, *args, **kwargs)

    Scheduler.finish_requests = freeing_finish_requests
    Scheduler._update_from_kv_xfer_finished = ignoring_late_receives
    Scheduler.update_from_output = noting_the_victim
    Scheduler.schedule = waiting_for_the_write
