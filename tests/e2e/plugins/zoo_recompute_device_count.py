"""Bug zoo, entry 3 (vLLM issue 49250, fix PR 49252): a recompute's rewind on Model Runner V2.

    ZOO_RECOMPUTE_FIX=1   apply PR 49252's first part to vLLM 0.32's MRV2: a running request whose
                          computed tokens the scheduler moved back (a failed KV load recomputed,
                          `kv_load_failure_policy="recompute"`) has the rewind staged to the device
                          copy of its count too, not only to the host mirror

vLLM 0.32 as shipped is the bug: `GPUModelRunner.update_requests` (vllm/v1/worker/gpu/
model_runner.py) writes a cached request's computed tokens to `req_states.num_computed_tokens_np`
only; the device count (`req_states.num_computed_tokens`, a StagedWriteTensor), which
`prepare_inputs` reads positions from, stays where the failed step left it. Prints `ZOO rewind
req=R computed=C device=D` on stderr for each rewind it sees (D: the device count after the
update), with or without the fix.
"""

import os
import sys


def register() -> None:
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "1":
        return
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_zoo_recompute", False):
        return
    GPUModelRunner._zoo_recompute = True
    fix = os.environ.get("ZOO_RECOMPUTE_FIX") == "1"
    update_requests = GPUModelRunner.update_requests

    def update_requests_seeing_rewinds(self, scheduler_output):
        states, cached = self.req_states, scheduler_output.scheduled_cached_reqs
        rewound = [
            (req_id, states.req_id_to_index[req_id], computed)
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            if computed < states.num_computed_tokens_np[states.req_id_to_index[req_id]]
        ]
        update_requests(self, scheduler_output)
        if fix and rewound:  # PR 49252: the truncation staged to the device as well
            for _, index, computed in rewound:
                states.num_computed_tokens.stage_write_elem(index, computed)
            states.num_computed_tokens.apply_write()
        for req_id, index, computed in rewound:
            device = int(states.num_computed_tokens.gpu[index])
            print(f"ZOO rewind req={req_id} computed={computed} device={device}", file=sys.stderr, flush=True)

    GPUModelRunner.update_requests = update_requests_seeing_rewinds
