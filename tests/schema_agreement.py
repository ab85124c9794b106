"""A typed model and its Avro schema, field for field: the check every typed record of the contract
(`kvledger.schemas.events`, `kvledger.schemas.checkpoint`) is held to.

Same record names, fields in the same order, of the same types (nullable where the schema says so,
nested records and named references alike, arrays, maps), enums of the same symbols, and every
default the model fills in the schema's (for the records of the modules named in `all_defaults`,
every default of the schema the model's too: those of `kvledger.schemas.events` take only the ones a
record built in process may leave out). An enum the schema keeps a string (for evolution) must be one the caller names.
"""

from __future__ import annotations

import typing
from enum import StrEnum

import msgspec

from kvledger.schemas.events import to_record
from kvledger.schemas.kinds import ConnectorKind, Runner, ViolationKind, connector_wire

_PRIMITIVES = {"int": int, "long": int, "string": str, "bytes": bytes, "boolean": bool}


def written_symbols(enum: type[StrEnum]) -> list[str]:
    """The symbols an enum is written with (a connector kind without a symbol is written as OTHER)."""
    return [m.value for m in enum if enum is not ConnectorKind or connector_wire(m, None)[0] == m.value]


class Agreement:
    """One schema against its model; named types defined in an earlier record are known to later ones."""

    def __init__(self, *, string_enums: tuple[type, ...] = (Runner, ViolationKind), all_defaults: tuple[str, ...] = ()):
        self.string_enums = string_enums  # enums the schema keeps as strings
        self.all_defaults = all_defaults  # modules whose records have every default of the schema
        self.named: dict[str, dict] = {}  # named types met so far, by full and by short name

    def record(self, avro: dict, cls: type) -> None:
        """A record of the schema and a Struct of the model say the same thing."""
        self._name(avro)
        assert cls.__name__ == avro["name"], f"{avro['name']} vs {cls.__name__}"
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        assert list(fields) == [f["name"] for f in avro["fields"]], avro["name"]
        for f in avro["fields"]:
            where = f"{avro['name']}.{f['name']}"
            self.type(f["type"], hints[f["name"]], where)
            field = fields[f["name"]]
            if not field.required:  # a default the model fills in is the schema's
                default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
                assert "default" in f and to_record(default) == f["default"], where
            elif cls.__module__ in self.all_defaults:
                assert "default" not in f, f"{where}: a default in the schema, none in the model"

    def type(self, avro, hint, where: str) -> None:
        """An Avro type and a type hint of the model say the same thing."""
        if isinstance(avro, list):  # a union: null and one branch
            assert avro[0] == "null" and len(avro) == 2, where
            args = typing.get_args(hint)
            assert type(None) in args, f"{where}: nullable in the schema, not in the model"
            (inner,) = [a for a in args if a is not type(None)]
            return self.type(avro[1], inner, where)
        assert type(None) not in typing.get_args(hint), f"{where}: nullable in the model, not in the schema"
        if isinstance(avro, str) and avro not in _PRIMITIVES:  # a named type, defined earlier
            assert avro in self.named or avro.rsplit(".", 1)[-1] in self.named, f"{where}: {avro} undefined"
            return self.type(self.named.get(avro) or self.named[avro.rsplit(".", 1)[-1]], hint, where)
        if avro == "string" and isinstance(hint, type) and issubclass(hint, StrEnum):
            assert hint in self.string_enums, f"{where}: {hint.__name__}, an enum the schema keeps a string"
        elif isinstance(avro, str):
            assert hint is _PRIMITIVES[avro], f"{where}: {avro} vs {hint}"
        elif avro["type"] == "array":
            assert typing.get_origin(hint) is list, where
            self.type(avro["items"], typing.get_args(hint)[0], where + "[]")
        elif avro["type"] == "map":
            assert typing.get_origin(hint) is dict and typing.get_args(hint)[0] is str, where
            self.type(avro["values"], typing.get_args(hint)[1], where + "{}")
        elif avro["type"] == "enum":
            self._name(avro)
            assert isinstance(hint, type) and issubclass(hint, StrEnum), where
            assert written_symbols(hint) == avro["symbols"], where
        elif avro["type"] == "record":
            assert isinstance(hint, type) and issubclass(hint, msgspec.Struct), where
            self.record(avro, hint)
        else:
            raise AssertionError(f"{where}: a {avro['type']} the check does not know")

    def _name(self, avro: dict) -> None:
        name = avro["name"]
        full = name if "." in name or "namespace" not in avro else f"{avro['namespace']}.{name}"
        self.named.setdefault(full, avro)
        self.named.setdefault(name.rsplit(".", 1)[-1], avro)


def record_agrees(avro: dict, cls: type, **options) -> None:
    """A record of a schema (with the definitions of the names it uses) and a Struct say the same thing."""
    Agreement(**options).record(avro, cls)
