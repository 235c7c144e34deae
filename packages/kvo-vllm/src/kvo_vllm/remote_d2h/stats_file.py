"""Counters to a JSON file, because vLLM runs the connector in another process.

The demo and the end-to-end benchmark start vLLM API servers and read what the connectors did
(bytes per path, per-layer transfer time, buffer footprint) from this file. Writes are
throttled and atomic (write a temporary file, then rename), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from kvo_vllm.remote_d2h.dp_rank import DecodeDpRank

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5


class StatsFile:
    """Rewrites ``path`` with ``snapshot()`` at most every INTERVAL_S (or when forced)."""

    def __init__(self, path: str | None, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._snapshot = snapshot
        self._last = 0.0
        self._failed = False

    def maybe_write(self, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._last < INTERVAL_S:
            return
        self._last = now
        data = {"pid": os.getpid(), "time": time.time(), **self._snapshot()}
        temporary = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w") as out:
                json.dump(data, out, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except OSError as error:
            if not self._failed:
                logger.warning("kvo: cannot write stats file %s: %s", self.path, error)
            self._failed = True


def rank_stats_file(path: str | None, dp: DecodeDpRank) -> str | None:
    """Each DP rank's own stats file: ``path.dp<rank>`` with data parallelism, else ``path``
    (the DP ranks' workers are different processes that would overwrite one file)."""
    if path is None or dp.size == 1:
        return path
    return f"{path}.dp{dp.rank}"


def rank_stats_path(path: str | None, tp_rank: int) -> str | None:
    """Where TP rank ``tp_rank`` writes: rank 0 the configured ``path`` (what a TP 1 reader
    expects), rank r > 0 ``<path>.tp<r>`` (each rank pulls and counts its own share)."""
    if path is None or tp_rank == 0:
        return path
    return f"{path}.tp{tp_rank}"


def read_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The last snapshot written to ``path`` ({} when there is none yet)."""
    try:
        with open(path) as source:
            data = json.load(source)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
