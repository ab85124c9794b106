"""Stand-ins shaped like vLLM 0.32's KV connectors (v1 worker API, Mooncake's worker), for the
connector probe's tests; importable without pytest (the vLLM interpreter's scripts use them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class PullReqMeta:  # vLLM's, same fields the adapter reads
    d_req_id: str
    transfer_id: str
    local_block_ids: list[list[int]]
    remote_engine_id: str


@dataclass
class Metadata:
    reqs_to_send: dict = field(default_factory=dict)
    reqs_to_recv: dict = field(default_factory=dict)
    reqs_not_processed: set = field(default_factory=set)


@dataclass
class Results:  # KVConnectorTransferResults
    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


class Worker:
    """MooncakeConnectorWorker's sending side: sent requests, and sends that expired."""

    def __init__(self):
        self.finished_sending_reqs: set[str] = set()
        self.expiring: set[str] = set()

    async def fetch_finished_sending_reqs(self) -> set[str]:
        finished, self.finished_sending_reqs = self.finished_sending_reqs | self.expiring, set()
        self.expiring = set()
        return finished


class V1Connector:
    """The three v1 worker methods the runner calls each step, on a Mooncake-like worker."""

    def __init__(self):
        self.connector_worker = Worker()
        self.bound = None
        self.next_results = Results()
        self.next_invalid: set[int] = set()

    def bind_connector_metadata(self, metadata):
        self.bound = metadata

    def get_transfer_results(self, finished_req_ids):
        sent = asyncio.run(self.connector_worker.fetch_finished_sending_reqs())
        results, self.next_results = self.next_results, Results()
        results.finished_sending |= sent
        return results

    def get_block_ids_with_load_errors(self):
        invalid, self.next_invalid = self.next_invalid, set()
        return invalid


class MooncakeConnector(V1Connector):
    """Named like vLLM's, as the adapter matches by class name (no vLLM import needed)."""


class OtherConnector(V1Connector):
    pass


def step(connector, metadata=None):
    connector.bind_connector_metadata(metadata or Metadata())
    connector.get_transfer_results(set())
    connector.get_block_ids_with_load_errors()
