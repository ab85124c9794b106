"""A real single-node Kafka broker and a real Schema Registry for the integration and end-to-end
tests, one of each per session.

`infra/local-kafka` and `infra/schema-registry` do the work (fetch on first
use, start, readiness); here they only get private state dirs and free ports,
so tests never collide with a developer's broker on 9092, registry on 8081,
or a parallel session.
"""

import json
import os
import random
import re
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

LOCAL_KAFKA = Path(__file__).resolve().parents[1] / "infra" / "local-kafka"
SCHEMA_REGISTRY = Path(__file__).resolve().parents[1] / "infra" / "schema-registry"
INSTALL_PROMETHEUS = Path(__file__).resolve().parents[1] / "infra" / "install-prometheus"
# A cold first `up` downloads ~45 MB of jars (the broker), ~160 MB (the registry) through Maven.
UP_TIMEOUT = 900


def prometheus_tool(name: str) -> str:
    """`prometheus` or `promtool`, where infra/install-prometheus put them (or found them on
    PATH): that script alone knows where. Fails the test when they are nowhere."""
    found = subprocess.run([INSTALL_PROMETHEUS, "--find"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.fail(f"no {name}: run infra/install-prometheus (make test does)", pytrace=False)
    return str(Path(found.stdout.split("=", 1)[1].split()[0]).with_name(name))


def _free_ports(n: int) -> list[int]:
    # Hold all sockets open until every port is picked, so the n are distinct.
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ports_no_client_takes(n: int) -> list[int]:
    """n free ports below the kernel's ephemeral range, for a broker that is stopped and started
    again on the same port. A client retrying a stopped broker's loopback port connects from an
    ephemeral port each time; once it is handed the broker's own port, the connection is made to
    itself (TCP simultaneous open) and holds the port: the broker could not start again (seen here,
    a client retrying ~4,000 times a second). Below the range no client is handed it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked: list[int] = []
    for port in random.sample(range(max(1024, low - 12_000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == n:
            return picked
    raise RuntimeError(f"no {n} free ports below the ephemeral range ({low})")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


@pytest.fixture(scope="session")
def local_kafka(tmp_path_factory) -> Callable[..., subprocess.CompletedProcess]:
    """Run `infra/local-kafka CMD` against this session's private broker."""
    port, controller_port, sasl_port = _free_ports(3)
    env = {
        **os.environ,
        "KVLEDGER_KAFKA_DIR": str(tmp_path_factory.mktemp("kafka")),
        "KVLEDGER_KAFKA_PORT": str(port),
        "KVLEDGER_KAFKA_CONTROLLER_PORT": str(controller_port),
        "KVLEDGER_KAFKA_SASL_PORT": str(sasl_port),  # SASL_SSL beside PLAINTEXT: one broker for both
    }
    return _local_kafka(env)


def _local_kafka(env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess]:
    """`infra/local-kafka CMD` under `env` (its state dir and ports)."""

    def run(cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(LOCAL_KAFKA), cmd], env=env, capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def kafka_bootstrap(local_kafka) -> Iterator[str]:
    """`127.0.0.1:PORT` of a running broker; fails (never skips) if it can't start."""
    up = _started(local_kafka, "infra/local-kafka", "local Kafka broker")
    try:
        yield _up_lines(up.stdout)["bootstrap"]
    finally:
        local_kafka("down")


def _started(run: Callable[..., subprocess.CompletedProcess], script: str, what: str) -> subprocess.CompletedProcess:
    """`run("up")`, or stop it and fail (never skip) with the script's error and its log's tail."""
    try:
        up = run("up", timeout=UP_TIMEOUT)
    except subprocess.TimeoutExpired:
        run("down")
        pytest.fail(f"{script} up took longer than {UP_TIMEOUT}s", pytrace=False)
    if up.returncode != 0:
        run("down")
        message = f"{what} did not start:\n{up.stderr.strip()}"
        # The script's error ends with "see <log>": show that log's tail too.
        if m := re.search(r"see (\S+)$", up.stderr.strip()):
            message += f"\n--- tail of {m[1]} ---\n{_tail(Path(m[1]))}"
        pytest.fail(message, pytrace=False)
    return up


def _up_lines(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.split())


@pytest.fixture(scope="session")
def kafka_sasl(kafka_bootstrap, local_kafka) -> dict[str, str]:
    """Client settings (librdkafka's names) of the session broker's SASL_SSL listener: SCRAM-SHA-512
    over TLS with the test CA infra/local-kafka made."""
    up = local_kafka("up")  # already running: prints the same lines again
    return json.loads(Path(_up_lines(up.stdout)["sasl_config"]).read_text())


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory) -> Iterator[str]:
    """Confluent API URL of a running registry (Apicurio, in memory); fails (never skips) if it can't start."""
    env = {
        **os.environ,
        "KVLEDGER_REGISTRY_DIR": str(tmp_path_factory.mktemp("schema-registry")),
        "KVLEDGER_REGISTRY_PORT": str(_free_ports(1)[0]),
    }

    def run(cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCHEMA_REGISTRY), cmd], env=env, capture_output=True, text=True, timeout=timeout)

    up = _started(run, "infra/schema-registry", "schema registry")
    try:
        yield up.stdout.strip().removeprefix("url=")
    finally:
        run("down")


