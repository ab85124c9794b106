"""Ledger events as the core reads them: decoded once, at its edge, into typed records.

An Avro decoder (fastavro) hands out dicts; `event_of` turns one into a
`LedgerEvent` whose body is one class per kind of observation, as vLLM's
`SchedulerOutput` is a handful of small dataclasses. The field names and
meanings are the contract's (schemas/avro/ledger_event.avsc, where each field
is documented at length); enum fields become `StrEnum`s, which still compare
equal to the symbols a checkpoint or a test writes.

A field the schema gives a default may be missing from a record built in
process (the in-engine check reads records before they are encoded): it takes
that default here, as an Avro reader would fill it in.

Packed columns stay `bytes` (little-endian integer arrays, unpacked where they
are used, by schemas/packing.py): ranks are matched by comparing and hashing a
step's columns as bytes, and the batched path joins a run's columns before one
unpack (core/batch.py), so unpacking them here would only be undone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvledger.schemas.kinds import (
    ConnectorKind,
    DigestReason,
    KvGroupKind,
    PdRole,
    Runner,
    StepKind,
    connector_kind,
    read,
    runner,
    symbols,
)
from kvledger.schemas.registry import CONNECTOR_EVENT, HEALTH, RANK_INFO, SNAPSHOT, STEP
from kvledger.stream_app.core.violations import RankKey

Record = dict[str, Any]


_PD_ROLES = symbols(PdRole)
_GROUP_KINDS = symbols(KvGroupKind)
_STEP_KINDS = symbols(StepKind)


# -- RankInfo -------------------------------------------------------------------------------------
@dataclass(slots=True)
class KvGroup:
    group_id: int  # index of the group in the engine's KV cache config
    kind: KvGroupKind
    block_size: int  # tokens per block
    num_blocks: int  # pool size: valid ids are 0 .. num_blocks-1, 0 the null block
    sliding_window: int | None  # window in tokens of a SLIDING_WINDOW group


@dataclass(slots=True)
class Capability:
    name: str  # a probe, or a configuration the checks do not model (schemas.kinds.Declaration)
    available: bool
    reason: str | None  # why it is unavailable


@dataclass(slots=True)
class RankInfo:
    """A rank's identity and KV cache layout: first event of every incarnation, and before each snapshot."""

    dp_size: int
    tp_size: int
    pp_size: int
    pd_role: PdRole
    vllm_version: str
    runner: Runner
    kv_groups: list[KvGroup]  # indexed by group_id
    capabilities: list[Capability]
    full_rows: bool  # plans carry full block-table rows
    snapshot_interval: int  # steps between the rank's snapshots; 0: none

    @classmethod
    def of(cls, d: Record) -> RankInfo:
        return cls(
            d["dp_size"],
            d["tp_size"],
            d["pp_size"],
            _PD_ROLES[d["pd_role"]],
            d["vllm_version"],
            runner(d["runner"]),
            list(map(_kv_group, d["kv_groups"])),
            [Capability(c["name"], c["available"], c.get("reason")) for c in d["capabilities"]],
            d.get("full_rows", False),
            d.get("snapshot_interval", 0),
        )

    def to_record(self) -> Record:
        """The Avro record (a checkpoint keeps the RankInfo of every rank)."""
        return _fields(self) | {
            "pd_role": str(self.pd_role),
            "runner": str(self.runner),
            "kv_groups": [_fields(g) | {"kind": str(g.kind)} for g in self.kv_groups],
            "capabilities": [_fields(c) for c in self.capabilities],
        }


# -- Step -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class NewRequest:
    req_index: int  # rank-local dense index, used by every packed column
    req_id: str
    block_ids: list[bytes]  # per group: packed int32
    num_computed_tokens: int
    num_prompt_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class StepInput:
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


@dataclass(slots=True)
class GroupPlan:
    """What attention wrote and read in one KV cache group."""

    group_id: int
    slot_runs: bytes  # packed int64 (start, length) runs of the slot mapping; start -1: padding
    num_real: int  # slot-mapping entries of scheduled tokens
    num_padding: int  # entries after them
    row_lens: bytes  # packed int32 per request (req_indices order): the row attention reads, in blocks
    row_digests: bytes  # packed uint32 per request: digest of that row
    rows: bytes | None  # packed int32 rows themselves, when full rows were asked for


