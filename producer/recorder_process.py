"""A rank's recorder process: its pid into the ring first, then to work.

    python -m kvledger.producer.recorder_process /dev/shm/kvledger-<pid>-dp0-tp0-pp0.ring

Spawned by the rank (`ring_writer.RingWriter`, through `setsid --fork`, so
outside the rank's process tree from its start: vLLM SIGKILLs every process of
a worker's tree that is slow to exit), never by hand. The rank knows its
recorder runs once the pid is in the ring, so that comes before the imports
of the work itself (`recorder`: numpy, the sinks, the ledger core),
which take seconds on a loaded host.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from kvledger.producer.processes import ProcessWatch
from kvledger.producer.ring import Ring, RingError

log = logging.getLogger("kvledger.producer")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [kvledger recorder] %(message)s")
    if len(argv) != 1:
        print("usage: python -m kvledger.producer.recorder_process RING_PATH", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        ring = Ring.attach(path)
    except (OSError, RingError) as exc:
        log.error("kv_trace: recorder for %s cannot start: %s", path, exc)
        return 1
    engine = ProcessWatch(ring.producer_pid)
    ring.consumer_pid = os.getpid()
    from kvledger.producer import recorder  # only now: see the module's docstring

    return recorder.run(path, ring, engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
