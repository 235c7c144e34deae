"""Benchmark: the P/D pair with kvo against one plain vLLM, through the OpenAI API.

Starts (in a loopback-only network namespace; Mooncake needs it) a plain vLLM API server and
the P/D deployment: a prefill with ``KvoMultiConnector`` (8 layers in 3 reused buffers, every
layer saved to the Mooncake store and published to decode), a decode with
``RemoteD2HConnector`` and the kvo proxy. For each prompt length the two take turns on the
same fresh prompts (alternating who goes first, so a busy machine slows both alike); each
request streams, so the time to the first token (TTFT) and the decode rate are measured at the
client. Also reported: the prefill's device KV footprint with and without buffer reuse, bytes
pulled per request and the per-layer pull time.

Layerwise offload against no offload on a single prefill engine (the 10% TTFT target at 4K
tokens) is measured by ``tools/bench/e2e_layerwise.py``.

    python tools/bench/e2e.py --quick --json /tmp/e2e.json     (re-runs itself under unshare)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TOOLS))

from pd.client import Answer, complete, completion_body  # noqa: E402
from pd.cluster import (  # noqa: E402
    Cluster,
    ClusterError,
    decode_transfer_config,
    free_port,
    prefill_transfer_config,
    reexec_in_namespace,
    start_master,
    stopping_on_signals,
    wait_healthy,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true",
                        help="short run: 1K-token prompts, two pairs, 16 new tokens")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in tokens")
    parser.add_argument("--reps", type=int, help="timed prompt pairs per length")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--workdir", type=Path, help="logs and counters (default: a temp dir)")
    args = parser.parse_args(argv)
    args.lengths = args.lengths or ([1024] if args.quick else [1024, 4096])
    args.reps = args.reps or (2 if args.quick else 4)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    if any(not 40 <= n <= 8000 for n in args.lengths):
        parser.error(f"--lengths must be between 40 and 8000 tokens, got {args.lengths}")
    if args.reps < 1 or args.max_tokens < 2:
        parser.error("--reps must be >= 1 and --max-tokens >= 2")
    return args


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(plain_url: str, proxy_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)

    def fresh(length: int) -> list[int]:
        return [rng.randrange(256) for _ in range(length)]

    rows = []
    for length in args.lengths:
        for url in (plain_url, proxy_url):  # one untimed request per length and path
            complete(url, completion_body(fresh(length), 2, stream=True))
        answers: dict[str, list[Answer]] = {"plain": [], "pd": []}
        for rep in range(args.reps):
            body = completion_body(fresh(length), args.max_tokens, stream=True)
            order = [("plain", plain_url), ("pd", proxy_url)]
            if rep % 2:
                order.reverse()
            for name, url in order:
                answer = complete(url, body)
                if not answer.ok:
                    raise RuntimeError(f"{name} request of {length} tokens failed: "
                                       f"{answer.error}")
                answers[name].append(answer)
            plain, pd = answers["plain"][-1], answers["pd"][-1]
            print(f"  {length} tokens, pair {rep + 1}/{args.reps}: TTFT plain "
                  f"{plain.ttft_s:.3f} s, P/D {pd.ttft_s:.3f} s; same tokens: "
                  f"{plain.token_ids == pd.token_ids}", flush=True)
        row: dict[str, Any] = {"prompt_tokens": length, "new_tokens": args.max_tokens}
        for name, got in answers.items():
            row[f"ttft_{name}_s"] = _median([a.ttft_s for a in got if a.ttft_s is not None])
            row[f"decode_tps_{name}"] = _median([t for a in got
                                                 if (t := a.decode_tokens_per_s) is not None])
        row["same_tokens"] = all(p.token_ids == d.token_ids
                                 for p, d in zip(answers["plain"], answers["pd"], strict=True))
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from models.tiny_llama import build_tiny_llama

    from kvo_vllm.remote_d2h.stats_file import read_stats

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvo-bench-e2e-"))
    model = build_tiny_llama(Path(os.environ.get("KVO_MODEL_DIR", tempfile.gettempdir()))
                             / "kvo-tiny-llama-8", num_layers=8)
    max_len = max(args.lengths) + args.max_tokens + 64
    master = start_master()
    try:
        with Cluster(workdir) as cluster:
            kv_port = free_port()
            prefill_stats, decode_stats = workdir / "prefill.json", workdir / "decode.json"
            plain = cluster.start_vllm("plain", model, free_port(), max_model_len=max_len)
            prefill = cluster.start_vllm(
                "prefill", model, free_port(),
                prefill_transfer_config(master.address, kv_port, prefill_stats),
                max_model_len=max_len)
            decode = cluster.start_vllm("decode", model, free_port(),
                                        decode_transfer_config(kv_port, decode_stats),
                                        max_model_len=max_len)
            proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
            print(f"starting plain, prefill, decode and the proxy (logs in {workdir}) ...",
                  flush=True)
            wait_healthy([plain, prefill, decode, proxy], 900,
                         lambda note: print(f"  {note}", flush=True))
            rows = measure(plain.url or "", proxy.url or "", args)
            time.sleep(1.0)
            prefill_report, decode_report = read_stats(prefill_stats), read_stats(decode_stats)
    finally:
        master.stop()
    layout = prefill_report.get("layout", {})
    puller = decode_report.get("decode", {})
    per_layer = puller.get("per_layer", {})
    reads = sum(v["reads"] for v in per_layer.values())
    return {
        "rows": rows,
        "prefill_kv_physical_bytes": layout.get("physical_bytes"),
        "prefill_kv_logical_bytes": layout.get("logical_bytes"),
        "prefill_kv_footprint_ratio": (layout["physical_bytes"] / layout["logical_bytes"]
                                       if layout else None),
        "requests_pulled": puller.get("received"),
        "pull_failures": puller.get("failed"),
        "pulled_bytes": sum(v["bytes"] for v in per_layer.values()),
        "pull_ms_per_layer_read": (1e3 * sum(v["seconds"] for v in per_layer.values()) / reads
                                   if reads else None),
        "store_saved_bytes": prefill_report.get("layerwise", {}).get("saved_bytes"),
    }


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def print_table(result: dict[str, Any]) -> None:
    print("\nP/D with kvo vs one plain vLLM (CPU, tiny 8-layer Llama, streamed, medians)")
    print(f"{'prompt':>7} {'TTFT plain':>11} {'TTFT P/D':>9} {'ratio':>6} "
          f"{'tok/s plain':>12} {'tok/s P/D':>10} {'same tokens':>12}")
    for row in result["rows"]:
        plain, pd = row["ttft_plain_s"], row["ttft_pd_s"]
        ratio = pd / plain if plain and pd else None
        print(f"{row['prompt_tokens']:>7} {_fmt(plain, 1e3):>8} ms {_fmt(pd, 1e3):>6} ms "
              f"{_fmt(ratio, 1, 2):>6} {_fmt(row['decode_tps_plain']):>12} "
              f"{_fmt(row['decode_tps_pd']):>10} {row['same_tokens']!s:>12}")
    ratio = result["prefill_kv_footprint_ratio"]
    print(f"prefill device KV footprint ratio (reuse / none): {_fmt(ratio, 1, 3)}; "
          f"pulled {result['pulled_bytes'] / (1 << 20):.1f} MiB in "
          f"{result['requests_pulled']} requests, {_fmt(result['pull_ms_per_layer_read'], 1, 2)}"
          f" ms per layer read, {result['pull_failures']} failures")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        reexec_in_namespace([os.path.abspath(__file__), *(argv if argv is not None
                                                          else sys.argv[1:])])
    except ClusterError as error:
        print(f"e2e benchmark: {error}", file=sys.stderr)
        return 2
    with stopping_on_signals():
        result = run(args)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
