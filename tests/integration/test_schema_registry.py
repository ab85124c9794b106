"""The project's Avro schemas through a real Confluent-compatible Schema Registry.

`infra/schema-registry` runs Apicurio Registry in memory (fetched on first
use); the fixture gives it a private state dir and a free port, and the tests
talk to it only through confluent_kafka's Confluent API client.
"""

import json
import os
import re
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import fastavro
import pytest

try:
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
    from confluent_kafka.schema_registry.error import SchemaRegistryError
except ImportError as e:  # the client's HTTP stack is an extra of confluent-kafka
    raise ImportError(f"{e}: install confluent-kafka[schemaregistry]") from e

from kvledger.schemas.registry import checkpoint_raw, raw_schema

pytestmark = pytest.mark.integration

SCHEMA_REGISTRY = Path(__file__).resolve().parents[2] / "infra" / "schema-registry"
# A cold first `up` downloads ~160 MB through Maven.
UP_TIMEOUT = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory) -> Iterator[str]:
    """Confluent API URL of a running registry; fails (never skips) if it can't start."""
    env = {
        **os.environ,
        "KVLEDGER_REGISTRY_DIR": str(tmp_path_factory.mktemp("schema-registry")),
        "KVLEDGER_REGISTRY_PORT": str(_free_port()),
    }

    def run(cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCHEMA_REGISTRY), cmd], env=env, capture_output=True, text=True, timeout=timeout)

    try:
        up = run("up", timeout=UP_TIMEOUT)
    except subprocess.TimeoutExpired:
        run("down")
        pytest.fail(f"infra/schema-registry up took longer than {UP_TIMEOUT}s", pytrace=False)
    if up.returncode != 0:
        run("down")
        message = f"schema registry did not start:\n{up.stderr.strip()}"
        # The script's error ends with "see <log>": show that log's tail too.
        if m := re.search(r"see (\S+)$", up.stderr.strip()):
            message += f"\n--- tail of {m[1]} ---\n{_tail(Path(m[1]))}"
        pytest.fail(message, pytrace=False)
    try:
        yield up.stdout.strip().removeprefix("url=")
    finally:
        run("down")


@pytest.fixture
def client(schema_registry) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry})


def _subject(name: str) -> str:
    return f"it-{name}-{uuid.uuid4().hex[:12]}-value"


def _avro(schema: dict) -> Schema:
    return Schema(json.dumps(schema), schema_type="AVRO")


def _canonical(schema_str: str) -> str:
    return fastavro.schema.to_parsing_canonical_form(fastavro.parse_schema(json.loads(schema_str)))


@pytest.mark.parametrize(
    "name, schema",
    [
        ("ledger_event", raw_schema("ledger_event")),
        ("violation", raw_schema("violation")),
        ("checkpoint", checkpoint_raw()),
    ],
    ids=["ledger_event", "violation", "checkpoint"],
)
def test_registered_schema_comes_back_by_id(client, name, schema):
    subject = _subject(name)
    schema_id = client.register_schema(subject, _avro(schema))
    assert isinstance(schema_id, int) and schema_id > 0

    fetched = client.get_schema(schema_id)
    assert fetched.schema_type == "AVRO"
    assert _canonical(fetched.schema_str) == _canonical(json.dumps(schema))

    # Registering the same schema again is a no-op that returns the same id.
    assert client.register_schema(subject, _avro(schema)) == schema_id
    latest = client.get_latest_version(subject)
    assert (latest.schema_id, latest.version) == (schema_id, 1)


def test_backward_compatibility_of_an_evolved_violation(client):
    subject = _subject("violation")
    v1 = raw_schema("violation")
    client.set_compatibility(subject, "BACKWARD")
    assert client.get_compatibility(subject) == "BACKWARD"
    id1 = client.register_schema(subject, _avro(v1))

    # A new optional field (with a default) can read data written with v1: backward compatible.
    added = {"name": "severity", "type": ["null", "string"], "default": None, "doc": "Added in v2."}
    v2 = {**v1, "fields": [*v1["fields"], added]}
    assert client.test_compatibility(subject, _avro(v2)) is True

    # A new required field cannot: v1 data has no value for it.
    required = {"name": "severity", "type": "string"}
    bad = {**v1, "fields": [*v1["fields"], required]}
    assert client.test_compatibility(subject, _avro(bad)) is False
    with pytest.raises(SchemaRegistryError) as err:
        client.register_schema(subject, _avro(bad))
    assert err.value.http_status_code == 409

    id2 = client.register_schema(subject, _avro(v2))
    assert id2 != id1
    assert client.get_versions(subject) == [1, 2]
    assert _canonical(client.get_schema(id2).schema_str) == _canonical(json.dumps(v2))
