"""What both RemoteD2H workers need of vLLM's KV caches: their layers, regions and engine.

Prefill exposes these tensors and decode fills its own; both describe them the same way and
pick the transfer engine by the same rule, so the rule lives here once.

A layer has one cache (dense models: its KV, part ``kv``) or two (DeepSeek-V3.2-architecture
"DSA" models: the MLA cache ``...self_attn.attn``, part ``kv``, and the lightning indexer's key
cache ``...self_attn.indexer.k_cache``, part ``idx``; kvo's C8 layout keeps the fp16 scale in
each indexer row, so there is no separate scale cache). The parts are recognised and named as
the layerwise connector's buffer plan names them (:mod:`kvo_core.buffer_regions`,
:mod:`kvo_vllm.layerwise.layout`), so both connectors agree on what a layer holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch

from kvo_core.buffer_regions import INDEXER_PART, MAIN_PART
from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError, KvoError
from kvo_core.layers import layer_index
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_vllm.layerwise.layout import INDEXER_MARK


@attrs.frozen(eq=False)
class KVLayer:
    """One cache-bearing layer: its main KV cache and, for DSA layers, its indexer cache."""

    name: str
    """The main (attention) cache's name: the one vLLM's per-layer hooks pass."""
    index: int
    main: torch.Tensor
    indexer: torch.Tensor | None = None
    indexer_name: str | None = None

    def tensors(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """(part, tensor) of every cache of the layer, main KV first."""
        parts = ((MAIN_PART, self.main),)
        return parts if self.indexer is None else (*parts, (INDEXER_PART, self.indexer))


@attrs.frozen
class KVLayout:
    """Every layer (ordered by index) and the common bytes per block of each part."""

    layers: tuple[KVLayer, ...]
    main_block_bytes: int
    indexer_block_bytes: int | None = None
    """None for dense models; every layer of a DSA model has an indexer cache."""

    @property
    def has_indexer(self) -> bool:
        return self.indexer_block_bytes is not None

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of every cache's whole region."""
        return [(tensor.data_ptr(), tensor.data_ptr() + tensor.shape[0] * block_bytes(tensor))
                for layer in self.layers for _, tensor in layer.tensors()]


def cache_part(name: str) -> str:
    """``idx`` for a lightning indexer's key cache, ``kv`` for any other (main) cache."""
    return INDEXER_PART if INDEXER_MARK in name else MAIN_PART


def block_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.stride(0) * tensor.element_size())


def merged_regions(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) ranges merged where they overlap or touch, sorted."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(regions):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor]) -> KVLayout:
    """Group vLLM's caches into layers 0..N-1 and check each moves block by block.

    A block must be one contiguous run (CPU layout ``[blocks, heads, block, 2*head]`` is, and
    so are the MLA ``[blocks, block, 576]`` and indexer ``[blocks, block, row_bytes]`` caches),
    so whole-block copies are layout-agnostic. Refuses layouts it cannot move block by block:
    a layer without a main cache, two caches of one part, or mixed block sizes within a part.
    """
    by_index: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in kv_caches.items():
        try:
            index = layer_index(name)
        except KvoError as error:
            raise ConfigError(f"RemoteD2H cannot place cache {name!r}: {error}") from error
        part = cache_part(name)
        parts = by_index.setdefault(index, {})
        if part in parts:
            raise ConfigError(f"caches {parts[part][0]!r} and {name!r} are both the {part!r} "
                              f"part of layer {index}; RemoteD2H moves one main KV cache and "
                              f"at most one indexer cache per layer")
        if tensor.dim() < 2 or not tensor[0].is_contiguous():
            raise ConfigError(f"cache {name!r}: a KV block is not one contiguous run (shape "
                              f"{tuple(tensor.shape)}, strides {tensor.stride()}); RemoteD2H "
                              f"moves whole blocks and needs a blocks-outermost layout")
        parts[part] = (name, tensor)
    indices = sorted(by_index)
    if indices != list(range(len(indices))):
        raise ConfigError(f"RemoteD2H needs KV caches for layers 0..N-1; vLLM registered "
                          f"layers {indices}")
    layers = []
    for index in indices:
        parts = by_index[index]
        if MAIN_PART not in parts:
            raise ConfigError(f"layer {index} has an indexer cache ({parts[INDEXER_PART][0]!r}) "
                              f"but no attention KV cache")
        main_name, main = parts[MAIN_PART]
        indexer_name, indexer = parts.get(INDEXER_PART, (None, None))
        layers.append(KVLayer(name=main_name, index=index, main=main, indexer=indexer,
                              indexer_name=indexer_name))
    with_indexer = [layer.index for layer in layers if layer.indexer is not None]
    if with_indexer and len(with_indexer) != len(layers):
        raise ConfigError(f"RemoteD2H needs an indexer cache on every layer or on none; layers "
                          f"{with_indexer} of {len(layers)} have one")
    main_sizes = {block_bytes(layer.main) for layer in layers}
    if len(main_sizes) != 1:
        raise ConfigError(f"RemoteD2H needs one block size for every layer's main KV, got "
                          f"{sorted(main_sizes)}")
    indexer_sizes = {block_bytes(layer.indexer) for layer in layers if layer.indexer is not None}
    if len(indexer_sizes) > 1:
        raise ConfigError(f"RemoteD2H needs one block size for every layer's indexer cache, "
                          f"got {sorted(indexer_sizes)}")
    blocks = {part_tensor.shape[0] for layer in layers for _, part_tensor in layer.tensors()}
    if len(blocks) != 1:
        raise ConfigError(f"RemoteD2H needs the same number of blocks in every cache (one "
                          f"block table), got {sorted(blocks)}")
    return KVLayout(layers=tuple(layers), main_block_bytes=main_sizes.pop(),
                    indexer_block_bytes=indexer_sizes.pop() if indexer_sizes else None)


def transfer_engine_for(config: RemoteD2HConfig, tensors: Sequence[torch.Tensor], *,
                        role: str, device_index: int) -> TransferEngine:
    """The configured backend; with Mooncake, direct copies (process_vm_readv) to a peer on
    this host when the KV lives in host memory, Mooncake otherwise. ``role`` ("Prefill" or
    "Decode") and ``device_index`` (the worker's accelerator on its node: MemFabric's device
    unless ``memfabric_device_id`` names one; ``dp_rank.local_device_index``) are MemFabric's."""
    if config.transfer_backend == "mooncake":
        on_host = all(tensor.device.type == "cpu" for tensor in tensors)
        return create_transfer_engine("mooncake", hostname=config.local_hostname,
                                      protocol=config.mooncake_protocol, same_host=on_host)
    return create_transfer_engine(
        "memfabric", protocol=config.memfabric_transfer_protocol,
        store_url=config.memfabric_store_url, role=role,
        device_id=(device_index if config.memfabric_device_id is None
                   else config.memfabric_device_id),
        hostname=config.local_hostname, store_server_role=config.memfabric_store_server_role,
        nic=config.memfabric_nic)
