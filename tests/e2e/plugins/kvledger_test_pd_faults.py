"""Test-only vLLM plugin: injects KV transfer faults into a prefill/decode pair, one transfer each.

    KVLEDGER_PD_FAULT_RECV_FAIL=TRANSFER_ID    decode: the pull succeeds, the worker reports it failed
    KVLEDGER_PD_FAULT_CORRUPT=TRANSFER_ID      decode: the first received block is zeroed after the pull
    KVLEDGER_PD_FAULT_REUSE=TRANSFER_ID        prefill: the next new request is handed the last block
                                               of this transfer's pending send (the scheduler's plan),
                                               to be written (its own, not a shared prefix block)
    KVLEDGER_PD_FAULT_SHORT_SEND=TRANSFER_ID   prefill: the worker sends one block fewer than decode expects

Each fault fires once, where a real bug would sit, and prints one line
`PD_FAULT kind=K transfer=T block=B` on stderr, which the tests match against.
"""

import ctypes
import os
import sys

VARS = {
    "recv_fail": "KVLEDGER_PD_FAULT_RECV_FAIL",
    "corrupt": "KVLEDGER_PD_FAULT_CORRUPT",
    "reuse": "KVLEDGER_PD_FAULT_REUSE",
    "short_send": "KVLEDGER_PD_FAULT_SHORT_SEND",
}


def _said(kind: str, transfer: str, block: int) -> None:
    print(f"PD_FAULT kind={kind} transfer={transfer} block={block}", file=sys.stderr, flush=True)


def register() -> None:
    targets = {kind: os.environ.get(var) for kind, var in VARS.items() if os.environ.get(var)}
    if not targets:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    if getattr(mc, "_kvledger_test_pd_faults", False):
        return
    mc._kvledger_test_pd_faults = True
    if "recv_fail" in targets or "corrupt" in targets:
        _wrap_pulls(mc, targets.get("recv_fail"), targets.get("corrupt"))
    if "short_send" in targets:
        _wrap_bind(mc, targets["short_send"])
    if "reuse" in targets:
        _wrap_scheduler(mc, targets["reuse"])


def _wrap_pulls(mc, fail_transfer, corrupt_transfer) -> None:
    worker_cls = mc.MooncakeConnectorWorker
    process = worker_cls.process_pulling_result

    def faulty_process(self, response, pull_metas):
        ok = list(response.ok_reqs or [])
        failing = [r for r in ok if r in pull_metas and pull_metas[r].transfer_id == fail_transfer]
        if failing:
            response = type(response)(
                status=response.status,
                ok_reqs=[r for r in ok if r not in failing] or None,
                err_reqs=[*(response.err_reqs or []), *failing],
                err_msg="injected receive failure",
            )
            _said("recv_fail", fail_transfer, pull_metas[failing[0]].local_block_ids[0][0])
        process(self, response, pull_metas)
        # Same loop iteration as the completion: get_finished cannot see it before the damage.
        for r in response.ok_reqs or ():
            meta = pull_metas.get(r)
            if meta is not None and meta.transfer_id == corrupt_transfer and r in self.finished_recving_reqs:
                block = meta.local_block_ids[0][0]
                base, stride = self.kv_caches_base_addr[0], self.block_len_per_layer[0]
                ctypes.memset(base + block * stride, 0, self.kv_block_len_per_layer[0])
                _said("corrupt", corrupt_transfer, block)

    worker_cls.process_pulling_result = faulty_process


def _wrap_bind(mc, transfer) -> None:
    connector_cls = mc.MooncakeConnector
    bind = connector_cls.bind_connector_metadata

    def short_bind(self, metadata, *args, **kwargs):
        for req_id, (tid, groups) in list(metadata.reqs_to_send.items()):
            if tid == transfer and any(len(g) > 1 for g in groups):
                metadata.reqs_to_send[req_id] = (tid, [list(g[:-1]) for g in groups])
                _said("short_send", transfer, groups[0][-1])
        return bind(self, metadata, *args, **kwargs)

    connector_cls.bind_connector_metadata = short_bind


def _wrap_scheduler(mc, transfer) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    held: dict[str, int] = {}
    finished = mc.MooncakeConnectorScheduler.request_finished

    def noting_finished(self, request, block_ids):
        delay, params = finished(self, request, block_ids)
        kv = request.kv_transfer_params or {}
        if delay and kv.get("transfer_id") == transfer and block_ids and block_ids[0]:
            held.setdefault("block", int(block_ids[0][-1]))
        return delay, params

    schedule = Scheduler.schedule

    def reusing_schedule(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if "block" in held and not held.get("done") and out.scheduled_new_reqs:
            req = out.scheduled_new_reqs[0]
            groups = [list(g) for g in req.block_ids]
            groups[0][0] = held["block"]
            req.block_ids = tuple(groups)
            held["done"] = True
            _said("reuse", transfer, held["block"])
        return out

    mc.MooncakeConnectorScheduler.request_finished = noting_finished
    Scheduler.schedule = reusing_schedule
