"""Topic names and their creation, with confluent-kafka's admin client.

Topics are made before the Faust app starts so that the partition count is
the operator's choice (`--partitions`), errors are one clear line, and a
broker that does not answer is found before any worker starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from kvledger.stream_app.kafka_security import PLAINTEXT, KafkaSecurity

# librdkafka logs every failed connection attempt; the one-line error says it all.
QUIET = logging.getLogger("kvledger.kafka-client")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False


class BrokerUnavailable(Exception):
    """The broker did not answer, or refused to make a topic (one-line message)."""


@dataclass(frozen=True)
class Topics:
    """The worker's topics, all under one prefix (`kvledger` in production)."""

    prefix: str = "kvledger"

    @property
    def events(self) -> str:
        return f"{self.prefix}.events"

    @property
    def violations(self) -> str:
        return f"{self.prefix}.violations"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.deadletter"

    @property
    def transfers(self) -> str:
        return f"{self.prefix}.transfers"


def admin(bootstrap: str, timeout: float = 5.0, security: KafkaSecurity = PLAINTEXT) -> AdminClient:
    """An admin client, after checking the broker answers (else BrokerUnavailable)."""
    refused: list[KafkaError] = []  # the client's own errors: a refusal is only seen there

    def on_error(err: KafkaError) -> None:
        if err.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL):
            refused.append(err)

    client = AdminClient(security.client(**{"bootstrap.servers": bootstrap, "logger": QUIET, "error_cb": on_error}))
    try:
        client.list_topics(timeout=timeout)
    except KafkaException as exc:
        client.poll(0)  # deliver the errors that explain it
        if refused:
            what = "credentials" if refused[0].code() == KafkaError._AUTHENTICATION else "TLS handshake"
            raise BrokerUnavailable(
                f"the broker at {bootstrap} refused the {what} (see --kafka-config): {refused[0].str()}"
            ) from None
        raise BrokerUnavailable(f"no Kafka broker answers at {bootstrap} ({exc.args[0].str()})") from None
    return client


def assigned_consumer(bootstrap: str, group: str, security: KafkaSecurity = PLAINTEXT, **settings) -> Consumer:
    """A consumer for partitions assigned by hand, never subscribed: `group` names it, no offsets committed."""
    base = {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False, "logger": QUIET}
    return Consumer(security.client(**base, **settings))


def partitions_of(client: AdminClient, topic: str, timeout: float = 10.0) -> int | None:
    # All topics' metadata: asking for one by name would make a broker that auto-creates topics create it.
    meta = client.list_topics(timeout=timeout).topics.get(topic)
    if meta is None or meta.error is not None:
        return None
    return len(meta.partitions)


def ensure_topics(
    bootstrap: str, topics: Topics, partitions: int, replication: int = 1, security: KafkaSecurity = PLAINTEXT
) -> int:
    """Create missing topics; return the events topic's partition count (an existing topic keeps its own).

    Violations are keyed by their id on a compacted topic, so re-sent
    duplicates collapse in storage as well as in consumers. The transfers
    topic has as many partitions as the events topic: its partition p is
    joined where the events of partition p are projected (Faust assigns
    co-partitioned topics together).
    """
    client = admin(bootstrap, security=security)
    existing = partitions_of(client, topics.events)
    events_partitions = existing or partitions
    wanted = {
        topics.events: NewTopic(topics.events, events_partitions, replication),
        topics.violations: NewTopic(
            topics.violations, events_partitions, replication, config={"cleanup.policy": "compact"}
        ),
        topics.deadletter: NewTopic(topics.deadletter, events_partitions, replication),
        topics.transfers: NewTopic(topics.transfers, events_partitions, replication),
    }
    transfers = partitions_of(client, topics.transfers)
    if transfers is not None and transfers != events_partitions:
        raise BrokerUnavailable(
            f"topic {topics.transfers} has {transfers} partitions, {topics.events} {events_partitions}: they must match"
        )
    missing = [t for name, t in wanted.items() if partitions_of(client, name) is None]
    if missing:
        for name, future in client.create_topics(missing, operation_timeout=30).items():
            try:
                future.result(timeout=30)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise BrokerUnavailable(f"cannot create topic {name}: {exc.args[0].str()}") from None
    return events_partitions
