"""The pure ledger core: events in, violations out. No I/O, no clock."""

from kvledger.stream_app.core.ledger import Ledger
from kvledger.stream_app.core.violations import Coverage, RankKey, Violation

__all__ = ["Coverage", "Ledger", "RankKey", "Violation"]
