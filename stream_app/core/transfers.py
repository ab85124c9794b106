"""KV transfers between engines (prefill/decode pairs), checked from both sides.

Two checkers, split by the state they need:

* `TransferJoin`, keyed by transfer id: both engines' ConnectorEvents of one
  transfer, in any interleaving, plus each rank's step progress (its clock).
  It reports `transfer_block_mismatch`, `transfer_content_mismatch`,
  `transfer_failed`, `transfer_stuck` and `orphan_transfer`.
* `TransferUse`, per rank: a rank's own step inputs against its own pending
  receives. It reports `read_before_transfer` (decode schedules a request
  before its receive completed, or on blocks whose receive failed).

What a pending transfer holds on its own rank (its blocks, from intent to end)
is the rank's tables' (`RankTables.pending_sends`, `pending_recvs`): a grant
that writes them meanwhile is a `foreign_block_write` when it happens, and a
send that then completes is a `send_block_reused` (it shipped the other
request's KV).

Deadlines count the ledger's own steps (a rank's step counter), never wall
time, so every replay of the same events gives the same answers; a stuck
transfer is reported at its deadline step, however coarse the clock that
passed it (a stream worker's progress records come now and then).

Transfer digests (`ConnectorEvent.digest`, written by the producer's
connector probe) have this layout: one version byte (1), an 8-byte
fingerprint of the KV layout that was hashed (regions, their byte lengths,
the TP size), then one little-endian uint64 per block, in the order of the
event's `block_ids` (groups concatenated). Per-block digests let a decode
engine that pulled only the tail of the prefill blocks (a prefix-cache hit)
be compared block by block, and name the first block that differs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvledger.schemas.events import ConnectorEvent, LedgerEvent, RankInfo, Step, StepInput, TransferPrefix
from kvledger.schemas.kinds import Check, ConnectorKind, TransferOutcome, TransferRole, Unchecked, ViolationKind
from kvledger.schemas.packing import unpack_i32, unpack_u64
from kvledger.stream_app.core.violations import Coverage, RankKey, Violation

if TYPE_CHECKING:
    from kvledger.stream_app.core.rank_tables import RankTables

DIGEST_VERSION = 1
DEFAULT_DEADLINE_STEPS = 4096  # a transfer still open this many rank steps after its intent is stuck
RETIRE_AFTER = 2  # deadlines after it closed, a transfer's state is dropped ...
FORGET_AFTER = 64  # ... and its id, kept so that late repeats of its events are not new transfers
SEND, RECV = TransferRole.SEND, TransferRole.RECV
RETIRE, FORGET = "retire", "forget"  # deadline-heap entries that are housekeeping, not a side
DERIVED_BY = "kvledger"  # the `connector` of the events the ledger derives for the join


@dataclass(frozen=True)
class TransferDigest:
    layout: bytes
    blocks: np.ndarray  # uint64, one per block, groups concatenated


def parse_digest(data: bytes | None) -> TransferDigest | None:
    """The digest of a ConnectorEvent, or None when absent or of an unknown version."""
    if not data or data[0] != DIGEST_VERSION or (len(data) - 9) % 8:
        return None
    return TransferDigest(bytes(data[1:9]), np.frombuffer(data, "<u8", offset=9))


def _blocks(body: ConnectorEvent) -> list[list[int]]:
    return [unpack_i32(b).tolist() for b in body.block_ids]


# -- the join by transfer id ------------------------------------------------------------------
@dataclass
class Side:
    """One rank's view of one transfer (a prefill rank sends, a decode rank receives)."""

    rank: RankKey
    role: TransferRole
    req_id: str | None = None
    first_step: int = 0
    intent_step: int | None = None
    blocks: list[list[int]] | None = None  # per group
    num_tokens: int | None = None
    remote_engine_id: str | None = None
    outcome: TransferOutcome | None = None
    done_step: int | None = None
    digest: bytes | None = None
    prefix: TransferPrefix | None = None  # what its request was computed from / reads the KV as
    prefix_step: int | None = None  # step of its prefix (decode: the request's first step)
    stuck: bool = False
    open_counted: bool = False
    peer_clock: int | None = None  # the peers' clock when this side was first seen
    seen: set[tuple[str, int]] = field(default_factory=set)  # (kind, step) of the events applied

    def where(self) -> str:
        return f"{self.rank} req {self.req_id}"


@dataclass
class Transfer:
    sides: dict[str, dict[RankKey, Side]] = field(default_factory=lambda: {SEND: {}, RECV: {}})
    joined: bool = False
    shape_checked: bool = False
    prefix_checked: bool = False
    compared: set[RankKey] = field(default_factory=set)  # receiving ranks whose digest was compared
    orphan_settled: bool = False
    retiring: bool = False

    def closed(self) -> bool:
        """Both roles seen and every side finished: only late repeats can still come."""
        sends, recvs = self.sides[SEND], self.sides[RECV]
        return bool(sends and recvs) and all(s.outcome for sides in (sends, recvs) for s in sides.values())


class TransferJoin:
    """Joins the two sides of every transfer by transfer id; state keyed by transfer id.

    Feeding it (offline, the Ledger does this): `apply(event)` with every
    ConnectorEvent of every engine and every Step event (only its step number
    is read: it is the rank's clock); `finish()` once, at the end of input.

    Feeding it from a stream worker: consume the topic repartitioned by
    transfer id (every ConnectorEvent with a transfer id, from any engine,
    in any interleaving); `apply` each. The clock needs progress from every
    rank in every partition: forward, to all partitions, a small progress
    record per rank now and then (a Step event with `input` and `plan`
    null will do; only `step` and the envelope's rank are read). Progress is
    monotonic per rank, so a late, repeated or reordered progress record is
    harmless, and so is a repeated ConnectorEvent (same rank, kind and step:
    a worker that restarts re-sends what its checkpoint did not cover). Never
    call `finish()` on a live stream: it settles orphans as if the input had
    ended; the deadline reports them instead. State is a plain object
    (a checkpoint is its record, core/checkpoints.py, like the Ledger's); a closed transfer's
    state is dropped `RETIRE_AFTER` deadlines after it closed, so it stays
    bounded on a stream that never ends.
    """

    def __init__(self, *, deadline_steps: int = DEFAULT_DEADLINE_STEPS, coverage: Coverage | None = None):
        self.deadline_steps = deadline_steps
        self.coverage = coverage if coverage is not None else Coverage()
        self.transfers: dict[str, Transfer] = {}
        self.clock: dict[RankKey, int] = {}
        self.engine_clock: dict[str, int] = {}  # max step of any rank of the engine
        self.pulled_from: dict[str, set[str]] = {}  # prefill engine -> decode engines that pulled from it
        self.retired: set[str] = set()  # ids of transfers whose state was dropped
        self._due: dict[RankKey, list[tuple[int, str, str]]] = {}  # rank -> heap of (step, transfer, role)

    # -- entry points ---------------------------------------------------------------------
    def apply(self, event: LedgerEvent) -> list[Violation]:
        body, key = event.body, event.rank
        if isinstance(body, Step):
            return self.advance(key, body.step)
        if not isinstance(body, ConnectorEvent):
            return []
        out = self.advance(key, body.step)
        role = body.kind.role
        tid = body.transfer_id
        if role is None or tid is None or tid in self.retired:
            return out
        transfer = self.transfers.setdefault(tid, Transfer())
        side = self._side(tid, transfer, role, key, body)
        if (body.kind, body.step) in side.seen:
            return out  # a repeat
        side.seen.add((body.kind, body.step))
        self._record(tid, side, body, out)
        self._compare(tid, transfer, out)
        if not transfer.retiring and transfer.closed():
            transfer.retiring = True
            self._schedule(key, body.step + RETIRE_AFTER * self.deadline_steps, tid, RETIRE)
        return out

    def advance(self, key: RankKey, step: int) -> list[Violation]:
        """The rank reached `step`: report transfers whose deadline it passed."""
        if step <= self.clock.get(key, -1):
            return []
        self.clock[key] = step
        if step > self.engine_clock.get(key.engine_id, -1):
            self.engine_clock[key.engine_id] = step
        due, out = self._due.get(key), []
        while due and due[0][0] <= step:
            at, tid, role = heapq.heappop(due)
            if role == RETIRE:
                self._retire(key, at, tid)
            elif role == FORGET:
                self.retired.discard(tid)
            else:
                self._deadline(tid, role, key, at, step, out)
        return out

    def due_by(self, key: RankKey, step: int) -> bool:
        """Something of the rank falls due at or before `step` (a deadline, a retirement)."""
        due = self._due.get(key)
        return bool(due) and due[0][0] <= step

    def _schedule(self, key: RankKey, step: int, tid: str, what: str) -> None:
        heapq.heappush(self._due.setdefault(key, []), (step, tid, what))

    def _retire(self, key: RankKey, at: int, tid: str) -> None:
        transfer = self.transfers.get(tid)
        if transfer is None or not transfer.closed():
            if transfer is not None:
                transfer.retiring = False  # reopened by a late side: retired once that closes
            return
        del self.transfers[tid]
        self.retired.add(tid)
        self._schedule(key, at + (FORGET_AFTER - RETIRE_AFTER) * self.deadline_steps, tid, FORGET)

    def finish(self) -> list[Violation]:
        """End of input: a transfer seen from one side only is an orphan, when its peer is in the input."""
        out: list[Violation] = []
        for tid, transfer in self.transfers.items():
            for role in (SEND, RECV):
                for side in transfer.sides[role].values():
                    if side.outcome is None and not side.open_counted:
                        side.open_counted = True
                        self.coverage.unchecked[Unchecked.TRANSFER_OPEN_AT_END] += 1
            lone = self._lone_side(transfer)
            if lone is None or transfer.orphan_settled:
                continue
            transfer.orphan_settled = True
            if self._peers_seen(lone):
                out.append(self._orphan(tid, lone, "the input ended"))
            else:
                self.coverage.unchecked[Unchecked.TRANSFER_PEER_NOT_IN_INPUT] += 1
        return out

    # -- sides -----------------------------------------------------------------------------
    def _side(self, tid: str, transfer: Transfer, role: str, key: RankKey, body: ConnectorEvent) -> Side:
        sides = transfer.sides[role]
        side = sides.get(key)
        if side is None:
            side = sides[key] = Side(key, role, first_step=body.step)
            if role == RECV and body.remote_engine_id:
                side.remote_engine_id = body.remote_engine_id
                self.pulled_from.setdefault(side.remote_engine_id, set()).add(key.engine_id)
            side.peer_clock = self._peer_clock(side)
            self._schedule(key, body.step + self.deadline_steps, tid, role)
        return side

    def _record(self, tid: str, side: Side, body: ConnectorEvent, out: list[Violation]) -> None:
        kind, step = body.kind, body.step
        side.req_id = side.req_id or body.req_id or None
        if body.num_tokens is not None:
            side.num_tokens = body.num_tokens
        if kind in (ConnectorKind.SEND_PREFIX, ConnectorKind.RECV_PREFIX):
            side.prefix, side.prefix_step = body.prefix, step
            return
        if kind in (ConnectorKind.SEND_INTENT, ConnectorKind.RECV_INTENT):
            side.intent_step = step
            side.blocks = _blocks(body)
            return
        if side.blocks is None and body.block_ids:
            side.blocks = _blocks(body)
        side.done_step = step
        if kind in (ConnectorKind.SEND_DONE, ConnectorKind.RECV_DONE):
            side.outcome, side.digest = TransferOutcome.DONE, body.digest
        elif kind in (ConnectorKind.SEND_CANCELLED, ConnectorKind.RECV_RELEASED):
            side.outcome = TransferOutcome.RELEASED
        else:  # RECV_FAILED, EXPIRED
            side.outcome = TransferOutcome.FAILED if kind == ConnectorKind.RECV_FAILED else TransferOutcome.EXPIRED
            failed = kind == ConnectorKind.RECV_FAILED
            what = "the receive failed" if failed else "the prefill engine gave up on the send"
            detail = f"transfer {tid}: {what}" + (f" ({body.detail})" if body.detail else "")
            out.append(Violation.at(ViolationKind.TRANSFER_FAILED, side.rank, step, detail, req_id=side.req_id))

    # -- checks across the two sides -----------------------------------------------------------
    def _compare(self, tid: str, transfer: Transfer, out: list[Violation]) -> None:
        sends, recvs = transfer.sides[SEND], transfer.sides[RECV]
        if not sends or not recvs:
            return
        if not transfer.joined:
            transfer.joined = True
            self.coverage.checks[Check.TRANSFER_JOIN] += 1
        if not transfer.shape_checked:
            send = next((s for s in sends.values() if s.blocks and s.outcome != TransferOutcome.RELEASED), None)
            recv = next((r for r in recvs.values() if r.blocks and r.outcome != TransferOutcome.RELEASED), None)
            if send is not None and recv is not None:
                transfer.shape_checked = True
                self._check_shape(tid, send, recv, out)
        if not transfer.prefix_checked:
            send = next((s for s in sends.values() if s.prefix is not None), None)
            recv = next((r for r in recvs.values() if r.prefix is not None), None)
            if send is not None and recv is not None:
                transfer.prefix_checked = True
                self._check_prefix(tid, send, recv, out)
        for recv in recvs.values():
            if recv.digest is None or recv.rank in transfer.compared:
                continue
            send = self._digest_partner(recv, sends)
            if send is not None:
                transfer.compared.add(recv.rank)
                self._check_content(tid, send, recv, out)

    def _check_shape(self, tid: str, send: Side, recv: Side, out: list[Violation]) -> None:
        self.coverage.checks[Check.TRANSFER_BLOCKS] += 1
        sent, expected = [len(g) for g in send.blocks], [len(g) for g in recv.blocks]
        problem = None
        if len(sent) != len(expected) or any(e > s for s, e in zip(sent, expected, strict=True)):
            problem = f"decode expects {expected} block(s) per group, prefill {send.where()} sends {sent}"
        elif send.num_tokens is not None and recv.num_tokens is not None and send.num_tokens != recv.num_tokens:
            problem = f"decode expects {recv.num_tokens} token(s), prefill {send.where()} sends {send.num_tokens}"
        elif sent != expected:
            self.coverage.unchecked[Unchecked.TRANSFER_PARTIAL_PULL] += 1  # decode had a prefix hit: it pulls the tail
        if problem:
            step = recv.intent_step if recv.intent_step is not None else recv.first_step
            detail = f"transfer {tid}: {problem}"
            out.append(Violation.at(ViolationKind.TRANSFER_BLOCK_MISMATCH, recv.rank, step, detail, req_id=recv.req_id))

    def _check_prefix(self, tid: str, send: Side, recv: Side, out: list[Violation]) -> None:
        """Decode reads the received KV as its own prompt's prefix: prefill computed it from that prefix
        (their chains agree at every full prompt block both have, group by group, where the engines'
        block sizes agree)."""
        sp, rp = send.prefix, recv.prefix
        compared = []
        for g, (bs, other) in enumerate(zip(sp.block_sizes, rp.block_sizes, strict=False)):
            if bs != other or bs <= 0 or g >= min(len(sp.chains), len(rp.chains)):
                continue
            s, r = unpack_u64(sp.chains[g]), unpack_u64(rp.chains[g])
            n = min(s.size, r.size)
            if n:
                compared.append((g, bs, np.flatnonzero(s[:n] != r[:n]), n))
        if not compared:
            self.coverage.unchecked[Unchecked.TRANSFER_PREFIX_UNKNOWN] += 1
            return
        self.coverage.checks[Check.TRANSFER_PREFIX] += 1
        for g, bs, differ, n in compared:
            if differ.size:
                i = int(differ[0])
                detail = (
                    f"transfer {tid}: decode reads the received KV as its own prompt, but prefill {send.where()} "
                    f"computed it from another prefix: their prefix chains differ from block {i} on (tokens "
                    f"{i * bs}..{(i + 1) * bs - 1}, group {g}; {differ.size} of {n} full blocks)"
                )
                step = recv.prefix_step
                out.append(
                    Violation.at(
                        ViolationKind.TRANSFER_PREFIX_MISMATCH, recv.rank, step, detail, req_id=recv.req_id, group=g
                    )
                )
                return

    def _digest_partner(self, recv: Side, sends: dict[RankKey, Side]) -> Side | None:
        """The sending rank whose digest this receiving rank's must equal: same TP/PP position."""
        done = [s for s in sends.values() if s.digest is not None]
        same = [s for s in done if (s.rank.tp, s.rank.pp) == (recv.rank.tp, recv.rank.pp)]
        return (same or done or [None])[0]

    def _check_content(self, tid: str, send: Side, recv: Side, out: list[Violation]) -> None:
        sd, rd = parse_digest(send.digest), parse_digest(recv.digest)
        if sd is None or rd is None or send.blocks is None or recv.blocks is None:
            self.coverage.unchecked[Unchecked.TRANSFER_DIGEST_UNREADABLE] += 1
            return
        if sd.layout != rd.layout:
            self.coverage.unchecked[Unchecked.TRANSFER_DIGEST_LAYOUT_DIFFERS] += 1
            return
        pairs = _aligned_blocks(send.blocks, recv.blocks)
        sizes = (sd.blocks.size, rd.blocks.size) == (len(_flat(send.blocks)), len(_flat(recv.blocks)))
        if pairs is None or not sizes:
            self.coverage.unchecked[Unchecked.TRANSFER_DIGEST_UNREADABLE] += 1
            return
        self.coverage.checks[Check.TRANSFER_CONTENT] += 1
        s_at, r_at, groups = pairs
        differ = np.flatnonzero(sd.blocks[s_at] != rd.blocks[r_at])
        if differ.size == 0:
            return
        i = int(differ[0])
        detail = (
            f"transfer {tid}: {differ.size} of {len(s_at)} received block(s) differ from what prefill "
            f"{send.where()} sent; first: decode block {_flat(recv.blocks)[r_at[i]]} (group {groups[i]}) "
            f"vs prefill block {_flat(send.blocks)[s_at[i]]}"
        )
        out.append(
            Violation.at(ViolationKind.TRANSFER_CONTENT_MISMATCH, recv.rank, recv.done_step, detail, req_id=recv.req_id)
        )

    # -- deadlines and orphans ---------------------------------------------------------------
    def _deadline(self, tid: str, role: str, key: RankKey, due: int, step: int, out: list[Violation]) -> None:
        """The rank's clock passed `due` (now at `step`): a side not finished before `due` is stuck."""
        transfer = self.transfers.get(tid)
        side = transfer.sides[role].get(key) if transfer else None
        if side is None:
            return
        start = side.intent_step if side.intent_step is not None else side.first_step
        # Finished at or after `due` counts as not finished by then: the same answer whether the
        # clock reached `due` step by step (a ledger file) or jumped past it (a worker's progress).
        late = side.outcome is None or (side.done_step is not None and side.done_step >= due)
        if late and not side.stuck:
            side.stuck = True
            what = "sent" if role == SEND else "received"
            detail = (
                f"transfer {tid}: not {what} {due - start} steps after its intent at step {start} "
                f"(deadline {self.deadline_steps} steps)"
            )
            out.append(Violation.at(ViolationKind.TRANSFER_STUCK, key, due, detail, req_id=side.req_id))
        if transfer.orphan_settled or self._lone_side(transfer) is not side:
            return
        # An orphan only once the peers moved on too: a lagging peer stream is not a missing side.
        now = self._peer_clock(side)
        if side.peer_clock is None or now is None:
            side.peer_clock = now
        elif now - side.peer_clock >= self.deadline_steps:
            transfer.orphan_settled = True
            out.append(self._orphan(tid, side, f"{self.deadline_steps} steps passed on both engines"))
            return
        self._schedule(key, step + self.deadline_steps, tid, role)

    def _lone_side(self, transfer: Transfer) -> Side | None:
        """The first side of a transfer only one role has seen."""
        sends, recvs = transfer.sides[SEND], transfer.sides[RECV]
        if bool(sends) == bool(recvs):
            return None
        return next(iter((sends or recvs).values()))

    def _peers(self, side: Side) -> set[str]:
        if side.role == RECV:
            return {side.remote_engine_id} if side.remote_engine_id else set()
        return self.pulled_from.get(side.rank.engine_id, set())

    def _peers_seen(self, side: Side) -> bool:
        return any(p in self.engine_clock for p in self._peers(side))

    def _peer_clock(self, side: Side) -> int | None:
        clocks = [self.engine_clock[p] for p in self._peers(side) if p in self.engine_clock]
        return max(clocks) if clocks else None

    def _orphan(self, tid: str, side: Side, why: str) -> Violation:
        missing = "no decode engine received it" if side.role == SEND else f"{side.remote_engine_id} never sent it"
        detail = f"transfer {tid}: seen only on {side.role} side, {missing} ({why})"
        step = side.intent_step if side.intent_step is not None else side.first_step
        return Violation.at(ViolationKind.ORPHAN_TRANSFER, side.rank, step, detail, req_id=side.req_id)


