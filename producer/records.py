"""Builders of ledger records from what a rank observed.

Shared by the vLLM probes and the synthetic engine, so both emit exactly the same records. Inputs
are numpy arrays or lists; outputs are the contract's typed records (`kvledger.schemas.events`,
where each is defined), packed as it says; `envelope` makes one the dict the Avro writer takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from kvledger.schemas import pack_digests, pack_i32
from kvledger.schemas.events import (
    BlockDigests,
    Body,
    Capability,
    ConnectorEvent,
    DraftPass,
    GroupPlan,
    Health,
    KvGroup,
    KvPlacement,
    LedgerEvent,
    NewRequest,
    RankInfo,
    RankKey,
    Snapshot,
    SnapshotRequest,
    Step,
    StepInput,
    StepPlan,
    envelope_record,
)
from kvledger.schemas.kinds import ConnectorKind, Declaration, DigestReason, KvGroupKind, PdRole, Runner, StepKind
from kvledger.schemas.packing import block_terms, length_term, length_terms, mix_blocks, pack_u64, position_weights
from kvledger.schemas.ranks import rank_label


@dataclass(frozen=True)
class RankIdentity:
    engine_id: str
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    incarnation: int = 0

    @property
    def label(self) -> str:
        """The rank within its engine: dp0-tp1-pp0."""
        return rank_label(self.dp_rank, self.tp_rank, self.pp_rank)


def envelope(rank: RankIdentity, seq: int, emitted_at_us: int, body: Body) -> dict:
    """A LedgerEvent of this rank as the Avro writer takes it."""
    r = rank
    return envelope_record(r.engine_id, r.dp_rank, r.tp_rank, r.pp_rank, r.incarnation, seq, emitted_at_us, body)


def event(rank: RankIdentity, seq: int, emitted_at_us: int, body: Body) -> LedgerEvent:
    """A LedgerEvent as the core reads it (the in-engine check: no encoding on the way)."""
    key = RankKey(rank.engine_id, rank.dp_rank, rank.tp_rank, rank.pp_rank)
    return LedgerEvent(key, rank.incarnation, seq, emitted_at_us, body)


def kv_group(
    group_id: int,
    kind: str,
    block_size: int,
    num_blocks: int,
    sliding_window: int | None = None,
    layout: list[KvPlacement] | None = None,
) -> KvGroup:
    return KvGroup(group_id, KvGroupKind(kind), block_size, num_blocks, sliding_window, layout)


def rank_info(
    *,
    dp_size: int,
    tp_size: int,
    pp_size: int,
    kv_groups: list[KvGroup],
    vllm_version: str,
    runner: str,
    pd_role: str = "NONE",
    capabilities: Sequence[tuple[str, bool, str | None]] = (),
    full_rows: bool = False,
    snapshot_interval: int = 0,
) -> RankInfo:
    return RankInfo(
        dp_size,
        tp_size,
        pp_size,
        PdRole(pd_role),
        vllm_version,
        Runner(runner),
        list(kv_groups),
        [Capability(n, a, r) for n, a, r in capabilities],
        full_rows,
        snapshot_interval,
    )


def _size(config, name: str) -> int:
    return int(getattr(config, name, 1) or 1)


def _calls(config, method: str) -> bool:
    fn = getattr(config, method, None)
    return bool(fn()) if callable(fn) else False


def config_declarations(vllm_config) -> list[tuple[str, bool, str | None]]:
    """The declarations (capability tuples) a rank's vLLM config calls for; read by attribute
    name so any vLLM version (or a stand-in config) reads."""
    parallel = getattr(vllm_config, "parallel_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    found = []
    dcp = _size(parallel, "decode_context_parallel_size")
    if dcp > 1:
        found.append(
            (
                Declaration.DECODE_CONTEXT_PARALLEL,
                False,
                f"decode context parallel size {dcp}: each rank stores only its share of every scheduler "
                f"block's tokens (its slot mapping pads the others), in blocks 1/{dcp} of the scheduler's size; "
                "write checks and the cross-rank plan compare are not modelled",
            )
        )
    pcp = _size(parallel, "prefill_context_parallel_size")
    if pcp > 1:
        found.append(
            (
                Declaration.PREFILL_CONTEXT_PARALLEL,
                False,
                f"prefill context parallel size {pcp}: each rank runs its own partition of the batch's tokens; "
                "plan checks and the cross-rank plan compare are not modelled",
            )
        )
    if spec is not None and getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
        found.append(
            (
                Declaration.ASYNC_SPEC_DECODE,
                False,
                "async scheduling with speculative decoding: the worker moves a request back by the previous "
                "step's rejected drafts on the device, which the scheduler's computed-token count (the step "
                "input) learns a step later; a plan behind that count is not checked",
            )
        )
    if spec is not None and _calls(spec, "uses_draft_kv_cache"):
        found.append(
            (
                Declaration.DRAFTER_KV_WRITES,
                False,
                f"the {getattr(spec, 'method', '?')} drafter writes KV through slot mappings of its own, "
                "which are not recorded",
            )
        )
    return found


def slot_runs(slot_mapping: np.ndarray) -> bytes:
    """Compress a slot mapping into packed (start, length) runs (see the schema)."""
    slots = np.asarray(slot_mapping, dtype=np.int64)
    n = slots.size
    if n == 0:
        return b""
    # A slot one past its predecessor (int64 wrapping, as ever) keeps `slot - position`: a run of
    # real slots has one key. After padding (any negative slot), a run goes on while padding does.
    key = slots - _positions(n)
    breaks = key[1:] != key[:-1]
    if slots.min() < 0:
        padding = slots < 0
        breaks = np.where(padding[:-1], ~padding[1:], breaks)
    ends = breaks.nonzero()[0]  # of each run but the last
    runs = np.empty((ends.size + 1, 2), np.int64)
    if ends.size == n - 1:  # every slot a run of its own (requests decoding a token each)
        np.maximum(slots, -1, out=runs[:, 0])
        runs[:, 1] = 1
        return runs.tobytes()
    starts = runs[:, 1]  # the runs' first positions, overwritten by their lengths below
    starts[0] = 0
    np.add(ends, 1, out=starts[1:])
    np.maximum(slots.take(starts), -1, out=runs[:, 0])  # every padding run starts at -1
    starts[:-1] = ends - starts[:-1] + 1
    starts[-1] = n - starts[-1]
    return runs.tobytes()


_arange = np.arange(0, dtype=np.int64)


def _positions(n: int) -> np.ndarray:
    """0 .. n-1, a view of an array made once (grown as needed)."""
    global _arange
    positions = _arange  # read once: another thread may grow it meanwhile
    if n > positions.size:
        positions = _arange = np.arange(max(n, 2 * positions.size), dtype=np.int64)
    return positions[:n]


def row_digests(rows: Sequence[np.ndarray]) -> np.ndarray:
    """Digests (kvledger.schemas.row_digest) of several rows at once."""
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    if lens.sum() == 0:
        return np.full(len(rows), length_term(0), np.uint64)
    flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    starts = np.cumsum(lens) - lens
    pos = np.arange(flat.size) - np.repeat(starts, lens)
    with np.errstate(over="ignore"):
        terms = block_terms(flat, pos)
        # A trailing zero lets reduceat index one past the end for trailing empty rows.
        sums = np.add.reduceat(np.append(terms, np.uint64(0)), starts, dtype=np.uint64)
        sums[lens == 0] = 0
        return sums + length_terms(lens)


_I32 = np.dtype("<i4")
# Each row's products summed, in one pass (numpy 2's ufunc; einsum before it, slower to call).
_row_dot = getattr(np, "vecdot", None) or (lambda a, b: np.einsum("ij,ij->i", a, b))
_WEIGHT_ROWS_MAX = 256  # widths up to this take their rows' weights from a table made once (~0.5 MiB)
_weight_rows = np.zeros((1, 0), np.uint64)


def _row_weights(width: int, lens: np.ndarray) -> np.ndarray:
    """Per row i, the weights of positions 0 .. width-1, zero from lens[i] on."""
    global _weight_rows
    if width > _WEIGHT_ROWS_MAX:
        return np.where(_positions(width) < lens[:, None], position_weights(0, width), np.uint64(0))
    table = _weight_rows  # read once: another thread may grow it meanwhile
    if width >= table.shape[0]:  # row l of the table: the weights of a row of length l
        size = min(max(width, 2 * table.shape[1]), _WEIGHT_ROWS_MAX)
        table = _weight_rows = np.tril(np.broadcast_to(position_weights(0, size), (size + 1, size)), -1)
    # A length outside 0 .. width takes the nearest: a negative one no weights, a longer one all.
    return table[: width + 1, :width].take(lens, axis=0, mode="clip")


def table_digests(table: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Digests of the rows `table[i, :lens[i]]` of a 2-D block table, without a Python loop."""
    lens = np.asarray(lens)
    sums = _row_dot(mix_blocks(table), _row_weights(table.shape[1], lens))  # uint64: wraps, no warning
    sums += length_terms(lens)  # a length's int64 bits, as ever
    return sums


