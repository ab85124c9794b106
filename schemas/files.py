"""The file ledger: a directory of Avro Object Container Files.

Layout, one stream per rank, rotated by size::

    ROOT/<engine_id>/dp<D>-tp<T>-pp<P>/<incarnation>-<segment:06d>.avro

Any Avro tool reads a segment (the writer schema is in its header). Each
Avro block reaches the file whole, in one write(2), so a killed writer loses
only what it still held in memory; `<incarnation>.end` beside the segments
says through which event the writer last confirmed the stream complete (when
idle, and at close), so a reader can tell a complete stream from one whose
writer died mid-run. Readers report what they could not read instead of
failing: a torn last block or an unconfirmed end is a truncated tail (every
whole block before it is kept), damage before the end is `corrupt`; each is
a `ReadProblem`.

Retention (`Retention`, off by default) bounds a rank directory: after each
rotation the oldest segments go while the directory holds more than its
byte budget or their newest event is older than its age limit. With it on,
segments are cut right before a snapshot's layout (RankInfo, then the
Snapshot), so the oldest segment kept replays on its own: a reader joins
the stream there, mid-stream, and resyncs at once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import fastavro
from fastavro.schema import to_parsing_canonical_form
from fastavro.write import Writer

from kvledger.schemas.kinds import ReadFailure
from kvledger.schemas.ranks import parse_rank_label, rank_label
from kvledger.schemas.registry import LEDGER_EVENT, RANK_INFO, SNAPSHOT

log = logging.getLogger("kvledger.producer")  # the writer runs in the producer

SEGMENT_SUFFIX = ".avro"
END_SUFFIX = ".end"
_SEGMENT = re.compile(r"^(\d+)-(\d+)\.avro$")
# With retention on, a segment waits for a snapshot to be cut, up to this many times its size:
# past that it is cut anyway (the bound on disk matters more; readers count the gap unchecked).
UNCUT_SEGMENT_FACTOR = 4
# zlib's level for deflate blocks: the recorder compresses every block on the engine's host, and at
# level 3 a decode step's share costs ~10 us at 64 requests and ~41 us at 256, against ~27 and ~87 us
# at zlib's default (6), for 2 % and 6 % more bytes (level 1 and 2 cost less still, but level 1 wrote
# 63 % more at 256 requests). Readers take any level.
DEFLATE_LEVEL = 3


def engine_dir_name(engine_id: str) -> str:
    """A directory name for an engine id that cannot escape the root ('.', '..', '/')."""
    if not engine_id:
        raise ValueError("engine id must not be empty")
    name = quote(engine_id, safe="")
    return "%2E" + name[1:] if name.startswith(".") else name


def rank_dir(root: Path, engine_id: str, dp: int, tp: int, pp: int) -> Path:
    return root / engine_dir_name(engine_id) / rank_label(dp, tp, pp)


def end_marker_path(directory: Path, incarnation: int) -> Path:
    """Where a rank incarnation's writer records how far its stream is confirmed complete."""
    return directory / f"{incarnation}{END_SUFFIX}"


@dataclass(frozen=True)
class EndMarker:
    seq: int  # the newest event in the file when the writer confirmed it (-1: none yet)
    closed: bool  # confirmed by the writer's close, not by an idle moment


def read_end_marker(path: Path) -> EndMarker | None:
    """The end marker, or None where the stream has none (another tool, an older writer)."""
    try:
        raw = json.loads(path.read_text())
        return EndMarker(int(raw["seq"]), bool(raw["closed"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Retention:
    """How much of a rank directory (all its incarnations) a writer keeps; 0 is unlimited."""

    max_bytes: int = 0
    max_age_s: float = 0.0

    def expired(self, total: int, mtime: float, now: float) -> bool:
        """Whether the oldest segment goes: the directory is over its budget, or the segment's
        newest event (its mtime) is older than the age limit."""
        over = 0 < self.max_bytes < total
        old = 0 < self.max_age_s < now - mtime
        return over or old


def segment_order(path: Path) -> tuple[int, int]:
    """Write order of a segment file: (incarnation, segment number)."""
    match = _SEGMENT.match(path.name)
    assert match, path
    return int(match[1]), int(match[2])


def list_segments(directory: Path) -> list[Path]:
    """The segments of a rank directory, oldest first."""
    return sorted((p for p in directory.iterdir() if _SEGMENT.match(p.name)), key=segment_order)


class SegmentWriter:
    """Appends events of one rank incarnation, rotating segments by size.

    Events are cut into Avro blocks of about `block_bytes` (compression works
    across the steps of a block) and every block reaches the file within
    `flush_interval` seconds of its first event, whole, in one write(2): a
    killed process leaves whole blocks only (a torn one only if the write
    itself fails, e.g. a full disk). `flush_interval=0` writes each `write`
    at once. `confirm()` and `close()` record in the end marker that the file
    holds every event so far. With `retention`, a full segment is cut at the
    next snapshot (`UNCUT_SEGMENT_FACTOR`) and every rotation deletes the
    oldest segments of the rank directory it no longer keeps (`deleted_*`
    count them); it runs on the writer's thread, the producer's drain thread.
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
        compression_level: int | None = DEFLATE_LEVEL,
        block_bytes: int = 64 << 10,
        flush_interval: float = 0.0,
        retention: Retention | None = None,
    ):
        if incarnation < 0:
            raise ValueError(f"incarnation must be >= 0, got {incarnation}")
        self.dir = rank_dir(Path(root), engine_id, dp, tp, pp)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.incarnation = incarnation
        self.max_segment_bytes = max_segment_bytes
        self.codec = codec
        self.compression_level = compression_level  # the codec's (None: its library's default)
        self.block_bytes = block_bytes
        self.flush_interval = flush_interval
        self.retention = retention
        self.deleted_segments = 0
        self.deleted_bytes = 0
        self._previous_body: str | None = None  # the name of the last event written
        self._pending_since: float | None = None  # when the unflushed block got its first event
        self.last_seq = -1  # the newest event handed to `write`
        self.segment = 0
        self.path: Path | None = None  # the segment being written
        self._file = None
        self._size = 0  # bytes in the file
        self._segment_events = 0  # events in the segment being written
        self._out = BytesIO()  # whole blocks (and the header) waiting for their write(2)
        self._writer: Writer | None = None
        self._marker = end_marker_path(self.dir, incarnation)
        self._write_marker(closed=False)  # from here on, a stream without its confirmation is a truncated one
        self._open_next()

    def _open_next(self) -> None:
        rotated = self._writer is not None
        self._close_file()
        self.segment += 1
        self.path = self.dir / f"{self.incarnation}-{self.segment:06d}{SEGMENT_SUFFIX}"
        self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115 - closed on rotation/close
        self._size = self._segment_events = 0
        self._writer = Writer(
            self._out,
            LEDGER_EVENT,
            codec=self.codec,
            sync_interval=self.block_bytes,
            compression_level=self.compression_level,
        )
        self._commit()
        if rotated and self.retention is not None:
            self._retire()

    def _retire(self) -> None:
        """Delete the oldest segments of the rank directory that retention no longer keeps; never
        the one being written, nor the one finished just before it (however large, it holds the
        newest events: the directory may exceed its budget by that segment), nor anything after
        them (another writer's)."""
        assert self.retention is not None
        sized = []
        for path in list_segments(self.dir):
            with contextlib.suppress(OSError):  # gone already: nothing to keep or count
                sized.append((path, path.stat()))
        total, now = sum(st.st_size for _, st in sized), time.time()
        for (path, st), (following, _) in itertools.pairwise(sized):
            if self.path in (path, following) or not self.retention.expired(total, st.st_mtime, now):
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            total -= st.st_size
            self.deleted_segments += 1
            self.deleted_bytes += st.st_size
            log.debug("kv_trace: retention deleted %s (%d bytes)", path, st.st_size)
        self._drop_orphan_markers()

    def _drop_orphan_markers(self) -> None:
        """End markers of incarnations whose segments are all gone say nothing any more."""
        live = {segment_order(p)[0] for p in list_segments(self.dir)} | {self.incarnation}
        for marker in self.dir.glob(f"*{END_SUFFIX}"):
            if marker.stem.isdigit() and int(marker.stem) not in live:
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()

    def _commit(self) -> None:
        """Hand the whole blocks fastavro has finished to the OS, in one write(2)."""
        data = memoryview(self._out.getvalue())
        self._out.seek(0)
        self._out.truncate(0)
        done = 0
        try:
            while done < len(data):
                done += self._file.write(data[done:])
        finally:
            self._size += done

    def write(self, events: list[dict[str, Any]]) -> None:
        """Append events; they are in the file within `flush_interval` seconds."""
        assert self._writer is not None, "writer is closed"
        if self.retention is None:
            self._append(events)
        else:  # event by event: a batch of any size is still cut at its snapshots
            for event in events:
                if self._segment_events and self._written() >= self.max_segment_bytes and self._resync_point(event):
                    self._open_next()  # the new segment begins where a reader can resync
                self._previous_body = event["body"][0]
                self._writer.write(event)
                self._segment_events += 1
        if events:
            self.last_seq = events[-1]["seq"]
        now = time.monotonic()
        if self._pending_since is None:
            self._pending_since = now
        if now - self._pending_since >= self.flush_interval:
            self.flush()
        else:
            self._commit()  # blocks fastavro cut at `block_bytes`
        factor = 1 if self.retention is None else UNCUT_SEGMENT_FACTOR
        if self._size >= factor * self.max_segment_bytes:
            self._open_next()

    def _written(self) -> int:
        """Bytes of the segment so far: in the file, and in whole blocks waiting for their write (the
        block fastavro is filling, at most `block_bytes` before compression, is not counted)."""
        return self._size + self._out.tell()

    def _append(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self._writer.write(event)
        self._segment_events += len(events)

    def _resync_point(self, event: dict[str, Any]) -> bool:
        """A snapshot's layout, or a snapshot that came without one: a reader starting here
        needs nothing older."""
        name = event["body"][0]
        return name == RANK_INFO or (name == SNAPSHOT and self._previous_body != RANK_INFO)

    def flush(self) -> None:
        """End the current block and write it."""
        if self._writer is not None:
            self._writer.flush()
            self._commit()
        self._pending_since = None

    def flush_if_due(self) -> None:
        """Flush a block that has waited `flush_interval` seconds (for writers that go idle)."""
        if self._pending_since is not None and time.monotonic() - self._pending_since >= self.flush_interval:
            self.flush()

    def confirm(self) -> None:
        """Write everything and record that the file holds every event so far (the writer is idle)."""
        self.flush()
        self._write_marker(closed=False)

    def _write_marker(self, *, closed: bool) -> None:
        tmp = self._marker.with_name(f".{self._marker.name}.tmp")
        tmp.write_text(json.dumps({"seq": self.last_seq, "closed": closed}))
        os.replace(tmp, self._marker)  # atomic: a reader sees the old marker or the new one

    def _close_file(self) -> None:
        if self._writer is not None:
            self.flush()
            self._file.close()
            self._writer = self._file = None
        self._pending_since = None

    def close(self) -> None:
        if self._writer is not None:
            self._close_file()
            self._write_marker(closed=True)


@dataclass(frozen=True)
class ReadProblem:
    path: str
    reason: ReadFailure
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
    # The engine and rank its directories name, where its events name another (a directory renamed or
    # copied): the stream is read as its events say, this is kept to say so. None where they agree.
    laid_out_as: tuple[str, int, int, int] | None = None

    @property
    def identity(self) -> tuple[str, int, int, int]:
        return self.engine_id, self.dp, self.tp, self.pp


class LedgerPathError(ValueError):
    """The path is not a usable file ledger (one line, naming the path)."""


# How deep below a given directory rank directories are looked for: the directory may be a rank
# directory (0), an engine's (1), a ledger root (2), or a directory of roots (3: one per engine of a
# prefill/decode pair, each traced to a root of its own).
_RANK_DEPTH = 3
_AVRO_MAGIC = b"Obj\x01"


def _subdirs(directory: Path) -> list[Path]:
    """The directories in `directory`, by name; an unreadable one is a LedgerPathError."""
    try:
        with os.scandir(directory) as entries:
            return sorted(Path(e.path) for e in entries if e.is_dir())
    except PermissionError:
        raise LedgerPathError(f"cannot read {directory}: permission denied") from None
    except NotADirectoryError:
        return []
    except OSError as exc:
        raise LedgerPathError(f"cannot read {directory}: {exc.strerror or exc}") from None


def _segments_of(directory: Path) -> list[Path]:
    try:
        return list_segments(directory)
    except PermissionError:
        raise LedgerPathError(f"cannot read {directory}: permission denied") from None
    except OSError as exc:
        raise LedgerPathError(f"cannot read {directory}: {exc.strerror or exc}") from None


def foreign_file(path: Path) -> str | None:
    """Why `path` is not a ledger segment at all (another kind of file, or Avro records of another
    schema); None for a segment, and for one whose writer never finished it (empty, or a torn
    header: the reader reports those as what they are). An unreadable file is a LedgerPathError."""
    try:
        with open(path, "rb") as fo:
            # Empty, or cut inside the magic bytes, is a segment its writer never finished.
            if not _AVRO_MAGIC.startswith(fo.read(len(_AVRO_MAGIC))):
                return "not an Avro object container file"
            fo.seek(0)
            try:
                writer_schema = fastavro.block_reader(fo).writer_schema
            except Exception:  # a header cut short or damaged: the reader reports it (not_avro)
                return None
    except FileNotFoundError:
        return None  # deleted since it was listed (a writer's retention): the reader says so
    except PermissionError:
        raise LedgerPathError(f"cannot read {path}: permission denied") from None
    except IsADirectoryError:
        return "a directory"
    except OSError as exc:
        raise LedgerPathError(f"cannot read {path}: {exc.strerror or exc}") from None
    name = writer_schema.get("name") if isinstance(writer_schema, dict) else None
    if name is None or name.rsplit(".", 1)[-1] != LEDGER_EVENT["name"].rsplit(".", 1)[-1]:
        return f"an Avro file of {name or 'other'} records, not ledger events"
    return None


def _checked(segments: list[Path]) -> list[Path]:
    """`segments`, each a ledger segment: a foreign file among them is a LedgerPathError."""
    for path in segments:
        if (why := foreign_file(path)) is not None:
            raise LedgerPathError(f"{path} is not a ledger segment: {why}")
    return segments


def _first_event(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(Exception), open(path, "rb") as fo:
        return next(iter(fastavro.reader(fo)), None)
    return None


def _as_its_events_say(stream: RankStream) -> RankStream:
    """`stream` under the engine and rank its first readable event names, where its directories name
    another (renamed or copied): it is read, checked and listed once, as the events' own."""
    first = next(filter(None, map(_first_event, stream.segments)), None)
    if first is None:
        return stream  # nothing readable: the layout is all there is to go by
    told = (first["engine_id"], first["dp_rank"], first["tp_rank"], first["pp_rank"])
    if told == stream.identity:
        return stream
    return RankStream(*told, stream.segments, laid_out_as=stream.identity)


def _stream_of_file(path: Path) -> RankStream:
    """A single segment's stream: its engine and rank from its first event, else from the layout
    above it (its rank directory and that one's engine directory)."""
    rank = parse_rank_label(path.parent.name)
    if rank is not None and path.parent.parent.name:
        dp, tp, pp = rank
        return _as_its_events_say(RankStream(unquote(path.parent.parent.name), dp, tp, pp, [path]))
    event = _first_event(path)
    if event is None:
        return RankStream("?", -1, -1, -1, [path])
    return RankStream(event["engine_id"], event["dp_rank"], event["tp_rank"], event["pp_rank"], [path])


def _rank_dirs(directory: Path, depth: int) -> Iterator[Path]:
    """Rank directories at `directory` or up to `depth` levels below it, in name order."""
    if parse_rank_label(directory.name) is not None:
        yield directory
        return
    if depth == 0:
        return
    for sub in _subdirs(directory):
        yield from _rank_dirs(sub, depth - 1)


def discover(path: str | Path) -> list[RankStream]:
    """The rank streams at `path`: a ledger root, any directory inside one (an engine's, a rank's), a
    directory of roots, or a single segment file. Engine and rank come from the layout, upward from
    a rank directory or a segment (`ROOT/<engine_id>/dp<D>-tp<T>-pp<P>/`), unless the stream's first
    readable event names others (a directory renamed or copied): then they are the events' own, and
    `laid_out_as` keeps what the directories named.

    A directory without that layout is read as a flat set of segments, one stream each (engine and
    rank from each one's first event). Raises LedgerPathError, one line naming the path, for a path
    that is missing or unreadable (permissions), and for a foreign file where a segment should be.
    """
    given = Path(path)
    if not given.exists():
        raise LedgerPathError(f"no such file or directory: {given}")
    # Absolute, `..` folded (symlinks kept): `.` inside a rank directory still names its engine.
    where = Path(os.path.abspath(given))
    if not given.is_dir():
        if given.name.endswith(END_SUFFIX) and given.stem.isdigit():
            raise LedgerPathError(
                f"{given} is an end marker (a writer's confirmation), not a segment: give its directory"
            )
        if (why := foreign_file(given)) is not None:
            raise LedgerPathError(f"{given} is not a ledger segment: {why}")
        stream = _stream_of_file(where)
        stream.segments = [given]
        return [stream]
    streams = []
    for rdir in _rank_dirs(where, _RANK_DEPTH):
        segments = _segments_of(rdir)
        if segments:
            dp, tp, pp = parse_rank_label(rdir.name)
            # The paths as given (relative stays relative): messages name what the user typed.
            shown = [given / p.relative_to(where) for p in segments]
            streams.append(_as_its_events_say(RankStream(unquote(rdir.parent.name), dp, tp, pp, _checked(shown))))
    if streams:
        return streams
    # No rank directories: a flat directory of segments, read as they are, one stream each.
    try:
        stray = sorted(given.rglob(f"*{SEGMENT_SUFFIX}"))
    except PermissionError as exc:
        raise LedgerPathError(f"cannot read {exc.filename or given}: permission denied") from None
    streams = []
    for segment in _checked([p for p in stray if p.is_file()]):
        stream = _stream_of_file(Path(os.path.abspath(segment)))
        stream.segments = [segment]
        streams.append(stream)
    return streams


def unread_peers(streams: list[RankStream]) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """The ranks beside `streams` whose own streams are not among them (a rank's directory or a
    segment given alone): for each engine directory and DP rank read, the other ranks' directories
    that hold segments, as (engine_id, dp) -> [(tp, pp)]. Their absence from the steps read is the
    reader's choice, not the ranks' fault."""
    read = {(s.engine_id, s.dp, s.tp, s.pp) for s in streams}
    engines: dict[Path, tuple[str, set[int]]] = {}
    for s in streams:
        rdir = Path(os.path.abspath(s.segments[0])).parent if s.segments else None
        if rdir is not None and parse_rank_label(rdir.name) is not None:
            engines.setdefault(rdir.parent, (s.engine_id, set()))[1].add(s.dp)
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for engine_dir, (engine_id, dps) in engines.items():
        with contextlib.suppress(LedgerPathError):  # an engine directory that cannot be listed: none known
            for rdir in _subdirs(engine_dir):
                rank = parse_rank_label(rdir.name)
                if rank is None:
                    continue
                dp, tp, pp = rank
                if dp in dps and (engine_id, dp, tp, pp) not in read and _segments_of(rdir):
                    out.setdefault((engine_id, dp), []).append((tp, pp))
    return out


def same_schema(a, b) -> bool:
    return to_parsing_canonical_form(a) == to_parsing_canonical_form(b)


def read_segment(
    path: Path, problems: list[ReadProblem], progress: dict[Path, int] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the events of one segment; append a ReadProblem for what is unreadable.

    A block that fails to read with no sync marker anywhere after its start
    was never finished (a torn last block): `truncated`, every whole block
    before it read. One that fails with whole blocks after it is `corrupt`.
    `progress[path]`, when given, follows the bytes read so far.
    """
    count = 0
    try:
        if os.path.getsize(path) == 0:
            problems.append(ReadProblem(str(path), ReadFailure.EMPTY, "file is empty", 0))
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
                fo.seek(0)
                what = (
                    "its Avro header is cut short or damaged"
                    if _AVRO_MAGIC.startswith(fo.read(len(_AVRO_MAGIC)))
                    else "not an Avro object container file"
                )
                problems.append(ReadProblem(str(path), ReadFailure.NOT_AVRO, f"{what} ({type(exc).__name__})", 0))
                return
            whole_end = fo.tell()  # the end of the header, then of the last whole block
            try:
                for block in blocks:
                    if block.num_records < 0:  # fastavro would take a garbage count as an empty block
                        raise ValueError(f"block with {block.num_records} records")
                    for event in block:
                        count += 1
                        yield event
                    whole_end = block.offset + block.size
                    if progress is not None:
                        progress[path] = whole_end
            except Exception as exc:  # zlib and codec errors surface as assorted types
                problems.append(_block_problem(path, blocks._header["sync"], whole_end, exc, count))
    except FileNotFoundError:
        # Listed, then gone: deleted by the writer's retention (the oldest segments go first).
        problems.append(ReadProblem(str(path), ReadFailure.DELETED, "the segment was deleted while being read", count))
    except (OSError, ValueError) as exc:
        problems.append(ReadProblem(str(path), ReadFailure.CORRUPT, f"{type(exc).__name__}: {exc}", count))


def _block_problem(path: Path, sync: bytes, start: int, exc: Exception, events_read: int) -> ReadProblem:
    """A block at `start` failed: torn (nothing whole after it) or corrupt (whole blocks follow)."""
    with open(path, "rb") as fo:
        fo.seek(start)
        rest = fo.read()
    if sync not in rest:
        detail = f"torn last block: {len(rest)} byte(s) after the last whole block at offset {start}"
        return ReadProblem(str(path), ReadFailure.TRUNCATED, detail, events_read)
    detail = f"block at offset {start}: {type(exc).__name__}: {exc}"
    return ReadProblem(str(path), ReadFailure.CORRUPT, detail, events_read)


def incarnation_of(segment: Path) -> int | None:
    match = _SEGMENT.match(segment.name)
    return int(match[1]) if match else None


def unconfirmed_end(segment: Path, last_seq: int, events_read: int) -> ReadProblem | None:
    """For the last segment of a rank incarnation: a truncated tail where its writer never
    confirmed that the file ends where it does (it was killed while busy); None otherwise,
    and where the stream has no end marker to go by."""
    incarnation = incarnation_of(segment)
    marker = None if incarnation is None else read_end_marker(end_marker_path(segment.parent, incarnation))
    if marker is None or marker.seq == last_seq:
        return None
    if marker.seq < last_seq:
        detail = (
            f"the stream ends at seq {last_seq} without its writer's confirmation (last at seq {marker.seq}): "
            "its writer was killed while busy (or is still writing); what it still held is missing"
        )
    else:
        detail = f"the writer confirmed the stream through seq {marker.seq}, the file ends at seq {last_seq}"
    return ReadProblem(str(segment), ReadFailure.TRUNCATED, detail, events_read)


def _continued(segment: Path) -> bool:
    """Whether a later segment of the same incarnation lies beside `segment` (so the end marker,
    which speaks of the incarnation's last segment, says nothing of this one)."""
    incarnation = incarnation_of(segment)
    if incarnation is None:
        return False
    with contextlib.suppress(OSError):
        return any(
            segment_order(p) > segment_order(segment) and incarnation_of(p) == incarnation
            for p in list_segments(segment.parent)
        )
    return False


def read_stream(
    stream: RankStream, problems: list[ReadProblem], progress: dict[Path, int] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the events of a rank stream, segment after segment; the last segment of each
    incarnation is checked against its end marker (`unconfirmed_end`)."""
    last_seq, events_read = -1, 0
    for i, path in enumerate(stream.segments):
        known = len(problems)
        for event in read_segment(path, problems, progress):
            last_seq = event["seq"]
            events_read += 1
            yield event
        if progress is not None:
            with contextlib.suppress(OSError):
                progress[path] = path.stat().st_size
        following = stream.segments[i + 1] if i + 1 < len(stream.segments) else None
        if following is not None and incarnation_of(following) == incarnation_of(path):
            continue
        if following is None and _continued(path):
            continue  # a segment read on its own: its incarnation goes on in the next one
        if len(problems) == known:  # a torn or corrupt file already says its tail is lost
            problem = unconfirmed_end(path, last_seq, events_read)
            if problem is not None:
                problems.append(problem)
        last_seq, events_read = -1, 0
