"""kvo's connector metrics: deltas of cumulative counters, the stats payload vLLM carries, and
the Prometheus series built from it (on a private registry, with vLLM's own base classes)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvo_core.errors import ConfigError
from kvo_vllm.layerwise.worker_side import LayerwiseStats
from kvo_vllm.metrics import (
    LAYERWISE_METRICS,
    METRICS,
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
                                         "1": {"reads": 1, "bytes": 512, "seconds": 0.02}}}}
    counters = remote_d2h_counters(snapshot)
    assert counters["remote_d2h_pulled_bytes"] == 1536
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
