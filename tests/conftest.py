"""Cross-package tests: make ``tools/`` importable (``from models.tiny_dsa import ...``).

The tiny models live under tools/ because the demo and the benchmarks use them too.
"""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
