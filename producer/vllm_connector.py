"""Probes for vLLM's KV connector (KV connector v1, worker side): what moves between engines.

The model runner drives the worker-side connector once per step, always in
this order (vllm/v1/worker/kv_connector_model_runner_mixin.py):

* `bind_connector_metadata(metadata)`: the scheduler's plan for this step.
  Its shape is the connector's own, so an adapter reads it: the transfers this
  rank will send (SEND_INTENT) or receive (RECV_INTENT), with their block ids;
* `get_transfer_results(finished_req_ids)`: completed sends and receives and
  failed receives (the base class builds it from `get_finished`);
* `get_block_ids_with_load_errors()`: blocks whose load failed; the API
  guarantees they come no later than the step whose results report the
  request finished, so a step's completions are recorded here, once the
  failed blocks are known.

The generic part wraps those three methods on the connector instance and
turns their results into ConnectorEvents; an adapter per connector class
decodes the metadata and may add connector-specific probes (Mooncake: sends
it gave up on). Another connector is another adapter. A probe never raises
into the engine, and a target missing in this vLLM version is reported as an
unavailable capability, never a crash.

Transfer digests (opt-in, `kv_trace.transfer_digests`: the share of
transfers sampled, chosen by a hash of the transfer id so both engines pick
the same ones): when a sampled send or receive completes, the probe hashes
the bytes of the transferred blocks exactly as the connector moves them
(an adapter knows where they are) and carries the per-block digests in the
completion event. Both completions are seen on the engine thread before the
scheduler learns of them, so the blocks cannot have changed hands yet: the
engine thread copies the blocks' bytes there and then (a gather; on a device
it is only queued, into pinned host memory), and the hashing runs on a digest
thread (hashlib releases the interpreter lock on buffers of 2 KiB and more).
The completion event waits for its digest in the rank's queue of held frames,
with every frame after it, so the ring keeps the rank's order
(`ring_writer.RingWriter.body_when`). The bytes do not cross the ring to
the recorder: at production sizes a transfer moves MBs to GBs, more than a
ring holds, and the engine thread would copy them a second time.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvledger.producer import records
from kvledger.producer.config import TraceConfig
from kvledger.producer.staging import Staged, StagingFull, StagingPool
from kvledger.schemas.kinds import ConnectorKind

log = logging.getLogger("kvledger.producer")

Body = tuple[str, dict]
# The rank's capture path: a body (or what builds it), and what says when it can be built.
Record = Callable[..., None]
Capability = tuple[str, bool, str | None]  # (name, available, reason), as RankInfo carries them
CONNECTOR_API = ("bind_connector_metadata", "get_transfer_results", "get_block_ids_with_load_errors")


@dataclass(frozen=True)
class Transfer:
    """One transfer as the bound metadata announces it."""

    kind: ConnectorKind | None  # SEND_INTENT, RECV_INTENT, SEND_CANCELLED, RECV_RELEASED; None: announced only
    req_id: str
    transfer_id: str | None
    remote_engine_id: str | None
    block_ids: list[list[int]]  # per KV cache group, copied


@dataclass
class Completions:
    """A step's transfer results, held until its load errors are known."""

    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


# -- adapters ----------------------------------------------------------------------------------
class ConnectorAdapter:
    """What the generic probe cannot know about one connector class. The base reads nothing."""

    name = "generic"

    def handles(self, connector: Any) -> bool:
        return True

    def transfers(self, metadata: Any) -> list[Transfer]:
        return []

    def attach(self, connector: Any, probe: ConnectorProbe) -> list[Capability]:
        kind = type(connector).__name__
        return [("connector_intents", False, f"no adapter reads {kind}'s metadata")]

    def digester(self, connector: Any) -> BlockDigester | None:
        """What hashes the bytes this connector moves, or None when the adapter cannot tell."""
        return None


def _blocks(groups: Iterable[Iterable[int]]) -> list[list[int]]:
    return [[int(b) for b in group] for group in groups]


class MooncakeAdapter(ConnectorAdapter):
    """vLLM's MooncakeConnector (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/).

    `MooncakeConnectorMetadata.reqs_to_send`: req id -> (transfer id, per-group
    block ids); an entry without blocks only registers a request that has not
    finished prefill yet (its blocks come once it has). `reqs_to_recv`: remote
    engine -> req id -> `PullReqMeta`; a pull without blocks only tells the
    prefill side to release its blocks. `reqs_not_processed`: transfer ids that
    will not be sent (the prefill request was aborted).
    """

    name = "mooncake"

    def handles(self, connector: Any) -> bool:
        return any(c.__name__ == "MooncakeConnector" for c in type(connector).__mro__)

    def transfers(self, metadata: Any) -> list[Transfer]:
        found = [
            Transfer(ConnectorKind.SEND_INTENT, req_id, transfer_id, None, _blocks(groups))
            if any(groups)
            else Transfer(None, req_id, transfer_id, None, [])  # registered: its prefill has not finished
            for req_id, (transfer_id, groups) in (getattr(metadata, "reqs_to_send", None) or {}).items()
        ]
        for remote_engine_id, pulls in (getattr(metadata, "reqs_to_recv", None) or {}).items():
            for pull in pulls.values():
                blocks = _blocks(pull.local_block_ids)
                kind = ConnectorKind.RECV_INTENT if any(blocks) else ConnectorKind.RECV_RELEASED
                found.append(Transfer(kind, pull.d_req_id, pull.transfer_id, remote_engine_id, blocks))
        found += [
            Transfer(ConnectorKind.SEND_CANCELLED, "", transfer_id, None, [])
            for transfer_id in getattr(metadata, "reqs_not_processed", None) or ()
        ]
        return found

    def attach(self, connector: Any, probe: ConnectorProbe) -> list[Capability]:
        worker = getattr(connector, "connector_worker", None)
        fetch = getattr(worker, "fetch_finished_sending_reqs", None)
        if fetch is None or not hasattr(worker, "finished_sending_reqs"):
            return [("connector_expiry", False, "MooncakeConnectorWorker.fetch_finished_sending_reqs not found")]

        async def fetch_noting_expiries():
            # On the sender loop: what it had sent before this call; the rest of the
            # answer is sends it gave up on (expired), which get_finished reports alike.
            sent = set(worker.finished_sending_reqs)
            finished = await fetch()
            probe.expired.update(finished - sent)
            return finished

        worker.fetch_finished_sending_reqs = fetch_noting_expiries
        return [("connector_expiry", True, None)]

    def digester(self, connector: Any) -> BlockDigester | None:
        worker = getattr(connector, "connector_worker", None)
        needed = ("kv_caches_base_addr", "block_len_per_layer", "kv_block_len_per_layer", "device_kv_caches")
        if worker is None or not all(hasattr(worker, name) for name in needed):
            return None
        return MooncakeRegions(worker)


# -- transfer digests --------------------------------------------------------------------------
def sampled(transfer_id: str, fraction: float) -> bool:
    """Whether a transfer is digested: the same answer on every engine for the same id."""
    if fraction <= 0.0:
        return False
    draw = int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")
    return draw < fraction * 2**64


class BlockDigester:
    """Per block, the KV bytes a transfer of these block ids moves (see records.transfer_digest):
    copied on the engine thread (`copy`), hashed elsewhere (`hash`)."""

    def copy(self, block_ids: list[list[int]]) -> Any:
        """The blocks' bytes, copied now (on a device: the copy queued, never waited for)."""
        raise NotImplementedError

    def hash(self, copied: Any) -> bytes:
        """The transfer's digest of what `copy` took; any thread."""
        raise NotImplementedError


@dataclass
class CopiedBlocks:
    """A transfer's blocks as `MooncakeRegions.copy` took them: per region that holds a group's
    blocks, its rows (one per block, all its bytes in that region), in group then region order."""

    block_ids: list[list[int]]
    rows: list[tuple[int, Staged]]  # (group, its blocks' rows in one region)


