"""How the stream app's Kafka clients authenticate, given once in librdkafka's names.

`--kafka-config FILE` names a JSON object of client settings, the same an engine takes as
`kv_trace.kafka` (infra/local-kafka writes one for its SASL_SSL listener):

    {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
     "sasl.username": "kvledger", "sasl.password": "...", "ssl.ca.location": "/path/ca.pem"}

The confluent-kafka clients (topic admin, `kvledger violations`, time travel) take the settings
as they are; the worker's Faust app (aiokafka) gets the same meaning as Faust credentials. A
setting the worker's client could not honour is refused by name, never ignored.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Settings both client libraries can honour; `bootstrap.servers` stands in for --bootstrap.
SUPPORTED = frozenset(
    {
        "bootstrap.servers",
        "security.protocol",
        "sasl.mechanism",
        "sasl.username",
        "sasl.password",
        "ssl.ca.location",
        "ssl.certificate.location",
        "ssl.key.location",
        "ssl.key.password",
        "ssl.endpoint.identification.algorithm",
    }
)
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class KafkaConfigError(ValueError):
    """A `--kafka-config` file that cannot be used; the message names the file and the setting."""


@dataclass(frozen=True)
class KafkaSecurity:
    """Client settings shared by every Kafka client of a command (librdkafka's names)."""

    settings: dict[str, str] = field(default_factory=dict)
    source: str = "--kafka-config"  # where they came from, for error messages

    @classmethod
    def load(cls, path: Path | None) -> KafkaSecurity:
        if path is None:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise KafkaConfigError(f"--kafka-config {path}: {exc}") from None
        security = cls(raw, f"--kafka-config {path}") if isinstance(raw, dict) else None
        if security is None:
            raise KafkaConfigError(f"--kafka-config {path}: expected a JSON object of client settings")
        security.check()
        return security

    def check(self) -> None:
        for key, value in self.settings.items():
            if key not in SUPPORTED:
                raise KafkaConfigError(f"{self.source}: {key}: not supported (known: {', '.join(sorted(SUPPORTED))})")
            if not isinstance(value, str):
                raise KafkaConfigError(f"{self.source}: {key}: expected a string, got {value!r}")
        if self.protocol not in PROTOCOLS:
            raise KafkaConfigError(f"{self.source}: security.protocol: expected one of {', '.join(PROTOCOLS)}")
        if self.protocol.startswith("SASL"):
            mechanism = self.settings.get("sasl.mechanism", "PLAIN")
            if mechanism not in MECHANISMS:
                raise KafkaConfigError(f"{self.source}: sasl.mechanism: expected one of {', '.join(MECHANISMS)}")
            for key in ("sasl.username", "sasl.password"):
                if key not in self.settings:
                    raise KafkaConfigError(f"{self.source}: {key}: required with {self.protocol}")

    @property
    def protocol(self) -> str:
        return self.settings.get("security.protocol", "PLAINTEXT")

    def bootstrap(self, given: str | None) -> str:
        """--bootstrap, else the file's bootstrap.servers."""
        found = given or self.settings.get("bootstrap.servers")
        if not found:
            raise KafkaConfigError("give --bootstrap HOST:PORT (or bootstrap.servers in --kafka-config)")
        return found

    def client(self, **settings: Any) -> dict[str, Any]:
        """A confluent-kafka client's configuration: `settings`, then these (bootstrap aside)."""
        own = {k: v for k, v in self.settings.items() if k != "bootstrap.servers"}
        return {**settings, **own}

    def faust_credentials(self):
        """The same settings as Faust's broker credentials (None: plaintext)."""
        import faust

        if self.protocol == "PLAINTEXT":
            return None
        context = self.ssl_context() if self.protocol in ("SSL", "SASL_SSL") else None
        if self.protocol == "SSL":
            return faust.SSLCredentials(context)
        return faust.SASLCredentials(
            username=self.settings["sasl.username"],
            password=self.settings["sasl.password"],
            mechanism=self.settings.get("sasl.mechanism", "PLAIN"),
            ssl_context=context,
        )

    def ssl_context(self) -> ssl.SSLContext:
        s = self.settings
        try:
            context = ssl.create_default_context(cafile=s.get("ssl.ca.location"))
            if "ssl.certificate.location" in s:
                context.load_cert_chain(
                    s["ssl.certificate.location"], s.get("ssl.key.location"), s.get("ssl.key.password")
                )
        except (OSError, ssl.SSLError) as exc:
            raise KafkaConfigError(f"{self.source}: ssl.*: {exc}") from None
        if s.get("ssl.endpoint.identification.algorithm", "https") == "none":
            context.check_hostname = False  # librdkafka's meaning: the broker's name is not checked
        return context


PLAINTEXT = KafkaSecurity()  # no settings: what a client gets when no --kafka-config is given
