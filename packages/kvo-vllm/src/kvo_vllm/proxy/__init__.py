"""The P/D proxy: an OpenAI-compatible front that runs the decode-first flow (``kvo-proxy``)."""

from kvo_vllm.proxy.app import build_app
from kvo_vllm.proxy.flow import ProxyConfig

__all__ = ["ProxyConfig", "build_app"]
