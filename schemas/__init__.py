"""The kvledger contract: Avro schemas, their codecs and the file ledger format.

Everything another team needs to read or write the ledger lives here, and
nothing here imports the rest of kvledger.
"""

from kvledger.schemas.codec import (
    BatchCodec,
    ConfluentCodec,
    DecodeError,
    EitherFraming,
    SingleObjectCodec,
    UnknownSchemaError,
)
from kvledger.schemas.packing import (
    pack_digests,
    pack_i32,
    pack_i64,
    pack_u64,
    row_digest,
    unpack_digests,
    unpack_i32,
    unpack_i64,
    unpack_u64,
)
from kvledger.schemas.registry import LEDGER_EVENT, LEDGER_EVENT_BATCH, VIOLATION, load_schema

__all__ = [
    "LEDGER_EVENT",
    "LEDGER_EVENT_BATCH",
    "BatchCodec",
    "VIOLATION",
    "ConfluentCodec",
    "DecodeError",
    "EitherFraming",
    "SingleObjectCodec",
    "UnknownSchemaError",
    "load_schema",
    "pack_i32",
    "pack_i64",
    "pack_digests",
    "pack_u64",
    "row_digest",
    "unpack_i32",
    "unpack_i64",
    "unpack_digests",
    "unpack_u64",
]
