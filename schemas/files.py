"""The file ledger: a directory of Avro Object Container Files.

Layout, one stream per rank, rotated by size::

    ROOT/<engine_id>/dp<D>-tp<T>-pp<P>/<incarnation>-<segment:06d>.avro

Any Avro tool reads a segment (the writer schema is in its header). Readers
report what they could not read instead of failing: a truncated last block
(a writer killed mid-write) or a corrupt file becomes a `ReadProblem`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import fastavro
from fastavro.schema import to_parsing_canonical_form
from fastavro.write import Writer

from kvledger.schemas.registry import LEDGER_EVENT

SEGMENT_SUFFIX = ".avro"
_RANK_DIR = re.compile(r"^dp(\d+)-tp(\d+)-pp(\d+)$")
_SEGMENT = re.compile(r"^(\d+)-(\d+)\.avro$")


def engine_dir_name(engine_id: str) -> str:
    """A directory name for an engine id that cannot escape the root ('.', '..', '/')."""
    if not engine_id:
        raise ValueError("engine id must not be empty")
    name = quote(engine_id, safe="")
    return "%2E" + name[1:] if name.startswith(".") else name


def rank_dir(root: Path, engine_id: str, dp: int, tp: int, pp: int) -> Path:
    return root / engine_dir_name(engine_id) / f"dp{dp}-tp{tp}-pp{pp}"


class SegmentWriter:
    """Appends events of one rank incarnation, rotating segments by size.

    Events are cut into Avro blocks of about `block_bytes` (compression works
    across the steps of a block) and every block reaches the file within
    `flush_interval` seconds of its first event; `flush_interval=0` makes each
    `write` durable at once.
    """

    def __init__(
        self,
        root: str | Path,
        engine_id: str,
        dp: int,
        tp: int,
        pp: int,
        incarnation: int,
        *,
        max_segment_bytes: int = 64 << 20,
        codec: str = "deflate",
        block_bytes: int = 64 << 10,
        flush_interval: float = 0.0,
    ):
        if incarnation < 0:
            raise ValueError(f"incarnation must be >= 0, got {incarnation}")
        self.dir = rank_dir(Path(root), engine_id, dp, tp, pp)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.incarnation = incarnation
        self.max_segment_bytes = max_segment_bytes
        self.codec = codec
        self.block_bytes = block_bytes
        self.flush_interval = flush_interval
        self._pending_since: float | None = None  # when the unflushed block got its first event
        self.segment = 0
        self._file = None
        self._writer: Writer | None = None
        self._open_next()

    def _open_next(self) -> None:
        self.close()
        self.segment += 1
        path = self.dir / f"{self.incarnation}-{self.segment:06d}{SEGMENT_SUFFIX}"
        self._file = open(path, "wb")  # noqa: SIM115 - closed on rotation/close
        self._writer = Writer(self._file, LEDGER_EVENT, codec=self.codec, sync_interval=self.block_bytes)

    def write(self, events: list[dict[str, Any]]) -> None:
        """Append events; they are in the file within `flush_interval` seconds."""
        assert self._writer is not None, "writer is closed"
        for event in events:
            self._writer.write(event)
        now = time.monotonic()
        if self._pending_since is None:
            self._pending_since = now
        if now - self._pending_since >= self.flush_interval:
            self._writer.flush()
            self._pending_since = None
        if self._file.tell() >= self.max_segment_bytes:
            self._open_next()

    def flush_if_due(self) -> None:
        """Flush a block that has waited `flush_interval` seconds (for writers that go idle)."""
        if self._pending_since is not None and time.monotonic() - self._pending_since >= self.flush_interval:
            self._writer.flush()
            self._pending_since = None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._file.close()
            self._writer = self._file = None
        self._pending_since = None


@dataclass(frozen=True)
class ReadProblem:
    path: str
    reason: str  # short machine-readable reason, e.g. 'truncated', 'not_avro'
    detail: str
    events_read: int


@dataclass
class RankStream:
    """All segments of one rank of one engine, in write order."""

    engine_id: str
    dp: int
    tp: int
    pp: int
    segments: list[Path] = field(default_factory=list)


class LedgerPathError(ValueError):
    """The path is not a usable file ledger."""


def discover(root: str | Path) -> list[RankStream]:
    """Find the rank streams under a ledger root (or a single segment file)."""
    root = Path(root)
    if not root.exists():
        raise LedgerPathError(f"no such file or directory: {root}")
    if root.is_file():
        return [RankStream("?", -1, -1, -1, [root])]
    streams = []
    for engine_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for rdir in sorted(p for p in engine_dir.iterdir() if p.is_dir()):
            match = _RANK_DIR.match(rdir.name)
            if not match:
                continue
            segments = sorted(
                (p for p in rdir.iterdir() if _SEGMENT.match(p.name)),
                key=lambda p: tuple(int(x) for x in _SEGMENT.match(p.name).groups()),
            )
            if segments:
                dp, tp, pp = (int(x) for x in match.groups())
                streams.append(RankStream(unquote(engine_dir.name), dp, tp, pp, segments))
    stray = [p for p in root.rglob(f"*{SEGMENT_SUFFIX}") if not _RANK_DIR.match(p.parent.name)]
    if not streams and stray:
        # A flat directory of segments: read them as they are, one stream each.
        streams = [RankStream("?", -1, -1, -1, [p]) for p in sorted(stray)]
    return streams


def same_schema(a, b) -> bool:
    return to_parsing_canonical_form(a) == to_parsing_canonical_form(b)


def read_segment(
    path: Path, problems: list[ReadProblem], progress: dict[Path, int] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the events of one segment; append a ReadProblem for what is unreadable.

    `progress[path]`, when given, follows the bytes read so far.
    """
    count = 0
    try:
        if os.path.getsize(path) == 0:
            problems.append(ReadProblem(str(path), "empty_file", "file is empty", 0))
            return
        with open(path, "rb") as fo:
            try:
                blocks = fastavro.block_reader(fo, return_record_name=True, return_record_name_override=True)
                if not same_schema(blocks.writer_schema, LEDGER_EVENT):
                    # Written by another version of the contract: resolve (slower).
                    fo.seek(0)
                    blocks = fastavro.block_reader(
                        fo, reader_schema=LEDGER_EVENT, return_record_name=True, return_record_name_override=True
                    )
            except Exception as exc:
                problems.append(ReadProblem(str(path), "not_avro", f"not an Avro container file: {exc}", 0))
                return
            for block in blocks:
                if progress is not None:
                    progress[path] = block.offset + block.size
                if block.num_records < 0:  # fastavro would take a garbage count as an empty block
                    problems.append(ReadProblem(str(path), "corrupt", f"block with {block.num_records} records", count))
                    return
                for event in block:
                    count += 1
                    yield event
    except (EOFError, ValueError, OSError, StopIteration, fastavro.read.SchemaResolutionError) as exc:
        reason = "truncated" if isinstance(exc, EOFError) else "corrupt"
        problems.append(ReadProblem(str(path), reason, f"{type(exc).__name__}: {exc}", count))
    except Exception as exc:  # zlib and codec errors surface as assorted types
        problems.append(ReadProblem(str(path), "corrupt", f"{type(exc).__name__}: {exc}", count))
