"""What both RemoteD2H workers need of vLLM's KV caches: their layers, regions and engine.

Prefill exposes these tensors and decode fills its own; both describe them the same way and
pick the transfer engine by the same rule, so the rule lives here once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError
from kvo_core.layers import layer_index
from kvo_transport.engine import TransferEngine, create_transfer_engine

KVLayer = tuple[str, int, torch.Tensor]
"""(layer name, layer index, KV tensor)."""


def merged_regions(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) ranges merged where they overlap or touch, sorted."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(regions):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor]) -> tuple[list[KVLayer], int]:
    """Layers ordered by index, each (name, index, tensor), and the common block size in bytes.

    A block must be one contiguous run (CPU layout ``[blocks, heads, block, 2*head]`` is), so
    whole-block copies are layout-agnostic. Refuses layouts it cannot move block by block.
    """
    layers = sorted(((name, layer_index(name), tensor) for name, tensor in kv_caches.items()),
                    key=lambda item: item[1])
    indices = [index for _, index, _ in layers]
    if indices != list(range(len(indices))):
        raise ConfigError(f"RemoteD2H needs one KV cache per layer 0..N-1; vLLM registered "
                          f"layers {indices}")
    sizes = set()
    for name, _, tensor in layers:
        if tensor.dim() < 2 or not tensor[0].is_contiguous():
            raise ConfigError(f"layer {name!r}: a KV block is not one contiguous run (shape "
                              f"{tuple(tensor.shape)}, strides {tensor.stride()}); RemoteD2H "
                              f"moves whole blocks and needs a blocks-outermost layout")
        sizes.add(tensor.stride(0) * tensor.element_size())
    if len(sizes) != 1:
        raise ConfigError(f"RemoteD2H needs one block size for every layer, got {sorted(sizes)}")
    return layers, sizes.pop()


def transfer_engine_for(config: RemoteD2HConfig, layers: Sequence[KVLayer], *, role: str,
                        tp_rank: int) -> TransferEngine:
    """The configured backend; with Mooncake, direct copies (process_vm_readv) to a peer on
    this host when the KV lives in host memory, Mooncake otherwise. ``role`` ("Prefill" or
    "Decode") and ``tp_rank`` (the default NPU) are MemFabric's."""
    if config.transfer_backend == "mooncake":
        on_host = all(tensor.device.type == "cpu" for _, _, tensor in layers)
        return create_transfer_engine("mooncake", hostname=config.local_hostname,
                                      protocol=config.mooncake_protocol, same_host=on_host)
    return create_transfer_engine(
        "memfabric", protocol=config.memfabric_transfer_protocol,
        store_url=config.memfabric_store_url, role=role,
        device_id=tp_rank if config.memfabric_device_id is None else config.memfabric_device_id,
        hostname=config.local_hostname, store_server_role=config.memfabric_store_server_role,
        nic=config.memfabric_nic)
