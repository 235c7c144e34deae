"""The per-token geometry of a sparse-attention model's caches (MLA latent + rope, indexer key).

The host pool and ``kvo_vllm.dsa``'s offload manager size the pool and the hot buffers from
this; a bad value fails here, naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from kvo_core.errors import ConfigError

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _positive(instance: Any, attribute: attrs.Attribute[int], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _kv_dtype(instance: Any, attribute: attrs.Attribute[torch.dtype], value: Any) -> None:
    if value not in KV_DTYPES:
        allowed = ", ".join(str(d) for d in KV_DTYPES)
        raise ConfigError(f"{attribute.name} must be one of {allowed}; got {value!r}")


def _scale(instance: Any, attribute: attrs.Attribute[float], value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{attribute.name} must be a finite number > 0, got {value!r}")


@attrs.frozen
class SparseModelLayout:
    """What every layer stores per token and how attention scales its logits.

    A main-KV row is ``latent_dim + rope_dim`` values (stored as one contiguous row, so one
    miss is one row copy); the indexer key is ``index_dim`` values and stays on the device.
    """

    num_layers: int = attrs.field(validator=_positive)
    latent_dim: int = attrs.field(validator=_positive)
    rope_dim: int = attrs.field(validator=_positive)
    index_dim: int = attrs.field(validator=_positive)
    softmax_scale: float = attrs.field(validator=_scale)
    kv_dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_kv_dtype)
    index_dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_kv_dtype)

    @property
    def row_dim(self) -> int:
        """Values in one main-KV row: latent, then rope."""
        return self.latent_dim + self.rope_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's main-KV row in one layer: the unit of a host -> device copy."""
        return self.row_dim * int(self.kv_dtype.itemsize)

    @property
    def host_bytes_per_token(self) -> int:
        """Host-pool bytes one token occupies over all layers."""
        return self.row_bytes * self.num_layers
