"""The ledger: a deterministic state machine over ledger events.

`Ledger.apply(event)` returns the violations the event reveals; nothing here
does I/O or reads a clock, so the offline checker, the stream app and the
in-engine raise mode get the same answers from the same events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvledger.schemas.events import (
    ConnectorEvent,
    Health,
    LedgerEvent,
    RankInfo,
    Snapshot,
    Step,
    StepInput,
    StepPlan,
)
from kvledger.schemas.kinds import (
    CONTENT_DIGESTS,
    Check,
    ConnectorKind,
    StepKind,
    Unchecked,
    ViolationKind,
)
from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.core import batch
from kvledger.stream_app.core.content import ContentLedger
from kvledger.stream_app.core.declarations import Declared, check_declared_plan, content_voided
from kvledger.stream_app.core.fingerprints import input_fingerprint, plan_fingerprint
from kvledger.stream_app.core.layout import Layout, describe, layout_of
from kvledger.stream_app.core.rank_tables import RankTables
from kvledger.stream_app.core.step_groups import LeadStep, StepGroup, rekeyed
from kvledger.stream_app.core.transfers import DEFAULT_DEADLINE_STEPS, TransferJoin, TransferUse
from kvledger.stream_app.core.violations import Coverage, RankKey, Violation


@dataclass
class TrackedRank:
    """What the ledger knows about one rank stream."""

    incarnation: int
    next_seq: int
    info: RankInfo | None = None
    state: RankTables | None = None
    desynced: bool = False  # events were lost: checks wait for a snapshot
    last_step: int = -1
    events_dropped: int = 0
    gap_after_step: int | None = None  # last step seen before a sequence gap, until the next step
    declared: Declared | None = None  # configurations the checks do not model (from RankInfo)
    # The step its closing Health named (it began no later one); None while it runs.
    closed_step: int | None = None

    @property
    def closed(self) -> bool:
        """The rank said it shut down (Health.closing): nothing more comes from it."""
        return self.closed_step is not None

    @property
    def in_sync(self) -> bool:
        """Its tables follow the rank and none of its events were lost to its probes (whose Health
        counts them, for the incarnation): what its checks say is about all it did. Events lost on the
        way (a sequence gap) are a violation of their own, and leave it out of sync until a snapshot."""
        return not self.desynced and self.events_dropped == 0


class Ledger:
    """Replays ledger events of any number of engines and ranks."""

    def __init__(
        self,
        *,
        rank_window: int = 256,
        batch_steps: int = 128,
        transfer_deadline_steps: int = DEFAULT_DEADLINE_STEPS,
        join_transfers: bool = True,
    ):
        # Steps a rank may lag behind its peers before it is declared missing.
        self.rank_window = rank_window
        # Longest run of step events `apply_many` checks at once.
        self.batch_steps = batch_steps
        self.ranks: dict[RankKey, TrackedRank] = {}
        self.step_groups: dict[tuple[str, int], StepGroup] = {}
        self.coverage = Coverage()
        # Transfers: each rank's own use of them, and (unless a stream worker runs the
        # join on the transfer-keyed topic instead) both sides joined by transfer id.
        self.transfer_use = TransferUse(self.coverage)
        self.transfer_join = (
            TransferJoin(deadline_steps=transfer_deadline_steps, coverage=self.coverage) if join_transfers else None
        )
        # Reference digests of sealed blocks, per engine and DP rank (core/content.py).
        self.content: dict[tuple[str, int], ContentLedger] = {}
        self._keys: dict[tuple, RankKey] = {}  # interned: a lookup costs half of building a RankKey
        self.events = 0
        self.steps = 0

    # -- entry points -------------------------------------------------------------------
    def apply(self, event: LedgerEvent) -> list[Violation]:
        """The violations an event reveals (an edge types a decoded record with
        `kvledger.schemas.events.event_of(record, ledger.key_of)`)."""
        out: list[Violation] = []
        key = event.rank
        self.events += 1
        slot = self._sequence(key, event, out)
        if slot is None:
            return out
        body = event.body
        if isinstance(body, Step):
            self._step(key, slot, body, out)
        elif isinstance(body, RankInfo):
            self._rank_info(key, slot, body, out)
        elif isinstance(body, Snapshot):
            self._snapshot(key, slot, body)
        elif isinstance(body, ConnectorEvent):
            if body.kind is ConnectorKind.OTHER:  # a newer writer's kind: nothing reads it here
                self.coverage.unchecked[Unchecked.CONNECTOR_KIND_UNKNOWN] += 1
            if slot.state is not None:  # a transfer holds blocks, not rows: its ends count while rows wait
                out += slot.state.apply_connector(body, self.coverage)
        elif isinstance(body, Health):
            slot.events_dropped = body.events_dropped
            if body.closing and not slot.closed:
                slot.closed_step = body.step
        if isinstance(body, _TRANSFER_BODIES):
            self._transfers(key, event, out)
        return out

    def _transfers(self, key: RankKey, event: LedgerEvent, out: list[Violation]) -> None:
        if not isinstance(event.body, Step) or self.transfer_use.waiting(key):  # a step matters to a receive
            out += self.transfer_use.apply(event, self.tables_of(key))
        if self.transfer_join is not None:
            out += self.transfer_join.apply(event)
            for derived in self.transfer_use.take_derived():  # a side's prefix, stated by its rank's tables
                out += self.transfer_join.apply(derived)

    def apply_many(self, events: Iterable[LedgerEvent]) -> list[Violation]:
        """`apply` each event, in order; the same violations and coverage, faster.

        Runs of steps are first tried on the batched fast path (core/batch.py),
        which commits only when it proves the run clean; anything else goes
        event by event.
        """
        out: list[Violation] = []
        run: list[LedgerEvent] = []
        for event in events:  # an iterator: an edge may type its records as they are read
            if isinstance(event.body, Step):
                run.append(event)
                if len(run) == self.batch_steps:
                    self._run(run, out)
                    run = []
                continue
            if run:
                self._run(run, out)
                run = []
            out += self.apply(event)
        if run:
            self._run(run, out)
        return out

    def _run(self, run: list[LedgerEvent], out: list[Violation]) -> None:
        if len(run) >= 2 and self._fast_run(run, out):
            return
        if not any(batch.reads_blocks(e.body) for e in run):
            for event in run:
                out += self.apply(event)
            return
        # A step that hands blocks out only to be read goes alone, its neighbours again in runs: what
        # was read may be what the fast path declined.
        start = 0
        for i, event in enumerate(run):
            if batch.reads_blocks(event.body):
                self._run(run[start:i], out)
                out += self.apply(event)
                start = i + 1
        self._run(run[start:], out)

    def _fast_run(self, events: list[LedgerEvent], out: list[Violation]) -> bool:
        per_rank: dict[RankKey, list[Step]] = {}
        expect: dict[RankKey, tuple[int, int]] = {}
        seen: list[tuple[RankKey, int, Step]] = []
        for event in events:
            key, body = event.rank, event.body
            if key not in expect:
                slot = self.ranks.get(key)
                follower = slot is not None and self.follower(key)
                if (
                    slot is None
                    or (not follower and (slot.state is None or slot.desynced))
                    or slot.declared is not None
                    or slot.gap_after_step is not None
                    or slot.incarnation != event.incarnation
                ):
                    return False
                # A rank's first step may have any number; after that they must follow on.
                expect[key] = (slot.next_seq, slot.last_step + 1 if slot.last_step >= 0 else body.step)
                per_rank[key] = []
            seq, step = expect[key]
            if event.seq != seq or body.step != step or event.incarnation != self.ranks[key].incarnation:
                return False
            expect[key] = (seq + 1, step + 1)
            per_rank[key].append(body)
            seen.append((key, seq, body))
        if not self._content_clean(seen):  # a finding is reported, with its holders, by the step path
            return False
        fps = self._agreeing_fingerprints(per_rank)
        if fps is None:
            return False
        planned = []
        for key, steps in per_rank.items():
            state = self.ranks[key].state
            if state is None:
                continue  # a follower: it agrees with its lead, whose steps are checked here
            result = batch.plan_run(state, steps) if batch.eligible(state) else None
            if result is None:
                return False
            planned.append(result)
        for commit, counted in planned:
            commit()
            self.coverage.merge(counted)
        # What `apply` does around a clean step, in order.
        self.events += len(seen)
        self.steps += len(seen)
        self.coverage.checks[Check.SEQUENCE] += len(seen)
        for key, (seq, step) in expect.items():
            slot = self.ranks[key]
            slot.next_seq, slot.last_step = seq, step - 1
        self._run_transfers(events, expect, out)
        for key, _, body in seen:  # in order: a step's digests come before its writes
            if body.content is not None:
                self._check_content(key, self.ranks[key], body, out)
            if self.ranks[key].state is not None and body.plan is not None:
                self._note_writes(key, body.step, body.plan)
        for key, _, body in seen:
            if key in fps:
                lead = None if self.follower(key) else (True, [], [])
                self._cross_rank(key, body, out=out, lead=lead, fps=fps[key][body.step])
        return True

    def _run_transfers(
        self, events: list[LedgerEvent], ends: dict[RankKey, tuple[int, int]], out: list[Violation]
    ) -> None:
        """What `_transfers` does for each step of a run: at once, each rank's clocks moved to its last
        step, where none of the run's steps matters to a receive or brings something due. `ends`: each
        rank's next seq and step after the run."""
        join = self.transfer_join
        last = {key: step - 1 for key, (_, step) in ends.items()}
        if any(self.transfer_use.waiting(k) or (join is not None and join.due_by(k, n)) for k, n in last.items()):
            for event in events:
                self._transfers(event.rank, event, out)
        elif join is not None:
            for key, step in last.items():
                join.advance(key, step)

    def _agreeing_fingerprints(self, per_rank: dict[RankKey, list[Step]]) -> dict | None:
        """Fingerprints of the steps of ranks that have a group to agree with, per rank and step, when
        every follower's step equals its lead's (in this run, or already seen, checked); else None: the
        step path checks what differs against the lead's tables at that step."""
        fps: dict[RankKey, dict[int, tuple[bytes, bytes]]] = {}
        leads: dict[RankKey, dict[int, LeadStep]] = {}  # the leads' steps in this run
        grouped = [k for k in per_rank if len(getattr(self.step_groups.get((k.engine_id, k.dp)), "expected", ())) > 1]
        for key in (k for k in grouped if not self.follower(k)):
            fps[key], leads[key] = {}, {}
            for body in per_rank[key]:
                fp = fps[key][body.step] = self._fingerprints(key, body)
                leads[key][body.step] = LeadStep(*fp, True, [], [], body=body)
        for key in (k for k in grouped if self.follower(k)):
            group, in_run = self.step_groups[(key.engine_id, key.dp)], leads.get(self._lead_key(key), {})
            fps[key] = {}
            for body in per_rank[key]:
                n = body.step
                like = in_run.get(n) or group.lead_steps.get(n)
                if like is None or not like.checked:
                    return None
                fp = fps[key][n] = self._fingerprints(key, body, like)
                if fp != (like.input_fp, like.plan_fp):
                    return None
        return fps

    def finish(self) -> list[Violation]:
        """End of input: settle every step still waiting for ranks, and transfers seen from one side."""
        out: list[Violation] = []
        if self.transfer_join is not None:
            out += self.transfer_join.finish()
        out += self.settle_held()
        for group in self.step_groups.values():
            group.missing_since.clear()
        return out

    def settle_held(self) -> list[Violation]:
        """A watermark, mid-stream: settle every step still waiting for ranks, as `finish` does,
        and remember it, so that a rank's record arriving later for such a step is counted
        (unchecked, `rank_late_after_settle`), not held again for ranks that already reported."""
        out: list[Violation] = []
        for gkey, group in self.step_groups.items():
            for step in sorted(group.pending):
                self._settle(gkey, group, step, out)
                group.settled_through = max(group.settled_through, step)
        return out

    def stream_lost(self, engine_id: str, dp: int, tp: int, pp: int) -> None:
        """The rest of a rank's stream is unreadable (e.g. a truncated file): its steps from
        here on are unchecked, and its absence from them is not the rank's fault."""
        key = RankKey(engine_id, dp, tp, pp)
        slot = self.ranks.get(key)
        self._lost_steps(key, slot.last_step if slot else -1, float("inf"))

    def _lost_steps(self, key: RankKey, after: int, before: float) -> None:
        group = self.step_groups.get((key.engine_id, key.dp))
        if group is not None:
            group.lost.setdefault((key.tp, key.pp), []).append((after, before))

    @property
    def closed(self) -> bool:
        """Every rank seen said it shut down: the engine can be retired once its steps are settled."""
        return bool(self.ranks) and all(slot.closed for slot in self.ranks.values())

    @property
    def producer_dropped(self) -> int:
        return sum(s.events_dropped for s in self.ranks.values())

    @property
    def ranks_out_of_sync(self) -> int:
        return sum(not s.in_sync for s in self.ranks.values())

    # -- sequence -------------------------------------------------------------------------
    def _sequence(self, key: RankKey, event: LedgerEvent, out: list[Violation]) -> TrackedRank | None:
        seq = event.seq
        slot = self.ranks.get(key)
        if slot is None or slot.incarnation != event.incarnation:
            if slot is not None:
                self.coverage.unchecked[Unchecked.RANK_RESTARTED] += 1
                self._content_lost(key)
            slot = self.ranks[key] = TrackedRank(event.incarnation, seq + 1)
            if seq != 0:
                # Its earlier records are gone (a retention window, a consumer that started late):
                # up to its first step, its absence is not the rank's fault.
                slot.desynced = True
                slot.gap_after_step = -1
                self.coverage.unchecked[Unchecked.JOINED_MID_STREAM] += 1
            return slot
        self.coverage.checks[Check.SEQUENCE] += 1
        if seq < slot.next_seq:
            out.append(
                Violation.at(
                    ViolationKind.DUPLICATE_EVENT,
                    key,
                    None,
                    f"event seq {seq} seen again (next expected {slot.next_seq})",
                )
            )
            return None
        if seq > slot.next_seq:
            out.append(
                Violation.at(
                    ViolationKind.SEQUENCE_GAP,
                    key,
                    slot.last_step if slot.last_step >= 0 else None,
                    f"events {slot.next_seq}..{seq - 1} missing ({seq - slot.next_seq} lost); "
                    "checks of this rank wait for the next snapshot",
                )
            )
            slot.desynced = True
            slot.gap_after_step = slot.last_step
            self._content_lost(key)
            self._transfers_lost(key, slot)
        slot.next_seq = seq + 1
        return slot

    # -- bodies ------------------------------------------------------------------------------
    def _rank_info(self, key: RankKey, slot: TrackedRank, info: RankInfo, out: list[Violation]) -> None:
        regrouped = slot.info is None or slot.info.kv_groups != info.kv_groups
        layout = self._layout(key, info, out) if regrouped else None
        gkey = (key.engine_id, key.dp)
        expected = frozenset((t, p) for t in range(info.tp_size) for p in range(info.pp_size))
        group = self.step_groups.get(gkey)
        if group is None or group.expected != expected:
            self.step_groups[gkey] = StepGroup(expected)
        if self.follower(key):
            slot.state = None  # compared with the lead, never replayed
        elif regrouped:
            slot.state = None if slot.desynced else RankTables(key, info, layout)
        elif slot.state is None:  # it just became its group's lead: its tables come with a snapshot
            slot.desynced = True
        changed = slot.info is None or slot.info.capabilities != info.capabilities
        if changed and any(c.name == CONTENT_DIGESTS and not c.available for c in info.capabilities):
            self.coverage.unchecked[Unchecked.CONTENT_DIGESTS] += 1  # asked for and not taken: said once per rank
        slot.info = info
        if slot.state is not None:
            slot.state.content_voided = content_voided(info)
        slot.declared = Declared.of(info)

    def _layout(self, key: RankKey, info: RankInfo, out: list[Violation]) -> Layout:
        """A rank's layout, judged once per layout (its tables take it): groups whose blocks share bytes
        at other block ids are reported at once (no step: every grant may collide); one that did not say
        is counted."""
        layout = layout_of(info.kv_groups)
        if not layout.known:
            self.coverage.unchecked[Unchecked.LAYOUT_UNKNOWN] += 1
        for gid, meetings in sorted(layout.meetings.items()):
            for meeting in meetings:
                if meeting.group < meeting.other:
                    out.append(Violation.at(ViolationKind.LAYOUT_ALIAS, key, None, describe(meeting), group=gid))
        return layout

    def follower(self, key: RankKey) -> bool:
        """A rank compared with its group's lead rather than replayed (not the lowest TP/PP rank)."""
        group = self.step_groups.get((key.engine_id, key.dp))
        return group is not None and len(group.expected) > 1 and (key.tp, key.pp) != group.lead

    def tables_of(self, key: RankKey) -> RankTables | None:
        """The block tables a rank's steps are checked against: its own, or its group lead's."""
        slot = self.ranks.get(key)
        if slot is None or not self.follower(key):
            return slot.state if slot is not None else None
        lead = self.ranks.get(self._lead_key(key))
        return lead.state if lead is not None and not lead.desynced else None

    def _lead_key(self, key: RankKey) -> RankKey:
        return self.key_of(key.engine_id, key.dp, *self.step_groups[(key.engine_id, key.dp)].lead)

    def key_of(self, engine_id: str, dp: int, tp: int, pp: int) -> RankKey:
        """The rank's key, interned: the edges that type records for this ledger pass this to `event_of`."""
        key = self._keys.get((engine_id, dp, tp, pp))
        if key is None:
            key = self._keys[(engine_id, dp, tp, pp)] = RankKey(engine_id, dp, tp, pp)
        return key

    def _snapshot(self, key: RankKey, slot: TrackedRank, snap: Snapshot) -> None:
        if slot.info is None:
            self.coverage.unchecked[Unchecked.SNAPSHOT_WITHOUT_RANK_INFO] += 1
            return
        if self.follower(key):
            slot.desynced = False  # nothing to load: it is compared, not replayed
            return
        if slot.desynced or slot.state is None:
            if slot.state is None:
                slot.state = RankTables(key, slot.info)
                slot.state.content_voided = content_voided(slot.info)
            slot.state.load_snapshot(snap)
            slot.desynced = False
            slot.last_step = snap.step
            self.coverage.checks[Check.RESYNC] += 1

    def _step(self, key: RankKey, slot: TrackedRank, step: Step, out: list[Violation]) -> None:
        self.steps += 1
        n = step.step
        if 0 <= slot.last_step < n - 1 and not slot.desynced:
            # The rank skipped steps without losing events: it never recorded
            # them, so its tables may have missed their inputs.
            slot.desynced = True
            self.coverage.unchecked[Unchecked.STEPS_NOT_RECORDED] += n - 1 - slot.last_step
            self._content_lost(key)  # a reseal may have been among them
        elif 0 <= n <= slot.last_step and not slot.desynced:
            # A step number again or backwards (a writer's bug): which tables it meant is unknown.
            slot.desynced = True
            self.coverage.unchecked[Unchecked.STEP_NOT_AFTER_LAST] += 1
            self._content_lost(key)
        if slot.gap_after_step is not None:
            self._lost_steps(key, slot.gap_after_step, n)
            slot.gap_after_step = None
        slot.last_step = n
        if step.content is not None:
            self._check_content(key, slot, step, out)
        if self.follower(key):
            self._cross_rank(key, step, out=out)
            return
        found = len(out)
        untrusted = slot.declared is not None and slot.declared.input is not None
        checked = slot.state is not None and not slot.desynced and not untrusted
        mark = found
        if untrusted:
            self.coverage.unchecked[slot.declared.input] += 1
        elif not checked:
            self.coverage.unchecked[Unchecked.AFTER_GAP if slot.desynced else Unchecked.NO_RANK_INFO] += 1
        else:
            state = slot.state
            if step.input is not None:
                state.apply_input(n, step.input, out, self.coverage)
            mark = len(out)
            if step.plan is not None:
                self._check_plan(state, slot.declared, n, step.plan, out)
                self._note_writes(key, n, step.plan)
            elif step.kind == StepKind.REAL and step.input is not None and _has_tokens(step.input):
                self.coverage.unchecked[Unchecked.NO_PLAN] += 1
        self._cross_rank(key, step, out=out, lead=(checked, out[found:mark], out[mark:]))

    # -- content of sealed blocks ------------------------------------------------------------------
    def _content_clean(self, seen: list[tuple[RankKey, int, Step]]) -> bool:
        """Whether a run's digests hold no finding (checked before the run is applied)."""
        touched: dict[tuple[str, int], set[int]] = {}
        for key, _, body in seen:
            if body.content is not None:
                touched.setdefault((key.engine_id, key.dp), set()).update(unpack_i32(body.content.block_ids).tolist())
        trials = {gkey: (self.content.get(gkey) or ContentLedger({})).trial(blocks) for gkey, blocks in touched.items()}
        found: list[Violation] = []
        for key, _, body in seen:  # the rule itself, on copies of the references the run touches
            if body.content is not None:
                trials[(key.engine_id, key.dp)].apply(key, body.step, body.content, _nobody, found, Coverage())
                if found:
                    return False
        return True

    def _check_content(self, key: RankKey, slot: TrackedRank, step: Step, out: list[Violation]) -> None:
        """A rank's digests, against its own earlier ones (every rank: its heads or layers are its own)."""
        if slot.info is None:
            self.coverage.unchecked[Unchecked.CONTENT_WITHOUT_RANK_INFO] += len(step.content.reasons)
            return
        content = self.content.get((key.engine_id, key.dp))
        if content is None:
            sizes = {g.group_id: g.block_size for g in slot.info.kv_groups}
            content = self.content[(key.engine_id, key.dp)] = ContentLedger(sizes)
        tables = self.tables_of(key)
        holders = tables.holders_of if tables is not None else lambda block: []
        content.apply(key, step.step, step.content, holders, out, self.coverage)

    def _note_writes(self, key: RankKey, step: int, plan: StepPlan) -> None:
        """A replayed rank's plan wrote at `step`: its group's sealed blocks it touched are marked."""
        content = self.content.get((key.engine_id, key.dp))
        if content is not None:
            content.note_writes(step, plan)

    def _transfers_lost(self, key: RankKey, slot: TrackedRank) -> None:
        """Events were lost: a transfer pending then may have ended among them, and one held on would
        make the next owner of its blocks a foreign writer (or its reader early). Forgotten, counted."""
        forgotten = self.transfer_use.forget(key)
        if slot.state is not None:
            forgotten = max(forgotten, slot.state.forget_transfers())
        if forgotten:
            self.coverage.unchecked[Unchecked.TRANSFERS_FORGOTTEN] += forgotten

    def _content_lost(self, key: RankKey) -> None:
        content = self.content.get((key.engine_id, key.dp))
        if content is not None:
            content.forget_rank(key)

    def _check_plan(self, state: RankTables, declared: Declared | None, step: int, plan: StepPlan, out) -> None:
        if declared is not None:
            check_declared_plan(state, declared, step, plan, out, self.coverage)
        else:
            state.check_plan(step, plan, out, self.coverage)

    # -- cross-rank agreement ---------------------------------------------------------------------
    def _cross_rank(self, key: RankKey, step: Step, *, out: list[Violation], lead=None, fps=None) -> None:
        """Record a rank's step for the comparison of its group; `lead` (for the lead rank: whether its
        tables were in sync, and what its input and plan revealed) is what the others are matched with."""
        group = self.step_groups.get((key.engine_id, key.dp))
        if group is None or len(group.expected) < 2:
            return
        rank, n = (key.tp, key.pp), step.step
        last = group.last_step.get(rank, -1)
        group.last_step[rank] = n
        if n <= group.settled_through and n not in group.pending:
            self.coverage.unchecked[Unchecked.RANK_LATE_AFTER_SETTLE] += 1
            return
        entry = group.pending.setdefault(n, {})
        known = group.lead_steps.get(n) if lead is None else None
        input_fp, plan_fp = fps if fps is not None else self._fingerprints(key, step, known)
        if lead is not None:
            checked, found_input, found_plan = lead
            ls = LeadStep(input_fp, plan_fp, checked, found_input, found_plan, body=step)
            group.lead_steps[n] = ls
            clean = (not found_input and not found_plan) if checked else None
            early = group.early.pop(n, {})
            for other, (o_input, o_plan, _) in list(entry.items()):  # ranks whose step came first
                other_key = self.key_of(key.engine_id, key.dp, *other)
                verdict = self._match(other_key, n, ls, o_input, o_plan, early.get(other), out)
                entry[other] = (o_input, o_plan, verdict)
        else:
            ls = group.lead_steps.get(n)
            if ls is not None:
                clean = self._match(key, n, ls, input_fp, plan_fp, step.plan, out)
            else:
                clean = None
                if step.plan is not None:  # checked when the lead's step comes
                    group.early.setdefault(n, {})[rank] = step.plan
        entry[rank] = (input_fp, plan_fp, clean)
        gkey = (key.engine_id, key.dp)
        if len(entry) == len(group.expected):
            self._settle(gkey, group, n, out)
        # Steps this rank skipped, and steps a lagging rank is now too far behind on: settled for
        # good (a record arriving for one later is late, not the start of a new comparison).
        horizon = n - self.rank_window
        for t in sorted(t for t in group.pending if (last < t < n and rank not in group.pending[t]) or t < horizon):
            self._settle(gkey, group, t, out)
            if t < horizon:
                group.settled_through = max(group.settled_through, t)
        # The rank reported again: a run of steps it missed ends here (the skipped ones, settled
        # above, belong to it).
        if rank in group.missing_since and n > last:
            del group.missing_since[rank]

    def _fingerprints(self, key: RankKey, step: Step, like: LeadStep | None = None) -> tuple[bytes, bytes]:
        """Fingerprints of a rank's step input and plan; `like`'s where the step equals its lead's
        (compared as bytes: much cheaper than hashing them again)."""
        same = like is not None and like.body is not None
        inp, plan = step.input, step.plan
        input_fp = like.input_fp if same and inp == like.body.input else input_fingerprint(inp)
        declared = self.ranks[key].declared
        if declared is not None and declared.rank_plans and plan is not None:
            self.coverage.unchecked[declared.rank_plans] += 1
            return input_fp, b""  # each rank's plan is its own share: inputs still compared
        return input_fp, like.plan_fp if same and plan == like.body.plan else plan_fingerprint(plan)

    def _match(self, key: RankKey, n: int, ls: LeadStep, input_fp, plan_fp, plan, out) -> bool | None:
        """A rank's step against its lead's: the lead's findings where they agree, its own plan checked
        against the lead's tables where they differ (while those are at that step), else unverified.
        Whether the rank's checks passed; None when they could not run."""
        found: list[Violation] = []
        if input_fp == ls.input_fp:
            found += rekeyed(ls.found_input, key)
        declared = self.ranks[key].declared
        own_share = declared is not None and declared.rank_plans is not None
        if plan_fp == ls.plan_fp and not own_share:
            found += rekeyed(ls.found_plan, key)
            verified = ls.checked
        elif plan is None:
            verified = plan_fp == ls.plan_fp and ls.checked
        else:
            lead = self.ranks.get(self._lead_key(key))
            verified = lead is not None and lead.state is not None and not lead.desynced and lead.last_step == n
            if verified:
                own: list[Violation] = []
                self._check_plan(lead.state, declared, n, plan, own)
                found += rekeyed(own, key)
            else:
                self.coverage.unchecked[Unchecked.RANK_PLAN_UNVERIFIED] += 1
        out += found
        if found:
            return False
        return True if verified else None

    def _settle(self, gkey, group: StepGroup, step: int, out: list[Violation]) -> None:
        entry = group.pending.pop(step)
        group.lead_steps.pop(step, None)
        unmatched = group.early.pop(step, None)  # the lead never reported the step: plans not checked
        if unmatched:
            self.coverage.unchecked[Unchecked.RANK_PLAN_UNVERIFIED] += len(unmatched)
        engine_id, dp = gkey
        self.coverage.checks[Check.RANK_COMPARE] += 1
        for rank in sorted(group.expected - entry.keys()):
            if any(after < step < before for after, before in group.lost.get(rank, ())):
                self.coverage.unchecked[Unchecked.RANK_RECORDS_LOST] += 1
                continue
            slot = self.ranks.get(self.key_of(engine_id, dp, *rank))
            if slot is not None and slot.closed_step is not None and slot.closed_step < step:
                # It said it shut down first (a shutdown reaches the ranks one by one, and the group's
                # last step can be an empty one that only tells the workers what finished).
                self.coverage.unchecked[Unchecked.RANK_CLOSED_BEFORE_STEP] += 1
                continue
            self.coverage.unchecked[Unchecked.RANK_MISSING_STEPS] += 1
            if group.missing_since.get(rank) is None:
                group.missing_since[rank] = step
                detail = f"rank never reported step {step}, which {len(entry)} other rank(s) did"
                out.append(Violation.at(ViolationKind.RANK_MISSING, RankKey(engine_id, dp, *rank), step, detail))
        for part, what in ((0, "step input"), (1, "step plan")):
            holders: dict[bytes, list[tuple[int, int]]] = {}
            for rank in sorted(entry):
                holders.setdefault(entry[rank][part], []).append(rank)
            if len(holders) < 2:
                continue
            # The majority is right; on a tie, the ranks none of whose checks failed,
            # then the lowest rank (max keeps the first best).
            majority = max(
                holders.values(), key=lambda ranks: (len(ranks), sum(entry[r][2] is not False for r in ranks))
            )
            ref = majority[0]
            for value_ranks in holders.values():
                if value_ranks is majority:
                    continue
                for rank in value_ranks:
                    detail = (
                        f"{what} differs from tp{ref[0]}-pp{ref[1]}'s "
                        f"({len(majority)} of {len(entry)} ranks agree on it)"
                    )
                    out.append(Violation.at(ViolationKind.RANK_DIVERGENCE, RankKey(engine_id, dp, *rank), step, detail))


_TRANSFER_BODIES = (Step, ConnectorEvent, RankInfo)


def _nobody(block: int) -> list[str]:
    return []


def _has_tokens(inp: StepInput) -> bool:
    return bool(inp.new_reqs) or len(inp.cached_req_indices) > 0
