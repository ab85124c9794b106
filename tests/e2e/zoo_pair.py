"""A prefill/decode pair (pd_pair.py's engines) whose decode request is aborted mid-transfer, for the bug zoo.

    python zoo_pair.py SPEC_JSON      (the driver; run by `run_zoo_pair` in a loopback-only namespace)

The driver, with the interpreter that has vLLM and Mooncake:

1. the prefill engine serves the victim's prompt alone (its reference answer);
2. the prefill engine prefills the doomed prompt for a transfer (`do_remote_decode`): its
   blocks stay held until the decode engine pulls them;
3. the decode engine gets the doomed request (`do_remote_prefill`); once its pull has reached
   the prefill side (the zoo plugin's `pull` marker), the client aborts it
   (`LLMEngine.abort_request`) and sends the victim, a plain prompt of the same length;
4. the decode engine runs until the victim is done.

The zoo plugin (plugins/zoo_abort_in_flight.py) holds the prefill side's write until the
victim's prefill ran, and the victim's next step until the write landed.

Spec: {"doomed": [token ids], "victim": [token ids], "max_tokens": 8, "ledger_root": "/abs" | null,
"markers": "/abs"}. Prints `ZOO_PAIR {"baseline": [...], "victim": [...]}`.

With "mode": "early_send" (SGLang 33970, plugins/zoo_early_send.py), instead:

1. the decode engine serves the prompt ("victim") alone (its reference answer), the prefill
   engine another prompt of the same length ("stale"), whose KV its freed blocks keep;
2. the decode engine gets the request (`do_remote_prefill`) first: its pull waits on the
   prefill side (the plugin's `pull` marker) for a request the prefill engine has not seen;
3. the prefill engine prefills it for the transfer (`do_remote_decode`); the plugin sets the
   send's `ready` at bind time, so the waiting pull is served before the forward;
4. the decode engine runs until the request is done;
5. per entry of "transfers" ([transfer id, prompt], e.g. SGLang 24878's, plugins/
   zoo_unsent_group.py): the prefill engine serves the prompt alone (its reference answer),
   then prefills it for that transfer, which the decode engine pulls and decodes as a pair does;
6. the prefill engine serves one more plain prompt, so its worker reports the finished sends.

With "mode": "in_flight" (vllm PR 45357, plugins/zoo_free_in_flight.py; both engines schedule
asynchronously, plugins/kvledger_async_scheduling.py), instead:

1. the decode engine serves the running prompt alone (its reference answer), whose second token
   becomes its stop token below;
2. the prefill engine prefills the waiting prompt for a transfer (`do_remote_decode`);
3. the decode engine, its pool sized to the running prompt and one block, gets the running request
   (stopping on that token, which the scheduler cannot foresee) and then the waiting one
   (`do_remote_prefill`), which waits for blocks until the running one finishes; it runs both to
   their end.

Spec: {"mode": "in_flight", "running": [token ids], "waiting": [token ids], "num_blocks": N, "max_tokens": 8,
"model": {config.json} | null (default: the tiny Llama), "max_model_len": 128, "running_max_tokens": max_tokens,
"stop_second": true (false: the running request ends on its token budget, e.g. vllm-ascend 13501's run,
plugins/zoo_window_in_flight.py), "ledger_root": "/abs" | null, "markers": "/abs"}; "baseline" in the
output is the running prompt's reference answer, "victim" the waiting request's answer, "running" the
running request's.

Spec: {"mode": "early_send", "victim": [token ids], "stale": [token ids], "transfers": [[id, [token ids]], ...],
"model": {config.json} | null (default: the tiny Llama), "max_tokens": 8, "ledger_root": "/abs" | null,
"markers": "/abs"}; "victim" in the output is the decode engine's answer, "transfers" per
transfer id its answer and reference: {"tokens", "logprobs", "baseline", "baseline_logprobs"}
(logprobs: each sampled token's log-probability).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:  # the driver, run as a script beside pd_pair.py
    from pd_pair import BOOTSTRAP_ADDR, PREFILL_ENGINE_ID, _engine, _params, _tokens, launch_pair
except ImportError:  # the harness, imported by the tests
    from tests.e2e.pd_pair import BOOTSTRAP_ADDR, PREFILL_ENGINE_ID, _engine, _params, _tokens, launch_pair

DOOMED, VICTIM = "zoo-doomed", "zoo-victim"
TRANSFER = "xfer-doomed"
EARLY, EARLY_TRANSFER = "zoo-early", "xfer-early"  # early_send: the decode request and its transfer
UNSENT_TRANSFER, SHIFTED_TRANSFER = "xfer-unsent", "xfer-shifted"  # early_send's "transfers" (the zoo's)
RUNNING, WAITING, IN_FLIGHT_TRANSFER = "zoo-running", "zoo-waiting", "xfer-in-flight"  # in_flight's


# -- harness (the tests' interpreter) ------------------------------------------------------------
@dataclass
class ZooPairRun:
    baseline: list[int]
    victim: list[int]
    log: str
    extra: dict = field(default_factory=dict)  # early_send's "transfers"


def run_zoo_pair(python: str, spec: dict, env: dict[str, str], timeout: float = 600) -> ZooPairRun:
    """Run the driver once in a loopback-only namespace; fail with the log's tail if it breaks."""
    import pytest

    # The plugin a mode's markers switch on (in_flight's needs none: its window opens by itself).
    markers = {"early_send": "ZOO_EARLY_MARKERS", "in_flight": None}.get(spec.get("mode"), "ZOO_ABORT_MARKERS")
    env = {markers: spec["markers"], **env} if markers else env
    returncode, stdout, log = launch_pair(python, "zoo_pair.py", spec, env, timeout, "zoo pair")
    found = [line for line in stdout.splitlines() if line.startswith("ZOO_PAIR ")]
    if returncode != 0 or not found:
        pytest.fail(f"zoo pair failed (exit {returncode}):\n{log[-4000:]}", pytrace=False)
    result = json.loads(found[0].removeprefix("ZOO_PAIR "))
    extra = {k: v for k, v in result.items() if k not in ("baseline", "victim")}
    return ZooPairRun(result["baseline"], result["victim"], log, extra)


