"""Time travel shows what the plan did: a synthetic engine with one slot shifted, recorded to a file
ledger and queried like `kvledger query` does, with no broker.

The plan part of a request's view must name the token written to the wrong slot, with the slot the
ledger's row gives it, exactly as the violation the replay reports says.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.producer.sinks import FileSink
from kvledger.stream_app.replay import query, replay
from tests.synthetic.engine import FaultSpec, GroupSpec, SimConfig, simulate

ENGINE = "travel-engine"
FAULT_STEP = 40
KVLEDGER = str(Path(sys.executable).with_name("kvledger"))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> tuple[Path, object]:
    """A TP=2 engine whose rank 0 shifts one request's slots at FAULT_STEP, as a file ledger."""
    config = SimConfig(
        seed=3,
        engine_id=ENGINE,
        steps=120,
        tp_size=2,
        groups=(GroupSpec(), GroupSpec("SLIDING_WINDOW", 48)),
        num_blocks=120,
        faults=(FaultSpec("slot_shift", FAULT_STEP),),
    )
    root = tmp_path_factory.mktemp("ledger")
    with FileSink(root) as sink:
        sink.write(simulate(config).events)
    [violation] = [v for v in replay(root).violations if v.kind == "write_target_mismatch"]
    return root, violation


def test_the_plan_beside_the_row_marks_the_wrong_slot(faulty):
    root, violation = faulty
    expected_slot, actual_slot = map(
        int, re.search(r"expected slot (\d+), actual slot (\d+)", violation.detail).groups()
    )
    views = query(root, ENGINE, violation.req_id, violation.step)
    assert [v.tp_rank for v in views] == [0, 1]
    for view in views:
        plan = view.plan
        assert plan is not None and plan.step == violation.step == view.step
        assert not plan.position_wrong and plan.first_position == plan.computed
        for g in plan.groups:
            row = view.rows[g.group_id]
            assert len(g.positions) == len(g.written) == len(g.expected) == plan.num_tokens
            # The ledger's side, from the row itself: block at the position's column, offset in it.
            bs = g.block_size
            assert g.expected == [row[p // bs] * bs + p % bs for p in g.positions]
            assert all(g.in_row) and g.read_len == g.ledger_len == len(row)
            assert not g.read_wrong and g.read_digest == g.ledger_digest
            faulty_group = view.tp_rank == violation.tp_rank and g.group_id == violation.group
            if not faulty_group:
                assert not any(g.wrong) and g.written == g.expected
                continue
            first = g.wrong.index(True)
            assert (g.expected[first], g.written[first]) == (expected_slot, actual_slot)
            assert [w - e for w, e, bad in zip(g.written, g.expected, g.wrong, strict=True) if bad] == [1] * sum(
                g.wrong
            )


def test_no_plan_where_the_request_is_not_planned(faulty):
    root, violation = faulty
    before = query(root, ENGINE, violation.req_id, 0)
    assert all(v.rows is None and v.plan is None for v in before)
    assert all(v.plan is None for v in query(root, ENGINE, "req-does-not-exist", violation.step))


def test_query_prints_the_plan_as_json(faulty):
    root, violation = faulty
    args = ["query", str(root), "--engine", ENGINE, "--req", violation.req_id, "--step", str(violation.step)]
    proc = subprocess.run([KVLEDGER, *args, "--format", "json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr  # ExitCode.VIOLATIONS: the plan shown broke a rule for the request
    views = [json.loads(line) for line in proc.stdout.splitlines()]
    lead = views[violation.tp_rank]["plan"]
    assert lead["step"] == violation.step
    [group] = [g for g in lead["groups"] if g["group_id"] == violation.group]
    assert any(group["wrong"]) and set(group) >= {"positions", "written", "expected", "read_len", "ledger_len"}
