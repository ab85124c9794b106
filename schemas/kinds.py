"""Every kind the ledger names, once: the enums of the contract.

Writers (the probes, the synthetic engine) and readers (the ledger core, the
stream worker, the CLI) import these and nothing else for a kind. Each is a
`StrEnum`, so a member is its symbol: it compares equal to the string an Avro
decoder hands out, hashes as that string (a `Counter` of coverage reasons keeps
one key per reason whether a checkpoint or the core counted it) and formats as
it in a message.

A symbol from a newer writer never fails a reader: an enum kept open (`Open`)
reads it as its named fallback (`OTHER`), and the reader counts what it could not
interpret as unchecked. Avro enums in `avro/*.avsc` carry the same symbols and
name that fallback as their default; fields that stay Avro strings for evolution
(the runner, a violation's kind, coverage reasons) document these values.
"""

from __future__ import annotations

from enum import StrEnum


class Open(StrEnum):
    """An enum readers keep open to newer writers: a symbol it does not know is its OTHER member."""

    @classmethod
    def _missing_(cls, value: object) -> StrEnum:
        return cls.OTHER  # type: ignore[attr-defined]


# -- ledger events ------------------------------------------------------------------------------
class PdRole(StrEnum):
    """The engine's role in a prefill/decode pair (kv_transfer_config.kv_role)."""

    NONE = "NONE"
    PREFILL = "PREFILL"
    DECODE = "DECODE"
    BOTH = "BOTH"


class KvGroupKind(Open):
    """Attention kind of a KV cache group: how its layers address their blocks."""

    FULL_ATTENTION = "FULL_ATTENTION"
    SLIDING_WINDOW = "SLIDING_WINDOW"
    MAMBA = "MAMBA"
    MLA = "MLA"
    OTHER = "OTHER"

    @property
    def addresses_slots(self) -> bool:
        """Its layers write tokens through slot = block * block_size + offset (the write checks apply);
        Mamba state and unknown kinds do not."""
        return self not in (KvGroupKind.MAMBA, KvGroupKind.OTHER)

    @property
    def null_free(self) -> bool:
        """vLLM's manager of this kind never puts the null block in a request's row (the probes record
        only vLLM's exact full-attention and MLA specs so; subclasses with managers of their own, which
        may, are OTHER)."""
        return self in (KvGroupKind.FULL_ATTENTION, KvGroupKind.MLA)


class StepKind(StrEnum):
    """Why the model runner ran."""

    REAL = "REAL"
    DUMMY = "DUMMY"
    PROFILE = "PROFILE"
    WARMUP = "WARMUP"


class DigestReason(Open):
    """Why a sealed block's content digest was taken (see BlockDigests in the contract)."""

    SEALED = "SEALED"  # it just became full: the reference
    READ = "READ"  # a prefix-cache hit or a resume reads it again
    RELEASED = "RELEASED"  # a request holding it finished or was preempted
    SWEEP = "SWEEP"  # the background sweep
    ZEROED = "ZEROED"  # the scheduler had it zeroed: its digest must be 0
    OTHER = "OTHER"  # a reason newer than this reader: not compared


