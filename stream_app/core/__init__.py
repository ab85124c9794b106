"""The pure ledger core: events in, violations out. No I/O, no clock."""

from kvledger.stream_app.core.engine import Ledger
from kvledger.stream_app.core.violations import KINDS, Coverage, RankKey, Violation

__all__ = ["KINDS", "Coverage", "Ledger", "RankKey", "Violation"]
