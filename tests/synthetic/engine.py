"""A synthetic engine: realistic ledger streams without vLLM, with injectable faults.

A small model of vLLM's v1 scheduler (block pool with prefix caching, chunked
prefill, preemption and resume, sliding-window groups that free blocks the
workers are never told about) drives a model of the worker (persistent block
tables, slot mappings, padded batches). Every TP/PP rank records the same
step, as real ranks do. Faults are injected where a real bug would sit: in
the scheduler's allocation or in the plan one rank builds.

Used by the tests (property-based: clean streams are silent, each fault is
caught), the benchmarks and the demo.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvledger.producer import records
from kvledger.producer.chains import PrefixChains
from kvledger.producer.records import RankIdentity
from kvledger.schemas.events import ConnectorEvent, KvPlacement
from kvledger.schemas.kinds import KvGroupKind

FAULTS = (
    "slot_shift",  # one request's slots are off by one: write_target_mismatch
    "stale_position",  # a request's positions ignore its computed tokens: write_target_mismatch
    "block_swap",  # two blocks of the row attention reads are swapped: read_target_mismatch
    "foreign_write",  # a token is written into another live request's block: foreign_block_write
    "padding_write",  # a padding slot writes into a live block: unowned_write
    "recycled_block",  # the allocator hands out a block another request holds: foreign_block_write
    "block_out_of_range",  # the allocator hands out a block id past the pool: block_out_of_range
    "rank_divergence",  # one TP rank builds a different plan: rank_divergence
    "rank_missing",  # one rank never records a step: rank_missing
    "sequence_gap",  # one rank's event is lost: sequence_gap
    "duplicate_event",  # one rank's event is appended twice: duplicate_event
    "zero_shared",  # the scheduler zeroes a block several live requests read: foreign_block_write
    "wrong_prefix_hit",  # a hit on a cached block of another prefix (a hash collision): prefix_hit_mismatch
    "unwritten_hit",  # a hit on a block its writer is still filling (cached early): unwritten_read
    "in_flight_load",  # async scheduling: a KV load into a block the step in flight writes: in_flight_reuse
)

# Faults whose target is a block several live requests share: they need prefix caching, which
# this model turns off beside a sliding-window group.
SHARING_FAULTS = ("zero_shared", "wrong_prefix_hit", "unwritten_hit")

# Violation kinds each fault may produce; the first is the one it must produce.
FAULT_KINDS = {
    # A shifted write leaves its block's slot unwritten: a later prefix hit on it reads what no step wrote.
    "slot_shift": (
        "write_target_mismatch",
        "foreign_block_write",
        "block_out_of_range",
        "rank_divergence",
        "unwritten_read",
    ),
    # A write through the row at an earlier position rewrites a block others may already read.
    "stale_position": (
        "write_target_mismatch",
        "foreign_block_write",
        "block_out_of_range",
        "rank_divergence",
        "shared_block_write",
    ),
    "block_swap": ("read_target_mismatch", "rank_divergence"),
    "foreign_write": ("foreign_block_write", "write_target_mismatch", "rank_divergence"),
    "padding_write": ("unowned_write", "rank_divergence"),
    # The block's new writer overwrites what its holder (and the prefix cache) still read.
    "recycled_block": ("foreign_block_write", "shared_block_write", "prefix_hit_mismatch"),
    "block_out_of_range": ("block_out_of_range",),
    "rank_divergence": (
        "rank_divergence",
        "write_target_mismatch",
        "foreign_block_write",
        "block_out_of_range",
    ),
    "rank_missing": ("rank_missing",),
    "sequence_gap": ("sequence_gap",),
    "duplicate_event": ("duplicate_event",),
    "zero_shared": ("foreign_block_write",),
    "wrong_prefix_hit": ("prefix_hit_mismatch",),
    # The writer's prompt is another: the chains differ where they are known.
    "unwritten_hit": ("unwritten_read", "prefix_hit_mismatch"),
    "in_flight_load": ("in_flight_reuse",),
}


@dataclass(frozen=True)
class GroupSpec:
    kind: str = "FULL_ATTENTION"
    sliding_window: int | None = None


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    step: int  # the first step at or after which a target is found
    tp_rank: int = 0
    pp_rank: int = 0
    group: int = 0


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    engine_id: str = "sim-engine"
    steps: int = 200
    dp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    block_size: int = 16
    num_blocks: int = 256  # one pool shared by all groups, block 0 is the null block
    max_num_seqs: int = 16
    max_batched_tokens: int = 256
    arrival_rate: float = 0.5  # expected new requests per step
    max_requests: int | None = None
    prompt_len: tuple[int, int] = (8, 200)
    output_len: tuple[int, int] = (1, 64)
    shared_prefixes: int = 3  # distinct shared prompt prefixes
    shared_prefix_prob: float = 0.4
    prefix_caching: bool = True  # ignored when a sliding-window group exists
    pad_to: int = 8
    snapshot_interval: int = 50
    health_interval: int = 50
    dummy_every: int = 0
    full_rows: bool = False
    # Newly allocated blocks listed to be zeroed (vLLM's new_block_ids_to_zero, sent when the
    # cache needs zeroing: Mamba layers, mixed precisions).
    zero_new_blocks: bool = False
    # Async scheduling: every step is scheduled with the one before in flight (StepInput.in_flight_steps),
    # and every `load_every` steps a KV connector load lands in a block no step in flight uses.
    in_flight: bool = False
    load_every: int = 9
    faults: tuple[FaultSpec, ...] = ()
    incarnation: int = 1
    close_at_end: bool = False  # each rank's last event says it shut down (Health.closing)
    # Where the groups' blocks live: every group overlays one allocation with the same bytes per block
    # (vLLM's layouts); with `byte_alias` every group past the first strides it by twice the bytes,
    # so its block b shares bytes with blocks 2b and 2b+1 of group 0 (vllm-ascend 16490).
    byte_alias: bool = False
    # New requests carry their prompts' prefix chains (False: as producers before they were recorded).
    prefix_chains: bool = True


@dataclass(frozen=True)
class Expected:
    """A violation an injected fault must produce."""

    fault: str
    kind: str
    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    step: int | None
    req_id: str | None
    group: int | None


@dataclass
class _Request:
    req_id: str
    index: int
    tokens: list[int]
    num_prompt: int
    max_output: int
    computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # scheduler view, per group
    seen: bool = False  # the worker knows it
    resumed: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.num_prompt >= self.max_output


class _BlockPool:
    """Free queue with prefix-cache hashes, like vLLM's BlockPool (simplified)."""

    def __init__(self, num_blocks: int):
        self.free: deque[int] = deque(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}

    def take(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            self.ref[b] = 1
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.block_of[h]
        return out

    def share(self, block: int) -> None:
        if self.ref[block] == 0:
            self.free.remove(block)
        self.ref[block] += 1

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            if not 0 < b < len(self.ref):
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def cache(self, block_hash: int, block: int) -> None:
        if not 0 < block < len(self.ref):  # a block id past the pool (an injected fault) is never a hit
            return
        if block_hash not in self.block_of and block not in self.hash_of:
            self.block_of[block_hash] = block
            self.hash_of[block] = block_hash


class SyntheticEngine:
    """Generates the ledger events of every rank of one engine, step by step."""

    def __init__(self, config: SimConfig):
        self.cfg = c = config
        self.rng = random.Random(c.seed)
        self.bs = c.block_size
        self.pool = _BlockPool(c.num_blocks)
        # The probes' prefix chains of each new request's prompt, at every group's block size.
        self.chains = PrefixChains([self.bs if KvGroupKind(g.kind).addresses_slots else None for g in c.groups])
        self.has_window = any(g.kind == "SLIDING_WINDOW" for g in c.groups)
        self.prefix_caching = c.prefix_caching and not self.has_window
        self.prefixes = [
            [self.rng.randrange(1000) for _ in range(self.rng.randrange(16, 80))] for _ in range(c.shared_prefixes)
        ]
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished_ids: list[str] = []
        self.preempted_ids: list[str] = []
        self.next_index = 0
        self.worker_rows: dict[int, list[list[int]]] = {}  # req_index -> per group (worker view)
        self.worker_ids: dict[int, str] = {}
        self.ranks = [
            RankIdentity(c.engine_id, c.dp_rank, tp, pp, c.incarnation)
            for pp in range(c.pp_size)
            for tp in range(c.tp_size)
        ]
        self.seq = dict.fromkeys(self.ranks, 0)
        self.expected: list[Expected] = []
        # What the stream exercised, so tests can insist on realistic coverage.
        self.stats = Counter()
        self._pending_faults = sorted(c.faults, key=lambda f: f.step)
        self.clock_us = 1_700_000_000_000_000
        # Async scheduling's window: asked for, or needed by a fault that loads into it.
        self.in_flight = c.in_flight or any(f.kind == "in_flight_load" for f in c.faults)
        # A receive whose completion a lost or repeated event hides keeps its blocks held in the ledger
        # (a completion is not in snapshots): streams with such faults load nothing beside the window.
        self._events_lost = any(f.kind in _EVENT_FAULTS for f in c.faults)
        self._in_flight_blocks: dict[str, list[list[int]]] = {}  # the last step's requests: per group, blocks used

    # -- public --------------------------------------------------------------------------------
    def events(self) -> Iterator[dict]:
        """All events of all ranks, ranks interleaved step by step."""
        yield from self._emit_all(self._rank_info())
        for step in range(self.cfg.steps):
            if self.cfg.dummy_every and step % self.cfg.dummy_every == self.cfg.dummy_every // 2:
                yield from self._emit_all(records.step(step, "DUMMY", None, self._dummy_plan()))
            else:
                yield from self._real_step(step)
            if self.cfg.snapshot_interval and step % self.cfg.snapshot_interval == self.cfg.snapshot_interval - 1:
                # Layout first, so a reader joining here can resync from the snapshot alone.
                yield from self._emit_all(self._rank_info())
                yield from self._emit_all(self._snapshot(step))
            if self.cfg.health_interval and step % self.cfg.health_interval == self.cfg.health_interval - 1:
                yield from self._emit_all(records.health(step, step + 1, 0, 0, 4096, 1))
        if self.cfg.close_at_end:
            yield from self._emit_all(records.health(self.cfg.steps - 1, self.cfg.steps, 0, 0, 4096, 1, closing=True))

    # -- emission -----------------------------------------------------------------------------
    def _emit(self, rank: RankIdentity, body: tuple[str, dict]) -> dict:
        seq = self.seq[rank]
        self.seq[rank] += 1
        self.clock_us += 1000
        return records.envelope(rank, seq, self.clock_us, body)

    def _emit_all(self, body: tuple[str, dict]) -> Iterator[dict]:
        for rank in self.ranks:
            yield self._emit(rank, body)

    def _rank_info(self) -> tuple[str, dict]:
        c = self.cfg
        groups = [
            records.kv_group(i, g.kind, self.bs, c.num_blocks, g.sliding_window, self._layout(i))
            for i, g in enumerate(c.groups)
        ]
        return records.rank_info(
            dp_size=1,
            tp_size=c.tp_size,
            pp_size=c.pp_size,
            kv_groups=groups,
            vllm_version="synthetic",
            runner="synthetic",
            capabilities=[("step_input", True, None), ("step_plan", True, None)],
            full_rows=c.full_rows,
            snapshot_interval=c.snapshot_interval,
        )

    def _layout(self, group: int) -> list:
        """One layer of the group in allocation 0 from byte 0, a page of 64 bytes per token."""
        page = self.bs * 64 * (2 if self.cfg.byte_alias and group > 0 else 1)
        return [KvPlacement(0, 0, page * self.cfg.num_blocks, page, 1, page)]

    def _snapshot(self, step: int) -> tuple[str, dict]:
        reqs = []
        for r in self.running:
            if r.index in self.worker_rows:
                reqs.append((r.index, r.req_id, r.computed, [np.array(b) for b in self.worker_rows[r.index]]))
        return records.snapshot(step, reqs)

    def _dummy_plan(self) -> dict:
        groups = [records.group_plan(g, np.full(self.cfg.pad_to, -1), 0, []) for g in range(len(self.cfg.groups))]
        return records.step_plan([], [], [], groups)

    # -- faults --------------------------------------------------------------------------------
    def _faults_due(self, step: int) -> list[FaultSpec]:
        return [f for f in self._pending_faults if f.step <= step]

    def _expect(self, fault: FaultSpec, kind: str, step: int | None, req_id=None, group=None, rank=None) -> None:
        rank = rank or self.ranks[0]
        self.expected.append(
            Expected(
                fault.kind,
                kind,
                rank.engine_id,
                rank.dp_rank,
                rank.tp_rank,
                rank.pp_rank,
                step,
                req_id,
                group,
            )
        )
        if fault in self._pending_faults:
            self._pending_faults.remove(fault)

    def _expect_on_all_ranks(self, fault: FaultSpec, kind: str, step: int, req_id: str, group: int) -> None:
        for rank in self.ranks:  # every rank executes the scheduler's bad decision
            self._expect(fault, kind, step, req_id, group, rank)

    def _take_event_fault(self, step: int, rank: RankIdentity) -> FaultSpec | None:
        for fault in self._faults_due(step):
            if fault.kind in _EVENT_FAULTS and (fault.tp_rank, fault.pp_rank) == (rank.tp_rank, rank.pp_rank):
                self._pending_faults.remove(fault)
                return fault
        return None

    # -- scheduler -----------------------------------------------------------------------------
    def _arrivals(self) -> None:
        c = self.cfg
        if c.max_requests is not None and self.next_index >= c.max_requests:
            return
        n = sum(self.rng.random() < c.arrival_rate / 4 for _ in range(4))
        for _ in range(n):
            length = self.rng.randint(*c.prompt_len)
            prompt = [self.rng.randrange(1000) for _ in range(length)]
            if self.prefixes and self.rng.random() < c.shared_prefix_prob:
                prefix = self.rng.choice(self.prefixes)
                prompt = (prefix + prompt)[: max(length, len(prefix) + 1)]
            self.waiting.append(
                _Request(
                    f"req-{self.next_index}",
                    self.next_index,
                    prompt,
                    len(prompt),
                    self.rng.randint(*c.output_len),
                )
            )
            self.next_index += 1

    def _block_hashes(self, req: _Request, n_blocks: int) -> list[int]:
        out, h = [], 0
        for i in range(n_blocks):
            h = hash((h, tuple(req.tokens[i * self.bs : (i + 1) * self.bs])))
            out.append(h)
        return out

    def _free_out_of_window(self, req: _Request) -> None:
        for g, spec in enumerate(self.cfg.groups):
            if spec.kind != "SLIDING_WINDOW":
                continue
            skipped = max(req.computed - spec.sliding_window + 1, 0) // self.bs
            row = req.blocks[g]
            freed = [b for b in row[:skipped] if b != 0]
            row[:skipped] = [0] * min(skipped, len(row))
            self.pool.release(freed)
            self.stats["window_freed_blocks"] += len(freed)

    def _allocate(self, req: _Request, upto_tokens: int, step: int) -> list[list[int]] | None:
        """Blocks appended per group to cover `upto_tokens`, or None when the pool is short."""
        need = -(-upto_tokens // self.bs)
        counts = [max(need - len(row), 0) for row in req.blocks]
        got = self.pool.take(sum(counts))
        if got is None:
            return None
        appended, at = [], 0
        for g, n in enumerate(counts):
            new = got[at : at + n]
            at += n
            new = self._maybe_corrupt_allocation(req, g, new, step)
            req.blocks[g].extend(new)
            appended.append(new)
        return appended

    def _maybe_corrupt_allocation(self, req: _Request, g: int, new: list[int], step: int) -> list[int]:
        for fault in self._faults_due(step):
            if fault.group != g or not new or fault.kind not in ("recycled_block", "block_out_of_range"):
                continue
            if fault.kind == "block_out_of_range":
                self._expect_on_all_ranks(fault, "block_out_of_range", step, req.req_id, g)
                self.pool.release(new[-1:])
                return [*new[:-1], self.cfg.num_blocks + 7]
            # recycled_block: a block another running request holds at another position.
            pos = len(req.blocks[g])
            for other in self.running:
                if other is req or len(other.blocks[g]) == 0:
                    continue
                cands = [
                    (j, b) for j, b in enumerate(other.blocks[g]) if b != 0 and j != pos and b not in req.blocks[g]
                ]
                if cands:
                    _, victim = cands[-1]
                    self.pool.release([new[0]])
                    self.pool.share(victim)
                    new = [victim, *new[1:]]
                    self._expect_on_all_ranks(fault, "foreign_block_write", step, req.req_id, g)
                    return new
        return new

    def _release(self, req: _Request) -> None:
        for row in req.blocks:
            self.pool.release(row)
        req.blocks = [[] for _ in self.cfg.groups]

    def _preempt(self, victim: _Request) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.computed = 0
        victim.resumed = victim.seen
        self.waiting.appendleft(victim)
        self.preempted_ids.append(victim.req_id)
        self.stats["preemptions"] += 1

    def _schedule(self, step: int):
        """One scheduler step: (scheduled [(req, n_new, appended, kind)], finished, preempted)."""
        budget = self.cfg.max_batched_tokens
        scheduled = []
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted by an earlier request this step
            n_new = min(req.num_tokens - req.computed, budget)
            if n_new <= 0:
                continue
            self._free_out_of_window(req)
            while (appended := self._allocate(req, req.computed + n_new, step)) is None:
                victim = self.running[-1]
                self._preempt(victim)
                scheduled = [s for s in scheduled if s[0] is not victim]
                if victim is req:
                    break
            if appended is None:
                continue
            scheduled.append((req, n_new, appended, "cached"))
            budget -= n_new
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            req.blocks = [[] for _ in self.cfg.groups]
            expected, pending = len(self.expected), list(self._pending_faults)
            self._prefix_hits(req, step, scheduled)
            n_new = min(req.num_tokens - req.computed, budget)
            appended = self._allocate(req, req.computed + n_new, step)
            if appended is None:
                self._release(req)
                req.computed = 0
                # Not admitted: a hit fault placed on it did not happen; it waits for another request.
                del self.expected[expected:]
                self._pending_faults = pending
                break
            self.waiting.popleft()
            self.running.append(req)
            scheduled.append((req, n_new, appended, "resumed" if req.resumed else "new"))
            self.stats["resumes" if req.resumed else "admissions"] += 1
            if req.computed + n_new < req.num_prompt:
                self.stats["chunked_prefills"] += 1
            budget -= n_new
        return scheduled

    def _prefix_hits(self, req: _Request, step: int, scheduled: list) -> None:
        req.computed = 0
        if not self.prefix_caching:
            return 0
        max_blocks = (req.num_tokens - 1) // self.bs  # vLLM recomputes at least the last token
        for h in self._block_hashes(req, max_blocks):
            block = self.pool.block_of.get(h)
            if block is None:
                break
            self.pool.share(block)
            req.blocks[0].append(block)
            self.stats["prefix_hit_blocks"] += 1
        req.computed = len(req.blocks[0]) * self.bs
        self._maybe_corrupt_hit(req, step, scheduled, max_blocks)

    def _maybe_corrupt_hit(self, req: _Request, step: int, scheduled: list, max_blocks: int) -> None:
        for fault in self._faults_due(step):
            if fault.group != 0 or fault.kind not in ("wrong_prefix_hit", "unwritten_hit"):
                continue
            row = req.blocks[0]
            if fault.kind == "wrong_prefix_hit":
                # The next block of the request's prefix found under a hash that is not its own: a
                # cached block nobody holds (no live holder at another position), of another prefix.
                col = len(row)
                if col >= max_blocks:
                    continue
                own = self._block_hashes(req, col + 1)[col]
                found = [b for h, b in self.pool.block_of.items() if h != own and self.pool.ref[b] == 0]
                if not found:
                    continue
                self.pool.share(found[0])
                row.append(found[0])
            else:
                # A running request's block it is still filling (this step included), read as full
                # with the blocks before it, at the same positions: cached before it was computed.
                if row:
                    continue
                n_new = {id(r): n for r, n, _, _ in scheduled}
                for other in self.running:
                    c = other.computed // self.bs
                    filled = other.computed + n_new.get(id(other), 0) - c * self.bs
                    partial = other.computed % self.bs and 0 < filled < self.bs
                    if partial and (c + 1) * self.bs < req.num_tokens and 0 not in other.blocks[0][: c + 1]:
                        break
                else:
                    continue
                for b in other.blocks[0][: c + 1]:
                    self.pool.share(b)
                    row.append(b)
            req.computed = len(row) * self.bs
            kind = FAULT_KINDS[fault.kind][0]
            self._expect_on_all_ranks(fault, kind, step, req.req_id, 0)
            return

    def _after_execute(self, scheduled) -> None:
        for req, n_new, _, _ in scheduled:
            req.computed += n_new
            if self.prefix_caching:
                full = min(req.computed, req.num_prompt) // self.bs
                for i, h in enumerate(self._block_hashes(req, full)):
                    self.pool.cache(h, req.blocks[0][i])
            if req.computed == req.num_tokens:
                req.tokens.append(self.rng.randrange(1000))
                if req.done:
                    self.running.remove(req)
                    self._release(req)
                    self.finished_ids.append(req.req_id)

    # -- one step ---------------------------------------------------------------------------------
    def _real_step(self, step: int) -> Iterator[dict]:
        self._arrivals()
        finished, self.finished_ids = self.finished_ids, []
        preempted_before = len(self.preempted_ids)
        scheduled = self._schedule(step)
        preempted = self.preempted_ids[preempted_before:]
        self.preempted_ids = []
        inp = self._step_input(scheduled, finished, preempted, self._blocks_to_zero(step, scheduled))
        if self.in_flight:
            inp.in_flight_steps = int(step > 0)
        load = self._load(step) if self.in_flight and step > 0 else None
        if self.in_flight:
            self._in_flight_blocks = self._used(scheduled)
        base_plan = self._plan(scheduled)
        self._after_execute(scheduled)
        if load is not None:
            yield from self._emit_all(load)
        for rank in self.ranks:
            body = records.step(step, "REAL", inp, self._faulty_plan(step, rank, base_plan))
            fault = self._take_event_fault(step, rank)
            if fault is None:
                yield self._emit(rank, body)
            elif fault.kind == "rank_missing":  # never recorded: no hole in its sequence
                self._expect(fault, "rank_missing", step, rank=rank)
            elif fault.kind == "sequence_gap":  # recorded, then lost
                self.seq[rank] += 1
                self._expect(fault, "sequence_gap", None, rank=rank)
            else:  # duplicate_event
                event = self._emit(rank, body)
                self._expect(fault, "duplicate_event", None, rank=rank)
                yield event
                yield event
        if load is not None:  # the load landed with the step: its blocks are free again
            done = records.connector_event(
                step, load.connector, "RECV_DONE", req_id=load.req_id, transfer_id=load.transfer_id
            )
            yield from self._emit_all(done)

    # -- async scheduling's window --------------------------------------------------------------
    def _used(self, scheduled) -> dict[str, list[list[int]]]:
        """Per request of this step and group: the blocks it writes or reads (up to its last query's)."""
        return {
            req.req_id: [row[: -(-(req.computed + n) // self.bs)] for row in self.worker_rows[req.index]]
            for req, n, _, _ in scheduled
            if n
        }

    def _load(self, step: int) -> ConnectorEvent | None:
        """A KV connector load announced for this step (and done at once): into a block no step in
        flight uses, or, the fault, into one the last step still writes for its request."""
        fault = next((f for f in self._faults_due(step) if f.kind == "in_flight_load"), None)
        held = {b for r in self.running for row in r.blocks for b in row} | {
            b for rows in self.worker_rows.values() for row in rows for b in row
        }
        if fault is not None:
            victims = sorted((r, used[0]) for r, used in self._in_flight_blocks.items() if used[0])
            if not victims:
                return None
            _, used = victims[0]
            block = used[-1]  # the group-0 block it writes
            self._expect_on_all_ranks(fault, "in_flight_reuse", step, f"load-{step}", 0)
        elif step % self.cfg.load_every == 0 and not self._events_lost:
            cached = set(self.pool.block_of.values())  # a load lands in a block allocated for it, never a cached one
            spare = [b for b in range(1, self.cfg.num_blocks) if b not in held and b not in cached]
            used = {b for rows in self._in_flight_blocks.values() for row in rows for b in row}
            free = [b for b in spare if b not in used]
            if not free:
                return None
            block = free[0]
        else:
            return None
        blocks = [[block]] + [[] for _ in self.cfg.groups[1:]]
        self.stats["in_flight_loads"] += 1
        name = f"load-{step}"
        return records.connector_event(
            step, "SyntheticConnector", "RECV_INTENT", req_id=name, transfer_id=name, block_ids=blocks
        )

    def _blocks_to_zero(self, step: int, scheduled) -> list[int]:
        zero = (
            []
            if not self.cfg.zero_new_blocks
            else [b for _, _, appended, _ in scheduled for row in appended for b in row if 0 < b < self.cfg.num_blocks]
        )
        for fault in [f for f in self._faults_due(step) if f.kind == "zero_shared"]:
            held = Counter(b for r in self.running for b in set(r.blocks[fault.group]) if b != 0)
            shared = sorted(b for b, n in held.items() if n > 1)
            if shared:  # a block several live requests read, zeroed under them
                zero.append(shared[0])
                self._expect_on_all_ranks(fault, "foreign_block_write", step, None, None)
        return zero

    def _step_input(self, scheduled, finished, preempted, blocks_to_zero: list[int]) -> dict:
        new_reqs, cached, appends, resumed = [], [], [], []
        for req, n_new, appended, kind in scheduled:
            if kind == "new":
                req.seen = True
                chains = self.chains(req.tokens[: req.num_prompt], ()) if self.cfg.prefix_chains else None
                new_reqs.append(
                    records.new_request(req.index, req.req_id, req.blocks, req.computed, req.num_prompt, n_new, chains)
                )
                self.worker_rows[req.index] = [list(row) for row in req.blocks]
                self.worker_ids[req.index] = req.req_id
                continue
            cached.append((req.index, req.computed, n_new))
            rows = self.worker_rows[req.index]
            if kind == "resumed":
                resumed.append(req.index)
                req.resumed = False
                for g, row in enumerate(req.blocks):
                    appends.append((req.index, g, row))
                    rows[g] = list(row)
            else:
                for g, new in enumerate(appended):
                    if new:
                        appends.append((req.index, g, new))
                        rows[g].extend(new)
        for req_id in finished:
            self.worker_rows.pop(int(req_id.split("-")[1]), None)
        return records.step_input(
            new_reqs=new_reqs,
            cached=cached,
            resumed=resumed,
            appends=appends,
            finished=finished,
            preempted=preempted,
            blocks_to_zero=blocks_to_zero,
        )

    def _plan(self, scheduled) -> dict:
        """The plan a correct worker builds; a dict of numpy arrays, encoded per rank."""
        order = [s for s in scheduled if s[3] == "cached"] + [s for s in scheduled if s[3] != "cached"]
        indices = [req.index for req, *_ in order]
        num_tokens = np.array([n for _, n, *_ in order], dtype=np.int64)
        first = np.array([req.computed for req, *_ in order], dtype=np.int64)
        total = int(num_tokens.sum())
        tok_req = np.repeat(np.arange(len(order)), num_tokens)
        pos = (
            first[tok_req] + np.arange(total) - np.repeat(np.cumsum(num_tokens) - num_tokens, num_tokens)
            if total
            else np.empty(0, np.int64)
        )
        padded = -(-total // self.cfg.pad_to) * self.cfg.pad_to if total else 0
        groups = []
        for g in range(len(self.cfg.groups)):
            rows = [np.array(self.worker_rows[i][g], dtype=np.int64) for i in indices]
            slots = np.full(padded, -1, dtype=np.int64)
            for t in range(total):
                row = rows[tok_req[t]]
                slots[t] = row[pos[t] // self.bs] * self.bs + pos[t] % self.bs
            groups.append({"slots": slots, "rows": rows})
        return {
            "indices": indices,
            "num_tokens": num_tokens,
            "first": first,
            "total": total,
            "groups": groups,
            "tok_req": tok_req,
            "pos": pos,
        }

    def _encode_plan(self, p: dict) -> dict:
        groups = [
            records.group_plan(g, gp["slots"], p["total"], gp["rows"], self.cfg.full_rows)
            for g, gp in enumerate(p["groups"])
        ]
        return records.step_plan(p["indices"], p["num_tokens"], p["first"], groups)

    def _faulty_plan(self, step: int, rank: RankIdentity, base: dict) -> dict:
        for fault in self._faults_due(step):
            if (fault.tp_rank, fault.pp_rank) != (rank.tp_rank, rank.pp_rank):
                continue
            mutated = _PLAN_FAULTS.get(fault.kind)
            if mutated is None:
                continue
            result = mutated(self, base, fault)
            if result is not None:
                plan, req_id, kind = result
                self._expect(fault, kind, step, req_id, fault.group if kind != "rank_divergence" else None, rank=rank)
                return self._encode_plan(plan)
        return self._encode_plan(base)

    # -- plan mutations (return (plan, req_id, expected kind) or None when no target yet) --------------
    def _copy_plan(self, base: dict, g: int) -> dict:
        plan = dict(base)
        plan["groups"] = [dict(gp) for gp in base["groups"]]
        plan["groups"][g]["slots"] = base["groups"][g]["slots"].copy()
        plan["groups"][g]["rows"] = list(base["groups"][g]["rows"])
        return plan

    def _slot_shift(self, base, fault, kind="write_target_mismatch"):
        if not base["indices"]:
            return None
        plan = self._copy_plan(base, fault.group)
        r = 0
        toks = np.flatnonzero(base["tok_req"] == r)
        plan["groups"][fault.group]["slots"][toks] += 1
        return plan, self.worker_ids[base["indices"][r]], kind

    def _stale_position(self, base, fault):
        if not base["indices"]:
            return None
        plan = dict(base)
        plan["first"] = base["first"].copy()
        plan["first"][0] += 1
        return plan, self.worker_ids[base["indices"][0]], "write_target_mismatch"

    def _block_swap(self, base, fault):
        g = fault.group
        for r, row in enumerate(base["groups"][g]["rows"]):
            if len(row) >= 2 and row[0] != row[1]:
                plan = self._copy_plan(base, g)
                swapped = row.copy()
                swapped[[0, 1]] = swapped[[1, 0]]
                plan["groups"][g]["rows"][r] = swapped
                return plan, self.worker_ids[base["indices"][r]], "read_target_mismatch"
        return None

    def _foreign_write(self, base, fault):
        g = fault.group
        if not base["indices"]:
            return None
        writer = base["indices"][0]
        mine = set(self.worker_rows[writer][g])
        for req in self.running:
            if req.index == writer or req.index not in self.worker_rows:
                continue
            theirs = [b for b in req.blocks[g] if b != 0 and b not in mine]
            if theirs:
                plan = self._copy_plan(base, g)
                tok = int(np.flatnonzero(base["tok_req"] == 0)[0])
                plan["groups"][g]["slots"][tok] = theirs[0] * self.bs
                return plan, self.worker_ids[writer], "foreign_block_write"
        return None

    def _padding_write(self, base, fault):
        g = fault.group
        live = [b for req in self.running for b in req.blocks[g] if b != 0]
        if not live or not base["indices"]:
            return None
        plan = self._copy_plan(base, g)
        slots = plan["groups"][g]["slots"]
        if slots.size == base["total"]:
            slots = np.append(slots, -1)
        slots[-1] = live[0] * self.bs + 3
        plan["groups"][g]["slots"] = slots
        return plan, None, "unowned_write"

    def _rank_divergence(self, base, fault):
        result = self._slot_shift(base, fault)
        return None if result is None else (result[0], None, "rank_divergence")


_EVENT_FAULTS = ("rank_missing", "sequence_gap", "duplicate_event")
_PLAN_FAULTS = {
    "slot_shift": SyntheticEngine._slot_shift,
    "stale_position": SyntheticEngine._stale_position,
    "block_swap": SyntheticEngine._block_swap,
    "foreign_write": SyntheticEngine._foreign_write,
    "padding_write": SyntheticEngine._padding_write,
    "rank_divergence": SyntheticEngine._rank_divergence,
}


@dataclass
class Simulation:
    events: list[dict]
    expected: list[Expected]
    stats: Counter
    unplaced_faults: list[FaultSpec]


def simulate(config: SimConfig) -> Simulation:
    """Generate a whole stream with the violations its faults must produce."""
    engine = SyntheticEngine(config)
    events = list(engine.events())
    return Simulation(events, engine.expected, engine.stats, list(engine._pending_faults))


# -- a prefill/decode pair ----------------------------------------------------------------------
# Faults of a synthetic pair, each on one transfer, and the violation it must produce (first) or may.
PD_FAULT_KINDS = {
    "recv_failed": ("transfer_failed",),  # the receive fails; decode recomputes the prompt
    "content": ("transfer_content_mismatch",),  # a received block's bytes differ from the sent ones
    "block_count": ("transfer_block_mismatch",),  # decode expects one block more (the MTP extra block)
    "send_reused": ("send_block_reused", "foreign_block_write"),  # a held block goes to the next request
    "read_early": ("read_before_transfer",),  # decode computes in the step its receive completes
    "orphan": ("orphan_transfer",),  # decode never hears of the transfer
    "stuck": ("transfer_stuck",),  # neither side ever completes (both sides are stuck)
    # Decode's request is another prompt than the one prefill computed the KV from (a caller handing it
    # another request's transfer id): its prompt differs from the first token on.
    "other_prefix": ("transfer_prefix_mismatch",),
}


@dataclass(frozen=True)
class PdConfig:
    seed: int = 0
    requests: int = 6
    block_size: int = 16
    num_blocks: int = 128
    prompt_len: tuple[int, int] = (2, 90)
    send_lag: int = 3  # steps from a prefill request's finish to its send completing
    idle_steps: int = 4  # steps both engines run after the last request
    digests: bool = True
    faults: tuple[tuple[str, int], ...] = ()  # (fault, request number)
    # Full blocks of a system prompt every prompt starts with: the prefill engine's prefix
    # cache hands them to each later request (a read) while earlier sends still hold them.
    shared_prefix_blocks: int = 0
    prefill_id: str = "sim-prefill"
    decode_id: str = "sim-decode"


@dataclass(frozen=True)
class PdExpected:
    fault: str
    kind: str
    engine_id: str
    req_id: str
    transfer_id: str


@dataclass
class PdSimulation:
    events: list[dict]  # both engines, interleaved at random, each engine in its own order
    expected: list[PdExpected]
    transfer_ids: list[str]
    prompts: list[list[int]]  # as prefill computed them


class _SimRank:
    """One rank's envelope, step counter and FIFO block pool."""

    def __init__(self, engine_id: str, role: str, cfg: PdConfig):
        self.identity = RankIdentity(engine_id, incarnation=1)
        self.cfg = cfg
        self.events: list[dict] = []
        self.step = 0
        self.free: deque[int] = deque(range(1, cfg.num_blocks))
        groups = [records.kv_group(0, "FULL_ATTENTION", cfg.block_size, cfg.num_blocks)]
        self.chains = PrefixChains([cfg.block_size])  # what the recorder states of each new request's prompt
        info = records.rank_info(
            dp_size=1,
            tp_size=1,
            pp_size=1,
            kv_groups=groups,
            vllm_version="synthetic",
            runner="synthetic",
            pd_role=role,
        )
        self.emit(info)

    def emit(self, body: tuple[str, dict]) -> None:
        n = len(self.events)
        self.events.append(records.envelope(self.identity, n, 1_700_000_000_000_000 + n, body))

    def connector(self, kind: str, req_id: str, tid: str, blocks: list[int], **fields) -> None:
        self.emit(
            records.connector_event(
                self.step, "SyntheticConnector", kind, req_id=req_id, transfer_id=tid, block_ids=[blocks], **fields
            )
        )

    def run(self, new: tuple | None = None, finished: tuple[str, ...] = ()) -> None:
        """One step: at most one new request (index, req id, blocks, computed, prompt tokens, scheduled)."""
        plan = None
        new_reqs = []
        if new is not None:
            index, req_id, blocks, computed, tokens, scheduled = new
            chains = self.chains(tokens, ())
            new_reqs.append(records.new_request(index, req_id, [blocks], computed, len(tokens), scheduled, chains))
            pos = np.arange(computed, computed + scheduled)
            bs = self.cfg.block_size
            slots = np.asarray(blocks)[pos // bs] * bs + pos % bs
            group = records.group_plan(0, slots, scheduled, [np.asarray(blocks)])
            plan = records.step_plan([index], [scheduled], [computed], [group])
        inp = records.step_input(new_reqs=new_reqs, finished=list(finished))
        self.emit(records.step(self.step, "REAL", inp, plan))
        self.step += 1

    def take(self, n: int) -> list[int]:
        return [self.free.popleft() for _ in range(n)]


def _block_digests(prompt: list[int], n_blocks: int, bs: int) -> list[int]:
    """What a block holds, as a digest: the tokens whose KV it carries (the same on both engines)."""
    return [hash(tuple(prompt[i * bs : (i + 1) * bs])) & (2**64 - 1) for i in range(n_blocks)]


def simulate_pd_pair(cfg: PdConfig) -> PdSimulation:
    """Both engines of a pair serving `cfg.requests` prompts, one transfer each, with faults."""
    rng = random.Random(cfg.seed)
    bs, layout = cfg.block_size, b"synthlay"
    faults = {n: f for f, n in cfg.faults}
    prefill, decode = _SimRank(cfg.prefill_id, "PREFILL", cfg), _SimRank(cfg.decode_id, "DECODE", cfg)
    expected: list[PdExpected] = []
    tids = [f"tx-{i}" for i in range(cfg.requests)]
    pending_free: list[tuple[int, list[int]]] = []  # (prefill step the blocks come back, blocks)
    sends: list[tuple[int, int, list[int]]] = []  # (done step, request, blocks)

    def prefill_step(**kw) -> None:
        for due, blocks in [p for p in pending_free if p[0] <= prefill.step]:
            prefill.free.extend(blocks)
            pending_free.remove((due, blocks))
        prefill.run(**kw)
        for item in [s for s in sends if s[0] < prefill.step]:
            sends.remove(item)
            _, i, blocks = item
            digest = records.transfer_digest(layout, _block_digests(prompts[i], len(blocks), bs))
            prefill.step -= 1  # completions are seen within the step that reports them
            prefill.connector("SEND_DONE", f"p-{i}", tids[i], blocks, digest=digest if cfg.digests else None)
            prefill.step += 1
            pending_free.append((prefill.step + 1, [b for b in blocks if b not in cached]))

    system = [rng.randrange(1000) for _ in range(cfg.shared_prefix_blocks * bs)]
    prompts = [system + [rng.randrange(1000) for _ in range(rng.randint(*cfg.prompt_len))] for _ in range(cfg.requests)]
    for i, prompt in enumerate(prompts):  # a prompt whose identity is judged has a full block at least
        if faults.get(i) == "other_prefix":
            prompt += [rng.randrange(1000) for _ in range(bs + 1 - len(prompt))]
    cached: list[int] = []  # the system prompt's blocks, once computed: kept by the cache, never freed
    p_blocks: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        n = -(-len(prompt) // bs)
        hit = cached[: cfg.shared_prefix_blocks]
        blocks = p_blocks[i] = hit + prefill.take(n - len(hit))
        computed = len(hit) * bs
        prefill_step(new=(i, f"p-{i}", blocks, computed, prompt, len(prompt) - computed))
        cached = cached or blocks[: cfg.shared_prefix_blocks]
        prefill.connector("SEND_INTENT", f"p-{i}", tids[i], blocks, num_tokens=len(prompt))
        fault = faults.get(i)
        if fault == "send_reused":
            prefill.free.appendleft(blocks[-1])  # freed while the send still reads it
            expected.append(PdExpected(fault, "send_block_reused", cfg.prefill_id, f"p-{i}", tids[i]))
        if fault not in ("orphan", "stuck"):
            sends.append((prefill.step + cfg.send_lag, i, blocks))
        prefill_step(finished=(f"p-{i}",))
    for _ in range(cfg.send_lag + cfg.idle_steps):
        prefill_step()

    for i, prompt in enumerate(prompts):
        fault = faults.get(i)
        if fault == "orphan":
            expected.append(PdExpected(fault, "orphan_transfer", cfg.prefill_id, f"p-{i}", tids[i]))
            continue
        n = len(p_blocks[i]) + (1 if fault == "block_count" else 0)
        blocks, req = decode.take(n), f"d-{i}"
        remote = {"remote_engine_id": cfg.prefill_id}
        decode.connector("RECV_INTENT", req, tids[i], blocks, **remote)
        decode.run()
        if fault == "stuck":
            expected.append(PdExpected(fault, "transfer_stuck", cfg.decode_id, req, tids[i]))
            expected.append(PdExpected(fault, "transfer_stuck", cfg.prefill_id, f"p-{i}", tids[i]))
            continue
        digests = _block_digests(prompt, len(p_blocks[i]), bs)
        if fault == "content":
            digests[-1] ^= 1
        digest = records.transfer_digest(layout, digests + [0] * (n - len(digests))) if cfg.digests else None
        if fault == "recv_failed":
            decode.connector("RECV_FAILED", req, tids[i], blocks, detail="synthetic failure", **remote)
        else:
            decode.connector("RECV_DONE", req, tids[i], blocks, digest=digest, **remote)
        if fault != "read_early":
            decode.run()
        computed = 0 if fault == "recv_failed" else len(prompt) - 1
        own = [(prompt[0] + 1) % 1000, *prompt[1:]] if fault == "other_prefix" else prompt
        decode.run(new=(i, req, blocks, computed, own, len(prompt) - computed))
        decode.run(finished=(req,))
        decode.free.extend(blocks)
        kind = {
            "recv_failed": "transfer_failed",
            "content": "transfer_content_mismatch",
            "block_count": "transfer_block_mismatch",
            "read_early": "read_before_transfer",
            "other_prefix": "transfer_prefix_mismatch",
        }.get(fault)
        if kind:
            expected.append(PdExpected(fault, kind, cfg.decode_id, req, tids[i]))
    for _ in range(cfg.idle_steps):
        decode.run()

    merged, a, b = [], prefill.events, decode.events
    while a or b:
        source = a if b == [] or (a and rng.random() < 0.5) else b
        merged.append(source.pop(0))
    return PdSimulation(merged, expected, tids, prompts)
