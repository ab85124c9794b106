"""The registry side of the Confluent framing: subjects, registration and lookups by id.

Through confluent-kafka's own client (`confluent_kafka.schema_registry.SchemaRegistryClient`,
the `schemaregistry` extra), imported only when a registry is configured. Subjects follow
the TopicNameStrategy (`<topic>-value`); a subject's compatibility rule is BACKWARD
(schemas/README.md, "Evolution rules").
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

# The rule every allowed change of the evolution rules passes (readers-first changes included);
# FORWARD and FULL refuse a new union branch or a wider type.
COMPATIBILITY = "BACKWARD"
# Rules that check at least as much: a subject an operator set to one of these keeps it.
AT_LEAST_BACKWARD = {"BACKWARD", "BACKWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE"}
# After a failed lookup of an id, records of that id are refused this long without asking again:
# an unreachable registry costs a reader one timeout per id and period, not one per record.
LOOKUP_RETRY_S = 10.0
# Without these the client waits up to ~25 s on a registry that does not answer.
CLIENT_DEFAULTS: dict[str, Any] = {"timeout": 5, "max.retries": 1}


def url_problem(url: str) -> str | None:
    """What is wrong with a registry URL given by a user, or None: it must be http(s)://HOST..."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"expected the registry's http:// or https:// URL, got {url!r}"
    return None


def value_subject(topic: str) -> str:
    """The subject of a topic's values (Confluent's TopicNameStrategy)."""
    return f"{topic}-value"


class RegistryError(Exception):
    """The registry could not be reached, or refused what was asked (one line: where and why)."""


class RegistryUnreachable(RegistryError):
    """No answer (refused connection, timeout, TLS): asking again later may succeed; a refusal will not."""


class SchemaRegistry:
    """A Schema Registry at `url` (the Confluent API base); `settings` go to the client as is
    (e.g. `basic.auth.user.info`, `ssl.ca.location`)."""

    def __init__(self, url: str, settings: dict[str, Any] | None = None):
        try:
            from confluent_kafka.schema_registry import SchemaRegistryClient
        except ImportError as exc:  # the client's HTTP stack is an extra of confluent-kafka
            raise RegistryError(f"no Schema Registry client ({exc}): install confluent-kafka[schemaregistry]") from None
        self.url = url
        try:
            self._client = SchemaRegistryClient({**CLIENT_DEFAULTS, **(settings or {}), "url": url})
        except (ValueError, TypeError) as exc:
            raise RegistryError(f"Schema Registry client settings: {exc}") from None
        self._failed: dict[int, tuple[float, str]] = {}  # id -> (when, why) of its last failed lookup
        self._lock = threading.Lock()

    def register(self, subject: str, schema: dict[str, Any]) -> int:
        """The id of `schema` under `subject`, registered if new. A subject that checks less than
        BACKWARD (none of its own, or NONE: Apicurio's default) is set to BACKWARD first, so the
        registry refuses a version the readers could not read."""
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            if self._compatibility(subject) not in AT_LEAST_BACKWARD:
                self._client.set_compatibility(subject, COMPATIBILITY)
            return self._client.register_schema(subject, Schema(json.dumps(schema), schema_type="AVRO"))
        except SchemaRegistryError as exc:
            if exc.http_status_code == 409:
                raise RegistryError(
                    f"the Schema Registry at {self.url} refused {schema.get('name')} under {subject}: "
                    f"not compatible with the versions registered ({exc.error_message})"
                ) from None
            raise RegistryError(
                f"the Schema Registry at {self.url} refused {schema.get('name')} under {subject}: "
                f"HTTP {exc.http_status_code} {exc.error_message}"
            ) from None
        except Exception as exc:  # the client's HTTP stack raises its own types (refused, timed out, TLS)
            why = f"no Schema Registry answers at {self.url} ({type(exc).__name__}: {exc})"
            raise RegistryUnreachable(why) from None

    def _compatibility(self, subject: str) -> str | None:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            return self._client.get_compatibility(subject)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:  # no such subject, or none of its own (Confluent's registry)
                return None
            raise

    def writer_schema(self, schema_id: int) -> dict[str, Any]:
        """The schema registered under `schema_id`, as a JSON dict (a codec's `lookup`); RegistryError
        if unknown or the registry cannot say. A failure is remembered for LOOKUP_RETRY_S."""
        with self._lock:  # readers may ask from several threads (the worker's views)
            failed = self._failed.get(schema_id)
            if failed is not None and time.monotonic() - failed[0] < LOOKUP_RETRY_S:
                raise RegistryError(failed[1])
            try:
                found = self._client.get_schema(schema_id)
            except Exception as exc:
                why = self._lookup_failure(schema_id, exc)
                self._failed[schema_id] = (time.monotonic(), why)
                raise RegistryError(why) from None
            self._failed.pop(schema_id, None)
        if found.schema_type not in (None, "AVRO"):
            raise RegistryError(f"schema {schema_id} is {found.schema_type}, not Avro")
        return json.loads(found.schema_str)

    def _lookup_failure(self, schema_id: int, exc: Exception) -> str:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        if isinstance(exc, SchemaRegistryError):
            return f"the Schema Registry at {self.url} has no schema id {schema_id} (HTTP {exc.http_status_code})"
        return f"no Schema Registry answers at {self.url} for schema id {schema_id} ({type(exc).__name__}: {exc})"
