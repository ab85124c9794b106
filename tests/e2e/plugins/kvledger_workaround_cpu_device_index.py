"""Test-only WORKAROUND, not a fix: lets vLLM 0.32's Mooncake worker start on a CPU-only host.

    KVLEDGER_WORKAROUND_CPU_DEVICE_INDEX=1   (set by the prefill/decode pair harness only)

`MooncakeConnectorWorker.__init__` asks `torch.accelerator.current_device_index()`,
which raises when the host has no accelerator (the CPU backend never needs a
device index). With the variable set and no accelerator present, this plugin
makes that call return 0, which `CpuPlatform.set_device` accepts. Everything
else, and every host with an accelerator, runs untouched. Remove it once vLLM's
Mooncake worker handles CPU-only hosts itself.
"""

import os


def register() -> None:
    if os.environ.get("KVLEDGER_WORKAROUND_CPU_DEVICE_INDEX") != "1":
        return
    import torch

    accelerator = torch.accelerator
    if accelerator.is_available() or getattr(accelerator, "_kvledger_cpu_index_workaround", False):
        return
    original = accelerator.current_device_index

    def current_device_index() -> int:
        return 0 if not accelerator.is_available() else original()

    accelerator.current_device_index = current_device_index
    accelerator._kvledger_cpu_index_workaround = True
