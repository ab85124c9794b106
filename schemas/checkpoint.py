"""Checkpoint records, defined once: the typed form of `avro/checkpoint.avsc`.

A stream worker's state goes to its changelog topics as one of these bodies and comes back as one:
`encode` is the only writer of a checkpoint and `decode` the only reader, so the ledger core builds
and reads typed records and never the Avro dicts. The `.avsc` stays the published contract,
documented field by field; `tests/unit/test_checkpoint_model.py` holds the two equal, field for
field, in order, with their types and defaults.

The records the ledger's own events carry (`RankInfo`, `StepPlan`, `Violation`) are those of
`kvledger.schemas.events`: a checkpoint names them, as the schema does. Packed columns stay `bytes`
(the core unpacks them as it rebuilds its arrays). Enums the schema keeps as strings (a transfer
side's role and outcome, a connector kind seen) are the contract's enums here: an unknown symbol is
refused when the checkpoint is read, never guessed. Every default of the schema is the model's, so a
record built in process and one read back are equal.
"""

from __future__ import annotations

import msgspec

from kvledger.schemas.codec import SingleObjectCodec
from kvledger.schemas.events import RankInfo, RankKey, StepPlan, Typed, Violation, to_record, typed
from kvledger.schemas.kinds import ConnectorKind, TransferOutcome, TransferRole
from kvledger.schemas.registry import CHECKPOINT


# -- shared pieces --------------------------------------------------------------------------------
class IssuedCount(Typed):
    """A violation id issued: its content's digest and how often it was issued."""

    digest: str  # digest of the violation's content
    count: int  # how many identical violations were issued


class Coverage(Typed):
    """Checks run and checks that could not run (the core's Coverage)."""

    checks: dict[str, int]  # checks run, by check name
    unchecked: dict[str, int]  # checks that could not run, by reason


class Rank(Typed):
    """One rank of one engine (a RankKey, as a record)."""

    engine_id: str
    dp: int  # data-parallel rank
    tp: int  # tensor-parallel rank
    pp: int  # pipeline-parallel rank

    @classmethod
    def of(cls, key: RankKey) -> Rank:
        return cls(engine_id=key.engine_id, dp=key.dp, tp=key.tp, pp=key.pp)

    @property
    def key(self) -> RankKey:
        return RankKey(self.engine_id, self.dp, self.tp, self.pp)


# -- an engine's ledger: its ranks' tables ---------------------------------------------------------
class LiveRequests(Typed):
    """A rank's live requests, as columns aligned with req_ids."""

    req_ids: list[str]  # the scheduler's request ids
    req_indices: bytes  # packed int32: each request's index in the rank's step records
    rows: bytes  # packed int32: each request's row in the tables
    num_computed_tokens: bytes  # packed int32: computed tokens at the rank's latest step
    num_scheduled_tokens: bytes  # packed int32: tokens scheduled at the rank's latest step


class GroupRows(Typed):
    """One KV cache group's rows."""

    lens: bytes  # packed int32: blocks in each row, rows 0 .. num_rows-1
    released: bytes  # packed int32: leading positions of each row the scheduler freed
    blocks: bytes  # the rows' block ids, row after row, `id_bytes` little-endian bytes each
    id_bytes: int  # 1 to 4: unsigned, the fewest that hold the largest id; 8: signed 64-bit


class Reuse(Typed):
    """A block of a pending send handed to another request."""

    step: int  # step of the grant
    group: int  # KV cache group
    req_id: str  # the request the block went to
    block: int


class PendingSend(Typed):
    """A pending transfer's blocks (a send's, or a receive's)."""

    transfer_id: str  # the connector's transfer id
    block_ids: list[bytes]  # per group: packed int32
    req_id: str | None = None  # the request transferred, when the connector named it
    intent_step: int = -1  # step of the intent (-1: not known)
    reused: Reuse | None = None  # a send's first block handed to another request to write meanwhile


class Table(Typed, kw_only=True):  # keyword-only: defaulted fields come among the others
    """A rank's block tables."""

    same_as: int | None = None  # index in `ranks` of an earlier rank with identical tables: the rest is empty
    requests: LiveRequests  # live requests, as columns
    num_rows: int  # rows in use or free
    free_rows: bytes  # packed int32: free rows, in reuse order
    groups: list[GroupRows]  # per KV cache group, in group order
    pending_sends: list[PendingSend]  # sends that still read blocks
    # Receives that still write blocks (empty in checkpoints from before receives held their blocks).
    pending_recvs: list[PendingSend] = msgspec.field(default_factory=list)


