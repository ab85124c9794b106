"""A rank's name, `dp0-tp1-pp0`: one spelling for the ledger's directories, logs, reports,
pages and metrics, written and read here only."""

from __future__ import annotations

import re

_LABEL = re.compile(r"^dp(\d+)-tp(\d+)-pp(\d+)$")


def rank_label(dp: int, tp: int, pp: int) -> str:
    """A rank of an engine by its data-, tensor- and pipeline-parallel ranks: dp0-tp1-pp0."""
    return f"dp{dp}-tp{tp}-pp{pp}"


def engine_rank_label(engine_id: str, dp: int, tp: int, pp: int) -> str:
    """A rank with its engine, as reports name it: `ENGINE dp0-tp1-pp0`."""
    return f"{engine_id} {rank_label(dp, tp, pp)}"


def parse_rank_label(name: str) -> tuple[int, int, int] | None:
    """(dp, tp, pp) of a name `rank_label` wrote, else None."""
    match = _LABEL.match(name)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))
