"""``mode="offload"``: the :class:`~kvo_vllm.dsa.main_kv.MainKVAccess` strategy whose rows live
in a kvo host pool (the seam: :mod:`kvo_vllm.dsa.main_kv`; the rules:
:mod:`kvo_vllm.dsa.offload_manager`; what vLLM allocates: :mod:`kvo_vllm.dsa.offload_backend`).

All offloaded layers of one worker share one :class:`OffloadWorker`: one host pool (every
layer's rows, laid out by vLLM slot id; at TP > 1 the DP rank's one pool, created by TP rank 0
and attached by the others, :mod:`kvo_vllm.dsa.offload_tp`), per-layer hot buffers and
residency tables, one set of counters. It is created at the first write after vLLM bound the
KV cache, when the number of blocks (the placeholder view's first dimension) and every
offloaded layer (registered when kvo's model class binds the layers, draft layers included)
are known. The engine is told by its compilation config: vLLM builds the MTP drafter from a
shallow copy of the engine's ``VllmConfig`` (``_create_draft_vllm_config``) that shares it (and
its ``static_forward_context``, where both models' layers are), so the draft layers join the
model's worker and pool (sized for them: ``offload_backend.offloaded_layers``).
:func:`offload_workers` lists the live workers of this process (tests, benchmarks, metrics).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from kvo_core.errors import ConfigError
from kvo_vllm.dsa.config import decode_query_rows, uses_fused_ops
from kvo_vllm.dsa.gather.contract import StepInputs
from kvo_vllm.dsa.main_kv import LayerInfo, SelectedRows, cache_rows
from kvo_vllm.dsa.offload_fused import IndexerInputs
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.dsa.offload_stats import OffloadStats
from kvo_vllm.dsa.offload_tp import vllm_tp_group
from kvo_vllm.sparse.layout import SparseModelLayout

LOG_EVERY_ENV = "KVO_OFFLOAD_LOG_EVERY"
HISTORY_ENV = "KVO_OFFLOAD_HISTORY"
"""How many layer calls each worker's stats keep (tests and the benchmark raise it)."""
DEFAULT_HISTORY = 4096
_pool_names = itertools.count()
_workers: dict[int, OffloadWorker] = {}


