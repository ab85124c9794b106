"""Loading the `.avsc` files shipped with the package."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import fastavro

Schema = dict[str, Any]


@cache
def load_schema(name: str) -> Schema:
    """Parse `schemas/avro/<name>.avsc` (e.g. 'ledger_event', 'violation')."""
    text = resources.files("kvledger.schemas").joinpath("avro", f"{name}.avsc").read_text()
    return fastavro.parse_schema(json.loads(text))


def raw_schema(name: str) -> dict[str, Any]:
    """The schema as written in the file, for registries and tooling."""
    text = resources.files("kvledger.schemas").joinpath("avro", f"{name}.avsc").read_text()
    return json.loads(text)


def _batch_schema() -> Schema:
    """`ledger_event_batch.avsc` with LedgerEvent's definition in place of its name."""
    batch = raw_schema("ledger_event_batch")
    batch["fields"][0]["type"]["items"] = raw_schema("ledger_event")
    return fastavro.parse_schema(batch)


def checkpoint_raw() -> dict[str, Any]:
    """`checkpoint.avsc` with RankInfo's definition (from `ledger_event.avsc`) in place of its name."""
    checkpoint = raw_schema("checkpoint")
    rank_info = {**raw_schema("ledger_event")["fields"][-1]["type"][0], "namespace": "kvledger"}
    engine = checkpoint["fields"][0]["type"][0]
    slot = engine["fields"][[f["name"] for f in engine["fields"]].index("ranks")]["type"]["items"]
    info = slot["fields"][[f["name"] for f in slot["fields"]].index("info")]
    info["type"] = ["null", rank_info]
    return checkpoint


LEDGER_EVENT = load_schema("ledger_event")
LEDGER_EVENT_BATCH = _batch_schema()
VIOLATION = load_schema("violation")
CHECKPOINT = fastavro.parse_schema(checkpoint_raw())

# Names of the body union's branches, as decoders return them.
RANK_INFO = "kvledger.RankInfo"
STEP = "kvledger.Step"
CONNECTOR_EVENT = "kvledger.ConnectorEvent"
SNAPSHOT = "kvledger.Snapshot"
HEALTH = "kvledger.Health"
ENGINE_CHECKPOINT = "kvledger.checkpoint.EngineCheckpoint"
JOIN_CHECKPOINT = "kvledger.checkpoint.JoinCheckpoint"
