"""vLLM's own ``MooncakeConnector`` on vLLM-CPU: the P/D peer kvo is benchmarked against.

vLLM 0.32's Mooncake connector worker asks ``torch.accelerator.current_device_index()`` for its
device when it starts, which raises on a host without an accelerator; everything after that
works on CPU tensors (Mooncake's non-CUDA Transfer Engine over tcp). This subclass answers that
one question with device 0 while the connector is built, and changes nothing else, so the
benchmark measures vLLM's connector as shipped.

Benchmark-only (it lives in kvo-tools, not in a kvo package). vLLM loads it with
``"kv_connector": "CpuMooncakeConnector",
"kv_connector_module_path": "kvo_tools.pd.peer_mooncake"`` (see ``kvo_tools.pd.peer``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
)


@contextlib.contextmanager
def _device_zero_without_accelerator() -> Iterator[None]:
    """Let ``torch.accelerator.current_device_index()`` answer 0 where no accelerator exists."""
    if torch.accelerator.is_available():
        yield
        return
    original = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        torch.accelerator.current_device_index = original


class CpuMooncakeConnector(MooncakeConnector):
    """``MooncakeConnector`` that starts on a CPU-only host (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        with _device_zero_without_accelerator():
            super().__init__(vllm_config, role, kv_cache_config)
