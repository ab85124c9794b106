"""A rank's recorder process: out of the rank's process tree first, then to work.

    python -m kvledger.producer.recorder_process /dev/shm/kvledger-<pid>-dp0-tp0-pp0.ring

Spawned by the rank (`ring_recorder.RingRecorder`), never by hand. vLLM kills
an engine's whole process tree when it shuts down (SIGKILL to every child of a
worker that is slow to exit), so the recorder forks and lets the launcher exit
before anything else: only the ring is mapped by then. The imports of the work
itself (`recorder_loop`: numpy, the sinks, the ledger core) take seconds on a
loaded host; a recorder that imported them first was killed with a rank that
stopped within those seconds, and the rank's frames were lost with it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from kvledger.producer.processes import ProcessWatch
from kvledger.producer.ring import Ring, RingError

log = logging.getLogger("kvledger.producer")


def detach(ring: Ring) -> None:
    """Leave the rank's process tree: fork, and let the launcher exit with the recorder's pid in
    the ring (a recorder outside the tree still drains when the tree is killed)."""
    child = os.fork()
    if child:
        ring.consumer_pid = child
        os._exit(0)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(asctime)s [kvledger recorder] %(message)s")
    if len(argv) != 1:
        print("usage: python -m kvledger.producer.recorder_process RING_PATH", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        ring = Ring.attach(path)
    except (OSError, RingError) as exc:
        log.error("kv_trace: recorder for %s cannot start: %s", path, exc)
        return 1
    engine = ProcessWatch(ring.producer_pid)  # before the fork: the rank is alive now
    detach(ring)
    from kvledger.producer import recorder_loop  # only now: see the module's docstring

    return recorder_loop.run(path, ring, engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
