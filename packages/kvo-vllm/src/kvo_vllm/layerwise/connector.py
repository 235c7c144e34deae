"""``LayerwiseStoreConnector``: layerwise prefill offload with device buffer reuse.

Load it in vLLM (eager mode required) with::

    KVTransferConfig(kv_connector="LayerwiseStoreConnector",
                     kv_connector_module_path="kvo_vllm.connectors", kv_role="kv_both",
                     kv_connector_extra_config={"store_master_address": "127.0.0.1:PORT", ...})

(``kvo_vllm.layerwise.connector`` works too). The extra config is validated by
``kvo_core.config.LayerwiseOffloadConfig``; ``store_options`` (a dict) goes to the store backend.

vLLM 0.32 hooks used:

- constructor (worker role): runs in ``Worker.initialize_from_config`` before the model runner
  allocates the KV cache from the same ``KVCacheConfig``; it rewrites ``kv_cache_tensors`` so
  the N layers share ``I + min(B, N - I)`` physical buffers (``layout``); a DSA layer's
  indexer cache shares its layer's slot and moves with it (store keys name the part).
- ``register_kv_caches``: checks the live caches alias as planned, registers them with the store.
- ``build_connector_meta`` (scheduler): plans the step's loads and saves and sets
  ``scheduler_output.has_sync_kv_loads`` so ``start_load_kv`` runs before the forward.
- ``start_load_kv`` / ``save_kv_layer`` / ``wait_for_layer_load`` / ``wait_for_save``: the
  per-layer pipeline (``worker_side``); ``get_finished`` drops finished requests' private
  blocks; ``get_block_ids_with_load_errors`` reports blocks the store did not have.
- ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` / ``on_new_request`` /
  ``request_finished`` and the bound KV-cache manager: prefix hits from the store; a local
  hit whose shared layers the store lost leaves vLLM's prefix cache (``scheduler_side``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import ConfigError
from kvo_core.gates import SlotGates, SlotKey
from kvo_vllm.dsa.offload_metrics import connector_stats
from kvo_vllm.layerwise.keys import StoreKeys, namespace_for
from kvo_vllm.layerwise.layout import LayerLayout, apply_layout, plan_layout
from kvo_vllm.layerwise.metadata import LayerwiseMetadata
from kvo_vllm.layerwise.put_progress import PendingPutsTracker, StagedPutsPending
from kvo_vllm.layerwise.scheduler_side import LayerwiseScheduler, SchedulerStats
from kvo_vllm.layerwise.store_client import (
    STORE_CLIENTS,
    STORE_OPTIONS_KEY,
    StoreLease,
    store_options_from,
)
from kvo_vllm.layerwise.worker_side import LayerwiseWorker
from kvo_vllm.layerwise.worker_stats import LayerwiseStats
from kvo_vllm.metrics import (
    LAYERWISE_METRICS,
    SPARSE_OFFLOAD_METRICS,
    CounterDeltas,
    KvoMetricsReporting,
    Metric,
)
from kvo_vllm.vllm_logging import join_vllm_logging
from kvo_vllm.vllm_version import require_supported_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class EagerModeRequiredError(ConfigError):
    """The connector's per-layer hooks and buffer aliasing need vLLM's eager mode."""


def require_eager_mode(vllm_config: VllmConfig) -> None:
    """Refuse compiled / graph mode: aliased buffers and per-layer waits must run as Python."""
    if not vllm_config.model_config.enforce_eager:
        raise EagerModeRequiredError(
            "LayerwiseStoreConnector requires eager mode: start vLLM with enforce_eager=True "
            "(--enforce-eager). Compiled or graph-captured forwards would skip the per-layer "
            "waits that keep a shared KV buffer from being overwritten before its save ends; "
            f"got enforce_eager={vllm_config.model_config.enforce_eager!r}")


def kv_replicated_across_tp(vllm_config: VllmConfig) -> bool:
    """Every TP rank holds the same KV: an MLA model's latent and rope (and a DSA model's
    indexer keys) come from replicated projections, one KV head per rank. Such a block is
    stored once, by TP rank 0, under keys every rank loads (``StoreKeys`` of rank 0); a
    model whose KV heads are split over the ranks stores each rank's share under its own."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def _store_namespace(vllm_config: VllmConfig, layout: LayerLayout) -> str:
    """What both the scheduler and the workers know: their KV-cache configs differ in specs
    (a DSA model's scheduler sees one merged spec) but not in the tensors' page sizes."""
    parallel = vllm_config.parallel_config
    return namespace_for([
        "layerwise-v2", vllm_config.model_config.model, str(vllm_config.model_config.dtype),
        str(vllm_config.cache_config.cache_dtype), layout.block_size,
        [(layer.index, [(part.part, part.block_bytes) for part in layer.parts])
         for layer in layout.layers],
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
    ])


