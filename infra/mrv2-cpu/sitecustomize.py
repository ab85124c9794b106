"""Model Runner V2 on a CPU host: its Triton kernels run in Triton's interpreter.

A test and demo switch, never part of what ships into a vLLM image: put this
directory on PYTHONPATH of an engine's processes (vLLM's engine core and
workers inherit it) and Python imports this file at start-up (`site`'s
`sitecustomize`). It then

* sets `VLLM_USE_V2_MODEL_RUNNER=1` (MRV2's CPU runner,
  `vllm/v1/worker/cpu/model_runner.py`) and `TRITON_INTERPRET=1` (every
  `@triton.jit` kernel runs as Python over CPU tensors), unless set already;
* lets vLLM see Triton: vLLM turns Triton on for a CPU host only when
  `triton.backends` lists a `cpu` backend (triton-cpu, which no registry
  serves). A `cpu` entry is present only while `vllm.triton_utils.importing`
  decides and removed right after: torch's Inductor (compiled TP and PP runs)
  must never see it, or it asks that entry's driver for a target and fails.

The top process says so in one line on stderr; the processes it starts do not
repeat it. Correct in what the kernels compute, slow, and silent on their
speed on a device.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_DECIDES = "vllm.triton_utils.importing"
_SAID = "KVLEDGER_MRV2_INTERPRETED_SAID"


class _CpuDriver:
    """What `vllm.triton_utils.importing` reads of a backend's driver while it decides: that it
    exists. Nothing launches through it: the interpreter runs every kernel."""

    @staticmethod
    def is_active() -> bool:
        return True


class _WithCpuBackend(importlib.abc.Loader):
    """Runs the module that decides with a `cpu` entry in `triton.backends`, then removes it."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        from triton.backends import Backend, backends

        had = backends.get("cpu")
        backends["cpu"] = had or Backend(compiler=None, driver=_CpuDriver)
        try:
            self.loader.exec_module(module)
        finally:
            if had is None:
                del backends["cpu"]


class _OnDecide(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _DECIDES:
            return None
        sys.meta_path.remove(self)  # once per process
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithCpuBackend(spec.loader)
        return spec


def _install() -> None:
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.meta_path.insert(0, _OnDecide())
    if not os.environ.get(_SAID):
        os.environ[_SAID] = "1"
        print(
            "mrv2-cpu: Model Runner V2 with its Triton kernels in Triton's interpreter "
            f"(TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}): slow, and nothing about their speed on a device",
            file=sys.stderr,
            flush=True,
        )


_install()