class ConnectorKind(Open):
    """What a KV connector observed about one transfer."""

    SEND_INTENT = "SEND_INTENT"  # the prefill side holds blocks to send
    RECV_INTENT = "RECV_INTENT"  # the decode side asked for blocks into its own
    SEND_DONE = "SEND_DONE"  # the send completed: its blocks are free to reuse
    RECV_DONE = "RECV_DONE"  # the blocks arrived: the request may read them
    RECV_FAILED = "RECV_FAILED"  # the receive failed
    INVALID_BLOCKS = "INVALID_BLOCKS"  # blocks whose load failed (get_block_ids_with_load_errors)
    EXPIRED = "EXPIRED"  # the send was dropped after its timeout: its blocks are released
    SEND_CANCELLED = "SEND_CANCELLED"  # the send will not happen (its prefill request was aborted)
    RECV_RELEASED = "RECV_RELEASED"  # a pull with no blocks: it only tells the prefill side to release
    # Derived by the ledger for the transfer join (never by a connector): the prefix a side's request was
    # computed from (SEND_PREFIX, at the send's intent) or is read as (RECV_PREFIX, at its first step).
    SEND_PREFIX = "SEND_PREFIX"
    RECV_PREFIX = "RECV_PREFIX"
    OTHER = "OTHER"  # a kind newer than this reader

    @property
    def role(self) -> TransferRole | None:
        """Which side of a transfer the kind speaks for; None for kinds tied to no side."""
        return _ROLES.get(self)

    @property
    def ends_recv(self) -> bool:
        """The receive is over, done or failed: the blocks its intent held are its request's to read."""
        return self in (ConnectorKind.RECV_DONE, ConnectorKind.RECV_FAILED)

    @property
    def ends_send(self) -> bool:
        """The send is over, whatever became of it: the blocks its intent held are released."""
        return self in (ConnectorKind.SEND_DONE, ConnectorKind.EXPIRED, ConnectorKind.SEND_CANCELLED)


class TransferRole(StrEnum):
    """A side of a transfer between two engines."""

    SEND = "send"
    RECV = "recv"


class TransferOutcome(StrEnum):
    """How one side of a transfer ended (a checkpoint keeps it by symbol)."""

    DONE = "DONE"  # sent or received
    FAILED = "FAILED"  # the receive failed
    EXPIRED = "EXPIRED"  # the prefill engine gave up on the send
    RELEASED = "RELEASED"  # cancelled, or a pull that only released the prefill side's blocks


_ROLES = {
    ConnectorKind.SEND_INTENT: TransferRole.SEND,
    ConnectorKind.SEND_DONE: TransferRole.SEND,
    ConnectorKind.EXPIRED: TransferRole.SEND,
    ConnectorKind.SEND_CANCELLED: TransferRole.SEND,
    ConnectorKind.SEND_PREFIX: TransferRole.SEND,
    ConnectorKind.RECV_INTENT: TransferRole.RECV,
    ConnectorKind.RECV_DONE: TransferRole.RECV,
    ConnectorKind.RECV_FAILED: TransferRole.RECV,
    ConnectorKind.RECV_RELEASED: TransferRole.RECV,
    ConnectorKind.RECV_PREFIX: TransferRole.RECV,
}

# Kinds the Avro enum has no symbol for: written as OTHER with their name in `detail` (the schema's
# fingerprint stays, so readers of every version read them), read back as these kinds.
_AS_DETAIL = {
    ConnectorKind.SEND_CANCELLED: "send_cancelled",
    ConnectorKind.RECV_RELEASED: "release_only",
    ConnectorKind.SEND_PREFIX: "send_prefix",
    ConnectorKind.RECV_PREFIX: "recv_prefix",
}
_OF_DETAIL = {detail: kind for kind, detail in _AS_DETAIL.items()}


def connector_wire(kind: ConnectorKind, detail: str | None) -> tuple[str, str | None]:
    """The (symbol, detail) a connector event of `kind` is written as."""
    named = _AS_DETAIL.get(kind)
    return (ConnectorKind.OTHER.value, named) if named is not None else (kind.value, detail)


def connector_kind(symbol: str, detail: str | None) -> ConnectorKind:
    """A connector event's kind as written by `connector_wire`; a symbol this reader does not know, or an
    OTHER it cannot name, is OTHER."""
    kind = ConnectorKind(symbol)
    if kind is ConnectorKind.OTHER and detail is not None:
        return _OF_DETAIL.get(detail, kind)
    return kind


class Runner(Open):
    """The model runner the probes attached to (RankInfo.runner, an Avro string)."""

    V1 = "v1"  # gpu_model_runner.GPUModelRunner (the default on CPU hosts)
    V2 = "v2"  # Model Runner V2 (vllm/v1/worker/gpu), the default on GPUs
    SYNTHETIC = "synthetic"  # the synthetic engine of the tests
    OTHER = "other"  # a runner newer than this reader

    @classmethod
    def _missing_(cls, value: object) -> Runner:
        # Probes before the runner was typed named Model Runner V2 'mrv2'.
        return cls.V2 if value == "mrv2" else cls.OTHER


