"""Bug zoo plugin: KV cache groups of different block sizes addressing one allocation (vllm-ascend PR
16490; vLLM issue 41262, PR 41657).

    ZOO_LAYOUT_ALIAS=1   the sliding-window group's blocks hold twice the tokens; both groups overlay
                         the KV allocation from byte 0, each striding blocks by its own page

The reports: hybrid models whose KV cache groups have different block sizes (Gemma-4 with a DFlash
drafter; vllm-ascend's hybrid pools) let those groups share a raw KV tensor because their page sizes
matched. Kernels address the tensor by slot, `block_id * block_size + offset`, so a block of one
group and a *different* block of the other reach the same bytes (2 x 16 = 1 x 32): block ids are
exclusive across groups, bytes were not. Corrupted output followed. The fix shares a tensor only
among groups whose blocks map to the same bytes.

vLLM 0.32 (`v1/core/kv_cache_utils.py`): every group's layers are placed in one backing allocation,
groups overlaying each other from byte 0 (`get_kv_cache_config_from_groups`, `KVCacheTensor`: layer
l's page of block b at `offset + l * layer_stride + b * block_stride`). That is sound only while
every group strides blocks alike, which `validate_kv_cache_layout` enforces: a layer-outer layout
(the CPU backend's LBHNC) may not hold mixed page sizes across groups. Here that check is reverted
(the fix's counterpart), and the hybrid Llama's sliding-window group gets blocks of twice the
tokens (and bytes) of the full-attention group, as groups of different block sizes have in the
reports. Each group then strides the allocation by its own page: block b of the sliding-window
group covers blocks 2b and 2b+1 of the full-attention group.

What differs: the groups' different block sizes come from the plugin (the reports' from a drafter's
or a model's own specs), and their pages differ too: vLLM 0.32 addresses a block by its page, not
by slot, so equal pages would alias nothing here. The harm is the reports': one group's KV written
over another's. Logged in the engine core: `ZOO layout group=G block_size=N block_stride=B`.
"""

import dataclasses
import functools
import os
import sys


def register() -> None:
    if not os.environ.get("ZOO_LAYOUT_ALIAS"):
        return
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if getattr(kv_cache_utils, "_zoo_layout_alias", False):
        return
    kv_cache_utils._zoo_layout_alias = True
    groups_of = kv_cache_utils.get_kv_cache_groups
    config_of = kv_cache_utils.get_kv_cache_config_from_groups

    @functools.wraps(groups_of)
    def groups_with_larger_window_blocks(vllm_config, kv_cache_spec):
        groups = groups_of(vllm_config, kv_cache_spec)
        for group in groups:
            if isinstance(group.kv_cache_spec, SlidingWindowSpec):
                spec = group.kv_cache_spec
                group.kv_cache_spec = dataclasses.replace(spec, block_size=2 * spec.block_size)
        return groups

    @functools.wraps(config_of)
    def config_with_logged_layout(vllm_config, kv_cache_groups, available_memory):
        config = config_of(vllm_config, kv_cache_groups, available_memory)
        for gid, group in enumerate(config.kv_cache_groups):
            for tensor in config.kv_cache_tensors:
                if tensor.layers[0] in group.layer_names:
                    block_size, stride = group.kv_cache_spec.block_size, tensor.block_stride
                    print(f"ZOO layout group={gid} block_size={block_size} block_stride={stride}", file=sys.stderr)
        return config

    kv_cache_utils.get_kv_cache_groups = groups_with_larger_window_blocks
    kv_cache_utils.validate_kv_cache_layout = lambda layout, groups: None  # the fix's check, reverted
    kv_cache_utils.get_kv_cache_config_from_groups = config_with_logged_layout
