"""The rooms of the tree and the doors between them (see docs/design.md).

The producer runs inside vLLM serving images and must import without the
stream side's libraries; the stream side runs where no torch or vLLM exists.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# room -> the kvledger modules it may import (by prefix). The producer's log and
# raise actions run the pure ledger core in the engine process: that core needs
# numpy only, and the producer imports it lazily (see the import test below).
DOORS = {
    "schemas": ("kvledger.schemas",),
    "producer": ("kvledger.producer", "kvledger.schemas", "kvledger.stream_app.core"),
    "stream_app": ("kvledger.stream_app", "kvledger.schemas"),
}


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
    return modules


def _kvledger_imports(path: Path) -> set[str]:
    return {m for m in _imports(path) if m.startswith("kvledger.")}


@pytest.mark.parametrize("room", sorted(DOORS))
def test_imports_follow_the_arrows(room):
    for path in (ROOT / room).rglob("*.py"):
        foreign = {m for m in _kvledger_imports(path) if not m.startswith(DOORS[room])}
        assert not foreign, f"{path.relative_to(ROOT)} imports {foreign}"


def _import_all_blocking(package: str, blocked: list[str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, pkgutil, sys
        BLOCKED = {blocked!r}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    raise ImportError(f"{{name}} must not be imported here")
        sys.meta_path.insert(0, Block())
        pkg = importlib.import_module({package!r})
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
        print("imported", sorted(m for m in sys.modules if m.startswith("kvledger")))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_producer_imports_without_the_stream_side():
    blocked = ["faust", "click", "rich", "aiokafka", "kvledger.stream_app", "tests"]
    result = _import_all_blocking("kvledger.producer", blocked)
    assert result.returncode == 0, result.stderr
    assert "kvledger.producer.plugin" in result.stdout and "kvledger.producer.vllm_v1" in result.stdout


def test_the_producer_ships_only_what_runs():
    """The package installed into vLLM images holds no test or benchmark support: the synthetic
    engine and its demo live in tests/synthetic/, and no producer module imports the test tree."""
    import kvledger.producer

    names = {info.name for info in pkgutil.walk_packages(kvledger.producer.__path__)}
    assert "plugin" in names, names  # the installed package, seen whole
    assert not {n for n in names if "synthetic" in n or "demo" in n}, names
    files = {p.name for folder in kvledger.producer.__path__ for p in Path(folder).iterdir()}
    assert not {f for f in files if "synthetic" in f or "demo" in f}, files
    for path in (ROOT / "producer").rglob("*.py"):
        tests = {m for m in _imports(path) if m == "tests" or m.startswith("tests.")}
        assert not tests, f"{path.relative_to(ROOT)} imports {tests}"
    assert {"engine.py", "demo.py"} <= {p.name for p in (ROOT / "tests" / "synthetic").iterdir()}


def test_stream_side_imports_without_torch_or_vllm():
    result = _import_all_blocking("kvledger.stream_app", ["torch", "vllm", "triton"])
    assert result.returncode == 0, result.stderr
    assert "kvledger.stream_app.cli" in result.stdout


def test_the_import_blocker_bites():
    result = _import_all_blocking("kvledger.stream_app", ["rich"])
    assert result.returncode != 0 and "rich must not be imported here" in result.stderr