class MooncakeRegions(BlockDigester):
    """The regions MooncakeConnectorWorker registered (register_kv_caches): per region a base
    address, a block stride and the bytes a block moves, and the KV groups whose block ids
    index it. A block's digest covers its bytes in every region of its group, in region order.
    """

    def __init__(self, worker: Any):
        self.worker = worker
        self._views: list[tuple[Any, tuple[int, ...]]] | None = None
        self.layout = b""
        self.staging = StagingPool(max_in_flight=4)  # a device's pinned copies of transfers in flight

    def _regions(self) -> list[tuple[Any, tuple[int, ...]]]:
        """(bytes of region as [block, byte] view, groups) per region; built once, after registration."""
        if self._views is not None:
            return self._views
        import torch

        w = self.worker
        storages = {
            t.untyped_storage().data_ptr(): t for t in w.device_kv_caches.values() if isinstance(t, torch.Tensor)
        }
        shared = getattr(w, "region_shared_groups", None) or [(g,) for g in w.registered_group_indices]
        views, shape = [], []
        for base, stride, length, groups in zip(
            w.kv_caches_base_addr, w.block_len_per_layer, w.kv_block_len_per_layer, shared, strict=True
        ):
            owner = next(t for ptr, t in storages.items() if ptr <= base < ptr + t.untyped_storage().nbytes())
            storage = owner.untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(storage)
            offset = base - storage.data_ptr()
            rows = (storage.nbytes() - offset - length) // stride + 1
            views.append((flat.as_strided((rows, length), (stride, 1), offset), tuple(groups)))
            shape.append((stride, length, tuple(groups)))
        per_logical = getattr(w, "_physical_blocks_per_logical_kv_block", 1)
        fingerprint = repr((shape, getattr(w, "tp_size", 1), per_logical)).encode()
        self.layout = hashlib.blake2b(fingerprint, digest_size=8).digest()
        self._views = views
        return views

    def copy(self, block_ids: list[list[int]]) -> CopiedBlocks:
        import torch

        regions = self._regions()
        per_logical = getattr(self.worker, "_physical_blocks_per_logical_kv_block", 1)
        groups, gathered = [], []
        for group, blocks in enumerate(block_ids):
            if not blocks:
                continue
            ids = torch.tensor(blocks, dtype=torch.int64)
            if per_logical > 1:  # kernel blocks of each logical block, as the connector expands them
                ids = (ids[:, None] * per_logical + torch.arange(per_logical)).reshape(-1)
            for view, region_groups in regions:
                if group in region_groups:
                    groups.append(group)
                    gathered.append(view[ids.to(view.device)].view(len(blocks), -1))  # a gather: a copy
        if all(t.is_cpu for t in gathered):  # the gather was the copy
            staged = [Staged.host(t.numpy()) for t in gathered]
        else:
            staged = self.staging.stage_all(gathered)
        return CopiedBlocks(block_ids, list(zip(groups, staged, strict=True)))

    def hash(self, copied: CopiedBlocks) -> bytes:
        digests: list[int] = []
        for group, blocks in enumerate(copied.block_ids):
            hashes = [hashlib.blake2b(digest_size=8) for _ in blocks]
            for _, rows in (r for r in copied.rows if r[0] == group):
                for h, row in zip(hashes, rows.numpy(), strict=True):
                    h.update(row)
            # The null block holds nothing transferable; its bytes differ between engines.
            digests += [int.from_bytes(h.digest(), "little") if b else 0 for b, h in zip(blocks, hashes, strict=True)]
        return records.transfer_digest(self.layout, digests)


ADAPTERS: list[ConnectorAdapter] = [MooncakeAdapter()]


def adapter_for(connector: Any) -> ConnectorAdapter:
    return next((a for a in ADAPTERS if a.handles(connector)), ConnectorAdapter())


