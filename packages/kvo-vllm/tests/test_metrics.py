"""kvo's connector metrics: deltas of cumulative counters, the stats payload vLLM carries, and
the Prometheus series built from it (on a private registry, with vLLM's own base classes)."""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvo_core.errors import ConfigError
from kvo_vllm.dsa import offload_metrics
from kvo_vllm.dsa.offload_metrics import offload_counters
from kvo_vllm.dsa.offload_stats import OffloadLayerStats, OffloadStats, OffloadTotals
from kvo_vllm.layerwise.worker_stats import LayerwiseStats
from kvo_vllm.metrics import (
    LAYERWISE_METRICS,
    METRICS,
    SPARSE_OFFLOAD_METRICS,
    CounterDeltas,
    KvoConnectorStats,
    build_prom_metrics,
    build_stats,
    make_stats,
    remote_d2h_counters,
)


def test_deltas_report_increments_since_the_last_take() -> None:
    deltas = CounterDeltas()
    assert deltas.take({"layerwise_saved_bytes": 100, "layerwise_loaded_bytes": 0}) == {
        "layerwise_saved_bytes": 100}
    assert deltas.take({"layerwise_saved_bytes": 100, "layerwise_loaded_bytes": 0}) == {}
    assert deltas.take({"layerwise_saved_bytes": 160, "layerwise_loaded_bytes": 8}) == {
        "layerwise_saved_bytes": 60, "layerwise_loaded_bytes": 8}


def test_unknown_metric_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="layerwise_saved_bites"):
        CounterDeltas().take({"layerwise_saved_bites": 1})
    with pytest.raises(ConfigError, match="nope"):
        KvoConnectorStats(data={"counters": {"nope": 1}})


def test_layerwise_stats_name_every_layerwise_metric() -> None:
    assert set(LayerwiseStats().metric_counters()) == set(LAYERWISE_METRICS)


def test_remote_d2h_counters_follow_the_stats_file_snapshot() -> None:
    snapshot = {"prefill": {"handshakes": 1, "published_layers": 8, "published_bytes": 4096,
                            "sends_done": 2, "sends_failed": 0, "handshake_failures": 0},
                "decode": {"received": 2, "failed": 1, "deadline_failures": 0,
                           "invalid_blocks_reported": 3,
                           "per_layer": {"0": {"reads": 2, "bytes": 1024, "seconds": 0.01},
                                         "1": {"reads": 1, "bytes": 512, "seconds": 0.02}},
                           "per_part": {"kv": {"bytes": 1280, "descriptors": 3},
                                        "idx": {"bytes": 256, "descriptors": 3}}}}
    counters = remote_d2h_counters(snapshot)
    assert counters["remote_d2h_pulled_bytes"] == 1536
    assert counters["remote_d2h_pulled_main_bytes"] == 1280
    assert counters["remote_d2h_pulled_indexer_bytes"] == 256
    assert counters["remote_d2h_layers_pulled"] == 3
    assert counters["remote_d2h_readys_published"] == 8
    assert counters["remote_d2h_invalid_blocks"] == 3
    assert set(counters) <= set(METRICS)
    assert remote_d2h_counters({}) == {}


def test_stats_aggregate_across_workers_and_steps() -> None:
    assert make_stats({}) is None  # nothing happened: vLLM skips None
    first = make_stats({"layerwise_saved_bytes": 10},
                       {"remote_d2h_pull_latency_seconds": [0.002]})
    second = make_stats({"layerwise_saved_bytes": 5, "remote_d2h_pulled_bytes": 7},
                        {"remote_d2h_pull_latency_seconds": [0.004, 0.001]})
    assert first is not None and second is not None
    total = build_stats(None).aggregate(first).aggregate(build_stats(second.to_dict()))
    reduced = total.reduce()
    assert reduced["layerwise_saved_bytes"] == 15
    assert reduced["remote_d2h_pulled_bytes"] == 7
    assert reduced["remote_d2h_pull_latency_seconds_count"] == 3
    assert reduced["remote_d2h_pull_latency_seconds_p50"] == 0.002
    assert reduced["remote_d2h_pull_latency_seconds_max"] == 0.004
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_stats_pickle_by_name() -> None:
    """vLLM's multiprocess executor ships the payload between processes."""
    stats = make_stats({"layerwise_saved_bytes": 3})
    copy = pickle.loads(pickle.dumps(stats))
    assert type(copy) is KvoConnectorStats and copy.to_dict() == stats.to_dict()


