"""Every benchmark chart renders from a small fixture: a title, axes with units, a legend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvo_tools.bench import _charts, residency_capacity

BENCH = Path(_charts.__file__).resolve().parent

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

RESIDENCY = {"benchmark": "residency", "top_k": 2048, "results": [
    {"rows": r, "capacity": c, "seq_len": 32768, "native_us": 40.0 * r, "upstream_us": 45.0 * r,
     "io_floor_us": 10.0 * r} for r in (1, 8) for c in (4096, 8192)]}
E2E = {"rows": [
    {"prompt_tokens": n, "ttft_plain_s": 0.05 * n / 256, "ttft_pd_s": 0.07 * n / 256,
     "ttft_peer_s": 0.08 * n / 256, "decode_tps_plain": 100.0, "decode_tps_pd": 95.0,
     "decode_tps_peer": 90.0} for n in (256, 1024)],
    "per_layer_pull": {"0": {"reads": 4, "bytes": 4096, "seconds": 0.004},
                       "1": {"reads": 4, "bytes": 4096, "seconds": 0.008}}}
DEMO = {"requests": [{"prompt_tokens": n, "ttft_plain_s": 0.05, "ttft_pd_s": 0.08}
                     for n in (40, 200, 1500)],
        "bytes_moved": {"prefill -> decode (pull)": 3 << 20, "prefill -> store (saves)": 5 << 20,
                        "store -> prefill (loads)": 1 << 20},
        "per_layer_pull": E2E["per_layer_pull"],
        "prefill_device_kv": {"physical_bytes": 3 << 20, "logical_bytes": 8 << 20},
        "pulled_per_part": {"main": (3 << 20) * 9 // 10, "indexer": (3 << 20) // 10, "scale": 0},
        "decode_device_kv": {"with_offload": 1 << 20, "without_offload": 6 << 20},
        "sparse_offload": {"h2d_bytes": 1 << 20, "full_reload_bytes": 30 << 20,
                           "hit_rate": 0.3}}
CAPACITY = {"benchmark": "residency_capacity", "top_k": 4, "trace_source": "fixture",
            "results": residency_capacity.measure({"top_k": 4, "source": "fixture", "layers": [
                [[0, 1, 2, 3], [0, 1, 4, 5], [2, 3, 6, 7], [0, 1, 2, 3], [4, 5, 6, 8]]]})}


# Small samples of the JSON each benchmark writes (the keys the benchmarks' code writes).
SPARSE_VLLM = {"benchmark": "sparse_vllm", "rows": [
    {"context": c, "batch": b, "resident_step_ms": 10.0 * b, "offload_step_ms": 11.0 * b,
     "step_ratio": 1.1, "resident_device_kv_mib": c * b / 100, "offload_device_kv_mib": 2.0 * b,
     "h2d_mib_per_step": 0.01, "full_reload_mib_per_step": c * b / 1000, "hit_rate": 0.9,
     "identical": True} for c in (128, 1024) for b in (1, 4)]}
SPARSE_VLLM_PREFIX = {"benchmark": "sparse_vllm_prefix", "rows": [
    {"mode": m, "prefix_caching": c, "prefix_tokens": 2048, "suffix_tokens": 64, "requests": 8,
     "cold_ttft_ms": 900.0, "ttft_ms_median": 80.0 if c else 900.0,
     "hit_tokens_per_request": 2048 if c else 0, "first_request_hit_tokens": 0,
     "same_tokens_as_cache_off": True} for m in ("resident", "offload") for c in (False, True)]}
SPARSE_BUDGET = {"benchmark": "sparse_budget", "offload_speedup": 1.05, "same_tokens": True,
                 "rows": [{"mode": m, "wall_s": 10.0, "budget_mib": 8.0, "device_kv_mib": kv,
                           "output_tokens_per_s": tps, "preemptions": p, "most_running": r,
                           "blocks": 100} for m, kv, tps, p, r in
                          (("resident", 7.9, 190.0, 3, 4), ("offload", 6.0, 200.0, 0, 16))]}
E2E_LAYERWISE = {"benchmark": "e2e_layerwise", "target_overhead_pct": 10.0, "results": [
    {"prompt_tokens": n, "ttft_plain_s": 0.02 * n / 1024, "ttft_layerwise_s": 0.021 * n / 1024,
     "ttft_peer_s": 0.023 * n / 1024, "overhead_pct": 5.0, "peer_overhead_pct": 15.0,
     "kvo_over_peer": 0.9} for n in (1024, 4096)]}
CONNECTOR_COST = {"benchmark": "connector_cost", "kvo_plans": ["kvo", "kvo-own"], "results": [
    {"prompt_tokens": n, **{name: {
        "ttft_with_s": 0.021, "ttft_without_s": 0.020, "cost_s": cost,
        "hook_s": {"lookup": 1e-4, "start_load_kv": 2e-5, "per_layer": 5e-4,
                   "wait_for_save": 1e-4, "other": 5e-5, "copy": 2e-4, "total": 7.7e-4,
                   "total_less_copy": 5.7e-4}}
        for name, cost in (("kvo", 4e-4), ("kvo-own", 3e-4), ("peer", 9e-4))}}
    for n in (1024, 4096)]}
KERNELS = {"benchmark": "kernels", "top_k": 2048, "results": [
    {"tokens": n, "device": "cpu", "implementation": "reference", "reps": 1,
     "times_ms": {"lightning_indexer_manage": 3.0, "copy_sfa": 2.0, "sparse_copy": 0.5}}
    for n in (32768, 131072)]}
TRANSPORT = {"pull": [{"scenario": s, "raw_gbps": 2.5, "kvo_gbps": 2.4, "memcpy_gbps": 20.0,
                       "same_host_gbps": 15.0} for s in ("64x16KiB", "8x1MiB")],
             "control_roundtrip": {f"{m}_{q}_us": v for m in ("kvo_pump", "kvo_pump_auth",
                                                              "kvo_io_thread", "raw_zmq")
                                   for q, v in (("p50", 120.0), ("p99", 300.0), ("min", 80.0))}}
STORE_OUTAGE = {"store_outage": [
    {"variant": v, "get_s": 0.1, "put_s": 0.1, "exists_s": 0.1, "remove_s": 0.1,
     "first_call_s": 0.5, "close_s": 0.2} for v in ("bare", "kvo_probe", "kvo_no_probe")]}
FRAME_AUTH = {"frame_auth": [
    {"frame": f, "payload_bytes": b, "seal_us": 2.0, "open_us": 2.5, "mac_total_us": 4.5,
     "encode_decode_us": 5.0, "mac_over_codec": 0.9} for f, b in (("READY small", 120),
                                                                  ("READY 1K blocks", 9000))]}
SAMPLES = {"sparse_vllm": SPARSE_VLLM, "sparse_vllm_prefix": SPARSE_VLLM_PREFIX,
           "sparse_budget": SPARSE_BUDGET,
           "e2e_layerwise": E2E_LAYERWISE, "connector_cost": CONNECTOR_COST,
           "kernels": KERNELS, "transport": TRANSPORT,
           "store_outage": STORE_OUTAGE, "frame_auth": FRAME_AUTH, "residency": RESIDENCY,
           "residency_capacity": CAPACITY, "e2e": E2E}


def _labelled(figure: object) -> None:
    for axes in figure.axes:  # type: ignore[attr-defined]
        assert axes.get_title(), "every panel has a title"
        for label in (axes.get_xlabel(), axes.get_ylabel()):
            assert "(" in label and ")" in label, f"axis label {label!r} names no unit"
        assert axes.get_legend() is not None, "every panel has a legend"


@pytest.mark.parametrize("build, data", [
    (_charts.residency_capacity_figure, CAPACITY),
    (_charts.residency_speed_figure, RESIDENCY),
    (_charts.latency_figure, E2E),
    (_charts.demo_summary_figure, DEMO),
    (lambda d: _charts.pull_latency_figure(d["per_layer_pull"]), E2E),
    (lambda d: _charts.pull_latency_figure({k: {**v, "samples_ms": [1.0, 2.0, 1.5]}
                                            for k, v in d["per_layer_pull"].items()}), E2E),
    (_charts.sparse_vllm_figure, SPARSE_VLLM),
    (_charts.sparse_vllm_prefix_figure, SPARSE_VLLM_PREFIX),
    (_charts.sparse_budget_figure, SPARSE_BUDGET),
    (_charts.e2e_layerwise_figure, E2E_LAYERWISE),
    (_charts.e2e_layerwise_figure, {**E2E_LAYERWISE, "results": [  # run with --no-peer
        {k: v for k, v in r.items() if "peer" not in k} for r in E2E_LAYERWISE["results"]]}),
    (_charts.connector_cost_figure, CONNECTOR_COST),
    (_charts.kernels_figure, KERNELS),
    (_charts.transport_figure, TRANSPORT),
    (_charts.transport_figure, {**TRANSPORT, "control_roundtrip": None}),
    (_charts.store_outage_figure, STORE_OUTAGE),
    (_charts.frame_auth_figure, FRAME_AUTH),
])
def test_each_chart_renders_labelled(build, data, tmp_path: Path) -> None:
    figure = build(data)
    _labelled(figure)
    path = _charts.save(figure, tmp_path / "chart.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_latency_chart_draws_every_flavour() -> None:
    figure = _charts.latency_figure(E2E)
    labels = {text.get_text() for text in figure.axes[0].get_legend().get_texts()}
    assert labels == {"plain", "pd", "peer"}


def test_chart_result_writes_pngs_beside_the_json(tmp_path: Path) -> None:
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(E2E))
    written = _charts.chart_result(path)
    assert [p.name for p in written] == ["e2e.png", "e2e-pull.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written)


def test_chart_result_draws_the_dsa_model_beside_the_llama(tmp_path: Path) -> None:
    path = tmp_path / "e2e.json"
    dsa = {"model": "dsa", "rows": [{k: v for k, v in row.items() if "peer" not in k}
                                    for row in E2E["rows"]]}
    path.write_text(json.dumps({**E2E, "dsa": dsa}))
    written = _charts.chart_result(path)
    assert [p.name for p in written] == ["e2e.png", "e2e-dsa.png", "e2e-pull.png"]
    figure = _charts.latency_figure(dsa)
    labels = {text.get_text() for text in figure.axes[0].get_legend().get_texts()}
    assert labels == {"plain", "pd"}


def test_capacity_replay_counts_lru_and_optimal_misses() -> None:
    by_capacity = {r["capacity"]: r for r in CAPACITY["results"]}
    # Capacity 16 holds every token of the fixture: only first sightings miss.
    assert by_capacity[16]["lru_misses"] == by_capacity[16]["belady_misses"] == 5
    # At capacity == top-k every step replaces what is not selected again.
    assert by_capacity[4]["lru_misses"] == 2 + 4 + 2 + 4
    assert all(r["lru_misses"] >= r["belady_misses"] for r in CAPACITY["results"])


def test_every_benchmark_has_a_chart_and_a_sample_here() -> None:
    """A benchmark added under kvo_tools/bench without a chart (or without a sample JSON in this
    file) fails here; nox's bench session charts every result with ``kvo_tools.bench._charts``."""
    benchmarks = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")}
    assert benchmarks <= set(_charts.CHARTS), benchmarks - set(_charts.CHARTS)
    assert benchmarks <= set(SAMPLES), benchmarks - set(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_benchmark_json_gets_a_png_beside_it(name: str, tmp_path: Path) -> None:
    """What nox runs after each benchmark:
    ``python -m kvo_tools.bench._charts bench-results/<name>.json``."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(SAMPLES[name]))
    assert _charts.main([str(path)]) == 0
    png = tmp_path / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
