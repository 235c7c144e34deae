"""Remote device-to-host KV hand-off between prefill and decode (the P/D flow).

``RemoteD2HConnector`` (prefill exposes its layer buffers, decode pulls them into its own KV
cache) and ``KvoMultiConnector`` (layerwise store offload + remote D2H on one prefill, sharing
the buffer-reuse gates). Load with ``kv_connector_module_path="kvo_vllm.remote_d2h"``.

The connectors are imported on first access: the P/D proxy uses this package's parameter and
notification modules and must not import torch or vLLM (a proxy host need not have them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvo_vllm.remote_d2h.connector import RemoteD2HConnector
    from kvo_vllm.remote_d2h.multi import KvoMultiConnector

__all__ = ["KvoMultiConnector", "RemoteD2HConnector"]
_LAZY = {"RemoteD2HConnector": "kvo_vllm.remote_d2h.connector",
         "KvoMultiConnector": "kvo_vllm.remote_d2h.multi"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