def _on(registry: CollectorRegistry, cls: type) -> Any:
    def build(**kwargs: Any) -> Any:
        return cls(registry=registry, **kwargs)
    return build


def test_prometheus_series_count_what_the_stats_carried() -> None:
    registry = CollectorRegistry()
    metric_types = {Counter: _on(registry, Counter), Gauge: _on(registry, Gauge),
                    Histogram: _on(registry, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = build_prom_metrics(vllm_config, metric_types, ["model_name", "engine"],
                              {0: ["tiny", "0"]}, METRICS)
    prom.observe({"counters": {"layerwise_saved_bytes": 4096, "remote_d2h_pulled_bytes": 512},
                  "samples": {"remote_d2h_pull_latency_seconds": [0.003, 0.2]}}, 0)
    prom.observe({"counters": {"layerwise_saved_bytes": 1024}, "samples": {}}, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    value = registry.get_sample_value
    assert value("vllm:kvo_layerwise_saved_bytes_total", labels) == 5120
    assert value("vllm:kvo_remote_d2h_pulled_bytes_total", labels) == 512
    assert value("vllm:kvo_remote_d2h_pull_latency_seconds_count", labels) == 2
    assert value("vllm:kvo_remote_d2h_pull_latency_seconds_bucket",
                 {**labels, "le": "0.005"}) == 1


def test_gauges_keep_the_latest_level_per_source_and_sum_sources() -> None:
    def step(source: str, level: int) -> KvoConnectorStats:
        stats = make_stats({"sparse_offload_steps": 1}, None,
                           {"sparse_offload_pool_rows_used": {source: level}})
        assert stats is not None
        return stats

    total = build_stats(None)
    for stats in (step("rank0", 100), step("rank1", 40), step("rank0", 70)):
        total.aggregate(build_stats(stats.to_dict()))
    reduced = total.reduce()
    assert reduced["sparse_offload_steps"] == 3                 # counters add up
    assert reduced["sparse_offload_pool_rows_used"] == 110      # rank0's latest + rank1's
    # a level alone is no report: an idle server stops sending
    assert make_stats({}, None, {"sparse_offload_pool_rows_used": {"rank0": 5}}) is None


def test_prometheus_gauge_is_set_not_added() -> None:
    registry = CollectorRegistry()
    metric_types = {Counter: _on(registry, Counter), Gauge: _on(registry, Gauge),
                    Histogram: _on(registry, Histogram)}
    prom = build_prom_metrics(SimpleNamespace(kv_transfer_config=None), metric_types,
                              ["engine"], {0: ["0"]}, SPARSE_OFFLOAD_METRICS)
    for level in (300, 120):
        prom.observe({"counters": {"sparse_offload_h2d_bytes": 1152}, "samples": {},
                      "gauges": {"sparse_offload_pool_rows_used": {"a": level, "b": 8}}}, 0)
    value = registry.get_sample_value
    assert value("vllm:kvo_sparse_offload_pool_rows_used", {"engine": "0"}) == 128
    assert value("vllm:kvo_sparse_offload_h2d_bytes_total", {"engine": "0"}) == 2304


def _fake_worker(totals: OffloadTotals, pool_rows_used: int) -> Any:
    stats = OffloadStats()
    stats.totals = totals
    stats.last[0] = OffloadLayerStats(
        layer=0, decode_rows=1, decode_tokens=1, pool_rows=0, selected=0, hits=0, misses=0,
        h2d_bytes=0, full_reload_bytes=0, pool_rows_used=pool_rows_used)
    return SimpleNamespace(stats=stats)


def test_offload_counters_name_every_sparse_offload_counter() -> None:
    counters = offload_counters(OffloadTotals())
    assert set(counters) == {name for name, metric in SPARSE_OFFLOAD_METRICS.items()
                             if metric.kind == "counter"}


def test_offload_increments_are_handed_out_once_per_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two connectors of one process (KvoMultiConnector's halves) must not count a miss twice."""
    totals = OffloadTotals(steps=2, calls=4, selected=40, hits=30, misses=10, h2d_bytes=11520,
                           full_reload_bytes=99999, residency_seconds=0.5)
    workers = [_fake_worker(totals, pool_rows_used=77)]
    monkeypatch.setattr(offload_metrics, "offload_workers", lambda: workers)
    monkeypatch.setattr(offload_metrics, "_DELTAS", CounterDeltas())
    first = offload_metrics.connector_stats({"layerwise_saved_bytes": 64})
    second = offload_metrics.connector_stats({"remote_d2h_pulled_bytes": 32})
    assert first is not None and second is not None
    assert first.data["counters"]["sparse_offload_misses"] == 10
    assert first.data["counters"]["layerwise_saved_bytes"] == 64
    assert first.data["gauges"]["sparse_offload_pool_rows_used"] == {str(os.getpid()): 77}
    assert "sparse_offload_misses" not in second.data["counters"]   # already handed out
    assert second.data["counters"] == {"remote_d2h_pulled_bytes": 32}
    totals.misses += 3
    totals.h2d_bytes += 3 * 1152
    third = offload_metrics.connector_stats({})
    assert third is not None
    assert third.data["counters"] == {"sparse_offload_misses": 3,
                                      "sparse_offload_h2d_bytes": 3456}
    assert offload_metrics.connector_stats({}) is None                # nothing new


def test_offload_stats_history_is_bounded() -> None:
    stats = OffloadStats(history_limit=3)
    for step in range(5):
        stats.record(OffloadLayerStats(
            layer=0, decode_rows=1, decode_tokens=1, pool_rows=0, selected=4, hits=step,
            misses=4 - step, h2d_bytes=0, full_reload_bytes=0, pool_rows_used=10 + step))
    assert [s.hits for s in stats.history] == [2, 3, 4]
    assert stats.totals.steps == 5 and stats.pool_rows_used == 14
    assert not OffloadStats().history.maxlen    # default: keeps none
    with pytest.raises(ValueError, match="history_limit is -1"):
        OffloadStats(history_limit=-1)


def _metrics_connector_config(role: str, extra: dict[str, Any]) -> Any:
    transfer = SimpleNamespace(kv_role=role, kv_connector_extra_config=extra,
                               is_kv_producer=role != "kv_consumer")
    return SimpleNamespace(kv_transfer_config=transfer)


def test_metrics_connector_refuses_what_it_cannot_do() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvo_vllm.dsa.metrics_connector import KvoOffloadMetricsConnector

    with pytest.raises(ConfigError, match=r"kv_role is 'kv_producer'.*'kv_both'"):
        KvoOffloadMetricsConnector(_metrics_connector_config("kv_producer", {}),
                                   KVConnectorRole.WORKER, None)
    with pytest.raises(ConfigError, match=r"\['store_url'\].*\['stats_file'\]"):
        KvoOffloadMetricsConnector(_metrics_connector_config("kv_both", {"store_url": "x"}),
                                   KVConnectorRole.WORKER, None)
    with pytest.raises(ConfigError, match="stats_file is ''"):
        KvoOffloadMetricsConnector(_metrics_connector_config("kv_both", {"stats_file": ""}),
                                   KVConnectorRole.WORKER, None)
    connector = KvoOffloadMetricsConnector(_metrics_connector_config("kv_both", {}),
                                           KVConnectorRole.SCHEDULER, None)
    assert connector.get_num_new_matched_tokens(None, 0) == (0, False)  # type: ignore[arg-type]


def test_every_connector_class_builds_its_own_series() -> None:
    """vLLM calls these two hooks on the connector class named in kv_transfer_config."""
    from kvo_vllm.connectors import (
        KvoMultiConnector,
        KvoOffloadMetricsConnector,
        LayerwiseStoreConnector,
        RemoteD2HConnector,
    )

    expected = {
        LayerwiseStoreConnector: {*LAYERWISE_METRICS, *SPARSE_OFFLOAD_METRICS},
        RemoteD2HConnector: {name for name in METRICS if name.startswith("remote_d2h_")}
        | set(SPARSE_OFFLOAD_METRICS),
        KvoMultiConnector: set(METRICS),
        KvoOffloadMetricsConnector: set(SPARSE_OFFLOAD_METRICS),
    }
    for cls, names in expected.items():
        registry = CollectorRegistry()
        metric_types = {Counter: _on(registry, Counter), Gauge: _on(registry, Gauge),
                        Histogram: _on(registry, Histogram)}
        prom = cls.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), metric_types,
                                      ["engine"], {0: ["0"]})
        assert set(prom.series) == names, cls.__name__
        stats = cls.build_kv_connector_stats({"counters": {"sparse_offload_hits": 2}})
        assert type(stats) is KvoConnectorStats and stats.reduce()["sparse_offload_hits"] == 2
