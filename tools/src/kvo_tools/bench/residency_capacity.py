"""Residency quality against hot capacity on a top-k trace a model really produced.

The tiny DeepSeek-V3.2-style model of ``kvo_tools.models.tiny_dsa`` (MLA latent KV, lightning
indexer, top-k sparse attention; random weights, fixed seed) prefills a prompt and decodes
greedily; every decode step's indexer top-k of every layer is recorded (the trace is written
beside the JSON, so a run can be replayed: ``--trace PATH``). The trace is then replayed through
kvo-core's residency table at hot capacities of 1x..4x top-k, each layer one decode row: first
step a first offload, then steady steps. Reported per capacity, over the steady steps: LRU hit
rate and misses per layer-step against Belady's optimum (the fewest misses any policy could get).
A table to stdout, JSON and a PNG chart beside it.

    python -m kvo_tools.bench.residency_capacity --json PATH [--quick] [--trace PATH]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvo_core.residency import RequestState, ResidencyTable, belady_min_misses
from kvo_tools.bench._charts import residency_capacity_figure, save
from kvo_tools.models.tiny_dsa import ResidentBackend, TinyDSA, TinyDSAConfig

MULTIPLES = (1, 2, 3, 4)


def record_trace(prompt_len: int, steps: int, seed: int) -> dict[str, Any]:
    """Greedy decode of one random prompt; per layer, every step's top-k positions."""
    config = TinyDSAConfig(seed=seed)
    model = TinyDSA(config)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist()
    history, token = model.prefill(prompt)
    backend = ResidentBackend(config, max_tokens=prompt_len + steps + 1)
    backend.admit(0, history)
    layers: list[list[list[int]]] = [[] for _ in range(config.num_layers)]
    for step in range(steps):
        token = model.decode_step(backend, [0], [token], [prompt_len + step])[0]
        for layer in range(config.num_layers):
            layers[layer].append(backend.selected[(0, layer)].tolist())
    return {"source": f"tiny_dsa seed {seed}, {prompt_len}-token prompt, {steps} greedy steps",
            "top_k": config.top_k, "layers": layers}


def replay(layer_trace: Sequence[Sequence[int]], capacity: int, max_seq_len: int) -> int:
    """LRU misses of one layer's trace over the steady steps (the first step is the offload)."""
    table = ResidencyTable(1, capacity, max_seq_len=max_seq_len)
    request = torch.zeros(1, dtype=torch.int64)
    stable = torch.full((1,), max_seq_len, dtype=torch.int64)
    misses = 0
    for step, selected in enumerate(layer_trace):
        state = RequestState.FIRST_OFFLOAD if step == 0 else RequestState.STEADY
        result = table.update(torch.tensor([selected], dtype=torch.int64), request, stable,
                              torch.full((1,), int(state), dtype=torch.int64))
        if step:
            misses += int(result.miss_counts.sum())
    return misses


def measure(trace: dict[str, Any]) -> list[dict[str, Any]]:
    top_k, layers = trace["top_k"], trace["layers"]
    max_seq_len = 1 + max(t for layer in layers for step in layer for t in step)
    steady_steps = sum(len(layer) - 1 for layer in layers)
    selected = sum(len({t for t in step if t >= 0}) for layer in layers for step in layer[1:])
    first = sum(len({t for t in layer[0] if t >= 0}) for layer in layers)
    records = []
    for multiple in MULTIPLES:
        capacity = multiple * top_k
        lru = sum(replay(layer, capacity, max_seq_len) for layer in layers)
        optimum = sum(belady_min_misses(layer, capacity) for layer in layers) - first
        records.append(dict(
            capacity=capacity, multiple=multiple, steady_layer_steps=steady_steps,
            lru_misses=lru, belady_misses=optimum,
            lru_misses_per_step=lru / steady_steps, belady_misses_per_step=optimum / steady_steps,
            lru_hit_rate=1 - lru / selected, belady_hit_rate=1 - optimum / selected,
            lru_over_belady=lru / optimum if optimum else float("nan")))
    return records


def table_text(trace: dict[str, Any], records: Sequence[dict[str, Any]]) -> str:
    head = (f"{'capacity':>8} {'x top-k':>7} {'LRU hit':>8} {'OPT hit':>8} {'LRU miss':>9} "
            f"{'OPT miss':>9} {'LRU/OPT':>8}")
    lines = [f"residency vs hot capacity on a recorded trace: {trace['source']}, top-k "
             f"{trace['top_k']}, {len(trace['layers'])} layers; misses per layer-step over the "
             f"steady steps (the first offload excluded)", head, "-" * len(head)]
    for r in records:
        lines.append(f"{r['capacity']:>8} {r['multiple']:>6}x {r['lru_hit_rate']:8.3f} "
                     f"{r['belady_hit_rate']:8.3f} {r['lru_misses_per_step']:9.2f} "
                     f"{r['belady_misses_per_step']:9.2f} {r['lru_over_belady']:8.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="a short trace (seconds)")
    parser.add_argument("--trace", type=Path, help="replay this recorded trace instead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.trace:
        trace = json.loads(args.trace.read_text())
    else:
        prompt_len, steps = (256, 24) if args.quick else (1024, 128)
        trace = record_trace(prompt_len, steps, args.seed)
    records = measure(trace)
    print(table_text(trace, records))
    result = dict(benchmark="residency_capacity", top_k=trace["top_k"],
                  trace_source=trace["source"], results=records)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    if not args.trace:
        trace_path = args.json.with_name(f"{args.json.stem}-trace.json")
        trace_path.write_text(json.dumps(trace))
        print(f"wrote {trace_path}")
    chart = save(residency_capacity_figure(result), args.json.with_suffix(".png"))
    print(f"wrote {args.json} and {chart}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