class LayerwiseStoreConnector(KvoMetricsReporting, KVConnectorBase_V1):
    """vLLM KV connector: layerwise save/load through a KV store with shared layer buffers."""

    metric_catalog: ClassVar[Mapping[str, Metric]] = {**LAYERWISE_METRICS, **SPARSE_OFFLOAD_METRICS}

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()
        require_supported_vllm(type(self).__name__)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = LayerwiseOffloadConfig.from_extra_config(
            extra, ignore_keys=(STORE_OPTIONS_KEY,))
        require_eager_mode(vllm_config)
        self.layout = plan_layout(kv_cache_config, self.config)
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
        if hash_block_size not in (None, self.layout.block_size):
            raise ConfigError(
                f"LayerwiseStoreConnector names blocks by vLLM's block hashes and needs "
                f"hash_block_size == block_size ({self.layout.block_size}), got "
                f"{hash_block_size}")
        namespace = _store_namespace(vllm_config, self.layout)
        engine_id = str(self._kv_transfer_config.engine_id)
        self._store_lease: StoreLease | None = STORE_CLIENTS.acquire(
            self.config, store_options_from(extra))
        self._store: Any = self._store_lease.shared.store
        self._pending_puts = self._store_lease.shared.pending_puts
        self._scheduler: LayerwiseScheduler | None = None
        self._worker: LayerwiseWorker | None = None
        self._metric_deltas = CounterDeltas()
        self._put_pending_at_stats = False
        self._puts = PendingPutsTracker()
        replicated = kv_replicated_across_tp(vllm_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            apply_layout(kv_cache_config, self.layout)
            tp_rank = get_tensor_model_parallel_rank()
            self._worker = LayerwiseWorker(
                layout=self.layout,
                keys=StoreKeys(namespace=namespace, rank=0 if replicated else tp_rank),
                store=self._store, prefetch_depth=self.config.prefetch_depth,
                layer_deadline_s=self.config.layer_deadline_s,
                staging_bytes=self.config.save_staging_bytes,
                flush_nice=self.config.flush_nice,
                saves_blocks=not replicated or tp_rank == 0, pending_puts=self._pending_puts)
        else:
            self._scheduler = LayerwiseScheduler(
                block_size=self.layout.block_size,
                stored_parts=self.layout.stored_parts,
                keys=StoreKeys(namespace=namespace),
                tp_size=1 if replicated else tp_size,
                engine_id=engine_id, store_exists=self._store_exists,
                block_ids_of=self._block_ids_of, evict_local=self._evict_cached)
        logger.info("kvo LayerwiseStoreConnector (%s): %s", role.name, self.layout.describe())

    # ==== worker side ====================================================================

    @property
    def worker(self) -> LayerwiseWorker:
        if self._worker is None:
            raise RuntimeError("this LayerwiseStoreConnector is the scheduler-side instance")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before vLLM writes any block of the step (its copy-on-write block copies and
        zeroing come before the forward): the last step's batched put, which reads the last
        layer of each buffer in place, must be over."""
        if self._worker is not None:
            self._worker.wait_staged_puts()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, LayerwiseMetadata)
        self.worker.start_step(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.before_attention(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.worker.after_attention(layer_name)

    def wait_for_save(self) -> None:
        self.worker.finish_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.worker.forget_requests(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._store_lease is not None:
            self._store_lease.release()
            self._store_lease = self._store = None

    # -- for composing connectors and tests ------------------------------------------

    @property
    def slot_gates(self) -> SlotGates:
        """The gates guarding buffer reuse. A composing connector announces its parts here
        during the step (``announce``); each layer's round takes them (``take_announced``)."""
        return self.worker.gates

    def slot_key(self, cache_name: str) -> SlotKey:
        """The buffer slot of a layer, by the name of any of its caches."""
        return self.worker.slot_key(cache_name)

    @property
    def stats(self) -> LayerwiseStats:
        return self.worker.stats

    # -- metrics through vLLM's KVConnectorStats / Prometheus (kvo_vllm.metrics) -----

    def get_kv_connector_stats(self) -> Any:
        if self._worker is None:
            return None
        # Asked before the counters are read: "not pending" means they include the put.
        self._put_pending_at_stats = self._worker.staged_put_pending()
        return connector_stats(self._metric_deltas.take(self._worker.stats.metric_counters()))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """With staging: whether this step's counters still miss a running put
        (``put_progress``)."""
        if self._worker is None or not self.config.save_staging_bytes:
            return None
        return StagedPutsPending(pending=self._put_pending_at_stats)


    # ==== scheduler side =================================================================

    @property
    def scheduler(self) -> LayerwiseScheduler:
        if self._scheduler is None:
            raise RuntimeError("this LayerwiseStoreConnector is the worker-side instance")
        return self._scheduler

    @property
    def scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def _store_exists(self, keys: list[str]) -> list[bool]:
        """The store's answer once the staged puts through this client landed (``staging``)."""
        self._pending_puts.wait(self.config.layer_deadline_s)
        return list(self._store.exists(keys))

    def _block_ids_of(self, request_id: str) -> list[int]:
        if self._kv_cache_manager is None:
            raise RuntimeError("vLLM did not bind its KV-cache manager to the connector")
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def _evict_cached(self, block_hashes: Sequence[Any]) -> int:
        """Drop the blocks with these hashes from vLLM's prefix cache (the store lost their
        shared layers); blocks in use stay with their requests. How many were found."""
        manager = self._kv_cache_manager
        if manager is None:
            return 0
        block_ids: set[int] = set()
        for block_hash in block_hashes:
            cached = manager.block_pool.get_cached_block(block_hash, [0])
            block_ids.update(block.block_id for block in cached or ())
        if block_ids:
            manager.evict_blocks(block_ids)
        return len(block_ids)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_metadata(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._puts.update(connector_output.kv_connector_worker_meta)

    def has_pending_push_work(self) -> bool:
        """True while a worker's staged put is not yet in its counters (``put_progress``)."""
        return self._puts.pending

