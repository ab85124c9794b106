"""The worker's join of `<prefix>.transfers`: pure, no Kafka, no clock.

The engine projections forward every ConnectorEvent with a transfer id to the
transfers topic, keyed by transfer id, so both engines of a transfer meet in
one partition whatever partitions their own events live in; and now and then
each rank's progress (a Step event with no input or plan) to every partition,
which is the clock the join's deadlines count. One `TransferJoin` per
partition of that topic, checkpointed like an engine.
"""

from __future__ import annotations

from kvledger.schemas import LEDGER_EVENT, DecodeError, SingleObjectCodec, UnknownSchemaError, checkpoint
from kvledger.schemas.checkpoint import JoinCheckpoint
from kvledger.schemas.events import event_of
from kvledger.stream_app.core.checkpoints import StateError, join_checkpoint, join_of
from kvledger.stream_app.core.transfers import TransferJoin
from kvledger.stream_app.worker.projection import (
    CheckpointError,
    DeadLetter,
    Outcome,
    Record,
    ViolationIds,
    decode_checkpoint,
)


class JoinProjection:
    """The transfers of one partition of the transfer-keyed topic, and the offsets it covers."""

    def __init__(self, partition: int, join: TransferJoin | None = None, *, next_offset: int = 0, ids=None):
        self.partition = partition
        self.join = join if join is not None else TransferJoin()
        self.next_offset = next_offset
        self.ids = ids if ids is not None else ViolationIds()
        self.codec = SingleObjectCodec(LEDGER_EVENT)

    def checkpoint(self) -> bytes:
        """The whole state as an Avro record (schemas/avro/checkpoint.avsc)."""
        body = join_checkpoint(self.join, self.partition, next_offset=self.next_offset, issued=self.ids.counts())
        return checkpoint.encode(body)

    @classmethod
    def restore(cls, blob: bytes, partition: int | None = None) -> JoinProjection:
        """The join a checkpoint describes (of `partition`, when given); CheckpointError otherwise."""
        body = decode_checkpoint(blob, JoinCheckpoint)
        if partition is not None and body.partition != partition:
            raise CheckpointError(f"the checkpoint of partition {body.partition} under the key of {partition}")
        try:
            join = join_of(body)
        except (StateError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the checkpoint does not describe a transfer join: {exc}") from exc
        ids = ViolationIds.from_counts(body.issued)
        return cls(body.partition, join, next_offset=body.next_offset, ids=ids)

    def apply(self, records: list[Record]) -> Outcome:
        """Apply records of this partition in offset order; skip what the state already covers."""
        out = Outcome()
        for record in records:
            if record.offset < self.next_offset:
                continue
            self.next_offset = record.offset + 1
            try:
                event = event_of(self.codec.decode(record.value))  # decoded once, here at the edge
            except (DecodeError, UnknownSchemaError, ValueError) as exc:  # only the worker writes here: a bug
                out.dead_letters.append(DeadLetter(record, "undecodable", str(exc)))
                continue
            try:
                found = self.join.apply(event)
            except Exception as exc:  # one bad record never stops the join
                out.dead_letters.append(DeadLetter(record, "rejected_by_join", f"{type(exc).__name__}: {exc}"))
                continue
            out.violations += self.ids.issue(found)
        return out

    @property
    def open_transfers(self) -> int:
        return len(self.join.transfers)
