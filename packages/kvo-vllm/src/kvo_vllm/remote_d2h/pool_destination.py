"""Decode's main-KV destination when kvo's DSA offload backend keeps main KV in a host pool.

With ``mode="offload"`` (:mod:`kvo_vllm.dsa.offload_backend`) vLLM's cache of an MLA layer is a
one-value-per-token placeholder and the rows live in the offload worker's host pool, one region
per layer laid out by vLLM slot id (``block * block_size + offset``). A P/D decode pulls the
prompt's main KV straight into those pool rows (the blocks vLLM allocated to the request) and
the indexer keys into vLLM's device indexer cache. Pulled blocks are reported to the offload
manager (``note_pulled``), so residency never serves hot rows copied from a block's previous
owner (:mod:`kvo_vllm.dsa.offload_identity`).

With ``kernel_backend="fused"`` the pool keeps each layer's latents and ropes in two arrays;
the transport still addresses the layer as interleaved rows and the decode's engine splits
them on arrival (``fused_layers``, :mod:`kvo_vllm.remote_d2h.fused_pool_split`). Only at
decode TP 1: a fused decode at TP > 1 as a P/D destination is refused at start (not tested).

At decode TP > 1 the TP ranks of a DP rank share one host pool (:mod:`kvo_vllm.dsa.offload_tp`)
and the main KV is replicated across them, so each rank pulls a disjoint part of every chunk's
main blocks into it (``decode_worker.main_share``: the pool is written once per DP rank) and
the whole indexer range of its contribution group into its own device indexer cache. Every
rank reports the request's blocks to its own offload manager when its own pull ended (each
rank keeps its own residency and row identity). What orders one rank's pull-writes before
another rank's reads of those rows: a rank reads a request's pool rows only in a forward
that schedules the request, and vLLM schedules it only after EVERY TP worker reported it in
``finished_recving``: vLLM 0.32's ``KVOutputAggregator.aggregate``
(``distributed/kv_transfer/kv_connector/utils.py``) counts each request id down from the
world size (kvo's connector keeps the default ``get_finished_count``) and passes it to the
scheduler only when the count reaches 0; the multiproc executor's ``execute_model`` collects
every worker's output for it (``collective_rpc`` with an aggregator waits on every response
queue). A rank reports a request only after its receiver saw every layer's read return, so
the rows are in the pool before the report; the report travels through vLLM's shared-memory
message queues to the engine core, whose next scheduler output travels back the same way to
every worker: that chain orders the writes before the reads (no timeout, no sleep). A failed
pull on any rank ends with that rank's invalid blocks, which the aggregator unites over the
ranks (``invalid_block_ids |= ...``): vLLM recomputes those blocks (or fails the request)
for every rank alike, and the unfinished rows are never taken as computed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kvo_core.errors import ConfigError
from kvo_vllm.remote_d2h.fused_pool_split import SplitLayer, fused_pool_layers
from kvo_vllm.remote_d2h.kv_caches import KVLayout, block_bytes

if TYPE_CHECKING:
    from kvo_vllm.dsa.offload_manager import OffloadManager


@attrs.frozen(eq=False)
class PoolDestination:
    """Where each layer's main KV lands in the host pool, and who hears about pulled blocks."""

    region: tuple[int, int]
    """(address, bytes) of the whole pool, registered with the transfer engine."""
    bases: Mapping[str, int]
    """Main cache name -> address of the layer's pool row 0."""
    block_bytes: int
    num_blocks: int
    note_pulled: Callable[[Iterable[int]], None]
    """Block ids whose rows (every layer) were just written by a pull."""
    hot_buffer_bytes: int = 0
    """Device bytes the offload backend keeps for main KV (its hot buffers), for the stats."""
    fused_layers: tuple[SplitLayer, ...] = ()
    """The fused pool's layers (latent and rope apart): reads into them are split on arrival.
    Empty for the interleaved pool."""


def pool_destination(vllm_config: Any, kv_caches: Mapping[str, torch.Tensor],
                     layout: KVLayout) -> PoolDestination | None:
    """The host pool of this engine's offload worker, or None when main KV is in vLLM's cache."""
    if not layout.has_indexer:
        return None  # a dense model: never offloaded by the DSA backend
    from kvo_vllm.dsa.offload_main_kv import offload_worker_for

    worker = offload_worker_for(vllm_config, [layer.name for layer in layout.layers])
    if worker is None:
        return None
    manager = worker.manager_for(kv_caches)
    num_blocks = int(layout.layers[0].main.shape[0])
    if manager.num_blocks != num_blocks:
        raise ConfigError(f"the offload host pool holds {manager.num_blocks} blocks per layer but "
                          f"vLLM's caches have {num_blocks}; pulled blocks would miss the pool")
    index_of = {name: i for i, name in enumerate(worker.layer_names)}
    return manager_destination(manager, {layer.name: index_of[layer.name]
                                         for layer in layout.layers})


def manager_destination(manager: OffloadManager, layers: Mapping[str, int]
                        ) -> PoolDestination:
    """The destination in ``manager``'s pool of the main caches ``layers`` (name -> the
    manager's layer index): interleaved rows, or the fused pool's split layers."""
    fused: tuple[SplitLayer, ...] = ()
    if manager.fused is not None:
        store, rows = manager.store, manager.num_blocks * manager.block_size
        fused = tuple(fused_pool_layers(
            [(store.latent(index), store.rope(index)) for index in layers.values()], rows))
        bases = {name: split.base for name, split in zip(layers, fused, strict=True)}
    else:
        bases = {name: manager.pool_layer_base(index) for name, index in layers.items()}
    return PoolDestination(
        region=manager.pool_region, bases=bases,
        block_bytes=manager.block_size * manager.row_bytes, num_blocks=manager.num_blocks,
        note_pulled=manager.note_blocks_written, hot_buffer_bytes=manager.hot_buffer_bytes,
        fused_layers=fused)


def device_kv_bytes(layout: KVLayout, pool: PoolDestination | None) -> dict[str, int]:
    """What decode's KV costs where, for the stats: vLLM's main caches (a placeholder when
    main KV lives in the host pool), the indexer caches, the offload hot buffers, the host
    pool, and the main KV the same blocks would take on the device without offload."""
    main = sum(int(layer.main.shape[0]) * block_bytes(layer.main) for layer in layout.layers)
    indexer = sum(int(t.shape[0]) * block_bytes(t) for layer in layout.layers
                  if (t := layer.indexer) is not None)
    if pool is None:
        return {"main_cache": main, "indexer": indexer, "hot_buffers": 0, "host_pool": 0,
                "main_resident": main}
    return {"main_cache": main, "indexer": indexer, "hot_buffers": pool.hot_buffer_bytes,
            "host_pool": pool.region[1],
            "main_resident": len(pool.bases) * pool.num_blocks * pool.block_bytes}


def indexer_block_label(vllm_config: Any) -> Callable[[int], str] | None:
    """Names the indexer layout (bf16 or C8) a block size implies, for handshake mismatches;
    None for models without a lightning indexer."""
    text = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    head_dim = getattr(text, "index_head_dim", None)
    if not isinstance(head_dim, int):
        return None
    from kvo_vllm.dsa.indexer_cache import describe_indexer_block

    return functools.partial(describe_indexer_block,
                             block_size=int(vllm_config.cache_config.block_size),
                             head_dim=head_dim)