# -- driver (the vLLM interpreter, inside the namespace) -----------------------------------------
def _drive(spec: dict) -> dict:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_run import TINY_LLAMA

    model = tempfile.mkdtemp(prefix="tiny-llama-")
    Path(model, "config.json").write_text(json.dumps(TINY_LLAMA))
    settings = {"ledger_root": spec.get("ledger_root"), "runners": spec.get("runners")}
    prefill = _engine(model, "prefill", PREFILL_ENGINE_ID, settings)
    decode = _engine(model, "decode", "decode-0", settings)
    max_tokens = spec.get("max_tokens", 8)

    baseline = _tokens(prefill.generate([{"prompt_token_ids": spec["victim"]}], _params(max_tokens, None)))[0]
    prefill.generate(
        [{"prompt_token_ids": spec["doomed"]}], _params(1, {"do_remote_decode": True, "transfer_id": TRANSFER})
    )

    engine = decode.llm_engine
    _pull(engine, DOOMED, spec["doomed"], TRANSFER, max_tokens, spec["markers"])
    engine.abort_request([DOOMED])
    engine.add_request(VICTIM, {"prompt_token_ids": spec["victim"]}, _params(max_tokens, None))
    victim = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id.startswith(VICTIM) and output.finished:
                victim = list(output.outputs[0].token_ids)
    return {"baseline": baseline, "victim": victim}


def _pull(engine, request_id: str, prompt: list[int], transfer_id: str, max_tokens: int, markers: str) -> dict:
    """Add a request whose KV the decode engine pulls from the prefill engine, and wait until its pull
    reached the prefill side (the plugin's marker); its transfer parameters."""
    pulled = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": PREFILL_ENGINE_ID,
        "remote_bootstrap_addr": BOOTSTRAP_ADDR,
    }
    engine.add_request(request_id, {"prompt_token_ids": prompt}, _params(max_tokens, pulled))
    marker, deadline = Path(markers) / "pull", time.monotonic() + 120
    while not marker.exists():  # the engine core runs on its own; the pull is its worker's
        if time.monotonic() > deadline:
            raise TimeoutError(f"the decode engine's pull of {request_id} never reached the prefill side")
        time.sleep(0.01)
    return pulled


def _logprobs(params):
    params.logprobs = 0  # each sampled token's log-probability
    return params


def _sampled_logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs, strict=True)]