# -- one of N test processes ----------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        metavar="K/N",
        help="run the K-th of N parts of the selected tests: whole modules (their fixtures stay in one "
        "process), the largest first (by SHARD_WEIGHT, else tests), each to the lightest part so far",
    )


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if not shard:
        return
    k, n = _shard(shard)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    sizes, mine, deselected = [0] * n, set(), []
    for _, tests in sorted(modules.items(), key=lambda kv: (-_weight(kv[1]), kv[0])):
        part = sizes.index(min(sizes))
        sizes[part] += _weight(tests)
        (mine.update if part == k - 1 else deselected.extend)(tests)
    config.hook.pytest_deselected(items=deselected)
    items[:] = [item for item in items if item in mine]


def _weight(tests: list) -> int:
    """A module's share of a part: its `SHARD_WEIGHT` (the engine runs its selected tests start,
    where several tests share a run or one test starts several), else its count of tests."""
    return getattr(tests[0].module, "SHARD_WEIGHT", len(tests))


def _shard(value: str) -> tuple[int, int]:
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"--shard takes K/N with 1 <= K <= N, not {value!r}")
    return int(k), int(n)


@dataclass
class OutageBroker:
    """A broker apart from the session's (`kafka_bootstrap`), to stop and start: stopping it disturbs
    no other test. Its ports lie below the ephemeral range (`_ports_no_client_takes`)."""

    run: Callable[..., subprocess.CompletedProcess]  # `infra/local-kafka CMD` for this broker
    bootstrap: str = ""

    @classmethod
    @contextmanager
    def running(cls, state_dir: Path, **env: str) -> Iterator["OutageBroker"]:
        """Started in `state_dir` (with `env` over the script's defaults), stopped at the end."""
        port, controller_port = _ports_no_client_takes(2)
        broker = cls(_local_kafka({
            **os.environ, "KVLEDGER_KAFKA_DIR": str(state_dir), "KVLEDGER_KAFKA_PORT": str(port),
            "KVLEDGER_KAFKA_CONTROLLER_PORT": str(controller_port), **env,
        }))  # fmt: skip
        broker.up()
        try:
            yield broker
        finally:
            broker.run("down")

    def up(self) -> None:
        self.bootstrap = _up_lines(_started(self.run, "infra/local-kafka", "the outage broker").stdout)["bootstrap"]

    def down(self) -> None:
        down = self.run("down", timeout=60)
        if down.returncode != 0 or self.run("status").returncode == 0:
            pytest.fail(f"the outage broker did not stop:\n{down.stderr.strip()}", pytrace=False)
