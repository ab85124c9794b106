"""Message encodings of ledger records.

Two framings of the same Avro binary body:

* Avro single-object encoding (the default): ``C3 01`` + the writer schema's
  8-byte CRC-64-AVRO fingerprint (little endian) + body. Self-describing
  without a registry: readers keep the schemas they know by fingerprint.
* Confluent wire format, when a Schema Registry is configured: ``00`` + the
  4-byte big-endian schema id the registry assigned + body.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from kvledger.schemas.registry import Schema

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"

Record = dict[str, Any]


class DecodeError(ValueError):
    """The bytes are not a record this codec can read."""


class UnknownSchemaError(DecodeError):
    """The record names a writer schema this reader has not been given."""


def schema_fingerprint(schema: Schema) -> bytes:
    """CRC-64-AVRO fingerprint of the schema's parsing canonical form, as framed."""
    hex_digest = fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO")
    # fastavro's hex digest already lists the 64-bit value's bytes little-endian, as framed.
    return bytes.fromhex(hex_digest)


def _read_body(data: bytes, offset: int, writer: Schema, reader: Schema | None) -> Record:
    try:
        return fastavro.schemaless_reader(
            io.BytesIO(data[offset:]),
            writer,
            reader,
            return_record_name=True,
            return_record_name_override=True,
        )
    except Exception as exc:  # fastavro raises several types for bad bytes
        raise DecodeError(f"undecodable Avro body: {exc}") from exc


def _write_body(schema: Schema, record: Record) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


class SingleObjectCodec:
    """Avro single-object encoding with a set of known writer schemas."""

    def __init__(self, schema: Schema, *, known: list[Schema] = (), reader: Schema | None = None):
        self.schema = schema
        self.reader = reader
        self._prefix = SINGLE_OBJECT_MAGIC + schema_fingerprint(schema)
        self._writers = {schema_fingerprint(s): s for s in [schema, *known]}

    def encode(self, record: Record) -> bytes:
        return self._prefix + _write_body(self.schema, record)

    def decode(self, data: bytes) -> Record:
        if len(data) < 10 or data[:2] != SINGLE_OBJECT_MAGIC:
            raise DecodeError("not an Avro single-object encoded record (bad magic)")
        writer = self._writers.get(data[2:10])
        if writer is None:
            raise UnknownSchemaError(f"unknown writer schema fingerprint {data[2:10].hex()}")
        reader = self.reader if self.reader is not None and writer is not self.reader else None
        return _read_body(data, 10, writer, reader)


class ConfluentCodec:
    """Confluent Schema Registry wire format for one registered schema id.

    Writer schemas of other ids are resolved through `lookup` (e.g. a
    registry client's `get_schema`), cached.
    """

    def __init__(self, schema: Schema, schema_id: int, *, lookup=None, reader: Schema | None = None):
        self.schema = schema
        self.schema_id = schema_id
        self.reader = reader
        self._lookup = lookup
        self._prefix = CONFLUENT_MAGIC + struct.pack(">I", schema_id)
        self._writers: dict[int, Schema] = {schema_id: schema}

    def encode(self, record: Record) -> bytes:
        return self._prefix + _write_body(self.schema, record)

    def decode(self, data: bytes) -> Record:
        if len(data) < 5 or data[:1] != CONFLUENT_MAGIC:
            raise DecodeError("not a Confluent wire-format record (bad magic)")
        (schema_id,) = struct.unpack(">I", data[1:5])
        writer = self._writers.get(schema_id)
        if writer is None and self._lookup is not None:
            writer = self._writers[schema_id] = fastavro.parse_schema(self._lookup(schema_id))
        if writer is None:
            raise UnknownSchemaError(f"unknown schema id {schema_id}")
        reader = self.reader if self.reader is not None and writer is not self.reader else None
        return _read_body(data, 5, writer, reader)
