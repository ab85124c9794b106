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

`head` and `tail` only grow; each is written by one side only, with one aligned
8-byte store, after (head) or before (tail) the bytes it covers, behind a
memory fence: on x86 stores are not reordered with stores anyway, on Arm the
fence orders them. The memory lives in a file under /dev/shm, mapped by both
processes: no resource tracker of either process removes it behind the other's
back; whoever closes the ring last (the recorder, after its final drain)
unlinks it.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

MAGIC = 0x4B564C52_00000001  # "KVLR", layout version 1
HEADER_BYTES = 64
_MAGIC, _CAPACITY, _HEAD, _TAIL, _PUBLISHED, _DROPPED, _PID, _CLOSED = range(8)
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


class Ring:
    """One mapping of a ring; `create` for the producer, `attach` for the consumer."""

    def __init__(self, path: Path, mapping: mmap.mmap):
        self.path = path
        self._map = mapping
        self._words = np.ndarray((8,), np.uint64, buffer=mapping)  # the header, as u64 words
        if int(self._words[_MAGIC]) != MAGIC:
            raise RingError(f"{path}: not a kvledger ring (magic {int(self._words[_MAGIC]):#x})")
        self.capacity = int(self._words[_CAPACITY])
        if len(mapping) != HEADER_BYTES + self.capacity:
            raise RingError(f"{path}: {len(mapping)} bytes mapped, the header says {HEADER_BYTES + self.capacity}")
        self.data = np.ndarray((self.capacity,), np.uint8, buffer=mapping, offset=HEADER_BYTES)
        self._head = int(self._words[_HEAD])  # this side's copies (each side writes one of them)
        self._tail = int(self._words[_TAIL])

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, capacity: int) -> Ring:
        """A new, empty ring of `capacity` data bytes (a multiple of 8) owned by this process."""
        if capacity <= 0 or capacity % 8:
            raise ValueError(f"ring capacity must be a positive multiple of 8, got {capacity}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
            mapping = mmap.mmap(fd, HEADER_BYTES + capacity)
        finally:
            os.close(fd)
        words = np.ndarray((8,), np.uint64, buffer=mapping)
        words[_CAPACITY], words[_PID] = capacity, os.getpid()
        memory_fence()
        words[_MAGIC] = MAGIC  # last: a consumer that sees it sees the rest
        del words
        return cls(path, mapping)

    @classmethod
    def attach(cls, path: Path) -> Ring:
        """Map an existing ring (RingError if it is not one, FileNotFoundError if it is gone)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise RingError(f"{path}: {size} bytes, shorter than a ring's header")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mapping)

    # -- the producer's side -----------------------------------------------------------------
    def reserve(self, size: int) -> np.ndarray | None:
        """`size` writable bytes at the head, or None when the ring has no room (counted as dropped).

        Nothing is visible to the consumer until `publish`; a second `reserve` before it
        replaces the first.
        """
        need = _align(_LENGTH + size)
        pos = self._head % self.capacity
        room_to_end = self.capacity - pos
        skip = room_to_end if room_to_end < need else 0
        if self._head + skip + need - int(self._words[_TAIL]) > self.capacity:
            self._words[_DROPPED] += 1
            return None
        if skip:
            self.data[pos : pos + _LENGTH].view(np.uint64)[0] = _PAD | room_to_end
            pos = 0
        self._reserved = (skip + need, pos, size)
        return self.data[pos + _LENGTH : pos + _LENGTH + size]

    def publish(self) -> None:
        """Make the record last reserved (and filled) visible to the consumer."""
        total, pos, size = self._reserved
        self.data[pos : pos + _LENGTH].view(np.uint64)[0] = size
        memory_fence()  # the record's bytes before the head that covers them
        self._head += total
        self._words[_HEAD] = self._head
        self._words[_PUBLISHED] += 1

    def write(self, payload: bytes | np.ndarray) -> bool:
        """Reserve, copy and publish one record; False (and counted) when the ring is full."""
        source = np.frombuffer(payload, np.uint8) if isinstance(payload, bytes | bytearray | memoryview) else payload
        room = self.reserve(source.nbytes)
        if room is None:
            return False
        room[:] = source.reshape(-1).view(np.uint8)
        self.publish()
        return True

    def close_producer(self) -> None:
        """Say no record follows (the consumer drains, then may unlink)."""
        memory_fence()
        self._words[_CLOSED] = 1

    # -- the consumer's side -----------------------------------------------------------------
    def records(self) -> Iterator[np.ndarray]:
        """Each record published and not yet released, in order, as a view into the ring.

        A view is valid until the next record is asked for: the one before it is released
        then (copy what must outlive it). Stops at the head as it was read at the start.
        """
        head = int(self._words[_HEAD])
        memory_fence()  # the head before the bytes it covers
        while self._tail < head:
            pos = self._tail % self.capacity
            length = int(self.data[pos : pos + _LENGTH].view(np.uint64)[0])
            if length & _PAD:
                self._release(length & ~_PAD)
                continue
            yield self.data[pos + _LENGTH : pos + _LENGTH + length]
            self._release(_align(_LENGTH + length))

    def _release(self, nbytes: int) -> None:
        memory_fence()  # done with the bytes before the producer may reuse them
        self._tail += nbytes
        self._words[_TAIL] = self._tail

    # -- both ---------------------------------------------------------------------------------
    @property
    def published(self) -> int:
        return int(self._words[_PUBLISHED])

    @property
    def dropped(self) -> int:
        return int(self._words[_DROPPED])

    @property
    def pending(self) -> int:
        """Bytes published and not yet released."""
        return int(self._words[_HEAD]) - int(self._words[_TAIL])

    @property
    def producer_pid(self) -> int:
        return int(self._words[_PID])

    @property
    def producer_closed(self) -> bool:
        return bool(self._words[_CLOSED])

    def close(self, unlink: bool = False) -> None:
        """Unmap (views into the ring must be gone by then), and remove the file if asked."""
        self._words = self.data = None
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)