def _drive_early_send(spec: dict) -> dict:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_run import TINY_LLAMA

    model = tempfile.mkdtemp(prefix="tiny-llama-")
    Path(model, "config.json").write_text(json.dumps(spec.get("model") or TINY_LLAMA))
    settings = {"ledger_root": spec.get("ledger_root"), "transfer_digests": 1.0}
    prefill = _engine(model, "prefill", PREFILL_ENGINE_ID, settings)
    decode = _engine(model, "decode", "decode-0", settings)
    max_tokens, prompt = spec.get("max_tokens", 8), spec["victim"]

    baseline = _tokens(decode.generate([{"prompt_token_ids": prompt}], _params(max_tokens, None), use_tqdm=False))[0]
    prefill.generate([{"prompt_token_ids": spec["stale"]}], _params(1, None), use_tqdm=False)
    engine = decode.llm_engine
    pulled = _pull(engine, EARLY, prompt, EARLY_TRANSFER, max_tokens, spec["markers"])
    prefill.generate(
        [{"prompt_token_ids": prompt}],
        _params(1, {"do_remote_decode": True, "transfer_id": EARLY_TRANSFER}),
        use_tqdm=False,
    )
    received = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id.startswith(EARLY) and output.finished:
                received = list(output.outputs[0].token_ids)
    result = {"baseline": baseline, "victim": received}
    result["transfers"] = {}
    for transfer_id, tokens in spec.get("transfers") or ():
        one = [{"prompt_token_ids": tokens}]
        reference = prefill.generate(one, _logprobs(_params(max_tokens, None)), use_tqdm=False)
        prefill.generate(one, _params(1, {"do_remote_decode": True, "transfer_id": transfer_id}), use_tqdm=False)
        pulled = {**pulled, "transfer_id": transfer_id}
        answer = decode.generate(one, _logprobs(_params(max_tokens, pulled)), use_tqdm=False)
        result["transfers"][transfer_id] = {
            "tokens": _tokens(answer)[0],
            "logprobs": _sampled_logprobs(answer[0]),
            "baseline": _tokens(reference)[0],
            "baseline_logprobs": _sampled_logprobs(reference[0]),
        }
    prefill.generate(
        [{"prompt_token_ids": prompt[:8]}], _params(1, None), use_tqdm=False
    )  # steps that report the sends
    return result


def _drive_in_flight(spec: dict) -> dict:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_run import TINY_LLAMA

    model = tempfile.mkdtemp(prefix="tiny-llama-")
    Path(model, "config.json").write_text(json.dumps(spec.get("model") or TINY_LLAMA))
    settings = {"ledger_root": spec.get("ledger_root"), "max_model_len": spec.get("max_model_len", 128)}
    settings["num_blocks"] = {"decode": spec["num_blocks"]}  # the decode pool: see the spec
    prefill = _engine(model, "prefill", PREFILL_ENGINE_ID, settings)
    decode = _engine(model, "decode", "decode-0", settings)
    max_tokens, running = spec.get("max_tokens", 8), spec["running"]

    baseline = _tokens(decode.generate([{"prompt_token_ids": running}], _params(max_tokens, None), use_tqdm=False))[0]
    prefill.generate(
        [{"prompt_token_ids": spec["waiting"]}],
        _params(1, {"do_remote_decode": True, "transfer_id": IN_FLIGHT_TRANSFER}),
        use_tqdm=False,
    )
    stopping = _params(spec.get("running_max_tokens", max_tokens), None)
    if spec.get("stop_second", True):
        stopping.stop_token_ids = [baseline[1]]  # its second token: known only once sampled
    pulled = {
        "do_remote_prefill": True,
        "transfer_id": IN_FLIGHT_TRANSFER,
        "remote_engine_id": PREFILL_ENGINE_ID,
        "remote_bootstrap_addr": BOOTSTRAP_ADDR,
    }
    engine = decode.llm_engine
    engine.add_request(RUNNING, {"prompt_token_ids": running}, stopping)
    engine.add_request(WAITING, {"prompt_token_ids": spec["waiting"]}, _params(max_tokens, pulled))
    answers = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                answers[output.request_id] = list(output.outputs[0].token_ids)
    prefill.generate([{"prompt_token_ids": running[:8]}], _params(1, None), use_tqdm=False)  # reports the send
    found = {name: next(v for k, v in answers.items() if k.startswith(name)) for name in (RUNNING, WAITING)}
    return {"baseline": baseline, "victim": found[WAITING], "running": found[RUNNING]}


def main() -> None:
    spec = json.loads(sys.argv[1])
    drive = {"early_send": _drive_early_send, "in_flight": _drive_in_flight}.get(spec.get("mode"), _drive)
    result = drive(spec)
    print("ZOO_PAIR " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
