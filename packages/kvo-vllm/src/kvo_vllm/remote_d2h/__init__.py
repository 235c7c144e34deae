"""Remote device-to-host KV hand-off between prefill and decode (the P/D flow).

``RemoteD2HConnector`` (prefill exposes its layer buffers, decode pulls them into its own KV
cache) and ``KvoMultiConnector`` (layerwise store offload + remote D2H on one prefill, sharing
the buffer-reuse gates). Load with ``kv_connector_module_path="kvo_vllm.remote_d2h"``.
"""

from kvo_vllm.remote_d2h.connector import RemoteD2HConnector
from kvo_vllm.remote_d2h.multi import KvoMultiConnector

__all__ = ["KvoMultiConnector", "RemoteD2HConnector"]
