"""Stable import path for kvo's vLLM connectors: ``kv_connector_module_path="kvo_vllm.connectors"``.

vLLM imports this module and looks the connector class up by ``kv_connector`` name.
``KvoOffloadMetricsConnector`` moves no KV: it only carries the sparse offload backend's
metrics to ``/metrics`` where no P/D connector runs.
"""

from kvo_vllm.dsa.metrics_connector import KvoOffloadMetricsConnector
from kvo_vllm.layerwise.connector import LayerwiseStoreConnector
from kvo_vllm.remote_d2h.connector import RemoteD2HConnector
from kvo_vllm.remote_d2h.multi import KvoMultiConnector

__all__ = ["KvoMultiConnector", "KvoOffloadMetricsConnector", "LayerwiseStoreConnector",
           "RemoteD2HConnector"]