# -- what a rank declares ---------------------------------------------------------------------
# The capability of the probe on the runner's step (execute_model): unavailable when it did not attach,
# or when the scheduler output lacks fields the step input is read from (its reason names them).
STEP_INPUT = "step_input"

# The capability a rank reports for sealed blocks' content digests: unavailable when asked for and not
# taken (counted unchecked once per rank under this name), which voids no other check.
CONTENT_DIGESTS = "content_digests"


class Declaration(StrEnum):
    """A configuration whose addressing the ledger's checks do not model. A rank running one reports it
    as an unavailable capability of this name (the reason says why); the checks it voids are counted
    unchecked under the same name, never reported as violations."""

    DECODE_CONTEXT_PARALLEL = "decode_context_parallel"
    PREFILL_CONTEXT_PARALLEL = "prefill_context_parallel"
    ASYNC_SPEC_DECODE = "async_spec_decode"
    DRAFTER_KV_WRITES = "drafter_kv_writes"
    ADAPTIVE_VERIFICATION = "adaptive_verification"


# -- what the ledger reports ---------------------------------------------------------------------
class ViolationKind(Open):
    """What a violation says went wrong (Violation.kind, an Avro string: new kinds may be added)."""

    WRITE_TARGET_MISMATCH = "write_target_mismatch"
    READ_TARGET_MISMATCH = "read_target_mismatch"
    UNOWNED_WRITE = "unowned_write"
    FOREIGN_BLOCK_WRITE = "foreign_block_write"
    BLOCK_OUT_OF_RANGE = "block_out_of_range"
    RANK_DIVERGENCE = "rank_divergence"
    RANK_MISSING = "rank_missing"
    SEQUENCE_GAP = "sequence_gap"
    DUPLICATE_EVENT = "duplicate_event"
    # Transfers between engines (core/transfers.py).
    TRANSFER_BLOCK_MISMATCH = "transfer_block_mismatch"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_STUCK = "transfer_stuck"
    READ_BEFORE_TRANSFER = "read_before_transfer"
    SEND_BLOCK_REUSED = "send_block_reused"
    ORPHAN_TRANSFER = "orphan_transfer"
    TRANSFER_CONTENT_MISMATCH = "transfer_content_mismatch"
    TRANSFER_PREFIX_MISMATCH = "transfer_prefix_mismatch"  # decode received KV computed from another prefix
    # The content of sealed blocks (core/content.py).
    SEALED_BLOCK_MODIFIED = "sealed_block_modified"
    BLOCK_NOT_ZEROED = "block_not_zeroed"
    # What a block holds (core/rank_tables.py: chains and fills).
    NULL_BLOCK_GRANT = "null_block_grant"
    PREFIX_HIT_MISMATCH = "prefix_hit_mismatch"
    UNWRITTEN_READ = "unwritten_read"
    SHARED_BLOCK_WRITE = "shared_block_write"
    # Where blocks live in the KV allocation (core/layout.py).
    LAYOUT_ALIAS = "layout_alias"
    # Async scheduling's window (core/rank_tables.py: a load into blocks a dispatched step still uses).
    IN_FLIGHT_REUSE = "in_flight_reuse"
    OTHER = "other"  # a kind newer than this reader (read from a topic or a file)


