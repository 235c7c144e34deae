"""``RemoteD2HConnector``: prefill exposes its layer buffers, decode pulls them layer by layer.

Load it in vLLM with::

    KVTransferConfig(kv_connector="RemoteD2HConnector",
                     kv_connector_module_path="kvo_vllm.remote_d2h",
                     kv_role="kv_producer" (prefill) | "kv_consumer" (decode),
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"kv_port": 20100, ...})

Dense models move each layer's KV cache; DeepSeek-V3.2-architecture (DSA) models move each
layer's MLA cache and its lightning indexer's key cache (bf16 or C8), and a decode serving
kvo's sparse backend with ``mode="offload"`` receives the main KV into its host pool
(``pool_destination``). DSA layouts run with prefill TP 1 or 2, decode TP 1 or 2 (in offload
mode the decode's TP ranks pull disjoint parts of the main KV into their shared host pool; in
resident mode each rank pulls all of it into its own cache), with or without MTP speculative
decoding (both sides run the same ``speculative_config``: the drafter's layer is handed over
like the model's; decode TP > 2 and other speculative methods are refused at start-up until
shown to work). A decode
may run vLLM's data parallelism (one API server, ``N`` DP ranks): each DP rank's workers bind
their own control ports (``kv_port + dp_rank * tp + tp_rank``), advertise which DP rank took a
request, and the kvo proxy pins later requests to a DP rank (``kvo_vllm.proxy.flow``); DP ranks
that vLLM runs as independent engines (a dense model) are refused (``dp_rank``). Each worker's
``stats_file`` is the path plus ``.dp<rank>`` (DP > 1), then ``.tp<rank>`` (TP rank > 0).

The extra config is kvo_core's ``RemoteD2HConfig`` plus ``stats_file``
(``kvo_vllm.remote_d2h.options``). Which side a request takes is decided by
its ``kv_transfer_params`` (``kvo_vllm.remote_d2h.params``), which the kvo proxy sets:
``do_remote_decode`` on prefill, ``do_remote_prefill`` on decode.

vLLM hooks, per side:

- prefill: ``build_connector_meta`` plans each step's chunks (and asks vLLM to run
  ``start_load_kv`` before the forward), ``start_load_kv`` handshakes new decode ranks,
  ``save_kv_layer`` publishes READY for the layer just written, ``request_finished`` keeps the
  blocks until ``get_transfer_results`` reports every read answered;
- decode: ``get_num_new_matched_tokens`` turns the prompt into an asynchronous load,
  ``update_state_after_alloc`` + ``start_load_kv`` register and advertise the destination
  blocks, ``get_transfer_results`` reports requests received and
  ``get_block_ids_with_load_errors`` the blocks of a failed pull (vLLM then recomputes them,
  with ``kv_load_failure_policy="recompute"``, or fails the request).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvo_core.buffer_regions import INDEXER_PART
from kvo_core.errors import ConfigError
from kvo_core.gates import SlotGates, SlotKey
from kvo_vllm.dsa.offload_metrics import connector_stats
from kvo_vllm.metrics import (
    REMOTE_D2H_METRICS,
    SPARSE_OFFLOAD_METRICS,
    CounterDeltas,
    KvoConnectorStats,
    KvoMetricsReporting,
    Metric,
    remote_d2h_counters,
)
from kvo_vllm.remote_d2h.decode_worker import DecodePuller
from kvo_vllm.remote_d2h.dp_rank import DecodeDpRank, decode_dp_rank, local_device_index
from kvo_vllm.remote_d2h.kv_caches import cache_part
from kvo_vllm.remote_d2h.metadata import RemoteD2HMetadata
from kvo_vllm.remote_d2h.options import RemoteD2HOptions
from kvo_vllm.remote_d2h.pool_destination import indexer_block_label, pool_destination
from kvo_vllm.remote_d2h.prefill_worker import PrefillSender
from kvo_vllm.remote_d2h.scheduler_side import RemoteD2HScheduler
from kvo_vllm.remote_d2h.stats_file import StatsFile, rank_stats_file, rank_stats_path
from kvo_vllm.remote_d2h.switch_interval import shorten_switch_interval
from kvo_vllm.vllm_logging import join_vllm_logging
from kvo_vllm.vllm_version import require_supported_vllm

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _block_size(kv_cache_config: KVCacheConfig) -> int:
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(f"RemoteD2HConnector supports models with one KV-cache group (dense "
                          f"attention); this model has {len(groups)}")
    return int(groups[0].kv_cache_spec.block_size)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def first_draft_layer(vllm_config: Any) -> int | None:
    """Index of the first drafter (MTP) layer in vLLM's caches (the model's layer count:
    vLLM names DeepSeek's MTP layers ``model.layers.N...``), None without MTP drafting."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None or getattr(speculative, "method", None) != "mtp":
        return None
    return int(vllm_config.model_config.hf_text_config.num_hidden_layers)


