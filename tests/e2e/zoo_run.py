"""Run a real vLLM engine through rounds of prompts and worker calls, for the bug zoo.

    python zoo_run.py SPEC_JSON

SPEC_JSON: engine_run.py's spec (model, kv_trace, num_blocks, speculative_config, ...) plus
"rounds": a list, each either {"prompts": [[token ids], ...], "max_tokens": N, "logprobs": bool}
(one generate call: its prompts arrive together) or {"worker": "METHOD", "times": N} (N calls
of a worker method through `LLM.collective_rpc` between generate calls, e.g.
"execute_dummy_batch") or {"remove": GLOB} (the files it matches deleted between generate calls:
stored KV a disk lost). Prints `ROUND I OUTPUTS [[token ids], ...]` per generate round, with
"logprobs" also `ROUND I LOGPROBS [[...], ...]` (each sampled token's log-probability), then
`METRICS {...}` with vLLM's speculative-decoding counters when the engine drafts.
"""

import glob
import json
import os
import sys

from engine_run import start


def main() -> None:
    spec = json.loads(sys.argv[1])
    llm, _, _ = start({**spec, "prompts": []})
    from vllm import SamplingParams

    for i, round_ in enumerate(spec["rounds"]):
        if "remove" in round_:
            removed = glob.glob(round_["remove"])
            for path in removed:
                os.remove(path)
            print(f"ROUND {i} REMOVED {len(removed)}", flush=True)
            continue
        if "worker" in round_:
            for _ in range(round_.get("times", 1)):
                llm.collective_rpc(round_["worker"])
            continue
        params = SamplingParams(
            max_tokens=round_.get("max_tokens", 8),
            temperature=0,
            ignore_eos=True,
            detokenize=False,
            logprobs=0 if round_.get("logprobs") else None,
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in round_["prompts"]], params, use_tqdm=False)
        print(f"ROUND {i} OUTPUTS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
        if round_.get("logprobs"):
            sampled = [
                [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                for o in outputs
            ]
            print(f"ROUND {i} LOGPROBS " + json.dumps(sampled), flush=True)
    if spec.get("speculative_config"):
        metrics = [m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")]
        counters = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in metrics}
        print("METRICS " + json.dumps(counters), flush=True)


if __name__ == "__main__":
    main()
