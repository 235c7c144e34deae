"""Test-only: stamps of a kvo prefill's per-layer hooks (``kvo_tools.bench._pd_timeline``).

A prefill started with this directory on PYTHONPATH and ``KVO_TIMING_OUT`` set appends one JSON
line per ``KvoMultiConnector`` hook call to that file: the hook, the layer, and
``time.monotonic()`` at its entry and exit (one clock for every process of the host). The
module is patched when it is first imported (``kvo_tools.pd.sites.timed_prefill_env``).
Production code never imports this module.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from kvo_tools.pd.sites import patch_on_import

OUT = os.environ.get("KVO_TIMING_OUT")
TARGET = "kvo_vllm.remote_d2h.multi"
_LOCK = threading.Lock()


def _emit(event: dict[str, Any]) -> None:
    with _LOCK, open(OUT or os.devnull, "a") as out:
        out.write(json.dumps(event) + "\n")


def _timed(name: str, method: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return method(self, *args, **kwargs)
        finally:
            layer = args[0] if args and isinstance(args[0], str) else None
            _emit({"event": name, "layer": layer, "start": start, "end": time.monotonic()})
    return wrapper


def _patch(module: Any) -> None:
    cls = module.KvoMultiConnector
    for name in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                 "get_finished", "get_transfer_results"):
        if hasattr(cls, name):
            setattr(cls, name, _timed(name, getattr(cls, name)))


if OUT:
    patch_on_import(TARGET, _patch)
