"""kvo's connector metrics through vLLM's own mechanism (``KVConnectorStats`` / Prometheus).

vLLM asks every worker's connector for ``get_kv_connector_stats()`` after each step, ships the
result to the front end, rebuilds it there with the connector class's
``build_kv_connector_stats`` (merging the workers' with ``aggregate``), logs ``reduce()`` at its
log interval and feeds the same data to the connector class's ``build_prom_metrics`` object,
which the API server exposes on ``/metrics``.

kvo's connectors already keep cumulative counters (bytes saved, blocks pulled, failures...). A
``CounterDeltas`` turns those into the increments since the last call, so the payload is a
plain ``{"counters": {name: increment}, "samples": {name: [values]}, "gauges": {name:
{source: level}}}`` whose counters and samples sum across workers and steps; a gauge keeps the
latest level per source (a worker process) and exports their sum. One catalog (``METRICS``)
names every series: counter ``x`` is exported as ``vllm:kvo_x`` (``_total`` appended by the
Prometheus client), sample series as histograms, gauges as gauges.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvo_core.buffer_regions import INDEXER_PART, MAIN_PART
from kvo_core.errors import ConfigError


@attrs.frozen
class Metric:
    """One exported series: ``kind`` is "counter", "gauge" or "histogram"; ``help`` says what
    it counts, with its unit. A gauge's payload value is the level itself, not an increment
    (workers' levels add up: each worker holds its own pool)."""

    name: str
    kind: str
    help: str

    @property
    def prometheus_name(self) -> str:
        return f"vllm:kvo_{self.name}"


def _catalog(*metrics: Metric) -> dict[str, Metric]:
    return {metric.name: metric for metric in metrics}


LAYERWISE_METRICS = _catalog(
    Metric("layerwise_saved_bytes", "counter", "Bytes of KV saved to the store (layer saves)."),
    Metric("layerwise_saved_blocks", "counter", "KV blocks saved to the store."),
    Metric("layerwise_loaded_bytes", "counter", "Bytes of KV loaded from the store."),
    Metric("layerwise_loaded_blocks", "counter",
           "KV blocks loaded from the store (store hits)."),
    Metric("layerwise_missing_blocks", "counter",
           "KV blocks asked of the store but not found there (store misses)."),
    Metric("layerwise_failed_loads", "counter",
           "KV blocks whose load failed every retry (reported to vLLM as load errors)."),
    Metric("layerwise_failed_saves", "counter", "Store keys whose save failed (poisoned)."),
    Metric("layerwise_poisoned_keys", "counter",
           "Store keys poisoned: saves dropped because their KV may be wrong, or failed."),
    Metric("layerwise_removal_retries", "counter",
           "Retries of store removals that failed (e.g. a key another engine holds a read "
           "lease on)."),
    Metric("layerwise_removals_given_up", "counter",
           "Store keys whose removal failed every retry: still in the store, never loaded "
           "here (their bytes are a confirmed save's)."),
    Metric("layerwise_ready_wait_seconds", "counter",
           "Seconds the forward waited for a layer buffer (slot gate and load)."),
    Metric("layerwise_step_end_wait_seconds", "counter",
           "Seconds wait_for_save waited for the step's last saves."),
)
REMOTE_D2H_METRICS = _catalog(
    Metric("remote_d2h_handshakes", "counter", "Prefill: handshakes with decode ranks."),
    Metric("remote_d2h_handshake_failures", "counter", "Prefill: handshakes that failed."),
    Metric("remote_d2h_readys_published", "counter",
           "Prefill: layer READY batches published to decode."),
    Metric("remote_d2h_published_bytes", "counter",
           "Prefill: bytes of KV announced to decode in READYs."),
    Metric("remote_d2h_sends_done", "counter",
           "Prefill: requests whose every layer decode acknowledged."),
    Metric("remote_d2h_sends_failed", "counter",
           "Prefill: requests whose hand-off failed (READ_FAILED, deadline, lost decode)."),
    Metric("remote_d2h_requests_received", "counter",
           "Requests whose KV decode pulled completely."),
    Metric("remote_d2h_requests_failed", "counter",
           "Requests whose pull failed (vLLM's load-failure path)."),
    Metric("remote_d2h_layers_pulled", "counter", "Layer reads decode completed."),
    Metric("remote_d2h_pulled_bytes", "counter", "Bytes decode pulled from prefill."),
    Metric("remote_d2h_pulled_main_bytes", "counter",
           "Bytes of main KV decode pulled (into its KV cache, or its host pool with kvo's "
           "offload backend)."),
    Metric("remote_d2h_pulled_indexer_bytes", "counter",
           "Bytes of lightning-indexer keys decode pulled (DSA models)."),
    Metric("remote_d2h_pull_seconds", "counter", "Seconds decode spent in layer reads."),
    Metric("remote_d2h_deadline_failures", "counter",
           "Requests failed because a layer did not arrive in time."),
    Metric("remote_d2h_invalid_blocks", "counter",
           "Destination blocks reported to vLLM as invalid after a failed pull."),
    Metric("remote_d2h_pull_latency_seconds", "histogram", "Time of one layer read (s)."),
)
SPARSE_OFFLOAD_METRICS = _catalog(
    Metric("sparse_offload_steps", "counter",
           "Decode offload: forward steps that ran the offloaded layers."),
    Metric("sparse_offload_layer_calls", "counter",
           "Decode offload: attention calls of offloaded layers (steps x layers)."),
    Metric("sparse_offload_selected_entries", "counter",
           "Decode offload: top-k entries selected by decode rows (hits + misses)."),
    Metric("sparse_offload_hits", "counter",
           "Decode offload: selected entries already in the device hot buffer."),
    Metric("sparse_offload_misses", "counter",
           "Decode offload: rows copied host -> device because they were not resident."),
    Metric("sparse_offload_h2d_bytes", "counter",
           "Decode offload: bytes copied host -> device (misses x row bytes)."),
    Metric("sparse_offload_full_reload_bytes", "counter",
           "Decode offload: bytes a reload of the decode rows' whole history would have moved."),
    Metric("sparse_offload_residency_seconds", "counter",
           "Decode offload: seconds in the gather of the selected rows: residency update, "
           "miss copies, identity-slot fills and their index work (fused: in the two fused "
           "ops, indexer scoring and attention included)."),
    Metric("sparse_offload_pool_rows_used", "gauge",
           "Decode offload: KV rows the last step's requests hold in the host pool."),
)
METRICS: dict[str, Metric] = {**LAYERWISE_METRICS, **REMOTE_D2H_METRICS,
                              **SPARSE_OFFLOAD_METRICS}


def remote_d2h_counters(snapshot: Mapping[str, Any]) -> dict[str, float]:
    """Cumulative remote-D2H counters from a RemoteD2HConnector's ``snapshot()`` (the same
    numbers its stats file carries, so /metrics and the demo's accounting agree)."""
    counters: dict[str, float] = {}
    prefill = snapshot.get("prefill")
    if prefill:
        counters.update({
            "remote_d2h_handshakes": prefill.get("handshakes", 0),
            "remote_d2h_handshake_failures": prefill.get("handshake_failures", 0),
            "remote_d2h_readys_published": prefill.get("published_layers", 0),
            "remote_d2h_published_bytes": prefill.get("published_bytes", 0),
            "remote_d2h_sends_done": prefill.get("sends_done", 0),
            "remote_d2h_sends_failed": prefill.get("sends_failed", 0)})
    decode = snapshot.get("decode")
    if decode:
        per_layer = decode.get("per_layer", {}).values()
        per_part = decode.get("per_part", {})
        counters.update({
            "remote_d2h_requests_received": decode.get("received", 0),
            "remote_d2h_requests_failed": decode.get("failed", 0),
            "remote_d2h_deadline_failures": decode.get("deadline_failures", 0),
            "remote_d2h_invalid_blocks": decode.get("invalid_blocks_reported", 0),
            "remote_d2h_layers_pulled": sum(layer["reads"] for layer in per_layer),
            "remote_d2h_pulled_bytes": sum(layer["bytes"] for layer in per_layer),
            "remote_d2h_pulled_main_bytes": per_part.get(MAIN_PART, {}).get("bytes", 0),
            "remote_d2h_pulled_indexer_bytes": per_part.get(INDEXER_PART, {}).get("bytes", 0),
            "remote_d2h_pull_seconds": sum(layer["seconds"] for layer in per_layer)})
    return counters


def _check_names(names: Iterable[str]) -> None:
    unknown = sorted(set(names) - set(METRICS))
    if unknown:
        raise ConfigError(f"unknown kvo metric(s) {unknown}; known: {sorted(METRICS)}")


class CounterDeltas:
    """Increments of cumulative counters since the previous ``take`` (thread-safe).

    The first ``take`` reports everything counted since start-up.
    """

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self, cumulative: Mapping[str, float]) -> dict[str, float]:
        _check_names(cumulative)
        with self._lock:
            deltas = {name: value - self._last.get(name, 0) for name, value in cumulative.items()}
            self._last.update(cumulative)
        return {name: delta for name, delta in deltas.items() if delta}


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Histogram bounds (seconds) for per-layer pull latency: loopback reads to slow networks."""


def _empty() -> dict[str, Any]:
    return {"counters": {}, "samples": {}, "gauges": {}}


@dataclass
class KvoConnectorStats(KVConnectorStats):
    """The payload vLLM carries from kvo's workers to its loggers (see the module docstring).

    A module-level class (not built at run time) so that it pickles by name when vLLM's
    multiprocess executor ships it between processes.
    """

    def __post_init__(self) -> None:
        if not self.data:  # vLLM builds an empty one to aggregate into
            self.data = _empty()
        self.data.setdefault("counters", {})
        self.data.setdefault("samples", {})
        self.data.setdefault("gauges", {})
        _check_names([*self.data["counters"], *self.data["samples"], *self.data["gauges"]])

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters, samples = self.data["counters"], self.data["samples"]
        for name, value in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + value
        for name, values in other.data.get("samples", {}).items():
            samples.setdefault(name, []).extend(values)
        for name, levels in other.data.get("gauges", {}).items():
            self.data["gauges"].setdefault(name, {}).update(levels)   # the later level wins
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = dict(sorted(self.data["counters"].items()))
        for name, values in sorted(self.data["samples"].items()):
            if values:
                ordered = sorted(values)
                reduced[f"{name}_count"] = len(ordered)
                reduced[f"{name}_p50"] = ordered[len(ordered) // 2]
                reduced[f"{name}_max"] = ordered[-1]
        for name, levels in sorted(self.data["gauges"].items()):
            reduced[name] = sum(levels.values())
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not any(
            self.data["samples"].values()) and not self.data["gauges"]


def make_stats(counters: Mapping[str, float],
               samples: Mapping[str, list[float]] | None = None,
               gauges: Mapping[str, Mapping[str, float]] | None = None
               ) -> KvoConnectorStats | None:
    """A stats object for vLLM, or None when nothing happened (vLLM skips None).

    ``gauges`` maps a gauge's name to ``{source: level}``; levels alone do not make a report
    (they ride along with counters, so an idle server stops sending)."""
    data = {"counters": dict(counters), "samples": {k: list(v) for k, v in (samples or {}).items()
                                                   if v},
            "gauges": {name: dict(levels) for name, levels in (gauges or {}).items()}}
    if not data["counters"] and not data["samples"]:
        return None
    return KvoConnectorStats(data=data)


def build_stats(data: dict[str, Any] | None) -> KvoConnectorStats:
    """``build_kv_connector_stats``: rebuild the payload on the logging side."""
    return KvoConnectorStats(data=dict(data) if data else {})


def build_prom_metrics(vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]],
                       names: Iterable[str]) -> Any:
    """``build_prom_metrics``: one Prometheus series per catalog entry in ``names``."""

    class KvoPromMetrics(KVConnectorPromMetrics):
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.series: dict[str, dict[int, Any]] = {}
            for name in names:
                metric = METRICS[name]
                series: Any
                if metric.kind == "counter":
                    series = self._counter_cls(name=metric.prometheus_name,
                                               documentation=metric.help, labelnames=labelnames)
                elif metric.kind == "gauge":
                    gauge: Any = self._gauge_cls
                    series = gauge(name=metric.prometheus_name, documentation=metric.help,
                                   labelnames=labelnames, multiprocess_mode="mostrecent")
                else:
                    histogram: Any = self._histogram_cls
                    series = histogram(name=metric.prometheus_name,
                                       documentation=metric.help, labelnames=labelnames,
                                       buckets=LATENCY_BUCKETS)
                self.series[name] = {index: series.labels(*values)
                                     for index, values in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, value in transfer_stats_data.get("counters", {}).items():
                if name in self.series and value > 0:
                    self.series[name][engine_idx].inc(value)
            for name, values in transfer_stats_data.get("samples", {}).items():
                if name in self.series:
                    for value in values:
                        self.series[name][engine_idx].observe(value)
            for name, levels in transfer_stats_data.get("gauges", {}).items():
                if name in self.series:
                    self.series[name][engine_idx].set(sum(levels.values()))

    return KvoPromMetrics()


class KvoMetricsReporting:
    """vLLM's two class-level metric hooks for a kvo connector (put it before
    ``KVConnectorBase_V1`` in the bases): the payload class, and one Prometheus series per
    entry of ``metric_catalog``."""

    metric_catalog: ClassVar[Mapping[str, Metric]] = METRICS

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvoConnectorStats:
        return build_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return build_prom_metrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues, cls.metric_catalog)
