"""Test-only KV connector: vLLM's shared-storage example connector whose failed loads are reported.

`ExampleConnector` (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py) stores a
prompt's KV as one file per layer in a folder named by the prompt, and loads it synchronously in
the forward pass. Its lookup only asks whether the folder exists: once the files are gone (a disk
or a peer lost them; the tests remove them between rounds) the lookup still says "hit", and the
load raises. Stock, that exception ends the engine; here it is caught per request and the
request's blocks are reported through `get_block_ids_with_load_errors`, as the connectors that
move KV over a network report theirs, so that `kv_load_failure_policy` decides (vLLM's scheduler
then rewinds the request's computed tokens and recomputes them, under "recompute").

    kv_transfer_config={"kv_connector": "LoadFailureReportingConnector",
                        "kv_connector_module_path": "kvledger_test_load_failure", ...}

Prints `LOADFAIL req=R blocks=B,... tokens=N` on stderr per failed load.
"""

import sys

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class LoadFailureReportingConnector(ExampleConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._failed: set[int] = set()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        requests = meta.requests
        try:
            for request in requests:
                if request.is_store:
                    continue
                meta.requests = [request]  # the stock loader, one request at a time
                try:
                    super().start_load_kv(forward_context, **kwargs)
                except Exception as exc:  # the stored files are gone (FileNotFoundError) or torn
                    blocks = sorted(set((request.slot_mapping[:: self._block_size] // self._block_size).tolist()))
                    self._failed.update(blocks)
                    print(
                        f"LOADFAIL blocks={','.join(map(str, blocks))} tokens={len(request.slot_mapping)} "
                        f"error={type(exc).__name__}",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            meta.requests = requests

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed
