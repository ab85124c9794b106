"""A single-producer, single-consumer ring of byte records in shared memory.

The shape of an eBPF ring buffer: the engine thread reserves room, copies a
step's arrays straight into it and publishes; a recorder process maps the
same memory, reads what was published and lets it go. Records vary in size
(a step's slot mappings follow its token count), so the ring holds bytes,
not fixed slots: each record is a length word and its payload, 8-byte
aligned; one that would cross the end leaves a pad record and starts at the
beginning. A full ring refuses the record and counts it (`dropped`); the
producer never waits and never raises for lack of room.

Layout (little-endian u64 words, then the data):

    0 magic+version  1 capacity  2 head (bytes published)  3 tail (bytes released)
    4 published (records)  5 dropped (records)  6 producer pid  7 closed (0/1)
    8 consumer pid (0: none yet)  9 stop requested (0/1)  10-15 reserved

`head` and `tail` only grow; each is written by one side only, with one aligned
8-byte store, after (head) or before (tail) the bytes it covers, behind a
memory fence: on x86 stores are not reordered with stores anyway, on Arm the
fence orders them. The producer's side is compiled (`_hotpath.c`, a release
store of the head, an acquire load of the tail); the consumer's is here.
The memory lives in a file under /dev/shm, mapped by both processes: no
resource tracker of either process removes it behind the other's back;
whoever closes the ring last (the recorder, after its final drain) unlinks it.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from kvledger.producer import _hotpath

MAGIC = 0x4B564C52_00000002  # "KVLR", layout version 2
HEADER_BYTES = 128
_MAGIC, _CAPACITY, _HEAD, _TAIL, _PUBLISHED, _DROPPED, _PID, _CLOSED, _CONSUMER, _STOP = range(10)
_LENGTH = 8  # bytes of a record's length word
_PAD = 1 << 63  # a length word with this bit set: skip to the ring's start
_fence_lock = threading.Lock()


class RingError(RuntimeError):
    """The mapped memory is not a ring of this layout (or not one at all)."""


def memory_fence() -> None:
    """Order the stores before it against those after it (a lock's acquire and release are full
    barriers on every platform Python runs on)."""
    with _fence_lock:
        pass


def ring_dir() -> Path:
    """Where rings live: tmpfs when the host has it (no disk writes), else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _align(n: int) -> int:
    return (n + 7) & ~7