def _flat(groups: list[list[int]]) -> list[int]:
    return [b for g in groups for b in g]


def _aligned_blocks(sent: list[list[int]], received: list[list[int]]):
    """Flat indices of the sent and received blocks that carry the same KV, and their group.

    Per group, the receiver's blocks are the tail of the sender's (what Mooncake
    copies when the decode engine had a prefix hit); None when they cannot be.
    """
    if len(sent) != len(received):
        return None
    s_at, r_at, groups = [], [], []
    s_off = r_off = 0
    for g, (s, r) in enumerate(zip(sent, received, strict=True)):
        if len(r) > len(s):
            return None
        skip = len(s) - len(r)
        s_at += range(s_off + skip, s_off + len(s))
        r_at += range(r_off, r_off + len(r))
        groups += [g] * len(r)
        s_off, r_off = s_off + len(s), r_off + len(r)
    return np.asarray(s_at, np.int64), np.asarray(r_at, np.int64), groups


# -- the rank's own use of its transfers ---------------------------------------------------------
@dataclass
class PendingRecv:
    """A receive a request waits for (decode side)."""

    transfer_id: str
    intent_step: int
    blocks: list[list[int]]
    done_step: int | None = None
    failed_step: int | None = None


@dataclass
class PendingTransfers:
    """A rank's receives its requests wait for (their blocks' hold is the rank's tables')."""

    recvs: dict[str, PendingRecv] = field(default_factory=dict)  # by request id
    block_sizes: list[int] = field(default_factory=list)