# -- the generic probe -------------------------------------------------------------------------
class ConnectorProbe:
    """Records one worker-side connector's transfers through the v1 API."""

    def __init__(
        self,
        connector: Any,
        adapter: ConnectorAdapter,
        record: Record,
        current_step: Callable[[], int],
        *,
        digest_fraction: float = 0.0,
        prompt_tokens: Callable[[str], int | None] = lambda req_id: None,
    ):
        self.connector = connector
        self.adapter = adapter
        self.name = type(connector).__name__
        self.record = record
        self.current_step = current_step
        self.pending: dict[tuple[ConnectorKind, str], Transfer] = {}  # (intent kind, req id) -> the intent
        self.expired: set[str] = set()  # filled by adapters that can tell
        self.capabilities: list[Capability] = []
        self.digest_fraction = digest_fraction
        self.digester: BlockDigester | None = None
        self.prompt_tokens = prompt_tokens  # the runner's count for a request it still holds
        self.num_tokens: dict[str, int] = {}  # req id -> prompt tokens, noted while the runner had it
        # Blocks reported as failed to load whose receive has not completed yet: the worker may
        # report them a step before it reports the receive finished.
        self.invalid: set[int] = set()
        self._completions: Completions | None = None
        self._broken = False
        self._hasher: ThreadPoolExecutor | None = None  # the digest thread, started by the first digest

    def attach(self) -> list[Capability]:
        missing = [m for m in CONNECTOR_API if not callable(getattr(self.connector, m, None))]
        if missing:
            return [("connector", False, f"{self.name} has no {', '.join(missing)}")]
        bind, results, load_errors = (getattr(self.connector, m) for m in CONNECTOR_API)

        def traced_bind(metadata, *args, **kwargs):
            bind(metadata, *args, **kwargs)
            self._guard(self._on_bind, metadata)

        def traced_results(*args, **kwargs):
            found = results(*args, **kwargs)
            self._guard(self._on_results, found)
            return found

        def traced_load_errors(*args, **kwargs):
            invalid = load_errors(*args, **kwargs)
            self._guard(self._on_load_errors, invalid)
            return invalid

        self.connector.bind_connector_metadata = traced_bind
        self.connector.get_transfer_results = traced_results
        self.connector.get_block_ids_with_load_errors = traced_load_errors
        return [("connector", True, None), *self.adapter.attach(self.connector, self), *self._attach_digests()]

    def _attach_digests(self) -> list[Capability]:
        if self.digest_fraction <= 0.0:
            return []
        self.digester = self.adapter.digester(self.connector)
        if self.digester is None:
            return [("transfer_digests", False, f"the {self.adapter.name} adapter cannot locate {self.name}'s blocks")]
        return [("transfer_digests", True, None)]

    def _guard(self, fn: Callable, *args) -> None:
        """Run a probe; on failure log once and go quiet, never raise into the engine."""
        if self._broken:
            return
        try:
            fn(*args)
        except Exception:
            self._broken = True
            log.exception("kv_trace: connector probe failed; this rank stops recording transfers")

    def _digest(self, transfer: Transfer | None) -> Future | None:
        """The digest of a completed transfer's blocks, when it is sampled: its bytes copied now
        (before the scheduler learns of the completion, so no other request has them yet), hashed
        on the digest thread."""
        if self.digester is None or transfer is None or not transfer.transfer_id:
            return None
        if not sampled(transfer.transfer_id, self.digest_fraction):
            return None
        try:
            copied = self.digester.copy(transfer.block_ids)
        except StagingFull as exc:  # the digest thread is behind: this transfer goes undigested
            log.warning("kv_trace: transfer %s not digested: %s", transfer.transfer_id, exc)
            return None
        except Exception:  # a layout we misread: no digests from here on, the rest keeps recording
            log.exception("kv_trace: transfer digests disabled on this rank")
            self.digester = None
            return None
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvledger-digest")
        return self._hasher.submit(self.digester.hash, copied)

    def _digest_of(self, pending: Future) -> bytes | None:
        """The digest the thread computed (waits for it); None, and no digests from here on,
        if hashing failed."""
        try:
            return pending.result()
        except Exception:
            log.exception("kv_trace: transfer digests disabled on this rank")
            self.digester = None
            return None

    # -- what the connector was told and what it reported ------------------------------------------
    def _on_bind(self, metadata: Any) -> None:
        if self._completions is not None:  # a runner that never asked for load errors
            self._record_completions()
        for transfer in self.adapter.transfers(metadata):
            if transfer.kind is None:  # the runner still holds the request: note its size
                tokens = self.prompt_tokens(transfer.req_id)
                if tokens is not None:
                    self.num_tokens[transfer.req_id] = tokens
                continue
            if transfer.kind in (ConnectorKind.SEND_INTENT, ConnectorKind.RECV_INTENT):
                self.pending[(transfer.kind, transfer.req_id)] = transfer
            self._emit(transfer.kind, transfer)

    def _on_results(self, results: Any) -> None:
        failed = set(getattr(results, "failed_recving", None) or ())
        self._completions = Completions(
            set(results.finished_sending or ()), set(results.finished_recving or ()) - failed, failed
        )

    def _on_load_errors(self, invalid: set[int]) -> None:
        if invalid:
            self._emit(ConnectorKind.INVALID_BLOCKS, None, req_id=None, blocks=[sorted(int(b) for b in invalid)])
            # Kept for the receives that hold them (only those: others can never claim them).
            pulls = [t for (kind, _), t in self.pending.items() if kind == ConnectorKind.RECV_INTENT]
            receiving = {b for t in pulls for g in t.block_ids for b in g}
            self.invalid |= {int(b) for b in invalid} & receiving
        self._record_completions()

    def _record_completions(self) -> None:
        done, self._completions = self._completions, None
        if done is None:
            return
        expired, self.expired = self.expired, set()
        for req_id in sorted(done.sent):
            kind = ConnectorKind.EXPIRED if req_id in expired else ConnectorKind.SEND_DONE
            intent = self.pending.pop((ConnectorKind.SEND_INTENT, req_id), None)
            self._emit(kind, intent, req_id, digest=self._digest(intent) if kind == ConnectorKind.SEND_DONE else None)
            self.num_tokens.pop(req_id, None)
        for req_id in sorted(done.received | done.failed):
            intent = self.pending.pop((ConnectorKind.RECV_INTENT, req_id), None)
            lost = sorted(self.invalid.intersection(b for g in intent.block_ids for b in g)) if intent else []
            self.invalid.difference_update(lost)
            if req_id in done.failed or lost:
                detail = f"{len(lost)} block(s) failed to load" if lost else "reported failed"
                self._emit(ConnectorKind.RECV_FAILED, intent, req_id, detail=detail)
            else:
                self._emit(ConnectorKind.RECV_DONE, intent, req_id, digest=self._digest(intent))

    def _emit(
        self,
        kind: ConnectorKind,
        transfer: Transfer | None,
        req_id: str | None = None,
        *,
        blocks: list[list[int]] | None = None,
        detail: str | None = None,
        digest: Future | None = None,
    ) -> None:
        step, name = self.current_step(), self.name
        req = req_id if transfer is None else transfer.req_id
        fields = {
            "req_id": req_id if transfer is None else transfer.req_id or None,
            "transfer_id": transfer.transfer_id if transfer else None,
            "remote_engine_id": transfer.remote_engine_id if transfer else None,
            "block_ids": blocks if blocks is not None else (transfer.block_ids if transfer else []),
            "detail": detail,
            "num_tokens": self.num_tokens.get(req) if req and kind == ConnectorKind.SEND_INTENT else None,
        }

        # Sent through the ring as a body; the block lists are our own copies. An event with a
        # digest is built once the digest thread is done, and held in the rank's order until then.
        def build() -> Body:
            hashed = self._digest_of(digest) if digest is not None else None
            return records.connector_event(step, name, kind, **fields, digest=hashed)

        self.record(build, ready=digest.done if digest is not None else None)


