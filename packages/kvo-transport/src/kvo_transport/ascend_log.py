"""Capture MemFabric's own log lines so kvo errors can quote the library's reason.

MemFabric (and Memcache, which runs on it) report why a call failed only in their log, not in
the return code. kvo installs one process-wide logger callback that forwards warnings and errors
to Python logging and keeps the most recent lines for error messages.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

LOG = logging.getLogger("kvo_transport.memfabric")
WARN, ERROR = 2, 3
DRIVER_MISSING = "the current version of ascend driver does not support mf!"


class LogTap:
    """Recent MemFabric log lines with a sequence number, for "what went wrong since X"."""

    def __init__(self, keep: int = 200) -> None:
        self._lines: deque[tuple[int, int, str]] = deque(maxlen=keep)
        self._seq = 0
        self._lock = threading.Lock()

    def __call__(self, level: int, message: str) -> None:
        with self._lock:
            self._seq += 1
            self._lines.append((self._seq, level, message))
        if level >= ERROR:
            LOG.error("%s", message)
        elif level >= WARN:
            LOG.warning("%s", message)
        else:
            LOG.debug("%s", message)

    def mark(self) -> int:
        with self._lock:
            return self._seq

    def errors_since(self, mark: int) -> list[str]:
        with self._lock:
            return [msg for seq, level, msg in self._lines if seq > mark and level >= ERROR]


_TAP = LogTap()
_installed: set[int] = set()
_install_lock = threading.Lock()


def log_tap(memfabric: Any) -> LogTap:
    """The process's LogTap, installed as the memfabric_hybrid module's logger on first use."""
    with _install_lock:
        if id(memfabric) not in _installed:
            memfabric.set_extern_logger(_TAP)
            _installed.add(id(memfabric))
    return _TAP


def explain(errors: list[str]) -> str:
    """The most telling library error: the driver check if it failed, else the last errors."""
    for line in errors:
        if DRIVER_MISSING in line:
            return f"no usable Ascend driver: {line}"
    if errors:
        return "library errors: " + " | ".join(errors[-3:])
    return "the library logged no error"
