"""A KV connector that moves no KV and only reports the sparse offload backend's metrics.

vLLM carries worker-side numbers to the API server's ``/metrics`` only through a KV
connector. A deployment that runs kvo's sparse offload backend without P/D (no
``RemoteD2HConnector`` / ``LayerwiseStoreConnector``, which report these counters themselves)
names this one::

    kv_transfer_config={"kv_connector": "KvoOffloadMetricsConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "kvo_vllm.connectors"}

It never claims a cached token and never loads or saves.
``kv_connector_extra_config={"stats_file": path}`` also writes the cumulative counters as JSON
after every step that changed them (demos, tests).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvo_core.errors import ConfigError
from kvo_vllm.dsa.offload_metrics import connector_stats, process_offload_counters
from kvo_vllm.metrics import (
    SPARSE_OFFLOAD_METRICS,
    KvoConnectorStats,
    KvoMetricsReporting,
    Metric,
)
from kvo_vllm.remote_d2h.stats_file import StatsFile
from kvo_vllm.vllm_logging import join_vllm_logging
from kvo_vllm.vllm_version import require_supported_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

EXTRA_KEYS = ("stats_file",)


class KvoOffloadMetricsConnector(KvoMetricsReporting, KVConnectorBase_V1):
    """Reports ``vllm:kvo_sparse_offload_*``; otherwise a connector that does nothing."""

    metric_catalog: ClassVar[Mapping[str, Metric]] = SPARSE_OFFLOAD_METRICS

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()
        require_supported_vllm(type(self).__name__)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # the base class refused None
        if transfer.kv_role != "kv_both":
            raise ConfigError(f"KvoOffloadMetricsConnector: kv_role is {transfer.kv_role!r}; "
                              "allowed: 'kv_both' (it moves no KV)")
        extra = dict(transfer.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"KvoOffloadMetricsConnector: unknown kv_connector_extra_config "
                              f"key(s) {unknown}; allowed: {list(EXTRA_KEYS)}")
        path = extra.get("stats_file")
        if path is not None and (not isinstance(path, str) or not path):
            raise ConfigError(f"KvoOffloadMetricsConnector: stats_file is {path!r}; "
                              "allowed: a non-empty path")
        self._stats = StatsFile(path if role == KVConnectorRole.WORKER else None,
                                self.snapshot)
        logger.info("kvo KvoOffloadMetricsConnector (%s)", role.name)

    def snapshot(self) -> dict[str, Any]:
        return {"sparse_offload": process_offload_counters()}

    # -- metrics ---------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KvoConnectorStats | None:
        stats = connector_stats({})
        if stats is not None:
            self._stats.maybe_write(force=True)
        return stats


    # -- worker side: nothing to load or save ------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side: no external hits ----------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()
