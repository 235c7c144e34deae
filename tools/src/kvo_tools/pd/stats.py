"""Reading a P/D server's stats file from a test: the decode's counters, settled.

The connector rewrites its stats file after the step that counted an event, so a test that
just got its answer may read the file one step early: ``settled_decode_stats`` polls until the
decode has counted the requests the test expects (or a timeout passes, and the caller's
asserts then say what was missing).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def decode_stats(stats_file: Path) -> dict[str, Any]:
    """The ``decode`` section of a RemoteD2H stats file (empty before the first write)."""
    from kvo_vllm.remote_d2h.stats_file import read_stats

    return dict(read_stats(stats_file).get("decode", {}))


def settled_decode_stats(stats_file: Path, ended: int, timeout_s: float = 30.0
                         ) -> dict[str, Any]:
    """Decode's stats once ``received + failed`` reached ``ended`` (or after ``timeout_s``)."""
    limit = time.monotonic() + timeout_s
    while True:
        stats = decode_stats(stats_file)
        if stats.get("received", 0) + stats.get("failed", 0) >= ended \
                or time.monotonic() > limit:
            return stats
        time.sleep(0.25)