def refuse_untested_dsa(kv_caches: Mapping[str, torch.Tensor], speculative: object | None
                        ) -> None:
    """ConfigError for a DSA set-up (main KV + indexer caches) whose hand-off is not shown to
    work here: speculative decoding other than MTP (``tests/e2e/test_pd_dsa_mtp.py`` shows
    MTP). Dense layouts pass; a prefill with TP > 1 passes (``tests/e2e/test_pd_dsa_tp2.py``)."""
    if not any(cache_part(name) == INDEXER_PART for name in kv_caches):
        return
    method = getattr(speculative, "method", speculative)
    if speculative is not None and method != "mtp":
        raise ConfigError(
            f"RemoteD2HConnector hands DSA models over with speculative decoding method "
            f"'mtp' only, got {method!r}: other drafters' hand-off is not tested; use "
            f"speculative_config={{'method': 'mtp', ...}} or none")


class RemoteD2HConnector(KvoMetricsReporting, KVConnectorBase_V1):
    """vLLM KV connector for the decode-first P/D flow (see the module docstring)."""

    metric_catalog: ClassVar[Mapping[str, Metric]] = {**REMOTE_D2H_METRICS,
                                                      **SPARSE_OFFLOAD_METRICS}

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig, *, gates: SlotGates | None = None,
                 slot_key_of: Callable[[str], SlotKey] | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()
        require_supported_vllm(type(self).__name__)
        transfer = self._kv_transfer_config
        self.options = RemoteD2HOptions.from_extra_config(transfer.kv_connector_extra_config)
        self.is_producer = transfer.is_kv_producer
        self.is_consumer = transfer.is_kv_consumer
        parallel = vllm_config.parallel_config
        dp = decode_dp_rank(parallel) if self.is_consumer else DecodeDpRank(0, 1)
        self._slot_key_of = slot_key_of
        self._scheduler: RemoteD2HScheduler | None = None
        self.sender: PrefillSender | None = None
        self.puller: DecodePuller | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = RemoteD2HScheduler(block_size=_block_size(kv_cache_config),
                                                 block_ids_of=self._block_ids_of)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
            tp_size = parallel.tensor_parallel_size
            device_index = local_device_index(parallel, tp_rank)
            shorten_switch_interval(self.options.config.gil_switch_interval_s)
            if self.is_producer:
                self.sender = PrefillSender(config=self.options.config, tp_rank=tp_rank,
                                            tp_size=tp_size, instance_id=str(transfer.engine_id),
                                            gates=gates, device_index=device_index,
                                            first_draft_layer=first_draft_layer(vllm_config))
            if self.is_consumer:
                self.puller = DecodePuller(config=self.options.config, tp_rank=tp_rank,
                                           tp_size=tp_size, dp_rank=dp.rank, dp_size=dp.size,
                                           device_index=device_index)
        self._stats = StatsFile(rank_stats_path(rank_stats_file(self.options.stats_file, dp),
                                                _tp_rank())
                                if role == KVConnectorRole.WORKER else None, self.snapshot)
        self._metric_deltas = CounterDeltas()
        logger.info("kvo RemoteD2HConnector (%s, %s)", role.name, transfer.kv_role)

    # ==== worker side ====================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        refuse_untested_dsa(kv_caches, getattr(self._vllm_config, "speculative_config", None))
        if self.sender is not None:
            self.sender.register_kv_caches(kv_caches, self._slot_key_of)
        if self.puller is not None:
            self.puller.register_kv_caches(
                kv_caches, functools.partial(pool_destination, self._vllm_config),
                indexer_block_label(self._vllm_config))
        self._stats.maybe_write(force=True)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RemoteD2HMetadata)
        if self.sender is not None:
            self.sender.start_step(metadata)
        if self.puller is not None:
            self.puller.start_step(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self.sender is not None:
            self.sender.publish_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.sender is not None:
            self.sender.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending: set[str] = set()
        recving: set[str] = set()
        if self.sender is not None:
            sending = self.sender.finished_sending(finished_req_ids)
        if self.puller is not None:
            recving, invalid = self.puller.collect()
            self._load_errors |= invalid
        self._stats.maybe_write(force=bool(sending or recving))
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._stats.maybe_write(force=True)
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.puller is not None:
            self.puller.close()
            self.puller = None

    def snapshot(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.sender is not None:
            data["prefill"] = self.sender.snapshot()
        if self.puller is not None:
            data["decode"] = self.puller.snapshot()
        return data

    # -- metrics through vLLM's KVConnectorStats / Prometheus (kvo_vllm.metrics) -----

    def get_kv_connector_stats(self) -> KvoConnectorStats | None:
        if self.sender is None and self.puller is None:
            return None
        return connector_stats(self._metric_deltas.take(remote_d2h_counters(self.snapshot())))


    # ==== scheduler side =================================================================

    @property
    def scheduler(self) -> RemoteD2HScheduler:
        if self._scheduler is None:
            raise RuntimeError("this RemoteD2HConnector is the worker-side instance")
        return self._scheduler

    def _block_ids_of(self, request_id: str) -> list[int]:
        if self._kv_cache_manager is None:
            raise RuntimeError("vLLM did not bind its KV-cache manager to the connector")
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def on_new_request(self, request: Request) -> None:
        if self.is_producer:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.is_consumer:
            return 0, False
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        if self.is_consumer:
            self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = self.scheduler.build_metadata(scheduler_output)
        if metadata.has_sends:
            # Chunks must be known before the first layer is saved: make vLLM run
            # start_load_kv before the forward on this step.
            scheduler_output.has_sync_kv_loads = True
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.on_connector_output(connector_output.finished_recving)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)
