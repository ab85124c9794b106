"""Where each KV cache group's blocks live in a rank's raw KV allocations, and where groups' blocks meet.

vLLM places the layers of every KV cache group in the rank's KV allocation, groups overlaying each
other (vLLM 0.32: one backing allocation, `KVCacheTensor`). Block ids are exclusive across groups
(one pool: `foreign_block_write` holds that), so the overlay is sound only while a byte one group's
block reaches is reached, in any other group, by that same block id. Groups that stride blocks
differently over one allocation break it: block b of one group meets other block ids of the other
(2 x 16 = 1 x 32).

A rank's layout (`RankInfo.kv_groups[].layout`) is judged once, when its tables are built: the pairs
of layer pages of two groups whose regions of one allocation meet where block ids differ are kept.
None is kept for every layout vLLM builds (equal strides, or pages packed within one block's
bytes), and then nothing more is done per grant; otherwise every block handed out is checked
against them (checks.py: `overlapping_blocks`, `layout_alias_failures`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvledger.schemas.events import KvGroup, KvPlacement

MAX_LAYERS = 1 << 12  # layers of one placement a reader expands; more: a malformed record, judged unknown


@dataclass(frozen=True, slots=True)
class Pages:
    """Layer pages, one entry each: the page of block b spans bytes [start + b * stride, + size) of `tensor`."""

    tensor: np.ndarray  # which raw allocation
    start: np.ndarray  # bytes of block 0's page
    stride: np.ndarray  # bytes between consecutive blocks' pages
    size: np.ndarray  # bytes of one page

    def take(self, keep: np.ndarray) -> Pages:
        return Pages(self.tensor[keep], self.start[keep], self.stride[keep], self.size[keep])


@dataclass(frozen=True, slots=True)
class Meeting:
    """Pages of `group` and of `other` (entry i of each a pair on one allocation) whose regions meet where
    block ids differ: a block of `group` shares bytes with other block ids of `other` there."""

    group: int
    other: int
    mine: Pages
    theirs: Pages


@dataclass(frozen=True, slots=True)
class Layout:
    known: bool  # every group said where its blocks live (False: nothing can be judged)
    meetings: dict[int, list[Meeting]]  # group id -> where its blocks meet other block ids of other groups

    @property
    def aliased(self) -> bool:
        return bool(self.meetings)


def pages_of(group: KvGroup) -> Pages:
    """Every layer page of a group, from its placements."""
    parts = [
        (p.tensor, p.offset + layer * p.layer_stride, p.block_stride, p.page_bytes)
        for p in group.layout or ()
        for layer in range(p.layers)
    ]
    cols = np.array(parts, np.int64).reshape(-1, 4).T
    return Pages(*cols)


def meeting_pairs(a: Pages, a_blocks: int, b: Pages, b_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i of a, j of b) of pages on one allocation whose regions meet at other block ids.

    Blocks b of a and b' of b meet iff (b' - b) lies in [k_lo, k_hi] when both stride alike (the same
    difference for every block): harmless when that is {0} or empty. Pages that stride differently and
    whose regions meet always meet other block ids (a pool of two blocks or more).
    """
    i, j = np.meshgrid(np.arange(a.start.size), np.arange(b.start.size), indexing="ij")
    i, j = i.ravel(), j.ravel()
    a_end = a.start[i] + (a_blocks - 1) * a.stride[i] + a.size[i]
    b_end = b.start[j] + (b_blocks - 1) * b.stride[j] + b.size[j]
    meet = (a.tensor[i] == b.tensor[j]) & (a.start[i] < b_end) & (b.start[j] < a_end)
    same = a.stride[i] == b.stride[j]
    d, stride = a.start[i] - b.start[j], np.maximum(a.stride[i], 1)
    k_lo = (d - b.size[j]) // stride + 1
    k_hi = -((-(d + a.size[i])) // stride) - 1
    harmless = same & ((k_lo > k_hi) | ((k_lo >= 0) & (k_hi <= 0)))
    keep = meet & ~harmless
    return i[keep], j[keep]


def _sound(p: KvPlacement) -> bool:
    """A placement a reader can judge: positive strides and page, a plausible number of layers."""
    return p.block_stride > 0 and p.page_bytes > 0 and p.layer_stride >= 0 and 0 < p.layers <= MAX_LAYERS


def layout_of(groups: list[KvGroup]) -> Layout:
    """A rank's layout, judged once: unknown where a group of several did not say; else where groups meet."""
    if len(groups) < 2:
        return Layout(True, {})
    if any(g.layout is None or not all(_sound(p) for p in g.layout) for g in groups):
        return Layout(False, {})
    pages = [pages_of(g) for g in groups]
    meetings: dict[int, list[Meeting]] = {}
    for g in groups:
        for h in groups:
            if h is g:
                continue
            i, j = meeting_pairs(pages[g.group_id], g.num_blocks, pages[h.group_id], h.num_blocks)
            if i.size:
                meeting = Meeting(g.group_id, h.group_id, pages[g.group_id].take(i), pages[h.group_id].take(j))
                meetings.setdefault(g.group_id, []).append(meeting)
    return Layout(True, meetings)


def describe(meeting: Meeting) -> str:
    """What a meeting of two groups' pages means, for the report at a rank's start: its first page pair."""
    a, b = meeting.mine, meeting.theirs
    block = 1 + int(b.stride[0] > a.stride[0])  # a block of the finer group past the null block
    lo = int(a.start[0] + block * a.stride[0])
    first = max((lo - int(b.size[0]) - int(b.start[0])) // int(b.stride[0]) + 1, 0)
    last = -((int(b.start[0]) - lo - int(a.size[0])) // int(b.stride[0])) - 1
    return (
        f"groups {meeting.group} and {meeting.other} overlay allocation {int(a.tensor[0])} striding it by "
        f"{int(a.stride[0])} and {int(b.stride[0])} bytes per block: block {block} of group {meeting.group} "
        f"shares bytes with block(s) {list(range(first, last + 1))} of group {meeting.other}; block ids are one "
        f"group's at a time, these bytes are not ({len(a.start)} such page pair(s))"
    )
