"""The contract's typed records (kvledger.schemas.events), the one definition of each: they agree with
the `.avsc` field for field, every decoded record is typed field for field, the enums name the
schema's symbols, and a typed record goes back to the record it came from."""

from __future__ import annotations

import typing
from enum import StrEnum

import msgspec
import pytest

from kvledger.producer import records
from kvledger.schemas import LEDGER_EVENT, SingleObjectCodec
from kvledger.schemas.events import (
    BODIES,
    ConnectorEvent,
    DraftPass,
    GroupPlan,
    Health,
    RankInfo,
    RankKey,
    Snapshot,
    Step,
    StepPlan,
    Violation,
    event_of,
    events_of,
    to_record,
    typed,
)
from kvledger.schemas.kinds import (
    ConnectorKind,
    DigestReason,
    KvGroupKind,
    PdRole,
    Runner,
    StepKind,
    Unchecked,
    connector_wire,
)
from kvledger.schemas.registry import raw_schema
from kvledger.stream_app.core import Ledger
from tests.schema_agreement import record_agrees as _record_agrees
from tests.synthetic.engine import FaultSpec, PdConfig, SimConfig, simulate, simulate_pd_pair

CODEC = SingleObjectCodec(LEDGER_EVENT)


def decoded(events: list[dict]) -> list[dict]:
    """As a reader gets them: through Avro (defaults filled in, enums as their symbols)."""
    return [CODEC.decode(CODEC.encode(e)) for e in events]


def same(typed, record) -> bool:
    """A typed value carries what the record does, field for field, all the way down."""
    if isinstance(typed, msgspec.Struct):
        return all(same(getattr(typed, f), record[f]) for f in typed.__struct_fields__)
    if isinstance(typed, list):
        return isinstance(record, list) and len(typed) == len(record) and all(map(same, typed, record))
    if isinstance(typed, StrEnum):
        return typed.value == record
    return type(typed) is type(record) and typed == record


def streams() -> list[dict]:
    pd = simulate_pd_pair(PdConfig(seed=1, requests=4, faults=(("recv_failed", 0),))).events
    closing = simulate(SimConfig(seed=2, steps=120, tp_size=2, snapshot_interval=40, close_at_end=True)).events
    return decoded(pd + closing)


def test_every_record_is_typed_field_for_field():
    records = streams()
    typed = [event_of(r) for r in records]
    assert {type(t.body) for t in typed} == {RankInfo, Step, ConnectorEvent, Snapshot, Health}
    for record, event in zip(records, typed, strict=True):
        assert event.rank == RankKey(record["engine_id"], record["dp_rank"], record["tp_rank"], record["pp_rank"])
        assert (event.incarnation, event.seq, event.emitted_at_us, event.engine_id) == (
            record["incarnation"], record["seq"], record["emitted_at_us"], record["engine_id"],
        )  # fmt: skip
        assert same(event.body, record["body"][1]), record
    assert any(isinstance(t.body, Health) and t.body.closing for t in typed)
    assert {t.body.kind for t in typed if isinstance(t.body, ConnectorEvent)} >= {
        ConnectorKind.SEND_INTENT, ConnectorKind.RECV_FAILED,
    }  # fmt: skip