class RankSlot(Typed, kw_only=True):  # keyword-only: defaulted fields come among the others
    """One rank stream of the engine: its sequence and its tables."""

    rank: Rank
    incarnation: int  # the rank's worker process run (the envelope's incarnation)
    next_seq: int  # the sequence number expected next
    info: RankInfo | None = None  # the rank's last RankInfo
    desynced: bool  # events were lost: checks wait for a snapshot
    last_step: int  # the rank's latest step; -1 before its first
    events_dropped: int  # events its probes dropped (its latest Health)
    gap_after_step: int | None = None  # last step seen before a sequence gap, until the rank's next step
    closed: bool = False  # the rank said it shut down (written for readers: follows from closed_step)
    closed_step: int | None = None  # the step its closing Health named; None while it runs
    table: Table | None = None  # None before its RankInfo, while desynced, or for a group's non-lead rank


# -- an engine's ledger: the ranks that must agree ---------------------------------------------------
class RankStep(Typed):
    """A (tp, pp) rank and a step."""

    tp: int
    pp: int
    step: int  # -1 where unused


class RankReport(Typed):
    """What one rank said of a pending step."""

    tp: int
    pp: int
    input_fingerprint: bytes  # of the rank's step input (empty: none)
    plan_fingerprint: bytes  # of the rank's step plan (empty: none, or not compared)
    clean: bool  # the rank's own checks passed


class PendingStep(Typed):
    """A step some ranks of the group reported and others have not yet."""

    step: int
    reports: list[RankReport]  # one per rank that reported it


class LostSteps(Typed):
    """Steps a rank's records were lost for, exclusive."""

    tp: int
    pp: int
    after: int  # last step before the loss
    before: int | None  # None: to the end of the stream


class LeadStep(Typed):
    """A pending step as the group's lead (its lowest TP/PP rank) saw it."""

    step: int
    input_fingerprint: bytes  # of the lead's step input
    plan_fingerprint: bytes  # of the lead's step plan
    checked: bool  # the lead's tables were in sync: its findings are complete
    found_input: list[Violation]  # what the step's input revealed
    found_plan: list[Violation]  # what its plan revealed


class EarlyPlan(Typed):
    """A plan of another rank that came before the lead's step: checked when it comes."""

    step: int
    tp: int
    pp: int
    plan: StepPlan  # the rank's step plan


class StepGroup(Typed):
    """The ranks of one DP rank of the engine that get the same scheduler output."""

    dp: int  # data-parallel rank of the group
    expected: list[RankStep]  # the ranks (step unused)
    pending: list[PendingStep]  # steps some rank reported and others have not yet
    last_step: list[RankStep]  # each rank's latest step
    missing_since: list[RankStep]  # ranks in an open run of missed steps, and its first step
    lost: list[LostSteps]
    settled_through: int  # a watermark settled every step up to here; -1 before any
    lead_steps: list[LeadStep] = msgspec.field(default_factory=list)  # pending steps as the lead saw them
    early: list[EarlyPlan] = msgspec.field(default_factory=list)  # other ranks' plans that came before the lead's step


# -- an engine's ledger: its ranks' own transfers --------------------------------------------------
class PendingRecv(Typed):
    """A receive (decode side) a request waits for."""

    req_id: str  # the request waiting
    transfer_id: str
    intent_step: int  # step of the receive's intent
    blocks: list[bytes]  # per group: packed int32
    done_step: int | None  # step it completed; None while open
    failed_step: int | None  # step it failed; None unless it did


class RankTransfers(Typed):
    """A rank's own pending receives, which its requests wait for."""

    rank: Rank
    block_sizes: list[int]  # block size of each KV cache group
    recvs: list[PendingRecv]  # by request (the blocks pending transfers hold are the tables')


class EngineCheckpoint(Typed, kw_only=True):  # keyword-only: defaulted fields come among the others
    """One engine's ledger, the offsets it covers and the violation ids it issued."""

    engine_id: str  # the engine (the key of its events)
    next_offset: int  # first offset of the engine's partition not yet applied
    partition: int | None = None  # the events partition its records come from (None in older checkpoints)
    issued: list[IssuedCount]  # violation ids issued so far (the most recent, bounded)
    events: int  # events applied
    steps: int  # step events applied
    coverage: Coverage
    rank_window: int  # steps a rank may lag behind its peers before it is missing
    ranks: list[RankSlot]  # one per rank stream
    step_groups: list[StepGroup]  # per DP rank: the ranks that must agree, and the steps waiting
    transfer_use: list[RankTransfers]  # per rank: its own pending transfers


