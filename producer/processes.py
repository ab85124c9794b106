"""Watching a process that is not necessarily our child (a rank, its recorder)."""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Iterable
from pathlib import Path


class ProcessWatch:
    """Whether a process (our child or not) still runs: a pidfd where Linux has them (immune to
    pid reuse), else a signal-0 probe."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = None
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):  # no pidfds here: probe by pid
            pass

    def alive(self) -> bool:
        if self._gone:
            return False
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], 0)[0])  # readable once it exited
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
            except PermissionError:
                pass
        return not self._gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def process_trees(pids: Iterable[int]) -> set[int]:
    """`pids` and every process below them, from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the name before may hold anything
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree
