"""Cache specs: what one layer's KV cache looks like, independent of where it lives.

Two layers may share a physical buffer only when their specs are equal, so specs are frozen,
hashable values and equality is the compatibility test.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import torch

from kvo_core.errors import ConfigError


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive integer, got {value!r}")


def _as_shape(value: Iterable[int]) -> tuple[int, ...]:
    """A tuple from any iterable shape; a clear error (not a TypeError) for a bare number."""
    try:
        return tuple(value)
    except TypeError:
        raise ConfigError(
            f"token_shape must be a non-empty tuple of positive integers, got {value!r}") from None


def _token_shape(instance: object, attribute: attrs.Attribute[tuple[int, ...]],
                 value: tuple[int, ...]) -> None:
    if not value or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in value):
        raise ConfigError(
            f"{attribute.name} must be a non-empty tuple of positive integers, got {value!r}")


def _dtype(instance: object, attribute: attrs.Attribute[torch.dtype], value: torch.dtype) -> None:
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"{attribute.name} must be a torch.dtype, got {value!r}")


@attrs.frozen
class CacheSpec:
    """One cache tensor family of a layer, per block: ``block_size`` tokens of ``token_shape``.

    ``token_shape`` is everything a single token stores in this cache, e.g. ``(2, heads, dim)``
    for dense K+V, ``(1, 576)`` for an MLA latent+rope row, ``(128,)`` for an indexer key.
    """

    block_size: int = attrs.field(validator=_positive)
    token_shape: tuple[int, ...] = attrs.field(converter=_as_shape, validator=_token_shape)
    dtype: torch.dtype = attrs.field(validator=_dtype)

    @property
    def elements_per_token(self) -> int:
        return math.prod(self.token_shape)

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * int(self.dtype.itemsize)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes of whole blocks needed to hold ``num_tokens`` tokens (paged allocation)."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ConfigError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        return math.ceil(num_tokens / self.block_size) * self.bytes_per_block


@attrs.frozen
class LayerSpec:
    """The caches one attention layer owns: main KV, optionally an indexer and its int8 scale."""

    name: str
    index: int
    main: CacheSpec
    indexer: CacheSpec | None = None
    indexer_scale: CacheSpec | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"layer name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ConfigError(
                f"layer {self.name!r}: index must be an integer >= 0, got {self.index!r}")
        for field, part in (("main", self.main), ("indexer", self.indexer),
                            ("indexer_scale", self.indexer_scale)):
            if not (isinstance(part, CacheSpec) or (part is None and field != "main")):
                raise ConfigError(f"layer {self.name!r}: {field} must be a CacheSpec, got {part!r}")
        if self.indexer_scale is not None and self.indexer is None:
            raise ConfigError(
                f"layer {self.name!r}: an indexer_scale spec needs an indexer spec")
        for part in (self.indexer, self.indexer_scale):
            if part is not None and part.block_size != self.main.block_size:
                raise ConfigError(
                    f"layer {self.name!r}: indexer block size {part.block_size} must equal the "
                    f"main-KV block size {self.main.block_size}")

    @property
    def layout(self) -> tuple[CacheSpec, CacheSpec | None, CacheSpec | None]:
        """Everything that must be identical for two layers to share one physical slot."""
        return (self.main, self.indexer, self.indexer_scale)

    @property
    def bytes_per_block(self) -> int:
        return sum(p.bytes_per_block for p in self.layout if p is not None)