class TransferUse:
    """Checks a rank's step inputs against its own pending receives, and states each side's prefix.

    Fed, per rank and in the rank's order, with its RankInfo, ConnectorEvent
    and Step events (`apply`); a stream worker runs it where the engine's
    events are (the topic keyed by engine id), beside the Ledger. What the
    join needs from the rank's tables comes out as derived connector events
    (`take_derived`): SEND_PREFIX at a send's intent (the prefix its request
    was computed from) and RECV_PREFIX at a received request's first step
    (the prefix it reads the KV as).
    """

    def __init__(self, coverage: Coverage | None = None):
        self.coverage = coverage if coverage is not None else Coverage()
        self.ranks: dict[RankKey, PendingTransfers] = {}
        self.derived: list[LedgerEvent] = []  # for the transfer join, in the order they arose

    def apply(self, event: LedgerEvent, tables: RankTables | None = None) -> list[Violation]:
        """`tables`: the rank's block tables (its cached requests' names, its live requests' prefixes)."""
        body, key = event.body, event.rank
        if isinstance(body, RankInfo):
            self.ranks.setdefault(key, PendingTransfers()).block_sizes = [g.block_size for g in body.kv_groups]
        elif isinstance(body, ConnectorEvent):
            return self._connector(event, body, tables)
        elif isinstance(body, Step) and body.input is not None:
            state = self.ranks.get(key)
            if state is not None and state.recvs:
                return self._step(event, state, body.input, tables)
        return []

    def take_derived(self) -> list[LedgerEvent]:
        derived, self.derived = self.derived, []
        return derived

    def _derive(self, event: LedgerEvent, kind: ConnectorKind, req_id: str, tid: str, prefix: TransferPrefix | None):
        """A side's prefix for the join, on the envelope of the event that revealed it."""
        if prefix is None:
            self.coverage.unchecked[Unchecked.TRANSFER_PREFIX_UNKNOWN] += 1
            return
        body = ConnectorEvent(event.body.step, DERIVED_BY, kind, req_id, tid, prefix=prefix)
        self.derived.append(LedgerEvent(event.rank, event.incarnation, event.seq, event.emitted_at_us, body))

    def waiting(self, key: RankKey) -> bool:
        """Some request of the rank waits for a receive (only then do its steps matter here)."""
        state = self.ranks.get(key)
        return state is not None and bool(state.recvs)

    def forget(self, key: RankKey) -> int:
        """Drop the rank's pending transfers (events were lost: their ends may be among them); how many."""
        state = self.ranks.get(key)
        if state is None:
            return 0
        n = len(state.recvs)
        state.recvs.clear()
        return n

    def _connector(self, event: LedgerEvent, body: ConnectorEvent, tables: RankTables | None) -> list[Violation]:
        tid, kind, step = body.transfer_id, body.kind, body.step
        if tid is None:
            return []
        state = self.ranks.setdefault(event.rank, PendingTransfers())
        if kind == ConnectorKind.SEND_INTENT and body.req_id:
            prefix = tables.prefix_of(body.req_id) if tables is not None else None
            self._derive(event, ConnectorKind.SEND_PREFIX, body.req_id, tid, prefix)
        elif kind == ConnectorKind.RECV_INTENT and body.req_id:
            state.recvs[body.req_id] = PendingRecv(tid, step, _blocks(body))
        elif kind in (ConnectorKind.RECV_DONE, ConnectorKind.RECV_FAILED) and body.req_id in state.recvs:
            recv = state.recvs[body.req_id]
            if kind == ConnectorKind.RECV_DONE:
                recv.done_step = step
            else:
                recv.failed_step = step
        return []

    def _step(self, event: LedgerEvent, state: PendingTransfers, inp: StepInput, tables) -> list[Violation]:
        out: list[Violation] = []
        step = event.body.step
        for req in inp.new_reqs:  # a received request's first step: the prefix it reads the KV as
            recv = state.recvs.get(req.req_id)
            if recv is not None and recv.done_step is not None and recv.done_step < step:
                prefix = tables.transfer_prefix(req.prefix_chains) if tables is not None else None
                self._derive(event, ConnectorKind.RECV_PREFIX, req.req_id, recv.transfer_id, prefix)
        self._check_reads(event.rank, state, step, inp, tables.req_id if tables is not None else None, out)
        return out

    # -- decode: computing before the receive completed ---------------------------------------------
    def _check_reads(self, key, state: PendingTransfers, step: int, inp: StepInput, req_id_of, out) -> None:
        for req_id, computed, row in _scheduled(inp, req_id_of):
            recv = state.recvs.get(req_id)
            if recv is None:
                continue
            self.coverage.checks[Check.TRANSFER_READ] += 1
            done = recv.done_step is not None and recv.done_step < step
            failed = recv.failed_step is not None and recv.failed_step < step
            problem = None
            if not done and not failed:
                since = f"its receive was bound at step {recv.intent_step}"
                end = recv.done_step if recv.done_step is not None else recv.failed_step
                problem = f"{since} and {'completes at step ' + str(end) if end is not None else 'has not completed'}"
            elif failed and computed > 0 and row is not None and state.block_sizes:
                covered = set(row[: -(-computed // state.block_sizes[0])])
                lost = covered.intersection(recv.blocks[0] if recv.blocks else ())
                if lost:
                    problem = f"its receive failed at step {recv.failed_step}, yet it computes on block {min(lost)}"
            if problem:
                detail = f"transfer {recv.transfer_id}: scheduled with {computed} computed token(s), but {problem}"
                out.append(Violation.at(ViolationKind.READ_BEFORE_TRANSFER, key, step, detail, req_id=req_id))
            del state.recvs[req_id]  # checked at its first schedule: later steps compute on its own KV


def _scheduled(inp: StepInput, req_id_of):
    """(req id, computed tokens, first group's row or None) of every request the step input schedules."""
    for req in inp.new_reqs:
        row = unpack_i32(req.block_ids[0]).tolist() if req.block_ids else None
        yield req.req_id, req.num_computed_tokens, row
    if req_id_of is not None:
        indices = unpack_i32(inp.cached_req_indices)
        computed = unpack_i32(inp.cached_num_computed_tokens)
        for index, n in zip(indices.tolist(), computed.tolist(), strict=True):
            yield req_id_of(index), n, None
