"""The sparse offload backend's counters in vLLM's metrics (``vllm:kvo_sparse_offload_*``).

The backend is an attention backend, and vLLM carries worker-side numbers to ``/metrics`` only
through a KV connector's ``get_kv_connector_stats``. So every kvo connector adds these counters
to its own (:func:`connector_stats`), and :class:`~kvo_vllm.dsa.metrics_connector.
KvoOffloadMetricsConnector` exists for a deployment that runs the offload backend without a
P/D connector.

One process-wide :class:`~kvo_vllm.metrics.CounterDeltas` hands each increment out once: when
several connectors of one process ask (``KvoMultiConnector`` asks both of its halves), the
first gets it and the others get nothing, so the sums in ``/metrics`` count it once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvo_vllm.dsa.offload_main_kv import offload_workers
from kvo_vllm.dsa.offload_stats import OffloadTotals
from kvo_vllm.metrics import CounterDeltas, KvoConnectorStats, make_stats

_DELTAS = CounterDeltas()


def offload_counters(totals: OffloadTotals) -> dict[str, float]:
    """The catalog's cumulative counters of one worker's totals."""
    return {
        "sparse_offload_steps": totals.steps,
        "sparse_offload_layer_calls": totals.calls,
        "sparse_offload_selected_entries": totals.selected,
        "sparse_offload_hits": totals.hits,
        "sparse_offload_misses": totals.misses,
        "sparse_offload_h2d_bytes": totals.h2d_bytes,
        "sparse_offload_full_reload_bytes": totals.full_reload_bytes,
        "sparse_offload_residency_seconds": totals.residency_seconds,
    }


def process_offload_counters() -> dict[str, float]:
    """Cumulative counters of every offload worker alive in this process ({} when none)."""
    summed: dict[str, float] = {}
    for worker in offload_workers():
        for name, value in offload_counters(worker.stats.totals).items():
            summed[name] = summed.get(name, 0) + value
    return summed


def process_pool_rows_used() -> int:
    return sum(worker.stats.pool_rows_used for worker in offload_workers())


def take_offload_deltas() -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(counter increments since the last take in this process, gauge levels by source)."""
    cumulative = process_offload_counters()
    if not cumulative:
        return {}, {}
    deltas = _DELTAS.take(cumulative)
    if not deltas:
        return {}, {}
    return deltas, {"sparse_offload_pool_rows_used": {str(os.getpid()): process_pool_rows_used()}}


def connector_stats(counters: Mapping[str, float],
                    samples: Mapping[str, list[float]] | None = None
                    ) -> KvoConnectorStats | None:
    """A connector's own increments plus the offload backend's, as one payload for vLLM."""
    offload, gauges = take_offload_deltas()
    merged = dict(counters)
    for name, value in offload.items():
        merged[name] = merged.get(name, 0) + value
    return make_stats(merged, samples, gauges)
