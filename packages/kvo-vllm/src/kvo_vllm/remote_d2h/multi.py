"""``KvoMultiConnector``: layerwise store offload and remote D2H on one prefill.

Load it in vLLM with::

    KVTransferConfig(kv_connector="KvoMultiConnector",
                     kv_connector_module_path="kvo_vllm.remote_d2h", kv_role="kv_producer",
                     kv_connector_extra_config={
                         "layerwise": {"store_master_address": "127.0.0.1:PORT", ...},
                         "remote_d2h": {"kv_port": 20100, ...},
                         "order": ["layerwise", "remote_d2h"],   # optional
                         "stats_file": "/tmp/prefill-stats.json"})  # optional

Composition rules (what upstream's generic MultiConnector cannot guarantee):

- the completion provider (RemoteD2H) is called first in every hook that decides when a
  request or a buffer is done (``start_load_kv``, ``save_kv_layer``, ``get_transfer_results``,
  ``request_finished``, ``shutdown``), whatever ``order`` says; ``order`` only orders the
  remaining hooks, where it does not change the outcome;
- one slot-gate table, the layerwise pipeline's own (kvo_core.gates ``SlotGates``): it
  closes a reused buffer's round with its store save *and* every part announced on the slot
  in the step (``take_announced``), so the buffer opens only when the save and every decode
  read of it are done. RemoteD2H announces the layer's remote-read part and publishes the
  layer before the layerwise pipeline closes the round (its reads report into the part, early
  answers are held until the round closes), so a single shared buffer never waits for a read
  that was not requested yet. The two halves share only the gates: no part names pass through
  this class. Announcements are keyed by the layerwise step (``new_epoch``): one made in a
  step that closed no round on the slot never joins a later round.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from kvo_core.errors import ConfigError
from kvo_core.gates import SlotGates
from kvo_vllm.layerwise.connector import LayerwiseStoreConnector
from kvo_vllm.metrics import (
    METRICS,
    KvoConnectorStats,
    KvoMetricsReporting,
    Metric,
    build_stats,
)
from kvo_vllm.remote_d2h.connector import RemoteD2HConnector
from kvo_vllm.remote_d2h.stats_file import StatsFile
from kvo_vllm.vllm_logging import join_vllm_logging
from kvo_vllm.vllm_version import require_supported_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LAYERWISE = "layerwise"
REMOTE = "remote_d2h"
KNOWN_KEYS = (LAYERWISE, REMOTE, "order", "stats_file")


@attrs.frozen
class MultiOptions:
    """The composed connector's ``kv_connector_extra_config``, checked."""

    layerwise: Mapping[str, Any]
    remote: Mapping[str, Any]
    order: tuple[str, ...] = (LAYERWISE, REMOTE)
    stats_file: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> MultiOptions:
        if not isinstance(extra, Mapping):
            raise ConfigError(f"KvoMultiConnector: kv_connector_extra_config must be a mapping "
                              f"with keys {', '.join(KNOWN_KEYS)}, got {extra!r}")
        unknown = sorted(set(extra) - set(KNOWN_KEYS))
        if unknown:
            raise ConfigError(f"KvoMultiConnector: unknown kv_connector_extra_config key(s) "
                              f"{unknown}; known keys: {', '.join(KNOWN_KEYS)}")
        sections = {}
        for key in (LAYERWISE, REMOTE):
            section = extra.get(key)
            if not isinstance(section, Mapping):
                raise ConfigError(f"KvoMultiConnector: {key!r} must be the mapping of that "
                                  f"connector's own extra config, got {section!r}")
            sections[key] = dict(section)
        order = extra.get("order", [LAYERWISE, REMOTE])
        if not isinstance(order, list | tuple) or sorted(order) != sorted((LAYERWISE, REMOTE)):
            raise ConfigError(f"KvoMultiConnector: order must list {LAYERWISE!r} and {REMOTE!r} "
                              f"once each, got {order!r}")
        stats_file = extra.get("stats_file")
        if stats_file is not None and (not isinstance(stats_file, str) or not stats_file):
            raise ConfigError(f"KvoMultiConnector: stats_file must be a path or absent, got "
                              f"{stats_file!r}")
        return cls(layerwise=sections[LAYERWISE], remote=sections[REMOTE], order=tuple(order),
                   stats_file=stats_file)


@dataclass(frozen=True)
class KvoMultiMetadata(KVConnectorMetadata):
    layerwise: KVConnectorMetadata
    remote: KVConnectorMetadata


def _sub_config(vllm_config: VllmConfig, extra: Mapping[str, Any], name: str) -> VllmConfig:
    """A shallow copy of ``vllm_config`` whose transfer config carries one connector's extra."""
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    sub = copy.copy(vllm_config)
    sub.kv_transfer_config = dataclasses.replace(transfer, kv_connector=name,
                                                 kv_connector_extra_config=dict(extra))
    return sub