_WORD = struct.Struct("<Q")
# Both sides map the ring populated: on its first lap the engine thread took a page fault every
# 4 KiB otherwise (a 64-request step's frame took 63 us on its first lap, 33 us once mapped).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class Ring:
    """One mapping of a ring; `create` for the producer, `attach` for the consumer.

    The producer's path is one compiled call per record: a Python-level reserve, copy and
    publish cost the engine thread 15-24 us per 64-request frame, the compiled call ~3 us.
    """

    def __init__(self, path: Path, mapping: mmap.mmap):
        self.path = path
        self._map = mapping
        if self._word(_MAGIC) != MAGIC:
            raise RingError(f"{path}: not a kvledger ring (magic {self._word(_MAGIC):#x})")
        self.capacity = self._word(_CAPACITY)
        if len(mapping) != HEADER_BYTES + self.capacity:
            raise RingError(f"{path}: {len(mapping)} bytes mapped, the header says {HEADER_BYTES + self.capacity}")
        self._tail = self._word(_TAIL)  # the consumer's copy (it alone writes the tail)
        # write_frame(kind, seq, emitted_at_us, parts) -> bool: one frame (frames.py's format) of
        # `parts`, each copied once; False (and counted) when the ring is full. The compiled call
        # itself, bound to this mapping: a Python method around it costs the engine thread ~1.5 us.
        self.write_frame = functools.partial(_hotpath.write_frame, mapping)

    def _word(self, i: int) -> int:
        return _WORD.unpack_from(self._map, 8 * i)[0]

    def _set(self, i: int, value: int) -> None:
        _WORD.pack_into(self._map, 8 * i, value)

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, capacity: int) -> Ring:
        """A new, empty ring of `capacity` data bytes (a multiple of 8) owned by this process."""
        if capacity <= 0 or capacity % 8:
            raise ValueError(f"ring capacity must be a positive multiple of 8, got {capacity}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserved now, not on first touch: a tmpfs out of room would fault the writer later.
            os.posix_fallocate(fd, 0, HEADER_BYTES + capacity)
            mapping = mmap.mmap(fd, HEADER_BYTES + capacity, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        _WORD.pack_into(mapping, 8 * _CAPACITY, capacity)
        _WORD.pack_into(mapping, 8 * _PID, os.getpid())
        memory_fence()
        _WORD.pack_into(mapping, 8 * _MAGIC, MAGIC)  # last: a consumer that sees it sees the rest
        return cls(path, mapping)

    @classmethod
    def attach(cls, path: Path) -> Ring:
        """Map an existing ring (RingError if it is not one, FileNotFoundError if it is gone)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise RingError(f"{path}: {size} bytes, shorter than a ring's header")
            mapping = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        return cls(path, mapping)

    # -- the producer's side -----------------------------------------------------------------
    # Compiled (producer/_hotpath.c): a record is reserved, filled and published in one call.
    def write(self, payload) -> bool:
        """Copy one record (any bytes-like object) in and publish it; False (and counted) when
        the ring is full."""
        return _hotpath.write_record(self._map, payload)

    def close_producer(self) -> None:
        """Say no record follows (the consumer drains, then may unlink)."""
        memory_fence()
        self._set(_CLOSED, 1)

    # -- the consumer's side -----------------------------------------------------------------
    def records(self) -> Iterator[memoryview]:
        """Each record published and not yet released, in order, as a view into the ring.

        A view is valid until the next record is asked for: the one before it is released
        then (copy what must outlive it). Stops at the head as it was read at the start.
        """
        head = self._word(_HEAD)
        memory_fence()  # the head before the bytes it covers
        data = memoryview(self._map)[HEADER_BYTES:]
        while self._tail < head:
            pos = self._tail % self.capacity
            length = _WORD.unpack_from(data, pos)[0]
            if length & _PAD:
                self._release(length & ~_PAD)
                continue
            yield data[pos + _LENGTH : pos + _LENGTH + length]
            self._release(_align(_LENGTH + length))

    def _release(self, nbytes: int) -> None:
        memory_fence()  # done with the bytes before the producer may reuse them
        self._tail += nbytes
        self._set(_TAIL, self._tail)

    # -- both ---------------------------------------------------------------------------------
    @property
    def published(self) -> int:
        return self._word(_PUBLISHED)

    @property
    def dropped(self) -> int:
        return self._word(_DROPPED)

    @property
    def pending(self) -> int:
        """Bytes published and not yet released."""
        return self._word(_HEAD) - self._word(_TAIL)

    @property
    def producer_pid(self) -> int:
        return self._word(_PID)

    @property
    def producer_closed(self) -> bool:
        return bool(self._word(_CLOSED))

    @property
    def stop_requested(self) -> bool:
        """Whether the producer's process was asked to stop (SIGTERM, its engine's shutdown): a
        producer gone without closing after that was stopped, not lost (`request_stop`)."""
        return bool(self._word(_STOP))

    def request_stop(self) -> None:
        """Say the producer's process is being stopped on purpose: one aligned store, safe in a
        signal handler."""
        self._set(_STOP, 1)

    @property
    def consumer_pid(self) -> int:
        """The process reading the ring, as it said when it attached (0: none yet)."""
        return self._word(_CONSUMER)

    @consumer_pid.setter
    def consumer_pid(self, pid: int) -> None:
        self._set(_CONSUMER, pid)

    @staticmethod
    def request_stop_at(path: Path) -> bool:
        """`request_stop` on the ring at `path`, from a process that has not mapped it (its header
        only is read and written); False when it is gone or not a ring of this layout."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return False
        try:
            if os.pread(fd, 8, 8 * _MAGIC) != _WORD.pack(MAGIC):
                return False
            os.pwrite(fd, _WORD.pack(1), 8 * _STOP)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def close(self, unlink: bool = False) -> None:
        """Unmap (no view into the ring may be alive by then), and remove the file if asked."""
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)
