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
from collections.abc import Callable
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from kvledger.schemas.registry import Schema

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"

Record = dict[str, Any]
# A registry's answer for a schema id: the writer schema as a JSON dict (e.g. from a registry client).
Lookup = Callable[[int], dict[str, Any]]


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


def _avro_long(n: int) -> bytes:
    """Avro's zig-zag varint encoding of a long."""
    z, out = (n << 1) ^ (n >> 63), bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def confluent_header(schema_id: int) -> bytes:
    """The 5 bytes before the body in the Confluent wire format."""
    return CONFLUENT_MAGIC + struct.pack(">I", schema_id)


def _confluent_id(data: bytes) -> int:
    if len(data) < 5 or data[:1] != CONFLUENT_MAGIC:
        raise DecodeError("not a Confluent wire-format record (bad magic)")
    return struct.unpack(">I", data[1:5])[0]


class SchemaIds:
    """Writer schemas by registry id: those added, else resolved through `lookup` and kept.

    A resolved schema equal (in Parsing Canonical Form) to one of `own` is kept as that very
    object, so a reader sees at once that no resolution is needed. A lookup that fails, or
    answers with something that is not an Avro schema, is an `UnknownSchemaError`: decoding
    fails only with `DecodeError`.
    """

    def __init__(self, lookup: Lookup | None = None, own: tuple[Schema, ...] = ()):
        self.lookup = lookup
        self._own = {to_parsing_canonical_form(s): s for s in own}
        self._schemas: dict[int, Schema] = {}

    def add(self, schema_id: int, schema: Schema) -> None:
        self._schemas[schema_id] = schema

    def __bool__(self) -> bool:
        return self.lookup is not None or bool(self._schemas)

    def get(self, schema_id: int) -> Schema:
        schema = self._schemas.get(schema_id)
        if schema is not None:
            return schema
        if self.lookup is None:
            raise UnknownSchemaError(f"unknown schema id {schema_id}")
        try:
            raw = self.lookup(schema_id)
        except Exception as exc:  # the registry's client raises its own types (HTTP, network)
            raise UnknownSchemaError(f"schema id {schema_id}: {exc}") from exc
        try:
            schema = fastavro.parse_schema(raw)
        except Exception as exc:
            raise UnknownSchemaError(f"schema id {schema_id} is not an Avro schema: {exc}") from exc
        schema = self._schemas[schema_id] = self._own.get(to_parsing_canonical_form(schema), schema)
        return schema


class BatchCodec:
    """Several records of one schema in one message.

    The batch schema is a record whose only field is an array of the item
    schema (`kvledger.LedgerEventBatch`). A batch is built from its items'
    own bodies, so a writer can cut batches by size without encoding twice;
    `decode` reads a batch or a single item and returns the items.

    Messages are single-object encoded, or, given the batch schema's registry
    `schema_id`, in the Confluent wire format. With a `schema_id` or a
    `lookup` it also reads Confluent-framed messages (batches or single items,
    of any writer schema the registry resolves, read as its own schemas):
    a fleet moving to a registry writes both framings.
    """

    def __init__(self, item: Schema, batch: Schema, *, schema_id: int | None = None, lookup: Lookup | None = None):
        self.item, self.batch = item, batch
        self._item_fp, self._batch_fp = schema_fingerprint(item), schema_fingerprint(batch)
        self._ids = SchemaIds(lookup, own=(item, batch))
        if schema_id is None:
            self._prefix = SINGLE_OBJECT_MAGIC + self._batch_fp
        else:
            self._prefix = confluent_header(schema_id)
            self._ids.add(schema_id, batch)

    def body(self, record: Record) -> bytes:
        return _write_body(self.item, record)

    def join(self, bodies: list[bytes]) -> bytes:
        """One message of the items whose bodies these are (an Avro array: count, items, end)."""
        return self._prefix + _avro_long(len(bodies)) + b"".join(bodies) + b"\x00"

    def encode(self, records: list[Record]) -> bytes:
        return self.join([self.body(r) for r in records])

    def decode(self, data: bytes) -> list[Record]:
        if data[:1] == CONFLUENT_MAGIC and self._ids:
            return self._decode_confluent(data)
        if len(data) < 10 or data[:2] != SINGLE_OBJECT_MAGIC:
            raise DecodeError("not an Avro single-object encoded record (bad magic)")
        fp = data[2:10]
        if fp == self._batch_fp:
            return _read_body(data, 10, self.batch, None)["events"]
        if fp == self._item_fp:
            return [_read_body(data, 10, self.item, None)]
        raise UnknownSchemaError(f"unknown writer schema fingerprint {fp.hex()}")

    def _decode_confluent(self, data: bytes) -> list[Record]:
        schema_id = _confluent_id(data)
        writer = self._ids.get(schema_id)
        # Another version of either schema resolves to ours (by name, as Avro resolution matches records).
        if writer["name"] == self.batch["name"]:
            return _read_body(data, 5, writer, None if writer is self.batch else self.batch)["events"]
        if writer["name"] == self.item["name"]:
            return [_read_body(data, 5, writer, None if writer is self.item else self.item)]
        raise UnknownSchemaError(f"schema id {schema_id} is a {writer['name']}, not {self.batch['name']} or its item")


class ConfluentCodec:
    """Confluent Schema Registry wire format for one registered schema id.

    Writer schemas of other ids are resolved through `lookup` (e.g. a
    registry client's `get_schema`), cached.
    """

    def __init__(self, schema: Schema, schema_id: int, *, lookup: Lookup | None = None, reader: Schema | None = None):
        self.schema = schema
        self.schema_id = schema_id
        self.reader = reader
        self._prefix = confluent_header(schema_id)
        self._writers = SchemaIds(lookup, own=(schema,) if reader is None else (schema, reader))
        self._writers.add(schema_id, schema)

    def encode(self, record: Record) -> bytes:
        return self._prefix + _write_body(self.schema, record)

    def decode(self, data: bytes) -> Record:
        writer = self._writers.get(_confluent_id(data))
        reader = self.reader if self.reader is not None and writer is not self.reader else None
        return _read_body(data, 5, writer, reader)


class EitherFraming:
    """Reads records of one schema in either framing: single-object (writers by fingerprint, `known`)
    or, with `lookup`, Confluent (writers by registry id); each resolved to `reader`. Writes nothing."""

    def __init__(self, reader: Schema, *, known: list[Schema] = (), lookup: Lookup | None = None):
        self.reader = reader
        self._single = SingleObjectCodec(reader, known=known, reader=reader)
        self._ids = SchemaIds(lookup, own=(reader,))

    def decode(self, data: bytes) -> Record:
        if data[:1] == CONFLUENT_MAGIC and self._ids:
            writer = self._ids.get(_confluent_id(data))
            return _read_body(data, 5, writer, None if writer is self.reader else self.reader)
        return self._single.decode(data)
