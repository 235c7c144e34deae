"""Test-only code plugged into a vLLM server from outside: a ``sitecustomize`` on its PYTHONPATH.

The harness (tests, soak, benchmarks) starts a server with one of these directories first on
``PYTHONPATH`` and the directory's environment variable set; Python runs the directory's
``sitecustomize`` at the start of every process of that server (API server, engine core, TP
workers), and it patches kvo when kvo is imported. Production config names none of it.
"""

from __future__ import annotations

import os
from pathlib import Path

TIMING_SITE = Path(__file__).resolve().parent / "timing_site"
"""Stamps a prefill's KvoMultiConnector hook calls (``KVO_TIMING_OUT``: the file)."""


def on_pythonpath(site: Path) -> str:
    """``PYTHONPATH`` with ``site`` first, then this process's own (its sources, plugins)."""
    return os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))


def timed_prefill_env(out_file: Path) -> dict[str, str]:
    """The environment of a prefill whose hook calls are stamped into ``out_file``."""
    return {"KVO_TIMING_OUT": str(out_file), "PYTHONPATH": on_pythonpath(TIMING_SITE)}