# -- the transfer join -----------------------------------------------------------------------------
class SeenEvent(Typed):
    """A connector event a side applied (a repeat is skipped)."""

    kind: ConnectorKind  # an Avro string
    step: int


class Side(Typed):
    """One rank's view of a transfer."""

    rank: Rank
    role: TransferRole  # an Avro string: send | recv
    req_id: str | None  # its request, when known
    first_step: int  # step of the first event seen
    intent_step: int | None  # step of its intent; None before it
    blocks: list[bytes] | None  # per group: packed int32
    num_tokens: int | None  # tokens transferred, when the side knows
    remote_engine_id: str | None  # the peer engine, when named
    outcome: TransferOutcome | None  # an Avro string; None while open
    done_step: int | None  # step of its outcome
    digest: bytes | None  # transfer digest (core/transfers.py layout), when recorded
    stuck: bool  # reported stuck
    open_counted: bool  # counted open at the end of input
    peer_clock: int | None  # the peers' clock when the side was first seen
    seen: list[SeenEvent]  # events applied
    # The prefix its request was computed from (send) or reads the KV as (recv): per group, the block
    # size and the packed uint64 chain (None: not stated yet); the step it was stated at.
    prefix_block_sizes: list[int] | None = None
    prefix_chains: list[bytes] | None = None
    prefix_step: int | None = None


class Transfer(Typed):
    """A transfer not yet retired."""

    transfer_id: str
    sides: list[Side]  # each rank's view
    joined: bool  # both roles seen
    shape_checked: bool  # block counts compared
    compared: list[Rank]  # receiving ranks whose digest was compared
    orphan_settled: bool  # reported (or counted) as an orphan
    retiring: bool  # closed: its state is dropped at a deadline
    prefix_checked: bool = False  # the sides' prefixes compared


class RankClock(Typed):
    """A rank's step: the join's clock."""

    rank: Rank
    step: int


class Due(Typed):
    """A deadline."""

    step: int  # the deadline step
    transfer_id: str
    what: str  # send, recv (a side's deadline), retire or forget


class RankDue(Typed):
    """A rank's deadline heap."""

    rank: Rank  # the rank whose clock the deadlines count
    entries: list[Due]  # in heap order


class JoinCheckpoint(Typed):
    """The transfer join of one partition of the transfer-keyed topic."""

    partition: int  # partition of the transfer-keyed topic
    next_offset: int  # first offset of the partition not yet applied
    issued: list[IssuedCount]  # violation ids issued so far (the most recent, bounded)
    deadline_steps: int  # rank steps after its intent a transfer still open is stuck
    coverage: Coverage
    transfers: list[Transfer]  # not yet retired
    clock: list[RankClock]  # each rank's step
    engine_clock: dict[str, int]  # each engine's highest step of any rank
    pulled_from: dict[str, list[str]]  # prefill engine -> decode engines that pulled from it
    retired: list[str]  # transfers whose state was dropped (late repeats are not new transfers)
    due: list[RankDue]  # per rank, its deadline heap


Body = EngineCheckpoint | JoinCheckpoint
# The body union's branches in the schema's order, by the names a decoder returns.
BODIES: tuple[type[Body], ...] = (EngineCheckpoint, JoinCheckpoint)
BODY_NAMES: dict[type, str] = {cls: f"kvledger.checkpoint.{cls.__name__}" for cls in BODIES}
BODY_TYPES: dict[str, type] = {name: cls for cls, name in BODY_NAMES.items()}


# -- the one encoder and the one decoder -----------------------------------------------------------
_CODEC = SingleObjectCodec(CHECKPOINT)


def encode(body: Body) -> bytes:
    """A checkpoint: a `kvledger.checkpoint.Checkpoint` record, Avro single-object encoded."""
    return _CODEC.encode({"body": (BODY_NAMES[type(body)], to_record(body))})


def decode(blob: bytes) -> Body:
    """The typed body of a checkpoint. DecodeError: not a checkpoint record (or one of a writer schema
    this reader was not given); ValueError: a record that does not fit the model."""
    name, body = _CODEC.decode(blob)["body"]
    cls = BODY_TYPES.get(name)
    if cls is None:
        raise ValueError(f"a checkpoint of unknown kind {name!r}")
    return typed(cls, body)