class Check(StrEnum):
    """A check the ledger ran, as coverage counts it."""

    SEQUENCE = "sequence"  # an event's place in its rank's stream
    RESYNC = "resync"  # a snapshot brought a rank's tables back
    OVERWRITE_TARGET = "overwrite_target"  # blocks handed out were free
    EXCLUSIVITY = "exclusivity"  # a written block is held by its writer alone
    POSITION = "position"  # query positions against computed tokens
    WRITE = "write"  # the slot mapping against the tables
    READ = "read"  # the block-table rows attention read
    PADDING = "padding"  # padding entries write nothing
    STATE_ROWS = "state_rows"  # a state group's rows
    DRAFT_POSITION = "draft_position"
    DRAFT_WRITE = "draft_write"
    DRAFT_PADDING = "draft_padding"
    RANK_COMPARE = "rank_compare"  # the ranks of a step group agree
    CONTENT_SEALED = "content_sealed"  # a sealed block's reference digest taken
    CONTENT_ZEROED = "content_zeroed"  # a block to zero read zero
    CONTENT_VERIFIED = "content_verified"  # a sealed block's digest equal to its reference
    TRANSFER_JOIN = "transfer_join"  # both sides of a transfer met
    TRANSFER_BLOCKS = "transfer_blocks"  # their block lists line up
    TRANSFER_CONTENT = "transfer_content"  # their content digests agree
    TRANSFER_PREFIX = "transfer_prefix"  # decode reads the received KV as the prefix prefill computed it from
    TRANSFER_READ = "transfer_read"  # a request read received blocks after they arrived
    SEND_HOLD = "send_hold"  # a completed send's blocks, judged from its intent on, stayed with it
    NULL_GRANT = "null_grant"  # a full-attention grant holds no null block
    PREFIX_IDENTITY = "prefix_identity"  # a prefix hit reads a block computed from its own prefix
    READ_WRITTEN = "read_written"  # a prefix hit reads a block executed steps wrote to its end
    BYTE_LAYOUT = "byte_layout"  # a granted block's bytes meet no live block of another group
    IN_FLIGHT_LOAD = "in_flight_load"  # a connector load's destinations, against the steps still in flight


class Unchecked(StrEnum):
    """Why a check could not run, as coverage counts it (with the Declarations, which void checks too)."""

    # The stream itself.
    NO_RANK_INFO = "no_rank_info"  # steps before the rank said who it is
    AFTER_GAP = "after_gap"  # events were lost: checks wait for a snapshot
    TRANSFERS_FORGOTTEN = "transfers_forgotten"  # KV transfers pending at a gap: their ends may be lost
    STEPS_NOT_RECORDED = "steps_not_recorded"  # the rank skipped step numbers without losing events
    STEP_NOT_AFTER_LAST = "step_not_after_last"  # a step number again or backwards
    RANK_RESTARTED = "rank_restarted"  # a new incarnation: its state starts over
    JOINED_MID_STREAM = "joined_mid_stream"  # the reader started after the rank did
    SNAPSHOT_WITHOUT_RANK_INFO = "snapshot_without_rank_info"
    CHECKPOINT_REFUSED = "checkpoint_refused"  # a stream worker could not restore its checkpoint
    # A step's plan.
    NO_PLAN = "no_plan"  # a real step with tokens and no plan recorded
    UNKNOWN_REQUEST = "unknown_request"  # a request the tables do not hold
    UNKNOWN_GROUP = "unknown_group"  # a group the rank's layout does not have
    MAMBA_GROUP = "mamba_group"  # a state group: no slots to check (its rows are)
    OTHER_GROUP = "other_group"  # a group of a kind this reader does not model
    MALFORMED_PLAN = "malformed_plan"  # columns that do not line up
    TOKENS_WITHOUT_SLOT = "tokens_without_slot"  # scheduled tokens past the slot mapping's real entries
    DRAFT_UNKNOWN_GROUP = "draft_unknown_group"
    DRAFT_UNCHECKED_GROUP = "draft_unchecked_group"
    # The ranks of a step group.
    RANK_PLAN_UNVERIFIED = "rank_plan_unverified"  # a follower's differing plan met no lead tables
    RANK_LATE_AFTER_SETTLE = "rank_late_after_settle"
    RANK_RECORDS_LOST = "rank_records_lost"
    RANK_CLOSED_BEFORE_STEP = "rank_closed_before_step"
    RANK_MISSING_STEPS = "rank_missing_steps"
    STEP_INPUT = STEP_INPUT  # the rank's step inputs are incomplete: its steps are not checked
    # Content digests.
    CONTENT_DIGESTS = CONTENT_DIGESTS  # asked for and not taken (the capability's name)
    CONTENT_WITHOUT_RANK_INFO = "content_without_rank_info"
    CONTENT_COLUMNS_MISALIGNED = "content_columns_misaligned"
    CONTENT_DIGEST_OF_UNKNOWN_REASON = "content_digest_of_unknown_reason"
    CONTENT_WITHOUT_SEAL = "content_without_seal"
    # Transfers.
    TRANSFER_OPEN_AT_END = "transfer_open_at_end"
    TRANSFER_PEER_NOT_IN_INPUT = "transfer_peer_not_in_input"
    TRANSFER_PARTIAL_PULL = "transfer_partial_pull"  # decode had a prefix hit: it pulls the tail
    TRANSFER_DIGEST_UNREADABLE = "transfer_digest_unreadable"
    # A side of a transfer whose prefix chains are not on record (no chains recorded, the request not
    # live at the send's intent), or whose groups' block sizes differ between the engines.
    TRANSFER_PREFIX_UNKNOWN = "transfer_prefix_unknown"
    TRANSFER_DIGEST_LAYOUT_DIFFERS = "transfer_digest_layout_differs"
    CONNECTOR_KIND_UNKNOWN = "connector_kind_unknown"  # a connector event of a kind newer than this reader
    # What a block holds.
    PREFIX_UNKNOWN = "prefix_unknown"  # a hit block or its reader without a known prefix chain
    READ_SOURCE_UNTRACED = "read_source_untraced"  # a rank with a KV connector: hits may be its loads
    READ_NOT_SETTLED = "read_not_settled"  # a hit in a step whose plan was not checked
    FILL_UNKNOWN = "fill_unknown"  # a hit block whose writes the ledger did not see (before a resync)
    # Where blocks live.
    LAYOUT_UNKNOWN = "layout_unknown"  # a rank of several groups that did not say where their blocks live
    # Async scheduling's window.
    IN_FLIGHT_UNMODELLED = "in_flight_unmodelled"  # a load beside a step in flight, in a group of a kind not modelled
    IN_FLIGHT_UNKNOWN = "in_flight_unknown"  # a load beside steps in flight the tables no longer know
    # Input lost before any check could see it (LOST_INPUT): a report with any of these is never clean.
    DROPPED_BY_PRODUCER = "dropped_by_producer"  # events the engine's probes dropped (its Health says how many)
    TRUNCATED_FILE = "truncated_file"  # a file ledger's segment whose tail is lost
    CORRUPT_FILE = "corrupt_file"
    NOT_AVRO_FILE = "not_avro_file"
    DELETED_FILE = "deleted_file"
    EMPTY_FILE = "empty_file"


