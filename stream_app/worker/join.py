"""The worker's join of `<prefix>.transfers`: pure, no Kafka, no clock.

The engine projections forward every ConnectorEvent with a transfer id to the
transfers topic, keyed by transfer id, so both engines of a transfer meet in
one partition whatever partitions their own events live in; and now and then
each rank's progress (a Step event with no input or plan) to every partition,
which is the clock the join's deadlines count. One `TransferJoin` per
partition of that topic, checkpointed like an engine.
"""

from __future__ import annotations

from kvledger.schemas import LEDGER_EVENT, DecodeError, SingleObjectCodec, UnknownSchemaError
from kvledger.stream_app.core.transfers import TransferJoin
from kvledger.stream_app.worker.projection import DeadLetter, Outcome, Record, ViolationIds, pack_state, unpack_state

CHECKPOINT_FORMAT = 1


class JoinProjection:
    """The transfers of one partition of the transfer-keyed topic, and the offsets it covers."""

    def __init__(self, partition: int, join: TransferJoin | None = None, *, next_offset: int = 0, ids=None):
        self.partition = partition
        self.join = join if join is not None else TransferJoin()
        self.next_offset = next_offset
        self.ids = ids if ids is not None else ViolationIds()
        self.codec = SingleObjectCodec(LEDGER_EVENT)

    def checkpoint(self) -> bytes:
        return pack_state(
            CHECKPOINT_FORMAT, partition=self.partition, join=self.join, next_offset=self.next_offset, ids=self.ids
        )

    @classmethod
    def restore(cls, blob: bytes) -> JoinProjection:
        state = unpack_state(blob, CHECKPOINT_FORMAT)
        return cls(state["partition"], state["join"], next_offset=state["next_offset"], ids=state["ids"])

    def apply(self, records: list[Record]) -> Outcome:
        """Apply records of this partition in offset order; skip what the state already covers."""
        out = Outcome()
        for record in records:
            if record.offset < self.next_offset:
                continue
            self.next_offset = record.offset + 1
            try:
                event = self.codec.decode(record.value)
                found = self.join.apply(event)
            except (DecodeError, UnknownSchemaError) as exc:  # only the worker writes here: a bug, kept aside
                out.dead_letters.append(DeadLetter(record, "undecodable", str(exc)))
                continue
            except Exception as exc:  # one bad record never stops the join
                out.dead_letters.append(DeadLetter(record, "rejected_by_join", f"{type(exc).__name__}: {exc}"))
                continue
            out.violations += self.ids.issue(found)
        return out

    @property
    def open_transfers(self) -> int:
        return len(self.join.transfers)
