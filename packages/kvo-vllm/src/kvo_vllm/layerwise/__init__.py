"""Layerwise prefill offload with device buffer reuse (``LayerwiseStoreConnector``)."""

from kvo_vllm.layerwise.connector import EagerModeRequiredError, LayerwiseStoreConnector

__all__ = ["EagerModeRequiredError", "LayerwiseStoreConnector"]