@dataclass(slots=True)
class DraftPass:
    """One forward pass of a drafter that writes KV in a target group."""

    group_id: int
    pass_index: int  # 0: over the target's tokens; k > 0: the k-th autoregressive pass
    num_tokens: bytes  # packed int32 per request of the plan
    first_positions: bytes  # packed int32, aligned with num_tokens
    slot_runs: bytes  # as GroupPlan.slot_runs
    num_real: int
    num_padding: int


@dataclass(slots=True)
class StepPlan:
    """The address plan the runner executed (read from its metadata, never recomputed)."""

    req_indices: bytes  # packed int32 req_index values, in slot-mapping order
    num_tokens: bytes  # packed int32 query tokens per request
    first_positions: bytes  # packed int32 position of each request's first query token
    groups: list[GroupPlan]
    draft_writes: list[DraftPass] | None  # None: no drafter KV recorded

    @classmethod
    def of(cls, d: Record) -> StepPlan:
        drafts = d.get("draft_writes")
        return cls(
            d["req_indices"],
            d["num_tokens"],
            d["first_positions"],
            list(map(_group_plan, d["groups"])),
            None if drafts is None else [DraftPass(**p) for p in drafts],
        )

    def to_record(self) -> Record:
        """The Avro record (a checkpoint keeps the plans that came before their lead's step)."""
        return {
            "req_indices": self.req_indices,
            "num_tokens": self.num_tokens,
            "first_positions": self.first_positions,
            "groups": [_fields(g) for g in self.groups],
            "draft_writes": None if self.draft_writes is None else [_fields(p) for p in self.draft_writes],
        }


@dataclass(slots=True)
class Step:
    """One step of one rank: the scheduler's input and the runner's plan."""

    step: int  # rank-local counter, aligned across the ranks of an engine
    kind: StepKind
    input: StepInput | None  # None: a run without a scheduler output
    plan: StepPlan | None  # None: no plan built, or the plan probe is unavailable
    content: BlockDigests | None = None  # None: no sealed block digested at this step

    @classmethod
    def of(cls, d: Record) -> Step:
        i, p, c = d.get("input"), d.get("plan"), d.get("content")
        inp = None if i is None else _input(i)
        content = None if c is None else BlockDigests.of(c)
        return cls(d["step"], _STEP_KINDS[d["kind"]], inp, None if p is None else StepPlan.of(p), content)


@dataclass(slots=True)
class BlockDigests:
    """Content digests of sealed blocks, taken at a step before its forward pass wrote anything."""

    group_ids: bytes  # packed int32
    block_ids: bytes  # packed int32, aligned with group_ids
    digests: bytes  # packed uint64, aligned with group_ids
    reasons: list[DigestReason]  # aligned with group_ids

    @classmethod
    def of(cls, d: Record) -> BlockDigests:
        reasons = [read(DigestReason, r) for r in d["reasons"]]
        return cls(d["group_ids"], d["block_ids"], d["digests"], reasons)


def _input(d: Record) -> StepInput:
    return StepInput(
        list(map(_new_request, d["new_reqs"])),
        d["cached_req_indices"],
        d["cached_num_computed_tokens"],
        d["cached_num_scheduled_tokens"],
        d["resumed_req_indices"],
        d["append_req_indices"],
        d["append_group_ids"],
        d["append_counts"],
        d["append_block_ids"],
        d["finished_req_ids"],
        d["preempted_req_ids"],
        d["block_ids_to_zero"],
        d["block_copies"],
    )


def _new_request(r: Record) -> NewRequest:
    return NewRequest(
        r["req_index"], r["req_id"], r["block_ids"], r["num_computed_tokens"], r["num_prompt_tokens"],
        r["num_scheduled_tokens"],
    )  # fmt: skip


def _group_plan(g: Record) -> GroupPlan:
    return GroupPlan(
        g["group_id"], g["slot_runs"], g["num_real"], g["num_padding"], g["row_lens"], g["row_digests"], g.get("rows")
    )


def _kv_group(g: Record) -> KvGroup:
    return KvGroup(g["group_id"], _GROUP_KINDS[g["kind"]], g["block_size"], g["num_blocks"], g.get("sliding_window"))


