"""Bug zoo plugin: random weights whose outputs depend on the KV they attend over.

    ZOO_WEIGHT_SCALE=S   multiply every floating-point weight of the dummy-loaded model by S

vLLM's dummy load (`load_format="dummy"`) draws every weight from U(-1e-3, 1e-3). With weights
that small, attention's share of the residual stream is about 1e-4 of the token's own
embedding: a tiny model answers from its current token alone, and replacing its whole KV cache
leaves its greedy tokens unchanged. Scaled by S (the zoo uses 100: U(-0.1, 0.1)), attention
carries the context and corrupted KV shows in the tokens. Test scaffolding, not a bug: it wraps
`DummyModelLoader.load_weights`, after which the weights are scaled in place.
"""

import functools
import os


def register() -> None:
    scale = os.environ.get("ZOO_WEIGHT_SCALE")
    if not scale:
        return
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    if getattr(DummyModelLoader, "_zoo_weight_scale", False):
        return
    DummyModelLoader._zoo_weight_scale = True
    load_weights, factor = DummyModelLoader.load_weights, float(scale)

    @functools.wraps(load_weights)
    def scaled_load_weights(self, model, model_config):
        load_weights(self, model, model_config)
        import torch

        with torch.no_grad():
            for tensor in model.state_dict().values():
                if torch.is_floating_point(tensor):
                    tensor.mul_(factor)

    DummyModelLoader.load_weights = scaled_load_weights
