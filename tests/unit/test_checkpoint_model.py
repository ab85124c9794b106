"""The typed checkpoint records (kvledger.schemas.checkpoint), the one definition of each: they agree
with `checkpoint.avsc` field for field, and a checkpoint decodes into them and encodes back to its
own bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.schemas import DecodeError, SingleObjectCodec, checkpoint
from kvledger.schemas.checkpoint import BODIES, BODY_NAMES, EngineCheckpoint, JoinCheckpoint
from kvledger.schemas.codec import schema_fingerprint
from kvledger.schemas.kinds import ConnectorKind, Runner, TransferOutcome, TransferRole, ViolationKind
from kvledger.schemas.registry import CHECKPOINT, checkpoint_raw
from kvledger.stream_app.worker.projection import CheckpointError, EngineProjection
from tests.schema_agreement import Agreement

GOLDEN = json.loads(Path(__file__).with_name("checkpoint_golden.json").read_text())
# Enums the schema keeps as strings: a RankInfo's runner, a violation's kind, a transfer side's role and
# outcome, a connector kind a side saw.
STRING_ENUMS = (Runner, ViolationKind, TransferRole, TransferOutcome, ConnectorKind)


def agreement() -> Agreement:
    return Agreement(string_enums=STRING_ENUMS, all_defaults=(checkpoint.__name__,))


def test_the_typed_checkpoint_is_the_schema_field_for_field():
    """`kvledger.schemas.checkpoint` and `checkpoint.avsc` (with the RankInfo, StepPlan and Violation it
    names) name the same records, fields in the same order, of the same types, nullable alike, with the
    same defaults; the body's branches are the bodies, in order."""
    schema = checkpoint_raw()
    assert [f["name"] for f in schema["fields"]] == ["body"]
    branches = schema["fields"][0]["type"]
    assert [f"{schema['namespace']}.{b['name']}" for b in branches] == [BODY_NAMES[cls] for cls in BODIES]
    check = agreement()
    for branch, cls in zip(branches, BODIES, strict=True):
        check.record(branch, cls)


def _engine_branch() -> dict:
    return json.loads(json.dumps(checkpoint_raw()["fields"][0]["type"][0]))


def _slot_fields(branch: dict) -> list[dict]:
    return next(f for f in branch["fields"] if f["name"] == "ranks")["type"]["items"]["fields"]


def _default_added(fields: list[dict]) -> None:
    next(f for f in fields if f["name"] == "desynced")["default"] = False


def _swapped(fields: list[dict]) -> None:
    fields[1], fields[2] = fields[2], fields[1]


def _made_required(fields: list[dict]) -> None:
    next(f for f in fields if f["name"] == "gap_after_step")["type"] = "long"


def _retyped(fields: list[dict]) -> None:
    next(f for f in fields if f["name"] == "incarnation")["type"] = "string"


@pytest.mark.parametrize("damage", [_default_added, _swapped, _made_required, _retyped])
def test_the_agreement_check_bites(damage):
    agreement().record(_engine_branch(), EngineCheckpoint)
    branch = _engine_branch()
    damage(_slot_fields(branch))
    with pytest.raises(AssertionError):
        agreement().record(branch, EngineCheckpoint)


def test_an_enum_the_schema_keeps_a_string_must_be_named_as_one():
    agreement().type("string", TransferRole, "Side.role")
    with pytest.raises(AssertionError, match="an enum the schema keeps a string"):
        Agreement().type("string", TransferRole, "Side.role")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_a_checkpoint_is_its_typed_record(name):
    """Decoded once into the typed body, encoded once: the same bytes (the model carries every field)."""
    blob = bytes.fromhex(GOLDEN[name])
    assert blob[2:10] == schema_fingerprint(CHECKPOINT)  # written with this very schema
    body = checkpoint.decode(blob)
    assert isinstance(body, JoinCheckpoint if name.startswith("join") else EngineCheckpoint)
    assert checkpoint.encode(body) == blob


def test_the_fingerprint_is_the_published_one():
    vectors = json.loads((Path(__file__).parents[2] / "schemas" / "vectors" / "fingerprints.json").read_text())
    assert schema_fingerprint(CHECKPOINT).hex() == vectors["schemas"]["kvledger.checkpoint.Checkpoint"]


def test_a_record_outside_the_model_is_refused_not_guessed():
    raw = SingleObjectCodec(CHECKPOINT)
    name, join = raw.decode(bytes.fromhex(GOLDEN["join"]))["body"]
    side = next(s for t in join["transfers"] for s in t["sides"])
    side["role"] = "relay"  # a string the schema allows and the model does not
    with pytest.raises(ValueError, match="malformed JoinCheckpoint"):
        checkpoint.decode(raw.encode({"body": (name, join)}))
    with pytest.raises(DecodeError):
        checkpoint.decode(b"\xc3\x01" + b"\x00" * 12)
    with pytest.raises(CheckpointError, match=r"where a kvledger\.checkpoint\.EngineCheckpoint belongs"):
        EngineProjection.restore(bytes.fromhex(GOLDEN["join"]))