def attach_connector_probe(runner: Any, record: Record, current_step: Callable[[], int]) -> list[Capability]:
    """Probe the worker-side KV connector of the runner's engine, if it has one.

    `record` is the rank's capture path (it takes a record body), `current_step`
    the rank's step counter. Returns the connector capabilities, available or
    not, in RankInfo's form.
    """
    if getattr(runner.vllm_config, "kv_transfer_config", None) is None:
        return [("connector", False, "no KV connector configured")]
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError as exc:
        return [("connector", False, f"vLLM's KV transfer group is unavailable ({exc})")]
    if not has_kv_transfer_group():
        return [("connector", False, "no KV connector in this worker")]
    connector = get_kv_transfer_group()
    existing = getattr(connector, "_kvledger_connector_probe", None)
    if existing is not None:  # a second attach in the same worker: record to the new rank probe
        existing.record, existing.current_step = record, current_step
        return existing.capabilities
    probe = ConnectorProbe(
        connector,
        adapter_for(connector),
        record,
        current_step,
        digest_fraction=_digest_fraction(runner),
        prompt_tokens=_prompt_tokens(runner),
    )
    try:
        probe.capabilities = probe.attach()
    except Exception as exc:  # a connector shaped unlike any we know: report, never crash
        log.exception("kv_trace: could not attach the connector probe")
        return [("connector", False, f"attach failed: {exc}")]
    connector._kvledger_connector_probe = probe
    log.info("kv_trace: connector probe on %s (%s adapter)", probe.name, probe.adapter.name)
    return probe.capabilities


def _digest_fraction(runner: Any) -> float:
    try:
        return TraceConfig.from_additional_config(runner.vllm_config.additional_config).transfer_digests
    except Exception:  # validated at engine start already; never fail the attach over it
        return 0.0


def _prompt_tokens(runner: Any) -> Callable[[str], int | None]:
    """A request's prompt length, from the V1 runner's request states or MRV2's `req_states`."""

    def count(req_id: str) -> int | None:
        state = getattr(runner, "requests", {}).get(req_id)
        prompt = getattr(state, "prompt_token_ids", None)
        if prompt is not None:
            return len(prompt)
        states = getattr(runner, "req_states", None)  # MRV2: columns indexed by a request slot
        slot = getattr(states, "req_id_to_index", {}).get(req_id)
        return int(states.prompt_len.np[slot]) if slot is not None else None

    return count
