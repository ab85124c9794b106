"""Where KV groups' blocks live (`KvGroup.layout`, core/layout.py): groups that stride one allocation
differently share bytes between distinct block ids (vllm-ascend PR 16490, vLLM PR 41657: 2 x 16 =
1 x 32). Hand-written streams of two full-attention groups, one pool; the step path and the batched
entry point must agree.
"""

from __future__ import annotations

import numpy as np

from kvledger.producer import records
from kvledger.producer.records import RankIdentity
from kvledger.schemas.events import KvPlacement, event_of, events_of
from kvledger.stream_app.core import Ledger
from kvledger.stream_app.core.checks import layout_alias_failures, overlapping_blocks
from kvledger.stream_app.core.layout import Pages, layout_of, meeting_pairs

RANK = RankIdentity("layout", incarnation=1)
NUM_BLOCKS = 32
TOKEN = 64  # bytes per token of a layer


def placement(block_size: int, offset: int = 0, stride: int | None = None, tensor: int = 0):
    page = block_size * TOKEN
    stride = stride or page
    return [KvPlacement(tensor, offset, stride * NUM_BLOCKS, stride, 1, page)]


class Stream:
    """A rank of two full-attention groups of block sizes `sizes`, placed as `layouts` says."""

    def __init__(self, sizes=(4, 8), layouts=None):
        self.sizes = sizes
        self.events: list[dict] = []
        self.rows: dict[int, list[list[int]]] = {}
        layouts = layouts if layouts is not None else [placement(bs) for bs in sizes]
        groups = [records.kv_group(g, "FULL_ATTENTION", bs, NUM_BLOCKS, None, layouts[g]) for g, bs in enumerate(sizes)]
        self.info = records.rank_info(dp_size=1, tp_size=1, pp_size=1, vllm_version="t", runner="t", kv_groups=groups)
        self._add(self.info)

    def _add(self, body) -> None:
        self.events.append(records.envelope(RANK, len(self.events), 0, body))

    def step(self, n: int, *, new=(), cached=()) -> None:
        """new: (index, scheduled tokens, blocks per group); cached: (index, computed, scheduled)."""
        for i, _, blocks in new:
            self.rows[i] = [list(b) for b in blocks]
        inp = records.step_input(
            new_reqs=[records.new_request(i, f"r{i}", blocks, 0, 64, k) for i, k, blocks in new], cached=cached
        )
        scheduled = [(i, 0, k) for i, k, _ in new] + list(cached)
        groups = []
        for gid, bs in enumerate(self.sizes):
            rows = [np.array(self.rows[i][gid]) for i, _, _ in scheduled]
            slots = [self.rows[i][gid][p // bs] * bs + p % bs for i, c, k in scheduled for p in range(c, c + k)]
            groups.append(records.group_plan(gid, np.array(slots), len(slots), rows))
        plan = records.step_plan(
            [i for i, _, _ in scheduled], [k for *_, k in scheduled], [c for _, c, _ in scheduled], groups
        )
        self._add(records.step(n, "REAL", inp, plan))

    def check(self):
        """Step by step, and through the batched entry point: the same violations and coverage."""
        ledger = Ledger()
        found = [v for e in self.events for v in ledger.apply(event_of(e))] + ledger.finish()
        batched = Ledger()
        again = batched.apply_many(events_of(self.events)) + batched.finish()
        assert [(v.kind, v.step, v.req_id, v.group, v.detail) for v in again] == [
            (v.kind, v.step, v.req_id, v.group, v.detail) for v in found
        ]
        assert batched.coverage == ledger.coverage
        return found, ledger


def _found(violations) -> list[tuple]:
    return [(v.kind, v.step, v.req_id, v.group) for v in violations]


def _two_requests(s: Stream) -> None:
    # r0: 6 tokens: blocks [1, 2] of group 0 (4 tokens each), [3] of group 1 (8 tokens);
    # r1: 8 tokens: blocks [6, 7] and [5]. With group 1 striding by two of group 0's pages, group 0's
    # block 6 is group 1's block 3 (r0's).
    s.step(0, new=[(0, 6, ([1, 2], [3]))])
    s.step(1, new=[(1, 8, ([6, 7], [5]))], cached=[(0, 6, 1)])


def test_groups_of_one_stride_share_block_for_block_and_cost_nothing():
    """vLLM's layout: every group from byte 0 by its page, pages of one size: block b is block b in
    both. Judged once, nothing per grant."""
    s = Stream(sizes=(4, 4))
    s.step(0, new=[(0, 6, ([1, 2], [3, 4]))])
    s.step(1, new=[(1, 8, ([6, 7], [5, 8]))], cached=[(0, 6, 1)])
    violations, ledger = s.check()
    assert violations == []
    assert "byte_layout" not in ledger.coverage.checks and ledger.coverage.unchecked == {}


def test_groups_packed_inside_one_block_are_no_alias():
    """A block-outer layout (vLLM's for mixed page sizes): every group strides by the whole block, each
    at its own offset inside it: pages of different groups meet only within one block id."""
    block = 12 * TOKEN  # a 4-token page of group 0 and an 8-token page of group 1
    s = Stream(layouts=[placement(4, 0, block), placement(8, 4 * TOKEN, block)])
    _two_requests(s)
    violations, ledger = s.check()
    assert violations == [] and "byte_layout" not in ledger.coverage.checks


def test_groups_striding_one_allocation_differently_are_caught_at_the_start_and_at_the_grant():
    """The reports' layout: 4-token and 8-token blocks overlaying one allocation from byte 0, each by
    its own page. Reported once at the rank's start, then where r1 is handed group 0's block 6 while
    r0 holds group 1's block 3, the same bytes."""
    s = Stream()
    _two_requests(s)
    violations, ledger = s.check()
    assert _found(violations) == [("layout_alias", None, None, 0), ("layout_alias", 1, "r1", 0)], violations
    assert "striding it by 256 and 512 bytes per block: block 2 of group 0 shares bytes with block(s) [1]" in (
        violations[0].detail
    )
    assert violations[1].detail.startswith(
        "scheduler handed block 6 in group 0, whose bytes 1536..1791 of allocation 0 meet block 3 of group 1 "
        "(bytes 1536..2047 of allocation 0), held by ['r0']"
    ), violations[1].detail
    assert ledger.coverage.checks["byte_layout"] == 6  # every real block granted, in both groups


def test_the_other_direction_is_caught_too():
    """Group 1's grant meets group 0's live blocks: r1's group 1 block 1 is group 0's blocks 2 and 3."""
    s = Stream()
    s.step(0, new=[(0, 6, ([2, 3], [4]))])
    s.step(1, new=[(1, 8, ([6, 7], [1]))], cached=[(0, 6, 1)])
    violations, _ = s.check()
    assert _found(violations)[1:] == [("layout_alias", 1, "r1", 1)], violations
    assert "handed block 1 in group 1" in violations[1].detail and "meet block 2 of group 0" in violations[1].detail


def test_separate_allocations_never_meet():
    s = Stream(layouts=[placement(4), placement(8, tensor=1)])
    _two_requests(s)
    assert s.check()[0] == []


def test_a_layout_not_recorded_is_counted_once_never_reported():
    """An older writer: no layouts. Counted once per rank, not per RankInfo (one comes before every
    snapshot), and one group alone has nothing to overlay."""
    s = Stream(layouts=[None, None])
    _two_requests(s)
    s._add(s.info)
    violations, ledger = s.check()
    assert violations == [] and ledger.coverage.unchecked == {"layout_unknown": 1}
    broken = Stream(layouts=[placement(4), [KvPlacement(0, 0, 0, 0, 1, 256)]])
    assert broken.check()[1].coverage.unchecked == {"layout_unknown": 1}  # a stride of 0: not judged
    alone = Ledger()
    group = records.kv_group(0, "FULL_ATTENTION", 4, NUM_BLOCKS)
    info = records.rank_info(dp_size=1, tp_size=1, pp_size=1, vllm_version="t", runner="t", kv_groups=[group])
    alone.apply(event_of(records.envelope(RANK, 0, 0, info)))
    assert alone.coverage.unchecked == {}


def test_the_rule_over_pages():
    """2 x 16 = 1 x 32: blocks of 16 tokens against blocks of 32, both from byte 0."""
    small = Pages(np.array([0]), np.array([0]), np.array([16]), np.array([16]))
    large = Pages(np.array([0]), np.array([0]), np.array([32]), np.array([32]))
    at, pair, others = overlapping_blocks(np.array([2, 3, 5]), small, large, NUM_BLOCKS)
    assert (at.tolist(), pair.tolist(), others.tolist()) == ([0, 1, 2], [0, 0, 0], [1, 1, 2])
    at, _, others = overlapping_blocks(np.array([1]), large, small, NUM_BLOCKS)
    assert others.tolist() == [2, 3]
    live = np.zeros(NUM_BLOCKS, bool)
    live[[1, 3]] = True
    blocks = np.array([1, 1])
    assert layout_alias_failures(blocks, np.array([1, 3]), live[[1, 3]]).tolist() == [False, True]
    assert layout_alias_failures(np.array([1]), np.array([0]), np.array([True])).tolist() == [False]  # null block
    # Pages that meet only block for block, or not at all, are dropped when the layout is judged.
    i, _ = meeting_pairs(small, NUM_BLOCKS, small, NUM_BLOCKS)
    assert i.size == 0
    i, _ = meeting_pairs(small, NUM_BLOCKS, large, NUM_BLOCKS)
    assert i.tolist() == [0]


def test_a_meeting_is_judged_per_pair_of_groups():
    groups = Stream().info.kv_groups
    layout = layout_of(groups)
    assert layout.known and sorted(layout.meetings) == [0, 1]
    assert layout_of(groups[:1]).meetings == {} and layout_of(groups[:1]).known


# -- what the probe reads ----------------------------------------------------------------------------
def _config(tensors, specs):
    from types import SimpleNamespace

    groups = [SimpleNamespace(layer_names=names, kv_cache_spec=spec) for names, spec in specs]
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=tensors, num_blocks=8)


def test_the_probe_reads_each_groups_placements_from_the_kv_cache_config():
    """vLLM 0.32's `KVCacheTensor`s: a run of layers each, in the group of its first layer; an older
    config (`shared_by`) or a group whose layers have no views (state groups) is not read."""
    from types import SimpleNamespace

    from kvledger.producer.vllm_v1 import kv_layouts

    spec = SimpleNamespace(page_size_bytes=256, has_layer_views=True)

    def tensor(layers, offset, stride, host=False):
        return SimpleNamespace(
            layers=layers, offset=offset, layer_stride=stride * 8, block_stride=stride, host_resident=host
        )

    config = _config(
        [tensor(["a0", "a1"], 0, 256), tensor(["s0"], 0, 512), tensor(["h0"], 0, 256, host=True)],
        [(["a0", "a1"], spec), (["s0"], spec), (["h0"], spec)],
    )
    got = kv_layouts(config)
    assert [[(p.tensor, p.offset, p.layer_stride, p.block_stride, p.layers, p.page_bytes) for p in g] for g in got] == [
        [(0, 0, 2048, 256, 2, 256)],
        [(0, 0, 4096, 512, 1, 256)],
        [(1, 0, 2048, 256, 1, 256)],
    ]
    state = SimpleNamespace(page_size_bytes=256, has_layer_views=False)
    assert (
        kv_layouts(_config([tensor(["a0"], 0, 256), tensor(["m0"], 0, 256)], [(["a0"], spec), (["m0"], state)]))[1]
        is None
    )
    older = _config([SimpleNamespace(size=1024, shared_by=["a0", "s0"])], [(["a0"], spec), (["s0"], spec)])
    assert kv_layouts(older) == [None, None]


class _View:
    """A bound per-layer view as the probe reads it (a torch tensor's few attributes)."""

    def __init__(self, offset: int, shape0: int, stride0: int, element_size: int = 4):
        self.offset, self.shape, self.stride0, self.size = offset, (shape0, 4, 32, 128), stride0, element_size

    def data_ptr(self) -> int:
        return 4096 + self.offset

    def untyped_storage(self):
        from types import SimpleNamespace

        return SimpleNamespace(data_ptr=lambda: 4096)

    def dim(self) -> int:
        return 4

    def stride(self, dim: int) -> int:
        return self.stride0

    def element_size(self) -> int:
        return self.size


def test_a_runner_whose_views_disagree_with_the_config_leaves_the_layout_unknown():
    """The views bound to the layers start and stride as the placements say (kernel blocks: a manager
    block's share of them); a platform that allocated otherwise leaves its group unknown."""
    from types import SimpleNamespace

    from kvledger.producer.vllm_v1 import kv_layouts

    spec = SimpleNamespace(page_size_bytes=65536, has_layer_views=True)
    tensors = [
        SimpleNamespace(layers=["a0"], offset=0, layer_stride=65536 * 8, block_stride=65536, host_resident=False),
        SimpleNamespace(layers=["s0"], offset=0, layer_stride=65536 * 8, block_stride=65536, host_resident=False),
    ]
    config = _config(tensors, [(["a0"], spec), (["s0"], spec)])
    layer = SimpleNamespace
    agree = {"a0": layer(kv_cache=_View(0, 8, 16384)), "s0": layer(kv_cache=[_View(0, 16, 8192)])}  # kernel blocks
    assert all(kv_layouts(config, agree))
    moved = {**agree, "s0": layer(kv_cache=_View(65536 * 4, 8, 16384))}  # starts elsewhere
    assert kv_layouts(config, moved)[1] is None and kv_layouts(config, moved)[0] is not None
    strided = {**agree, "s0": layer(kv_cache=_View(0, 8, 32768))}  # strides blocks by two pages
    assert kv_layouts(config, strided)[1] is None