def group_plan_from_table(
    group_id: int,
    slot_mapping: np.ndarray,
    num_real: int,
    table: np.ndarray,
    lens: np.ndarray,
    full_rows: bool = False,
) -> GroupPlan:
    """A GroupPlan from block-table rows as runners hold them: `table[i, :lens[i]]`."""
    rows = None
    if full_rows:
        rows = pack_i32(table[np.arange(table.shape[1]) < np.asarray(lens)[:, None]])
    padding = int(len(slot_mapping) - num_real)
    digests = pack_digests(table_digests(table, lens))
    return GroupPlan(group_id, slot_runs(slot_mapping), int(num_real), padding, pack_i32(lens), digests, rows)


def group_plan(
    group_id: int,
    slot_mapping: np.ndarray,
    num_real: int,
    rows: Sequence[np.ndarray],
    full_rows: bool = False,
) -> GroupPlan:
    lens = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
    packed = pack_i32(np.concatenate(rows)) if full_rows and len(rows) else (b"" if full_rows else None)
    padding = int(len(slot_mapping) - num_real)
    digests = pack_digests(row_digests(rows))
    return GroupPlan(group_id, slot_runs(slot_mapping), int(num_real), padding, lens.tobytes(), digests, packed)


def new_request(
    req_index: int,
    req_id: str,
    block_ids: Sequence[Sequence[int]],
    num_computed_tokens: int,
    num_prompt_tokens: int,
    num_scheduled_tokens: int,
    prefix_chains: list[bytes] | None = None,
) -> NewRequest:
    blocks = [pack_i32(b) for b in block_ids]
    return NewRequest(
        req_index, req_id, blocks, num_computed_tokens, num_prompt_tokens, num_scheduled_tokens, prefix_chains
    )


