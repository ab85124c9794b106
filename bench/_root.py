"""Puts the checkout's root on the import path, for the benchmarks that drive the test support.

A benchmark runs as `python bench/X.py`, so Python puts bench/ on the path, not the root, and the
synthetic engine (`tests.synthetic.engine`) and the stream harness (`tests.stream_harness`) live
in the checkout, not in the installed package. A script that imports them imports this module
first, for its effect: `import _root  # noqa: F401`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