def test_what_a_checkpoint_keeps_goes_back_to_its_record():
    records = streams()
    infos = [r["body"][1] for r in records if r["body"][0] == "kvledger.RankInfo"]
    assert {i["pd_role"] for i in infos} == {"PREFILL", "DECODE", "NONE"}
    for info in infos:
        assert to_record(typed(RankInfo, info)) == info
    steps = [r for r in records if r["body"][0] == "kvledger.Step" and r["body"][1]["plan"] is not None]
    step = steps[len(steps) // 2]
    plan = step["body"][1]["plan"]
    pass_ = {"group_id": 0, "pass_index": 1, "num_tokens": plan["num_tokens"], "first_positions": b"",
             "slot_runs": b"", "num_real": 0, "num_padding": 0}  # fmt: skip
    step["body"][1]["plan"] = plan = plan | {"draft_writes": [pass_]}
    (drafted,) = decoded([step])
    assert drafted["body"][1]["plan"] == plan
    for p in (plan, plan | {"draft_writes": None}, *(s["body"][1]["plan"] for s in steps[:20])):
        assert to_record(typed(StepPlan, p)) == p


def test_the_enums_name_the_schema_symbols():
    symbols: dict[str, list[str]] = {}

    def walk(node) -> None:
        if isinstance(node, list):
            for n in node:
                walk(n)
        elif isinstance(node, dict):
            if node.get("type") == "enum":
                symbols[node["name"]] = node["symbols"]
            for key in ("type", "items", "fields"):
                walk(node.get(key))

    walk(raw_schema("ledger_event"))
    enums = {
        "PdRole": PdRole,
        "KvGroupKind": KvGroupKind,
        "StepKind": StepKind,
        "ConnectorEventKind": ConnectorKind,
        "DigestReason": DigestReason,
    }
    assert symbols.keys() == enums.keys()
    for name, enum in enums.items():
        written = [m.value for m in enum if enum is not ConnectorKind or connector_wire(m, None)[0] == m.value]
        assert written == symbols[name], name
        assert all(m == m.value for m in enum)  # a member equals the symbol a checkpoint holds


@pytest.mark.parametrize("kind", [ConnectorKind.SEND_CANCELLED, ConnectorKind.RECV_RELEASED])
def test_a_connector_kind_without_a_symbol_is_written_as_other_and_read_back_typed(kind):
    """The schema keeps its symbols (and fingerprint): the kind is named in `detail`, as ledgers written
    before it was typed named it, and both read back as the kind."""
    body = records.connector_event(3, "MooncakeConnector", kind, req_id="r", transfer_id="t")
    (record,) = decoded([records.envelope(records.RankIdentity("e"), 0, 0, body)])
    assert record["body"][1]["kind"] == "OTHER" and record["body"][1]["detail"] in ("send_cancelled", "release_only")
    assert event_of(record).body.kind is kind


def test_a_connector_kind_from_a_newer_writer_reads_as_other_and_is_counted():
    record = records.envelope(records.RankIdentity("e"), 0, 0, records.connector_event(3, "c", "SEND_INTENT"))
    record["body"][1]["kind"] = "SEND_REPLAYED"
    event = event_of(record)
    assert event.body.kind is ConnectorKind.OTHER
    ledger = Ledger()
    ledger.apply(event)
    assert ledger.coverage.unchecked[Unchecked.CONNECTOR_KIND_UNKNOWN] == 1


def test_the_runner_reads_older_names_and_newer_ones():
    info = to_record(records.rank_info(dp_size=1, tp_size=1, pp_size=1, kv_groups=[], vllm_version="x", runner="v1"))
    info["runner"] = "mrv2"  # as probes before the runner was typed wrote Model Runner V2
    assert typed(RankInfo, info).runner is Runner.V2
    assert typed(RankInfo, info | {"runner": "v3"}).runner is Runner.OTHER
    assert typed(RankInfo, info | {"runner": "v1"}).runner is Runner.V1


def test_a_body_of_unknown_kind_is_refused_not_guessed():
    record = streams()[0] | {"body": ("kvledger.Future", {})}
    with pytest.raises(ValueError, match=r"unknown kind 'kvledger\.Future'"):
        event_of(record)


def test_the_core_answers_the_same_for_records_typed_at_once_or_as_read():
    faults = (FaultSpec("slot_shift", step=40), FaultSpec("block_swap", step=90, tp_rank=1))
    records = decoded(simulate(SimConfig(seed=4, steps=150, tp_size=2, faults=faults)).events)
    by_stream, by_list = Ledger(), Ledger()
    found = by_stream.apply_many(events_of(records, by_stream.key_of))
    assert found  # the faults are there to be found
    assert by_list.apply_many([event_of(r) for r in records]) == found
    assert by_list.coverage.checks == by_stream.coverage.checks


def test_a_record_built_in_process_may_leave_out_what_the_schema_defaults():
    """The in-engine check reads records before they are encoded: a defaulted field may be missing."""
    defaulted = {
        "kvledger.RankInfo": ("full_rows", "snapshot_interval"),
        "kvledger.Step": ("input", "plan"),
        "kvledger.ConnectorEvent": ("req_id", "transfer_id", "remote_engine_id", "block_ids", "num_tokens", "digest"),
        "kvledger.Health": ("closing",),
    }
    records = streams()
    for name, fields in defaulted.items():
        record = next(r for r in records if r["body"][0] == name)
        sparse = {k: v for k, v in record["body"][1].items() if k not in fields}
        normalized = CODEC.decode(CODEC.encode(record | {"body": (name, sparse)}))  # as a reader fills them in
        assert event_of(record | {"body": (name, sparse)}) == event_of(normalized), name


# -- the typed model and the .avsc, field for field ------------------------------------------------------
def test_the_typed_model_is_the_schema_field_for_field():
    """`kvledger.schemas.events` and `ledger_event.avsc` name the same records, fields in the same order,
    of the same types (nullable where the schema says so), enums of the same symbols, defaults alike."""
    schema = raw_schema("ledger_event")
    assert [f["name"] for f in schema["fields"][:-1]] == [
        "engine_id",
        "dp_rank",
        "tp_rank",
        "pp_rank",
        "incarnation",
        "seq",
        "emitted_at_us",
    ]  # fmt: skip  (the envelope: LedgerEvent's rank, incarnation, seq, time)
    branches = schema["fields"][-1]["type"]
    assert [b["name"] for b in branches] == [cls.__name__ for cls in BODIES]
    for branch, cls in zip(branches, BODIES, strict=True):
        _record_agrees(branch, cls)


def test_the_violation_is_its_schema_field_for_field():
    _record_agrees(raw_schema("violation"), Violation)


def test_the_agreement_check_bites():
    class StepPlan(msgspec.Struct):  # a field renamed
        req_indices: bytes
        num_token: bytes
        first_positions: bytes
        groups: list[GroupPlan]
        draft_writes: list[DraftPass] | None = None

    plan = next(t for t in typing.get_args(typing.get_type_hints(Step)["plan"]) if t is not type(None))
    avro = next(b for b in raw_schema("ledger_event")["fields"][-1]["type"] if b["name"] == "Step")
    plan_avro = next(f for f in avro["fields"] if f["name"] == "plan")["type"][1]
    _record_agrees(plan_avro, plan)
    with pytest.raises(AssertionError):
        _record_agrees(plan_avro, StepPlan)
