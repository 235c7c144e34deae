"""Stable import path for kvo's vLLM connectors: ``kv_connector_module_path="kvo_vllm.connectors"``.

vLLM imports this module and looks the connector class up by ``kv_connector`` name.
"""

from kvo_vllm.layerwise.connector import LayerwiseStoreConnector

__all__ = ["LayerwiseStoreConnector"]
