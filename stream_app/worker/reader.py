"""Reading the violations topic: every violation once, in the shape `kvledger check` prints.

Violations are keyed by their id (see the package docstring): a repeated id
is a re-send after a worker restart and is dropped here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaError, KafkaException, TopicPartition

from kvledger.schemas import VIOLATION, DecodeError, EitherFraming, SingleObjectCodec
from kvledger.schemas.confluent import SchemaRegistry
from kvledger.stream_app.core import Violation
from kvledger.stream_app.kafka_security import PLAINTEXT, KafkaSecurity
from kvledger.stream_app.worker.topics import BrokerUnavailable, admin, assigned_consumer, partitions_of


@dataclass
class ViolationsRead:
    """What a read of the topic saw, for the summary line."""

    records: int = 0
    duplicates: int = 0
    undecodable: int = 0
    kinds: Counter = field(default_factory=Counter)
    engines: set[str] = field(default_factory=set)

    def summary(self) -> dict:
        return {
            "type": "summary",
            "violations": dict(sorted(self.kinds.items())),
            "engines": len(self.engines),
            "records": self.records,
            "duplicates_dropped": self.duplicates,
            "undecodable": self.undecodable,
        }


def read_violations(
    bootstrap: str,
    topic: str,
    *,
    from_beginning: bool,
    idle_timeout: float,
    stats: ViolationsRead,
    security: KafkaSecurity = PLAINTEXT,
    registry: SchemaRegistry | None = None,
) -> Iterator[tuple[str, Violation]]:
    """(id, violation) from `topic`, each id once, until nothing new came for `idle_timeout` seconds.
    With a `registry`, Confluent-framed violations are read too (writer schemas by id)."""
    client = admin(bootstrap, security=security)
    partitions = partitions_of(client, topic)
    if partitions is None:
        raise BrokerUnavailable(f"topic {topic} does not exist (is a worker running against {bootstrap}?)")
    codec = EitherFraming(VIOLATION, lookup=registry.writer_schema) if registry else SingleObjectCodec(VIOLATION)
    consumer = assigned_consumer(bootstrap, "kvledger-violations-reader", security, **{"enable.partition.eof": False})
    start = OFFSET_BEGINNING if from_beginning else OFFSET_END
    consumer.assign([TopicPartition(topic, p, start) for p in range(partitions)])
    seen: set[bytes] = set()
    try:
        last_new = time.monotonic()
        while time.monotonic() - last_new < idle_timeout:
            message = consumer.poll(min(0.5, idle_timeout))
            if message is None:
                continue
            if message.error() is not None:
                if message.error().code() == KafkaError._TRANSPORT:
                    raise BrokerUnavailable(f"lost the broker at {bootstrap}: {message.error().str()}")
                raise KafkaException(message.error())
            last_new = time.monotonic()
            stats.records += 1
            key = message.key() or b""
            if key in seen:
                stats.duplicates += 1
                continue
            try:
                violation = Violation.of(codec.decode(message.value()))
            except (DecodeError, TypeError):
                stats.undecodable += 1
                continue
            seen.add(key)
            stats.kinds[violation.kind] += 1
            stats.engines.add(violation.engine_id)
            yield key.decode(errors="replace"), violation
    finally:
        consumer.close()
