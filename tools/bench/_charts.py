"""PNG charts of the benchmarks' JSON results (matplotlib, Agg backend: no display needed).

Each ``*_figure`` function takes the data a benchmark wrote and returns a matplotlib Figure with
a title, axis labels that carry units, and a legend; ``save`` writes it as PNG. The figures are
built from plain dicts so a test can render each one from a small fixture, and so that
``python tools/bench/_charts.py RESULT.json`` can chart a result written earlier.

Charted, by benchmark name (the ``benchmark`` key or the file's stem):
- residency_capacity: hit rate and LRU/Belady misses vs hot capacity (1x..4x top-k);
- residency: kvo's native op vs vllm-ascend's host LRU, time per layer-step, per shape;
- e2e: TTFT and decode tokens/s, plain vs P/D, per prompt length;
- pull latency per layer (the demo's and e2e's per-layer read statistics).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: never look for a display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

Record = Mapping[str, Any]


def save(figure: Figure, path: Path) -> Path:
    """Write ``figure`` as PNG at ``path`` (parents created) and release its memory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def residency_capacity_figure(result: Record) -> Figure:
    """Hit rate (left) and misses per step, LRU vs Belady (right), against hot capacity."""
    rows = sorted(result["results"], key=lambda r: r["capacity"])
    top_k = result["top_k"]
    multiples = [r["capacity"] / top_k for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(multiples, [100 * r["lru_hit_rate"] for r in rows], "o-", label="LRU (kvo)")
    left.plot(multiples, [100 * r["belady_hit_rate"] for r in rows], "s--",
              label="Belady (optimal)")
    left.set_xlabel(f"hot capacity (x top-k = {top_k} tokens)")
    left.set_ylabel("hit rate (%)")
    left.set_title("Hit rate vs hot capacity")
    left.legend()
    right.plot(multiples, [r["lru_misses_per_step"] for r in rows], "o-", label="LRU (kvo)")
    right.plot(multiples, [r["belady_misses_per_step"] for r in rows], "s--",
               label="Belady (optimal)")
    right.set_xlabel(f"hot capacity (x top-k = {top_k} tokens)")
    right.set_ylabel("misses per layer-step (rows copied)")
    right.set_title("Misses vs hot capacity")
    right.legend()
    figure.suptitle(f"Residency on a recorded top-k trace ({result.get('trace_source', 'trace')})")
    return figure


def residency_speed_figure(result: Record) -> Figure:
    """kvo's native op vs upstream's host LRU (and the io floor), microseconds per shape."""
    rows = [r for r in result["results"] if r.get("native_us") is not None]
    labels = [f"R={r['rows']}\nC={r['capacity']}\n{r['seq_len'] // 1024}K" for r in rows]
    series = [("kvo native", "native_us"), ("upstream LRU", "upstream_us"),
              ("io floor", "io_floor_us")]
    present = [(name, key) for name, key in series if any(r.get(key) is not None for r in rows)]
    width = 0.8 / max(1, len(present))
    figure, axes = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    for i, (name, key) in enumerate(present):
        values = [r.get(key) or 0.0 for r in rows]
        axes.bar([x + i * width for x in range(len(rows))], values, width, label=name)
    axes.set_xticks([x + width * (len(present) - 1) / 2 for x in range(len(rows))], labels,
                    fontsize=7)
    axes.set_ylabel("time per layer-step (us, median)")
    axes.set_xlabel("shape (decode rows R, hot capacity C in slots, sequence length in tokens)")
    axes.set_title(f"Residency update, K={result.get('top_k')}: kvo vs upstream")
    axes.legend()
    return figure


def latency_figure(result: Record) -> Figure:
    """TTFT (left) and decode tokens/s (right) per prompt length for every measured flavour."""
    rows = sorted(result["rows"], key=lambda r: r["prompt_tokens"])
    lengths = [r["prompt_tokens"] for r in rows]
    flavours = sorted({key[len("ttft_"):-len("_s")] for r in rows for key in r
                       if key.startswith("ttft_") and key.endswith("_s")})
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for flavour in flavours:
        ttft = [1e3 * v if (v := r.get(f"ttft_{flavour}_s")) is not None else float("nan")
                for r in rows]
        tps = [v if (v := r.get(f"decode_tps_{flavour}")) is not None else float("nan")
               for r in rows]
        left.plot(lengths, ttft, "o-", label=flavour)
        right.plot(lengths, tps, "o-", label=flavour)
    left.set_xlabel("prompt length (tokens)")
    left.set_ylabel("time to first token (ms, median)")
    left.set_title("TTFT")
    left.legend()
    right.set_xlabel("prompt length (tokens)")
    right.set_ylabel("decode tokens/s (median)")
    right.set_title("Decode speed")
    right.legend()
    figure.suptitle(result.get("title", "Latency: plain vLLM vs P/D"))
    return figure


def pull_latency_figure(per_layer: Mapping[str, Mapping[str, Any]],
                        title: str = "Remote D2H pull latency per layer") -> Figure:
    """Per layer: the distribution of read times when samples exist, else the mean per read.

    ``per_layer`` maps a layer index to ``{"reads", "bytes", "seconds"}`` and optionally
    ``"samples_ms"`` (one entry per read).
    """
    layers = sorted(per_layer, key=int)
    figure, axes = plt.subplots(figsize=(max(6, 0.5 * len(layers) + 2), 4))
    samples = [list(per_layer[layer].get("samples_ms") or []) for layer in layers]
    if all(samples):
        axes.boxplot(samples, tick_labels=layers)
        axes.plot([], [], " ", label="box: quartiles, whiskers: 1.5 IQR")
    else:
        means = [1e3 * per_layer[layer]["seconds"] / max(1, per_layer[layer]["reads"])
                 for layer in layers]
        axes.bar(layers, means, label="mean per read")
    axes.set_xlabel("layer (index)")
    axes.set_ylabel("pull time per read (ms)")
    axes.set_title(title)
    axes.legend()
    return figure


def demo_summary_figure(report: Record) -> Figure:
    """The demo's one-page summary: TTFT per request, bytes per path (the pull split into main
    KV and indexer), per-layer pull time, prefill device KV with and without buffer reuse,
    decode device KV with and without offload, and bytes host -> device against a reload."""
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    ttft, moved, pulls, footprint, decode_kv, h2d = axes.flat
    requests = report["requests"]
    lengths = [r["prompt_tokens"] for r in requests]
    for flavour in ("plain", "pd"):
        ttft.plot(lengths, [1e3 * v if (v := r.get(f"ttft_{flavour}_s")) is not None
                            else float("nan") for r in requests], "o", label=flavour)
    ttft.set_xlabel("prompt length (tokens)")
    ttft.set_ylabel("time to first token (ms)")
    ttft.set_title("TTFT per request")
    ttft.legend()
    paths = dict(report["bytes_moved"])
    parts = report.get("pulled_per_part") or {}
    names = list(paths)
    moved.bar(names, [v / (1 << 20) for v in paths.values()], label="bytes moved")
    if parts:
        pull = next(name for name in names if "pull" in name)
        main = parts.get("main", 0) / (1 << 20)
        moved.bar([pull], [main], label="of it: main KV", color="tab:orange")
        moved.bar([pull], [parts.get("indexer", 0) / (1 << 20)], bottom=[main],
                  label="of it: indexer", color="tab:green")
    moved.set_ylabel("data moved (MiB)")
    moved.set_xlabel("path (source -> destination)")
    moved.tick_params(axis="x", labelsize=7)
    moved.set_title("Bytes per path")
    moved.legend()
    per_layer = report.get("per_layer_pull") or {}
    layers = sorted(per_layer, key=int)
    pulls.bar(layers, [1e3 * per_layer[k]["seconds"] / max(1, per_layer[k]["reads"])
                       for k in layers], label="mean per read")
    pulls.set_xlabel("layer (index)")
    pulls.set_ylabel("pull time per read (ms)")
    pulls.set_title("Remote D2H pull per layer")
    pulls.legend()
    kv = report["prefill_device_kv"]
    footprint.bar(["without reuse", "with reuse"],
                  [kv["logical_bytes"] / (1 << 20), kv["physical_bytes"] / (1 << 20)],
                  label="prefill device KV")
    footprint.set_xlabel("prefill layer buffers (configuration)")
    footprint.set_ylabel("device KV (MiB)")
    footprint.set_title("Prefill device KV")
    footprint.legend()
    dkv = report["decode_device_kv"]
    decode_kv.bar(["without offload", "with offload"],
                  [dkv["without_offload"] / (1 << 20), dkv["with_offload"] / (1 << 20)],
                  label="decode device KV (main + indexer)")
    decode_kv.set_xlabel("decode main KV (configuration)")
    decode_kv.set_ylabel("device KV (MiB)")
    decode_kv.set_title("Decode device KV")
    decode_kv.legend()
    offload = report["sparse_offload"]
    rate = offload.get("hit_rate")
    h2d.bar(["full reload", "kvo offload"],
            [offload["full_reload_bytes"] / (1 << 20), offload["h2d_bytes"] / (1 << 20)],
            label="host -> device")
    h2d.set_xlabel("decode step copies (strategy)")
    h2d.set_ylabel("bytes host -> device (MiB)")
    h2d.set_title("Decode H2D" + ("" if rate is None else f" (hit rate {rate:.1%})"))
    h2d.legend()
    figure.suptitle(report.get("title", "kvo P/D demo"))
    figure.tight_layout()
    return figure


CHARTS: dict[str, Callable[[Record], Figure]] = {
    "residency_capacity": residency_capacity_figure,
    "residency": residency_speed_figure,
    "e2e": latency_figure,
}


def chart_result(path: Path) -> list[Path]:
    """Write the PNG chart(s) of one benchmark JSON beside it; returns the paths written."""
    result = json.loads(path.read_text())
    name = result.get("benchmark", path.stem)
    written = []
    chart = CHARTS.get(name)
    if chart is not None:
        written.append(save(chart(result), path.with_suffix(".png")))
    if name == "e2e" and result.get("dsa"):  # the DSA model's rows beside the Llama's
        written.append(save(latency_figure(result["dsa"]), path.with_name(f"{path.stem}-dsa.png")))
    per_layer = result.get("per_layer_pull")
    if per_layer:
        written.append(save(pull_latency_figure(per_layer),
                            path.with_name(f"{path.stem}-pull.png")))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python tools/bench/_charts.py RESULT.json [...]", file=sys.stderr)
        return 2
    for path in paths:
        for written in chart_result(path):
            print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
