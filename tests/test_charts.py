"""Every benchmark chart renders from a small fixture: a title, axes with units, a legend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import _charts  # noqa: E402
import residency_capacity  # noqa: E402

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
