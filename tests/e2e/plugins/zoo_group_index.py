"""Bug zoo plugin: a transfer region takes its block ids from another KV cache group.

Report: vllm-ascend PR 13965 (issue 13934; PD disaggregation over Mooncake with context
parallelism, a hybrid model; docs/bugs.md entry 11). The request's metadata keeps its block ids
by KV cache group, but the context-parallel path of vllm-ascend's `MooncakeConnectorWorker`
looked them up by transfer-group index: where one KV group is split into several transfer
groups the index points at another group's block ids (or past the end: an `IndexError`), scaled
by that group's block-size factor.

Where: vLLM 0.32's `MooncakeConnectorWorker._build_transfer_params`
(`vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py`) builds each
transfer region's source addresses from `_block_ids_for_region(local_block_ids_by_group,
region.group_index, ...)`. For one transfer the plugin makes the source side of region k read
KV group k+1's block ids (modulo the number of groups); the destination side stays right.

    ZOO_GROUP_INDEX=T       prefill: the transfer whose id is T sends group k+1's blocks as group k's

What differs from the original, and why: vLLM 0.32 has no context-parallel Mooncake path and,
for the hybrid model a CPU host runs (a two-layer Llama, a full-attention and a sliding-window
layer), its transfer groups are its KV groups, so no index can be confused by itself; the
plugin shifts the index as the confused lookup did. Both groups have the same block size here,
so there is no size factor to get wrong; the prompt (32 tokens) gives each group one block to
send, so the shifted lists have the lengths the destinations expect and the transfer succeeds,
which is what made the report silent.

It prints, on stderr: `ZOO shifted transfer=T region=K from=G blocks=B,...` per region.
"""

import functools
import os
import sys


def register() -> None:
    transfer_id = os.environ.get("ZOO_GROUP_INDEX")
    if not transfer_id:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    worker_cls = mc.MooncakeConnectorWorker
    if getattr(worker_cls, "_zoo_group_index", False):
        return
    worker_cls._zoo_group_index = True
    build, block_ids_for_region = worker_cls._build_transfer_params, mc._block_ids_for_region
    state = {"calls": None}  # while the target's transfer is built: lookups so far (local, remote, ...)

    @functools.wraps(block_ids_for_region)
    def shifted_block_ids_for_region(block_ids_by_group, group_index, shared_group_ids=()):
        calls = state["calls"]
        if calls is None or group_index < 0:
            return block_ids_for_region(block_ids_by_group, group_index, shared_group_ids)
        state["calls"] = calls + 1
        if calls % 2:  # the destination side: right
            return block_ids_for_region(block_ids_by_group, group_index, shared_group_ids)
        source = (group_index + 1) % len(block_ids_by_group)
        found = block_ids_for_region(block_ids_by_group, source, shared_group_ids)
        blocks = ",".join(map(str, found))
        print(f"ZOO shifted transfer={transfer_id} region={group_index} from={source} blocks={blocks}", file=sys.stderr)
        return found

    @functools.wraps(build)
    async def building_with_a_shifted_index(self, ready_reqs, agent_meta, local_regions, remote_regions):
        if not any(send_meta.transfer_id == transfer_id for _, send_meta in ready_reqs):
            return await build(self, ready_reqs, agent_meta, local_regions, remote_regions)
        state["calls"] = 0  # the build runs to its end without yielding: no other transfer interleaves
        try:
            return await build(self, ready_reqs, agent_meta, local_regions, remote_regions)
        finally:
            state["calls"] = None

    mc._block_ids_for_region = shifted_block_ids_for_region
    worker_cls._build_transfer_params = building_with_a_shifted_index