class OffloadWorker:
    """The offload state one vLLM worker's offloaded layers share (module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        self._engine_ref = weakref.ref(_engine_of(vllm_config))
        self.layer_names: list[str] = []
        self._layers: list[LayerInfo] = []
        self.manager: OffloadManager | None = None
        self._step_metadata: Callable[[], Any] = lambda: None
        self._step: StepInputs | None = None
        self.stats = OffloadStats(
            log_every=_env_int(LOG_EVERY_ENV, 100),
            history_limit=_env_int(HISTORY_ENV, DEFAULT_HISTORY))

    def register(self, layer: LayerInfo) -> int:
        if self.manager is not None:
            raise RuntimeError(f"{layer.layer_name}: registered after the host pool was built")
        self.layer_names.append(layer.layer_name)
        self._layers.append(layer)
        return len(self.layer_names) - 1

    def manager_for(self, kv_caches: Mapping[str, torch.Tensor]) -> OffloadManager:
        """The manager, built now from vLLM's bound caches if no write built it yet.

        A P/D decode's connector needs the host pool before the first forward: it registers the
        pool with its transfer engine and pulls prompts into it.
        """
        if not self._layers:
            raise RuntimeError("no offloaded layer is registered with this worker")
        first = self._layers[0]
        if first.layer_name not in kv_caches:
            raise ConfigError(f"vLLM bound no KV cache to the offloaded layer "
                              f"{first.layer_name!r}")
        return self.ensure_manager(first, kv_caches[first.layer_name])

    def ensure_manager(self, layer: LayerInfo, kv_cache: torch.Tensor) -> OffloadManager:
        if self.manager is not None:
            return self.manager
        vllm_config = layer.vllm_config
        config = layer.config
        placeholder = cache_rows(kv_cache)
        num_blocks, block_size = int(placeholder.shape[0]), int(placeholder.shape[1])
        text = vllm_config.model_config.hf_text_config
        layout = SparseModelLayout(
            num_layers=len(self.layer_names), latent_dim=layer.kv_lora_rank,
            rope_dim=layer.rope_dim, index_dim=int(text.index_head_dim),
            softmax_scale=1.0,  # the store reads only the row geometry
            kv_dtype=placeholder.dtype)
        self.manager = OffloadManager(
            layout, num_blocks=num_blocks, block_size=block_size,
            max_rows=int(vllm_config.scheduler_config.max_num_seqs),
            max_blocks_per_row=-(-int(vllm_config.model_config.max_model_len) // block_size),
            top_k=config.top_k, capacity=config.hot_capacity,
            decode_query_rows=decode_query_rows(config),
            pool_name=f"dsa-{os.getpid()}-{next(_pool_names)}",
            residency_backend=config.residency_backend,
            copy_implementation="reference" if config.kernel_backend == "reference" else None,
            device=placeholder.device, stats=self.stats, fused=uses_fused_ops(config),
            tp_group=vllm_tp_group())
        return self.manager

    def step_inputs(self, manager: OffloadManager, metadata: Any) -> StepInputs:
        """:meth:`OffloadManager.step_inputs` of vLLM's step metadata, computed at the step's
        first layer and reused by the others (they share vLLM's metadata object)."""
        if self._step_metadata() is not metadata:
            self._step = manager.step_inputs(metadata.query_start_loc, metadata.seq_lens,
                                             metadata.block_table, int(metadata.num_reqs))
            self._step_metadata = weakref.ref(metadata)
        assert self._step is not None
        return self._step

    def matches(self, vllm_config: Any) -> bool:
        """Whether ``vllm_config`` is this worker's engine's (the model's or its drafter's)."""
        return self._engine_ref() is _engine_of(vllm_config)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a whole number >= 0") from None
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected a whole number >= 0")
    return value


def _engine_of(vllm_config: Any) -> Any:
    """What identifies an engine's configs: the compilation config the model's ``VllmConfig``
    and its drafter's copy share (module docstring)."""
    return vllm_config.compilation_config


def _worker_for(vllm_config: Any) -> OffloadWorker:
    engine = _engine_of(vllm_config)
    key = id(engine)
    worker = _workers.get(key)
    if worker is None or not worker.matches(vllm_config):
        worker = _workers[key] = OffloadWorker(vllm_config)
        weakref.finalize(engine, _forget, key, worker)
    return worker


def _forget(key: int, worker: OffloadWorker) -> None:
    if _workers.get(key) is worker:
        del _workers[key]
    worker.close()


def offload_worker_for(vllm_config: Any, layer_names: Iterable[str]) -> OffloadWorker | None:
    """The offload worker serving ``vllm_config``'s engine, or None when its layers' main KV
    is not offloaded. ``layer_names`` (the engine's main-KV caches) must then all be offloaded.

    Found by the engine's config object; failing that (a caller holding a copy of the config),
    by the layers it registered.
    """
    names = set(layer_names)
    worker = _workers.get(id(_engine_of(vllm_config)))
    if worker is None or not worker.matches(vllm_config):
        found = [w for w in _workers.values() if names & set(w.layer_names)]
        if len(found) > 1:
            raise ConfigError(f"{len(found)} offload workers in this process serve layers "
                              f"named like {sorted(names)[:2]}; cannot tell which is this "
                              f"engine's")
        worker = found[0] if found else None
    if worker is None:
        return None
    missing = sorted(names - set(worker.layer_names))
    if missing:
        raise ConfigError(f"layers {missing} keep their main KV in vLLM's cache while "
                          f"{len(worker.layer_names)} others are offloaded to the host pool; "
                          f"RemoteD2H needs one main-KV home for every layer")
    return worker


def open_offload_pool(vllm_config: Any) -> OffloadManager | None:
    """Build this engine worker's offload manager (its host pool) now, from the KV caches vLLM
    bound to the offloaded layers; None when no layer of this engine is offloaded. Called at
    start-up by kvo's worker class (:mod:`kvo_vllm.dsa.worker`), after vLLM bound the caches,
    on every TP rank at the same point."""
    layers = vllm_config.compilation_config.static_forward_context
    worker = _workers.get(id(_engine_of(vllm_config)))
    if worker is None or not worker.matches(vllm_config):
        found = [w for w in _workers.values() if w.layer_names
                 and set(w.layer_names) <= set(layers)]
        if len(found) != 1:
            return None
        worker = found[0]
    caches = {name: layers[name].kv_cache for name in worker.layer_names}
    return worker.manager_for(caches)


def offload_workers() -> list[OffloadWorker]:
    """The offload workers alive in this process (one per engine worker)."""
    return list(_workers.values())


class OffloadMainKV:
    """One offloaded layer's access to the shared :class:`OffloadWorker`."""

    def __init__(self, layer: LayerInfo) -> None:
        if layer.vllm_config is None:
            raise ValueError(f"{layer.layer_name}: offload mode needs the engine's vllm_config")
        self.layer = layer
        self.worker = _worker_for(layer.vllm_config)
        self.index = self.worker.register(layer)

    def write(self, kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor,
              metadata: Any) -> None:
        manager = self.worker.ensure_manager(self.layer, kv_cache)
        manager.write(self.index, rows, slot_mapping)

    def gather(self, kv_cache: torch.Tensor, topk: torch.Tensor, metadata: Any) -> SelectedRows:
        manager = self.worker.ensure_manager(self.layer, kv_cache)
        step = self.worker.step_inputs(manager, metadata)
        selected = manager.select_rows(self.index, topk, step)
        tokens = int(selected.valid.shape[0])
        if tokens < topk.shape[0]:  # padded tokens: no rows
            pad = topk.shape[0] - tokens
            valid = torch.cat([selected.valid, selected.valid.new_zeros(pad, topk.shape[1])])
            if selected.slots is not None:
                slots = torch.cat([selected.slots,
                                   selected.slots.new_full((pad, topk.shape[1]), -1)])
                return SelectedRows(rows=selected.rows, valid=valid, slots=slots)
            rows = selected.rows
            rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
            return SelectedRows(rows=rows, valid=valid)
        return selected

    def attend(self, kv_cache: torch.Tensor, query: torch.Tensor, query_rope: torch.Tensor,
               topk: torch.Tensor, metadata: Any, indexer: IndexerInputs,
               scale: float) -> torch.Tensor:
        """``kernel_backend="fused"``: attention output ``[T, N, latent]`` of the step's tokens
        (decode rows through the fused ops, see ``OffloadManager.attend``)."""
        manager = self.worker.ensure_manager(self.layer, kv_cache)
        requests = int(metadata.num_reqs)
        tokens = int(metadata.query_start_loc[requests])
        out = manager.attend(
            self.index, query[:tokens], query_rope[:tokens], topk[:tokens],
            metadata.query_start_loc[:requests + 1], metadata.seq_lens[:requests],
            metadata.block_table[:requests], indexer, scale)
        if tokens < query.shape[0]:  # padded tokens: no rows, zeros
            out = torch.cat([out, out.new_zeros(query.shape[0] - tokens, *out.shape[1:])])
        return out
