"""Ledger records, defined once: the typed form of `avro/ledger_event.avsc`.

Writers build these (the probes, through `kvledger.producer.records`) and `to_datum` turns one into
what the Avro encoder takes; readers get them back from a decoded record with `event_of` and nothing
else touches the record's dicts. The `.avsc` stays the published contract, documented field by field;
`tests/unit/test_events.py` holds the two equal, field for field, in order, with their types.

Packed columns stay `bytes` (little-endian integer arrays, `kvledger.schemas.packing`): ranks are
matched by comparing and hashing a step's columns as bytes, and the batched core joins a run's
columns before one unpack, so unpacking them at decode would only be undone.

A field the schema gives a default has that default here only where a record built in process may
leave it out (the in-engine check reads records before they are encoded), as an Avro reader fills it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import msgspec

from kvledger.schemas.kinds import (
    ConnectorKind,
    DigestReason,
    KvGroupKind,
    PdRole,
    Runner,
    StepKind,
    ViolationKind,
    connector_kind,
    connector_wire,
)
from kvledger.schemas.ranks import engine_rank_label, rank_label

Record = dict[str, Any]


class Typed(msgspec.Struct, gc=False):
    """Every record of the contract: plain data (bytes, numbers, strings, lists of records), never a
    cycle, so the garbage collector need not track them (a step's records are built by the thousand)."""


class RankKey(NamedTuple):
    """One rank of one engine. A tuple: it keys most of the core's dicts, hashed several times per
    event, and a tuple hashes in C."""

    engine_id: str
    dp: int
    tp: int
    pp: int

    @property
    def label(self) -> str:
        """The rank within its engine: dp0-tp1-pp0."""
        return rank_label(self.dp, self.tp, self.pp)

    def __str__(self) -> str:
        return f"{self.engine_id}/{self.label}"


# -- RankInfo -------------------------------------------------------------------------------------
class KvPlacement(Typed):
    """Where a run of a group's layers keeps its blocks in a raw KV allocation, as the kernels address them:
    layer l's page of block b starts at `offset + l * layer_stride + b * block_stride` bytes into `tensor`."""

    tensor: int  # which raw allocation of the rank (0, 1, ...: allocations of one rank, never across ranks)
    offset: int  # bytes from the allocation's start to the first layer's page of block 0
    layer_stride: int  # bytes between the pages of consecutive layers of one block
    block_stride: int  # bytes between the pages of consecutive blocks of one layer
    layers: int  # how many layers the run holds
    page_bytes: int  # bytes of one layer's page of one block


class KvGroup(Typed):
    """One KV cache group: layers sharing one block table."""

    group_id: int  # index of the group in the engine's KV cache config
    kind: KvGroupKind  # how its layers address their blocks
    block_size: int  # tokens per block
    num_blocks: int  # pool size: valid ids are 0 .. num_blocks-1, 0 the null block
    sliding_window: int | None = None  # window in tokens of a SLIDING_WINDOW group
    # Where the group's layers keep their blocks (None: not recorded, an older writer or a runner whose
    # allocation the probe cannot read): groups overlaying one allocation must map a block id to the
    # same bytes, or blocks of one group overwrite another's.
    layout: list[KvPlacement] | None = None


class Capability(Typed):
    """A probe that attached or not, or a configuration the checks do not model (kinds.Declaration)."""

    name: str
    available: bool
    reason: str | None = None  # why it is unavailable


class RankInfo(Typed):
    """A rank's identity and KV cache layout: first event of every incarnation, and before each snapshot."""

    dp_size: int
    tp_size: int
    pp_size: int
    pd_role: PdRole  # its role in a prefill/decode pair
    vllm_version: str
    runner: Runner  # the model runner the probes attached to (an Avro string)
    kv_groups: list[KvGroup]  # indexed by group_id
    capabilities: list[Capability]
    full_rows: bool = False  # plans carry full block-table rows
    snapshot_interval: int = 0  # steps between the rank's snapshots; 0: none


# -- Step -----------------------------------------------------------------------------------------
class NewRequest(Typed):
    """A request the worker sees for the first time (or again after it was finished)."""

    req_index: int  # rank-local dense index, used by every packed column
    req_id: str
    block_ids: list[bytes]  # per group: packed int32
    num_computed_tokens: int  # prefix-cache hits, received KV
    num_prompt_tokens: int
    num_scheduled_tokens: int
    # Per group: packed uint64 prefix chain of each full prompt block (packing.prefix_chain); b"" for
    # a group without slots; None when not recorded (prompt embeddings, older producers).
    prefix_chains: list[bytes] | None = None


class StepInput(Typed):
    """The scheduler output as the worker received it; columns aligned as the contract says."""

    new_reqs: list[NewRequest]
    cached_req_indices: bytes  # packed int32 req_index values
    cached_num_computed_tokens: bytes  # packed int32, aligned with cached_req_indices
    cached_num_scheduled_tokens: bytes  # packed int32, aligned with cached_req_indices
    resumed_req_indices: bytes  # packed int32: their new blocks replace the row
    append_req_indices: bytes  # appends, one entry per (request, group): packed int32
    append_group_ids: bytes  # packed int32, aligned with append_req_indices
    append_counts: bytes  # packed int32, aligned with append_req_indices
    append_block_ids: bytes  # packed int32, every entry's blocks in entry order
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    block_ids_to_zero: bytes  # packed int32
    block_copies: bytes  # packed int32 (src, dst) pairs
    # Earlier steps dispatched whose output the engine core had not processed when it scheduled this
    # one (its batch queue: async scheduling or pipeline parallel); None: not said (a synchronous
    # engine core, an older producer).
    in_flight_steps: int | None = None


class GroupPlan(Typed):
    """What attention wrote and read in one KV cache group."""

    group_id: int
    slot_runs: bytes  # packed int64 (start, length) runs of the slot mapping; start -1: padding
    num_real: int  # slot-mapping entries of scheduled tokens
    num_padding: int  # entries after them
    row_lens: bytes  # packed int32 per request (req_indices order): the row attention reads, in blocks
    row_digests: bytes  # packed uint32 per request: digest of that row
    rows: bytes | None = None  # packed int32 rows themselves, when full rows were asked for


class DraftPass(Typed):
    """One forward pass of a drafter that writes KV in a target group."""

    group_id: int
    pass_index: int  # 0: over the target's tokens; k > 0: the k-th autoregressive pass
    num_tokens: bytes  # packed int32 per request of the plan
    first_positions: bytes  # packed int32, aligned with num_tokens
    slot_runs: bytes  # as GroupPlan.slot_runs
    num_real: int
    num_padding: int


class StepPlan(Typed):
    """The address plan the runner executed (read from its metadata, never recomputed)."""

    req_indices: bytes  # packed int32 req_index values, in slot-mapping order
    num_tokens: bytes  # packed int32 query tokens per request
    first_positions: bytes  # packed int32 position of each request's first query token
    groups: list[GroupPlan]
    draft_writes: list[DraftPass] | None = None  # None: no drafter KV recorded


class BlockDigests(Typed):
    """Content digests of sealed blocks, taken at a step before its forward pass wrote anything."""

    group_ids: bytes  # packed int32
    block_ids: bytes  # packed int32, aligned with group_ids
    digests: bytes  # packed uint64, aligned with group_ids
    reasons: list[DigestReason]  # aligned with group_ids; a newer writer's reason reads as OTHER


class Step(Typed):
    """One step of one rank: the scheduler's input and the runner's plan."""

    step: int  # rank-local counter, aligned across the ranks of an engine
    kind: StepKind  # why the model runner ran
    input: StepInput | None = None  # None: a run without a scheduler output
    plan: StepPlan | None = None  # None: no plan built, or the plan probe is unavailable
    content: BlockDigests | None = None  # None: no sealed block digested at this step


# -- the other bodies -----------------------------------------------------------------------------
class TransferPrefix(Typed):
    """What a side's request of a transfer was computed from (prefill) or reads it as (decode)."""

    block_sizes: list[int]  # per group: the block size its chain is taken at (0: a group without slots)
    chains: list[bytes]  # per group: the request's prefix chain (NewRequest.prefix_chains)


class ConnectorEvent(Typed):
    """A KV connector observation (a disaggregated prefill/decode transfer)."""

    step: int
    connector: str  # connector class, e.g. 'MooncakeConnector'
    kind: ConnectorKind  # SEND_CANCELLED and RECV_RELEASED are written as OTHER named by `detail`
    req_id: str | None = None
    transfer_id: str | None = None  # shared by both engines of a pair
    remote_engine_id: str | None = None
    block_ids: list[bytes] = []  # per group: packed int32 local blocks
    num_tokens: int | None = None
    digest: bytes | None = None  # of the transferred blocks' bytes, when sampled
    detail: str | None = None  # the connector's free text (never read by a check)
    prefix: TransferPrefix | None = None  # on SEND_PREFIX / RECV_PREFIX only (the ledger derives them)

    def __post_init__(self) -> None:
        # As read: an OTHER that names one of the kinds the Avro enum has no symbol for is that kind.
        if self.kind is ConnectorKind.OTHER:
            self.kind = connector_kind(self.kind, self.detail)


class SnapshotRequest(Typed):
    """A live request as a snapshot holds it."""

    req_index: int
    req_id: str
    num_computed_tokens: int  # after the snapshot's step
    block_ids: list[bytes]  # per group: packed int32 row


class Snapshot(Typed):
    """A rank's full state after a step: a reader that lost events resyncs here."""

    step: int
    requests: list[SnapshotRequest]


class Health(Typed):
    """The probe's own accounting, now and then and at shutdown."""

    step: int  # last step captured when emitted
    events_captured: int  # cumulative over the incarnation
    events_dropped: int  # cumulative: buffer full or sink failed
    probe_ns: int  # time in probes on the engine's hot path, cumulative
    buffer_capacity: int
    buffer_high_water: int
    closing: bool = False  # the rank's last event: its worker shut down


Body = RankInfo | Step | ConnectorEvent | Snapshot | Health
# The body union's branches in the schema's order, by the names a decoder returns.
BODIES: tuple[type[Body], ...] = (RankInfo, Step, ConnectorEvent, Snapshot, Health)
BODY_NAMES: dict[type, str] = {cls: f"kvledger.{cls.__name__}" for cls in BODIES}
BODY_TYPES: dict[str, type] = {name: cls for cls, name in BODY_NAMES.items()}


class LedgerEvent(Typed):
    """One record of the ledger: what one engine rank observed."""

    rank: RankKey  # engine id and DP/TP/PP ranks
    incarnation: int  # the worker process run; a new one restarts seq and the rank's state
    seq: int  # per rank and incarnation, every captured event (a jump is a gap)
    emitted_at_us: int  # capture time: informational, no check reads it
    body: Body

    @property
    def engine_id(self) -> str:
        return self.rank.engine_id


# -- what the ledger reports (`avro/violation.avsc`) ---------------------------------------------------
class Violation(Typed, frozen=True):
    """A mismatch the ledger found, as the violations topic and `kvledger check --format json` carry it."""

    kind: ViolationKind  # what went wrong; a kind newer than this reader reads as OTHER
    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    step: int | None  # the rank's step, when tied to one
    req_id: str | None  # the request, when tied to one
    group: int | None  # the KV cache group, when tied to one
    detail: str  # what was expected and what was found

    @classmethod
    def at(cls, kind: ViolationKind, rank: RankKey, step: int | None, detail: str, *, req_id=None, group=None):
        return cls(kind, rank.engine_id, rank.dp, rank.tp, rank.pp, step, req_id, group, detail)

    @classmethod
    def of(cls, record: Record) -> Violation:
        """A decoded `kvledger.Violation` record."""
        return typed(cls, record)

    @property
    def rank(self) -> str:
        """Its engine and rank: `ENGINE dp0-tp1-pp0`."""
        return engine_rank_label(self.engine_id, self.dp_rank, self.tp_rank, self.pp_rank)

    def where(self) -> str:
        """Where it is, as a rank's `log` and `raise` actions report it."""
        return f"{self.kind} at step {self.step}, req {self.req_id}, group {self.group}"

    def to_record(self) -> Record:
        """As the Avro `kvledger.Violation` record (and the JSON line, minus 'type')."""
        return to_record(self)


# -- decoding -------------------------------------------------------------------------------------
def typed(cls: type, record: Record) -> Any:
    """A decoded record (or one built in process) as its typed form; a malformed one raises ValueError."""
    try:
        return msgspec.convert(record, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"a malformed {cls.__name__}: {exc}") from exc


KeyOf = Callable[[str, int, int, int], RankKey]


def body_of(name: str, body: Record) -> Body:
    """A decoded body, named by its union branch, typed."""
    cls = BODY_TYPES.get(name)
    if cls is None:
        raise ValueError(f"a ledger event with a body of unknown kind {name!r}")
    return typed(cls, body)


def event_of(record: Record, key_of: KeyOf = RankKey) -> LedgerEvent:
    """The typed event of a decoded record (`key_of` may intern the rank keys)."""
    body = body_of(*record["body"])
    rank = key_of(record["engine_id"], record["dp_rank"], record["tp_rank"], record["pp_rank"])
    return LedgerEvent(rank, record["incarnation"], record["seq"], record["emitted_at_us"], body)


def events_of(records: Iterable[Record], key_of: KeyOf = RankKey) -> Iterator[LedgerEvent]:
    """Decoded records typed one by one, as they are read."""
    return (event_of(record, key_of) for record in records)


# -- encoding -------------------------------------------------------------------------------------
def to_record(value: msgspec.Struct) -> Record:
    """A typed record as the Avro writer takes it (enums as their symbols, packed columns as bytes)."""
    return msgspec.to_builtins(value, builtin_types=(bytes,))


_asdict = msgspec.structs.asdict  # one level, in C


def _step_record(step: Step) -> Record:
    """A Step as the Avro writer takes it, one level at a time (a recorder writes one a step: `to_record`'s
    generic walk costs it several microseconds more). Enums as their symbols, as `to_record` writes them."""
    out = _asdict(step)
    out["kind"] = step.kind.value
    inp, plan, content = step.input, step.plan, step.content
    if inp is not None:
        out["input"] = record = _asdict(inp)
        record["new_reqs"] = [_asdict(r) for r in inp.new_reqs]
    if plan is not None:
        out["plan"] = record = _asdict(plan)
        record["groups"] = [_asdict(g) for g in plan.groups]
        if plan.draft_writes is not None:
            record["draft_writes"] = [_asdict(d) for d in plan.draft_writes]
    if content is not None:
        out["content"] = record = _asdict(content)
        record["reasons"] = [r.value for r in content.reasons]
    return out


def body_record(body: Body) -> Record:
    """A body as the Avro writer takes it: a connector kind without a symbol is written as OTHER
    named by its detail."""
    if isinstance(body, Step):
        return _step_record(body)
    out = to_record(body)
    if isinstance(body, ConnectorEvent):
        out["kind"], out["detail"] = connector_wire(body.kind, body.detail)
    return out


def envelope_record(
    engine_id: str, dp: int, tp: int, pp: int, incarnation: int, seq: int, emitted_at_us: int, body: Body
) -> Record:
    """A LedgerEvent as the Avro writer takes it, from its fields (`avro_datum` names its branches)."""
    return {
        "engine_id": engine_id,
        "dp_rank": dp,
        "tp_rank": tp,
        "pp_rank": pp,
        "incarnation": incarnation,
        "seq": seq,
        "emitted_at_us": emitted_at_us,
        "body": (BODY_NAMES[type(body)], body_record(body)),
    }


def event_record(event: LedgerEvent) -> Record:
    """A typed event as the Avro writer takes it (a stream worker forwards some of what it read)."""
    return envelope_record(*event.rank, event.incarnation, event.seq, event.emitted_at_us, event.body)


# A Step's optional parts, by the names of their union branches.
_BRANCHES = (("input", "kvledger.StepInput"), ("plan", "kvledger.StepPlan"), ("content", "kvledger.BlockDigests"))
_STEP = BODY_NAMES[Step]


def avro_datum(event: Record) -> Record:
    """`event` as the Avro writer takes it fastest, written to the same bytes: a Step's optional parts
    name their union's branch (fastavro's tuple notation), so none is validated against each branch
    to find it (a third of a decode step's encoding). The event itself is left as it is."""
    name, body = event["body"]
    if name != _STEP:
        return event
    named = dict(body)
    for field, branch in _BRANCHES:
        if body[field] is not None:
            named[field] = (branch, body[field])
    plan = body["plan"]
    if plan is not None and plan["draft_writes"] is not None:
        named["plan"] = ("kvledger.StepPlan", {**plan, "draft_writes": ("array", plan["draft_writes"])})
    return {**event, "body": (name, named)}
