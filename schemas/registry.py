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


def batch_raw() -> dict[str, Any]:
    """`ledger_event_batch.avsc` with LedgerEvent's definition in place of its name (as registered)."""
    batch = raw_schema("ledger_event_batch")
    batch["fields"][0]["type"]["items"] = raw_schema("ledger_event")
    return batch


def _named(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "namespace": "kvledger"}


def checkpoint_raw() -> dict[str, Any]:
    """`checkpoint.avsc` with the definitions it names from the other schemas in place of their first
    use: `kvledger.RankInfo` and `kvledger.StepPlan` (`ledger_event.avsc`), `kvledger.Violation`."""
    event_bodies = raw_schema("ledger_event")["fields"][-1]["type"]
    step_fields = {f["name"]: f["type"] for f in event_bodies[1]["fields"]}
    definitions = {
        "kvledger.RankInfo": _named(event_bodies[0]),
        "kvledger.StepPlan": _named(next(t for t in step_fields["plan"] if isinstance(t, dict))),
        "kvledger.Violation": raw_schema("violation"),
    }

    def inline(node: Any) -> Any:
        if isinstance(node, str) and node in definitions:
            return definitions.pop(node)  # later uses refer to it by name
        if isinstance(node, list):
            return [inline(n) for n in node]
        if isinstance(node, dict):
            return {k: inline(v) if k in ("type", "items", "values", "fields") else v for k, v in node.items()}
        return node

    return inline(raw_schema("checkpoint"))


LEDGER_EVENT = load_schema("ledger_event")
LEDGER_EVENT_BATCH = fastavro.parse_schema(batch_raw())
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
