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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvledger.producer import records

log = logging.getLogger("kvledger.producer")

Body = tuple[str, dict]
Record = Callable[[Body | Callable[[], Body]], None]  # the rank's capture path
Capability = tuple[str, bool, str | None]  # (name, available, reason), as RankInfo carries them
CONNECTOR_API = ("bind_connector_metadata", "get_transfer_results", "get_block_ids_with_load_errors")


@dataclass(frozen=True)
class Transfer:
    """One transfer as the bound metadata announces it."""

    kind: str  # SEND_INTENT | RECV_INTENT | OTHER
    req_id: str
    transfer_id: str | None
    remote_engine_id: str | None
    block_ids: list[list[int]]  # per KV cache group, copied
    detail: str | None = None


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
            Transfer("SEND_INTENT", req_id, transfer_id, None, _blocks(groups))
            for req_id, (transfer_id, groups) in (getattr(metadata, "reqs_to_send", None) or {}).items()
            if any(groups)
        ]
        for remote_engine_id, pulls in (getattr(metadata, "reqs_to_recv", None) or {}).items():
            for pull in pulls.values():
                blocks = _blocks(pull.local_block_ids)
                kind, detail = ("RECV_INTENT", None) if any(blocks) else ("OTHER", "release_only")
                found.append(Transfer(kind, pull.d_req_id, pull.transfer_id, remote_engine_id, blocks, detail))
        found += [
            Transfer("OTHER", "", transfer_id, None, [], "send_cancelled")
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


ADAPTERS: list[ConnectorAdapter] = [MooncakeAdapter()]


def adapter_for(connector: Any) -> ConnectorAdapter:
    return next((a for a in ADAPTERS if a.handles(connector)), ConnectorAdapter())


# -- the generic probe -------------------------------------------------------------------------
class ConnectorProbe:
    """Records one worker-side connector's transfers through the v1 API."""

    def __init__(self, connector: Any, adapter: ConnectorAdapter, record: Record, current_step: Callable[[], int]):
        self.connector = connector
        self.adapter = adapter
        self.name = type(connector).__name__
        self.record = record
        self.current_step = current_step
        self.pending: dict[tuple[str, str], Transfer] = {}  # (intent kind, req id) -> the intent
        self.expired: set[str] = set()  # filled by adapters that can tell
        self.capabilities: list[Capability] = []
        self._completions: Completions | None = None
        self._broken = False

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
        return [("connector", True, None), *self.adapter.attach(self.connector, self)]

    def _guard(self, fn: Callable, *args) -> None:
        """Run a probe; on failure log once and go quiet, never raise into the engine."""
        if self._broken:
            return
        try:
            fn(*args)
        except Exception:
            self._broken = True
            log.exception("kv_trace: connector probe failed; this rank stops recording transfers")

    # -- what the connector was told and what it reported ------------------------------------------
    def _on_bind(self, metadata: Any) -> None:
        if self._completions is not None:  # a runner that never asked for load errors
            self._record_completions(set())
        for transfer in self.adapter.transfers(metadata):
            if transfer.kind != "OTHER":
                self.pending[(transfer.kind, transfer.req_id)] = transfer
            self._emit(transfer.kind, transfer)

    def _on_results(self, results: Any) -> None:
        failed = set(getattr(results, "failed_recving", None) or ())
        self._completions = Completions(
            set(results.finished_sending or ()), set(results.finished_recving or ()) - failed, failed
        )

    def _on_load_errors(self, invalid: set[int]) -> None:
        if invalid:
            self._emit("INVALID_BLOCKS", None, req_id=None, blocks=[sorted(int(b) for b in invalid)])
        self._record_completions(invalid)

    def _record_completions(self, invalid: set[int]) -> None:
        done, self._completions = self._completions, None
        if done is None:
            return
        expired, self.expired = self.expired, set()
        for req_id in sorted(done.sent):
            kind = "EXPIRED" if req_id in expired else "SEND_DONE"
            self._emit(kind, self.pending.pop(("SEND_INTENT", req_id), None), req_id)
        for req_id in sorted(done.received | done.failed):
            intent = self.pending.pop(("RECV_INTENT", req_id), None)
            lost = sorted(invalid.intersection(b for group in intent.block_ids for b in group)) if intent else []
            if req_id in done.failed or lost:
                detail = f"{len(lost)} block(s) failed to load" if lost else "reported failed"
                self._emit("RECV_FAILED", intent, req_id, detail=detail)
            else:
                self._emit("RECV_DONE", intent, req_id)

    def _emit(
        self,
        kind: str,
        transfer: Transfer | None,
        req_id: str | None = None,
        *,
        blocks: list[list[int]] | None = None,
        detail: str | None = None,
    ) -> None:
        step, name = self.current_step(), self.name
        fields = {
            "req_id": req_id if transfer is None else transfer.req_id or None,
            "transfer_id": transfer.transfer_id if transfer else None,
            "remote_engine_id": transfer.remote_engine_id if transfer else None,
            "block_ids": blocks if blocks is not None else (transfer.block_ids if transfer else []),
            "detail": detail or (transfer.detail if transfer else None),
        }
        # Packed on the drain thread; the block lists are our own copies.
        self.record(lambda: records.connector_event(step, name, kind, **fields))


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
    probe = ConnectorProbe(connector, adapter_for(connector), record, current_step)
    try:
        probe.capabilities = probe.attach()
    except Exception as exc:  # a connector shaped unlike any we know: report, never crash
        log.exception("kv_trace: could not attach the connector probe")
        return [("connector", False, f"attach failed: {exc}")]
    connector._kvledger_connector_probe = probe
    log.info("kv_trace: connector probe on %s (%s adapter)", probe.name, probe.adapter.name)
    return probe.capabilities