def _fields(obj: Any) -> Record:
    """A slotted record's fields by name, as its Avro record names them (nested records as they are)."""
    return {name: getattr(obj, name) for name in type(obj).__slots__}


# -- the other bodies -----------------------------------------------------------------------------
@dataclass(slots=True)
class ConnectorEvent:
    """A KV connector observation (a disaggregated prefill/decode transfer)."""

    step: int
    connector: str  # connector class, e.g. 'MooncakeConnector'
    kind: ConnectorKind
    req_id: str | None
    transfer_id: str | None  # shared by both engines of a pair
    remote_engine_id: str | None
    block_ids: list[bytes]  # per group: packed int32 local blocks
    num_tokens: int | None
    digest: bytes | None  # of the transferred blocks' bytes, when sampled
    detail: str | None  # the connector's free text (never read by a check)

    @classmethod
    def of(cls, d: Record) -> ConnectorEvent:
        get = d.get
        return cls(
            d["step"], d["connector"], connector_kind(d["kind"], get("detail")), get("req_id"), get("transfer_id"),
            get("remote_engine_id"), get("block_ids", []), get("num_tokens"), get("digest"), get("detail"),
        )  # fmt: skip


@dataclass(slots=True)
class SnapshotRequest:
    req_index: int
    req_id: str
    num_computed_tokens: int  # after the snapshot's step
    block_ids: list[bytes]  # per group: packed int32 row


@dataclass(slots=True)
class Snapshot:
    """A rank's full state after a step: a reader that lost events resyncs here."""

    step: int
    requests: list[SnapshotRequest]

    @classmethod
    def of(cls, d: Record) -> Snapshot:
        reqs = [
            SnapshotRequest(r["req_index"], r["req_id"], r["num_computed_tokens"], r["block_ids"])
            for r in d["requests"]
        ]
        return cls(d["step"], reqs)


@dataclass(slots=True)
class Health:
    """The probe's own accounting, now and then and at shutdown."""

    step: int
    events_captured: int  # cumulative over the incarnation
    events_dropped: int  # cumulative: buffer full or sink failed
    probe_ns: int
    buffer_capacity: int
    buffer_high_water: int
    closing: bool  # the rank's last event: its worker shut down

    @classmethod
    def of(cls, d: Record) -> Health:
        return cls(
            d["step"], d["events_captured"], d["events_dropped"], d["probe_ns"], d["buffer_capacity"],
            d["buffer_high_water"], bool(d.get("closing")),
        )  # fmt: skip


Body = RankInfo | Step | ConnectorEvent | Snapshot | Health
_BODIES: dict[str, Callable[[Record], Body]] = {
    RANK_INFO: RankInfo.of,
    STEP: Step.of,
    CONNECTOR_EVENT: ConnectorEvent.of,
    SNAPSHOT: Snapshot.of,
    HEALTH: Health.of,
}


@dataclass(slots=True)
class LedgerEvent:
    """One record of the ledger: what one engine rank observed."""

    rank: RankKey  # engine id and DP/TP/PP ranks
    incarnation: int  # the worker process run; a new one restarts seq and the rank's state
    seq: int  # per rank and incarnation, every captured event (a jump is a gap)
    emitted_at_us: int  # capture time: informational, no check reads it
    body: Body

    @property
    def engine_id(self) -> str:
        return self.rank.engine_id


KeyOf = Callable[[str, int, int, int], RankKey]


def event_of(record: Record, key_of: KeyOf = RankKey) -> LedgerEvent:
    """The typed event of a decoded record (`key_of` may intern the rank keys)."""
    name, body = record["body"]
    typed = _BODIES.get(name)
    if typed is None:
        raise ValueError(f"a ledger event with a body of unknown kind {name!r}")
    rank = key_of(record["engine_id"], record["dp_rank"], record["tp_rank"], record["pp_rank"])
    return LedgerEvent(rank, record["incarnation"], record["seq"], record["emitted_at_us"], typed(body))


def as_event(event: LedgerEvent | Record, key_of: KeyOf = RankKey) -> LedgerEvent:
    """A typed event as it is; a decoded record typed (the core's entry points take either)."""
    return event if isinstance(event, LedgerEvent) else event_of(event, key_of)
