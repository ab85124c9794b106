"""Where captured events go. The file sink is the embedded default."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvledger.schemas.files import SegmentWriter


class FileSink:
    """Appends events to a file ledger, one segment stream per rank incarnation."""

    def __init__(self, root: str | Path, *, max_segment_bytes: int = 64 << 20, codec: str = "deflate"):
        self.root = Path(root)
        self.max_segment_bytes = max_segment_bytes
        self.codec = codec
        self._writers: dict[tuple, SegmentWriter] = {}

    def write(self, events: Iterable[dict]) -> None:
        batches: dict[tuple, list[dict]] = {}
        for event in events:
            key = (
                event["engine_id"],
                event["dp_rank"],
                event["tp_rank"],
                event["pp_rank"],
                event["incarnation"],
            )
            batches.setdefault(key, []).append(event)
        for key, batch in batches.items():
            writer = self._writers.get(key)
            if writer is None:
                writer = self._writers[key] = SegmentWriter(
                    self.root, *key, max_segment_bytes=self.max_segment_bytes, codec=self.codec
                )
            writer.write(batch)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def __enter__(self) -> FileSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
