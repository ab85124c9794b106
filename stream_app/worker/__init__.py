"""The online stream worker: a Faust app over `kvledger.events`.

Crash safety: idempotent violation ids, not Kafka transactions.

Every violation is published with a key that identifies the fact, not the
send: `<engine>/<digest of the violation's content>/<n>`, where n counts the
identical violations the engine issued before (a counter kept in the engine's
checkpoint). The ledger core is deterministic, so replaying the same events
from the same checkpoint issues the same ids, whatever the batching, the
checkpoint timing or the worker doing it. Processing is at-least-once:

1. a batch's violations, dead letters and transfers are sent;
2. a checkpoint (the engine's `Ledger`, the next offset it needs, the id
   counters) is written to the Faust table only after the producer was
   flushed, so the violations of every event a checkpoint covers are on the
   broker before it;
3. events are acked (their offsets may be committed) only once a checkpoint
   covers them, and a restored engine skips the offsets its checkpoint covers.

A worker killed anywhere re-sends at most what came after its last
checkpoint, under the same ids. The violations topic is compacted on that
key and `kvledger violations` drops repeated ids, so consumers see each
violation exactly once and lose none.

The transfer join follows the same rules over `<prefix>.transfers`: its
state per partition (the `TransferJoin`, the next offset, the id counters)
is checkpointed after its violations were flushed, and its input is acked
only then. What the engine projections re-send after a crash (connector
events and progress they had sent before their checkpoint) reaches the join
as repeats, which it ignores: a connector event is identified by its rank,
kind and step, and progress only ever moves a rank's clock forward.

Why not Kafka transactions (exactly-once): they make a re-send invisible
only within one run of one worker group. Ids go further: dropping the state
and replaying the topic from the start (the event-sourcing way to repair a
projection), restoring an older checkpoint, or a second deployment writing
the same topic all issue the same ids again, so consumers still see each
violation once. They also need nothing of consumers but to keep the last id
(no `read_committed`), and keep Faust on its well-trodden at-least-once path
(its exactly-once mode runs one transactional producer per input partition).
Violations are rare and small, so de-duplicating them by key costs little.
"""