def step_input(
    *,
    new_reqs: Sequence[NewRequest] = (),
    cached: Sequence[tuple[int, int, int]] = (),
    cached_columns: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None,
    resumed: Sequence[int] = (),
    appends: Sequence[tuple[int, int, Sequence[int]]] = (),
    finished: Sequence[str] = (),
    preempted: Sequence[str] = (),
    blocks_to_zero: Sequence[int] = (),
    block_copies: Sequence[tuple[int, int]] = (),
    in_flight_steps: int | None = None,
) -> StepInput:
    """A StepInput record.

    cached: (req_index, num_computed_tokens, num_scheduled_tokens) per cached request, or the
    same as three columns in `cached_columns` (cheaper for a runner that holds them so; a column
    may come packed already, as int32 bytes);
    appends: (req_index, group_id, block ids) per cached request and group that got blocks.
    """
    if cached_columns is None:
        cached_columns = tuple(np.array(cached, dtype=np.int64).reshape(-1, 3).T)
    indices, computed, scheduled = cached_columns
    # The appends' columns: one array of (req_index, group_id, count) rows, their blocks end to end.
    heads = np.array([(a[0], a[1], len(a[2])) for a in appends], _I32).reshape(-1, 3) if appends else None
    append_blocks = pack_i32(np.fromiter(chain.from_iterable(a[2] for a in appends), np.int64)) if appends else b""
    return StepInput(
        list(new_reqs),
        _i32(indices),
        _i32(computed),
        _i32(scheduled),
        _i32(resumed),
        heads[:, 0].tobytes() if appends else b"",
        heads[:, 1].tobytes() if appends else b"",
        heads[:, 2].tobytes() if appends else b"",
        append_blocks,
        list(finished),
        list(preempted),
        _i32(blocks_to_zero),
        _i32(np.asarray(block_copies, np.int64).reshape(-1)) if len(block_copies) else b"",
        in_flight_steps,
    )


