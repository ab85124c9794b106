"""--kafka-config: one set of client settings, honoured by both Kafka client libraries or refused by name."""

from __future__ import annotations

import json
import ssl
import subprocess

import faust
import pytest

from kvledger.stream_app.kafka_security import KafkaConfigError, KafkaSecurity

SASL = {
    "bootstrap.servers": "127.0.0.1:9096",
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "kvledger",
    "sasl.password": "secret",
}


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("ca")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "1", "-subj", "/CN=test CA"],
        cwd=d, check=True, capture_output=True,
    )  # fmt: skip
    return str(d / "ca.pem")


def write(tmp_path, settings) -> KafkaSecurity:
    path = tmp_path / "kafka.json"
    path.write_text(json.dumps(settings))
    return KafkaSecurity.load(path)


def test_sasl_ssl_settings_reach_both_clients(tmp_path, ca):
    security = write(tmp_path, {**SASL, "ssl.ca.location": ca})
    assert security.bootstrap(None) == "127.0.0.1:9096" and security.bootstrap("h:1") == "h:1"
    client = security.client(**{"group.id": "g"})
    assert client["sasl.password"] == "secret" and client["group.id"] == "g" and "bootstrap.servers" not in client
    credentials = security.faust_credentials()
    assert isinstance(credentials, faust.SASLCredentials)
    assert (credentials.protocol.value, credentials.mechanism.value) == ("SASL_SSL", "SCRAM-SHA-512")
    assert isinstance(credentials.ssl_context, ssl.SSLContext) and credentials.ssl_context.check_hostname


def test_no_file_is_plaintext():
    security = KafkaSecurity.load(None)
    assert security.faust_credentials() is None and security.client(a=1) == {"a": 1}
    with pytest.raises(KafkaConfigError, match="give --bootstrap"):
        security.bootstrap(None)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({**SASL, "sasl.oauthbearer.config": "x"}, r"sasl\.oauthbearer\.config: not supported"),
        ({**SASL, "security.protocol": "TLS"}, r"security\.protocol: expected one of"),
        ({**SASL, "sasl.mechanism": "GSSAPI"}, r"sasl\.mechanism: expected one of"),
        ({k: v for k, v in SASL.items() if k != "sasl.password"}, r"sasl\.password: required with SASL_SSL"),
        ({**SASL, "sasl.username": 7}, r"sasl\.username: expected a string"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_settings_are_refused_by_name(tmp_path, settings, message):
    with pytest.raises(KafkaConfigError, match=message):
        write(tmp_path, settings)


def test_an_unreadable_file_or_ca_says_which(tmp_path):
    with pytest.raises(KafkaConfigError, match=r"kafka\.json"):
        KafkaSecurity.load(tmp_path / "kafka.json")
    (tmp_path / "kafka.json").write_text("{not json")
    with pytest.raises(KafkaConfigError, match=r"kafka\.json"):
        KafkaSecurity.load(tmp_path / "kafka.json")
    security = write(tmp_path, {**SASL, "ssl.ca.location": str(tmp_path / "missing.pem")})
    with pytest.raises(KafkaConfigError, match=r"ssl\.\*"):
        security.faust_credentials()