class KvoMultiConnector(KvoMetricsReporting, KVConnectorBase_V1):
    """LayerwiseStoreConnector + RemoteD2HConnector with joined buffer-reuse gates."""

    metric_catalog: ClassVar[Mapping[str, Metric]] = METRICS

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()
        require_supported_vllm(type(self).__name__)
        self.options = MultiOptions.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.layerwise = LayerwiseStoreConnector(
            _sub_config(vllm_config, self.options.layerwise, "LayerwiseStoreConnector"),
            role, kv_cache_config)
        self.gates: SlotGates | None = None
        if role == KVConnectorRole.WORKER:
            # One gate table for both: the layerwise pipeline's, which it waits on; the
            # remote reads report into it.
            self.gates = self.layerwise.slot_gates
        self.remote = RemoteD2HConnector(
            _sub_config(vllm_config, self.options.remote, "RemoteD2HConnector"), role,
            kv_cache_config, gates=self.gates,
            slot_key_of=self.layerwise.slot_key if role == KVConnectorRole.WORKER else None)
        self._stats = StatsFile(self.options.stats_file if role == KVConnectorRole.WORKER
                                else None, self.snapshot)
        self._staged_puts_written = 0
        self._chosen: dict[str, KVConnectorBase_V1] = {}
        logger.info("kvo KvoMultiConnector (%s): remote D2H first, then layerwise store",
                    role.name)

    @property
    def _in_order(self) -> list[KVConnectorBase_V1]:
        """Sub-connectors in the configured order (hooks where the order is free)."""
        by_name = {LAYERWISE: self.layerwise, REMOTE: self.remote}
        return [by_name[name] for name in self.options.order]

    @property
    def _completion_first(self) -> list[KVConnectorBase_V1]:
        return [self.remote, self.layerwise]

    # ==== worker side ====================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The layerwise half checks the aliasing its plan produced and registers the buffers
        # with the store; the remote half then exposes the same (aliased) buffers.
        self.layerwise.register_kv_caches(kv_caches)
        self.remote.register_kv_caches(kv_caches)
        self._stats.maybe_write(force=True)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, KvoMultiMetadata)
        self.layerwise.bind_connector_metadata(connector_metadata.layerwise)
        self.remote.bind_connector_metadata(connector_metadata.remote)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.layerwise.clear_connector_metadata()
        self.remote.clear_connector_metadata()
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KvoMultiMetadata)
        self.layerwise.handle_preemptions(kv_connector_metadata.layerwise)
        self.remote.handle_preemptions(kv_connector_metadata.remote)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for connector in self._completion_first:
            connector.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for connector in self._in_order:
            connector.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # A request that lost a store load (this layer or an earlier one) attended over another
        # layer's KV: its layers are not published to decode from here on (the decode's pull
        # then fails and it recomputes; a published one would be taken as valid).
        failed = self.layerwise.worker.requests_with_failed_loads()
        if failed and self.remote.sender is not None:
            self.remote.sender.give_up_requests(
                failed, f"a store load failed before layer {layer_name} was published")
        self.remote.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self.layerwise.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for connector in self._completion_first:
            connector.wait_for_save()  # type: ignore[no-untyped-call]

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        merged = KVConnectorTransferResults()
        for connector in self._completion_first:
            results = connector.get_transfer_results(finished_req_ids)
            merged.finished_sending |= results.finished_sending
            merged.finished_recving |= results.finished_recving
            merged.failed_recving |= results.failed_recving
        self._stats.maybe_write(force=bool(merged.finished_sending))
        return merged

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for connector in self._completion_first:
            errors |= connector.get_block_ids_with_load_errors()
        return errors

    def shutdown(self) -> None:
        self._stats.maybe_write(force=True)
        failure: Exception | None = None
        for connector in self._completion_first:
            try:
                connector.shutdown()  # type: ignore[no-untyped-call]
            except Exception as error:  # shut the other one down too
                logger.exception("kvo: shutting down %s failed", type(connector).__name__)
                failure = error
        if failure is not None:
            raise failure

    def snapshot(self) -> dict[str, Any]:
        data: dict[str, Any] = {"remote": self.remote.snapshot()}
        if self.role == KVConnectorRole.WORKER:
            layout = self.layerwise.layout
            data["layerwise"] = attrs.asdict(self.layerwise.stats)
            data["layout"] = {"num_layers": layout.num_layers,
                              "physical_buffers": layout.physical_buffers,
                              "physical_bytes": layout.physical_bytes,
                              "logical_bytes": layout.logical_bytes,
                              "describe": layout.describe()}
        return data

    # ==== scheduler side =================================================================

    # -- metrics: both halves' series, one payload (kvo_vllm.metrics) ----------------

    def get_kv_connector_stats(self) -> KvoConnectorStats | None:
        parts = [part for part in (self.remote.get_kv_connector_stats(),
                                   self.layerwise.get_kv_connector_stats()) if part is not None]
        if not parts:
            return None
        total = build_stats(None)
        for part in parts:
            total.aggregate(part)
        return total

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The layerwise half's (RemoteD2H sends none). A staged put that ended since the
        last look changed the counters after this step's (throttled) stats-file write: the
        file is written now, so it agrees with /metrics once the engine idles."""
        ended = self.layerwise.worker.stats.staged_puts
        if ended != self._staged_puts_written:
            self._staged_puts_written = ended
            self._stats.maybe_write(force=True)
        return self.layerwise.build_connector_worker_meta()


    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.layerwise.bind_kv_cache_manager(kv_cache_manager)
        self.remote.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        for connector in self._completion_first:
            connector.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        for connector in self._completion_first:
            count, load_async = connector.get_num_new_matched_tokens(request,
                                                                     num_computed_tokens)
            if count is None:
                return None, False
            if count > 0:
                self._chosen[request.request_id] = connector
                return count, load_async
        self._chosen.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        for connector in self._completion_first:
            count = num_external_tokens if connector is chosen else 0
            connector.update_state_after_alloc(request, blocks, count)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        remote = self.remote.build_connector_meta(scheduler_output)
        layerwise = self.layerwise.build_connector_meta(scheduler_output)
        return KvoMultiMetadata(layerwise=layerwise, remote=remote)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for connector in self._completion_first:
            connector.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return any(connector.has_pending_push_work() for connector in self._completion_first)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay = False
        params: dict[str, Any] = {}
        for connector in self._completion_first:
            later, extra = connector.request_finished(request, block_ids)
            delay = delay or later
            params.update(extra or {})
        self._chosen.pop(request.request_id, None)
        return delay, params or None