class ReadFailure(StrEnum):
    """Why (part of) a segment of a file ledger could not be read (ReadProblem.reason)."""

    TRUNCATED = "truncated"  # its tail is lost: a torn last block, or more than its writer confirmed
    CORRUPT = "corrupt"  # bad block data with whole blocks after it
    NOT_AVRO = "not_avro"  # no readable Avro header
    DELETED = "deleted"  # listed, then gone (a writer's retention)
    EMPTY = "empty"  # zero bytes: its writer never wrote its header

    @property
    def unchecked(self) -> Unchecked:
        """What the events it held count as: never a check that ran."""
        return _READ_UNCHECKED[self]


_READ_UNCHECKED = {
    ReadFailure.TRUNCATED: Unchecked.TRUNCATED_FILE,
    ReadFailure.CORRUPT: Unchecked.CORRUPT_FILE,
    ReadFailure.NOT_AVRO: Unchecked.NOT_AVRO_FILE,
    ReadFailure.DELETED: Unchecked.DELETED_FILE,
    ReadFailure.EMPTY: Unchecked.EMPTY_FILE,
}

# Input that never reached a check: whatever else a report says, it is not clean.
LOST_INPUT = frozenset({Unchecked.DROPPED_BY_PRODUCER, *_READ_UNCHECKED.values()})


def group_unchecked(kind: KvGroupKind) -> Unchecked:
    """Why a group of a kind whose layers do not address slots has its write checks unchecked."""
    return Unchecked.MAMBA_GROUP if kind is KvGroupKind.MAMBA else Unchecked.OTHER_GROUP