def _i32(values) -> bytes:
    """`pack_i32`, for a column that may come packed already; an empty list is packed at once."""
    if isinstance(values, bytes):
        return values
    if isinstance(values, list | tuple) and not values:
        return b""
    return pack_i32(values)


def step_plan(
    req_indices, num_tokens, first_positions, groups: list[GroupPlan], draft_writes: list[DraftPass] | None = None
) -> StepPlan:
    return StepPlan(_i32(req_indices), pack_i32(num_tokens), pack_i32(first_positions), groups, draft_writes)


def draft_pass(group_id: int, pass_index: int, num_tokens, first_positions, slot_mapping: np.ndarray) -> DraftPass:
    """A DraftPass: one drafter pass's slot mapping; its first sum(num_tokens) entries are real."""
    num_real = int(np.sum(num_tokens, dtype=np.int64))
    padding = int(len(slot_mapping) - num_real)
    runs = slot_runs(slot_mapping)
    return DraftPass(group_id, pass_index, pack_i32(num_tokens), pack_i32(first_positions), runs, num_real, padding)


def step(
    step: int, kind: str, inp: StepInput | None, plan: StepPlan | None, content: BlockDigests | None = None
) -> Step:
    return Step(step, StepKind(kind), inp, plan, content)


def block_digests(groups, blocks, digests: np.ndarray, reasons: Sequence[str]) -> BlockDigests:
    """A BlockDigests: per digest its group, block, digest (uint64, carried as int64 bits) and reason."""
    packed = pack_u64(np.asarray(digests, np.int64).view(np.uint64))
    return BlockDigests(pack_i32(groups), pack_i32(blocks), packed, [DigestReason(r) for r in reasons])


def snapshot(step: int, requests: list[tuple[int, str, int, list[np.ndarray]]]) -> Snapshot:
    return Snapshot(step, [SnapshotRequest(i, r, c, [pack_i32(b) for b in blocks]) for i, r, c, blocks in requests])


def health(
    step: int, captured: int, dropped: int, probe_ns: int, capacity: int, high_water: int, closing: bool = False
) -> Health:
    return Health(step, captured, dropped, probe_ns, capacity, high_water, closing)


def connector_event(
    step: int,
    connector: str,
    kind: ConnectorKind,
    *,
    req_id: str | None = None,
    transfer_id: str | None = None,
    remote_engine_id: str | None = None,
    block_ids: Sequence[Sequence[int]] = (),
    num_tokens: int | None = None,
    digest: bytes | None = None,
    detail: str | None = None,
) -> ConnectorEvent:
    """A ConnectorEvent record; block_ids per KV cache group."""
    blocks = [pack_i32(b) for b in block_ids]
    kind = ConnectorKind(kind)
    return ConnectorEvent(
        step, connector, kind, req_id, transfer_id, remote_engine_id, blocks, num_tokens, digest, detail
    )


# -- transfer digests (their reader: kvledger.stream_app.core.transfers.parse_digest) -------------
TRANSFER_DIGEST_VERSION = 1


def transfer_digest(layout: bytes, block_digests: Sequence[int] | np.ndarray) -> bytes:
    """ConnectorEvent.digest: version byte, 8-byte layout fingerprint, one LE uint64 per block."""
    if len(layout) != 8:
        raise ValueError("the layout fingerprint is 8 bytes")
    blocks = np.asarray(block_digests, dtype="<u8")
    return bytes([TRANSFER_DIGEST_VERSION]) + layout + blocks.tobytes()
