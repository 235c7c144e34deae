"""Benchmark: the P/D pair with kvo against vLLM's own Mooncake P/D pair and one plain vLLM.

Starts (in a loopback-only network namespace; Mooncake needs it) a plain vLLM API server, the
kvo P/D deployment: a prefill with ``KvoMultiConnector`` (8 layers in 3 reused buffers, every
layer saved to the Mooncake store and published to decode), a decode with
``RemoteD2HConnector`` and the kvo proxy; a second kvo pair whose prefill runs
``RemoteD2HConnector`` alone ("kvo-d2h": P/D only, nothing saved to a store, as the peer
does; ``--no-d2h`` leaves it out); and the peer a user would pick
instead: vLLM's own ``MooncakeConnector`` prefill/decode pair over Mooncake tcp with its
proxy (``pd/peer.py``;
``--no-peer`` leaves it out). For each prompt length the contenders take turns on the same fresh
prompts (the order rotates every round, so a busy machine slows all alike); each request
streams, so the time to the first token (TTFT) and the decode rate are measured at the client.
Reported per length: TTFT medians, the median of each round's paired ratio (P/D TTFT over
plain's in the same round, and kvo's over the peer's), decode tokens/s, and exactness (answers
whose tokens and logprobs are bit-equal to plain's answer for the same prompt on a warm prefix
cache, which, like a P/D decode, computes only the prompt's tail; the cold answer differs from
it in the last bits of its logprobs at 1024 and 4096 tokens, not at 128). Also: the prefill's
device KV footprint with and without buffer reuse, bytes pulled per request and the per-layer
pull time, and where kvo's TTFT goes as its proxy saw it.

``--model dsa`` runs the same P/D deployment on a tiny DeepSeek-V3.2-architecture model (MLA +
lightning indexer + top-k sparse attention, kvo's sparse backend): the decode runs kvo's sparse
offload mode (main KV pulled into its host pool), so the table adds the decode's device KV with
offload over what it would hold resident. vLLM's MooncakeConnector pair is not run for it (not
tried with DSA layouts on vLLM-CPU here). ``--model all`` (the default) runs both, one after the
other. ``--tp2`` (DSA only) adds a third kvo pair, "kvo-tp2": a prefill at TP 2 with
``RemoteD2HConnector`` alone feeding a decode at TP 2 in offload mode, whose TP ranks share one
host pool and pull disjoint parts of the main KV into it; its bytes pulled are reported per
decode rank. ``--kernel-backend fused`` (DSA only, not with ``--tp2``) runs the DSA decodes
with the fused ops (``kernel_backend="fused"``: their pool keeps latent and rope apart and the
pulled rows are split on arrival); their answers then differ from plain vLLM's in the last
bits of the logprobs (another summation order), so "exact" counts tokens and logprobs as usual
and is expected to fall.
``--mtp N`` (DSA only) gives the model one MTP layer and serves every engine (plain,
prefills, decodes) with ``speculative_config={"method": "mtp", "num_speculative_tokens": N}``:
the prefills hand the draft layer over like the others.

Layerwise offload against no offload on a single prefill engine (the 10% TTFT target at 4K
tokens) is measured by ``kvo_tools.bench.e2e_layerwise``.

    python -m kvo_tools.bench.e2e --quick --json /tmp/e2e.json     (re-runs itself under unshare)
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
import urllib.request
from pathlib import Path
from typing import Any

from kvo_tools.pd.client import Answer, complete, completion_body
from kvo_tools.pd.cluster import (
    Cluster,
    ClusterError,
    d2h_prefill_transfer_config,
    decode_transfer_config,
    free_port,
    prefill_transfer_config,
    reexec_in_namespace,
    start_master,
    stopping_on_signals,
    wait_healthy,
)
from kvo_tools.pd.peer import external_prefix_tokens, start_peer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true",
                        help="short run: 1K-token prompts, two pairs, 16 new tokens")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in tokens")
    parser.add_argument("--reps", type=int, help="timed prompt pairs per length")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--workdir", type=Path, help="logs and counters (default: a temp dir)")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="leave out vLLM's own MooncakeConnector pair")
    parser.add_argument("--no-d2h", dest="d2h", action="store_false",
                        help="leave out kvo's P/D-only prefill (RemoteD2HConnector alone)")
    parser.add_argument("--decode-first", action="store_true",
                        help="kvo's proxies wait for decode's advertisement before posting "
                             "prefill on every request (default: prefill and decode at once "
                             "once a decode's endpoints are known)")
    parser.add_argument("--tp2", action="store_true",
                        help="DSA model: add kvo's P/D pair with prefill TP 2 -> decode TP 2 "
                             "(offload mode, one host pool shared by the decode's TP ranks)")
    parser.add_argument("--mtp", type=int, default=0, metavar="N",
                        help="DSA model: MTP speculative decoding with N draft tokens on every "
                             "engine (0: off)")
    parser.add_argument("--model", choices=("llama", "dsa", "all"), default="all",
                        help="tiny 8-layer Llama, tiny DeepSeek-V3.2-architecture model, or "
                             "both (default)")
    parser.add_argument("--kernel-backend", choices=("auto", "fused"), default="auto",
                        help="DSA model: the decodes' kvo_sparse kernel_backend (default auto; "
                             "fused: the fused manage + Copy-SFA ops)")
    args = parser.parse_args(argv)
    if args.kernel_backend == "fused" and args.tp2:
        parser.error("--kernel-backend fused with --tp2: a fused decode at TP 2 is refused as "
                     "a P/D destination (not tested)")
    args.lengths = args.lengths or ([1024] if args.quick else [1024, 4096])
    args.reps = args.reps or (2 if args.quick else 4)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    if any(not 40 <= n <= 8000 for n in args.lengths):
        parser.error(f"--lengths must be between 40 and 8000 tokens, got {args.lengths}")
    if args.reps < 1 or args.max_tokens < 2:
        parser.error("--reps must be >= 1 and --max-tokens >= 2")
    if not 0 <= args.mtp <= 4 or (args.mtp and args.model != "dsa"):
        parser.error(f"--mtp takes 0 to 4 draft tokens and needs --model dsa, got --mtp "
                     f"{args.mtp} --model {args.model}")
    return args


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _paired_ratio(answers: dict[str, list[Answer]], top: str, bottom: str) -> float | None:
    """Median over rounds of top's TTFT / bottom's TTFT in the same round."""
    return _median([a.ttft_s / b.ttft_s for a, b in zip(answers[top], answers[bottom],
                                                          strict=True)
                    if a.ttft_s and b.ttft_s])


def _last_proxy_record(proxy_url: str) -> dict[str, Any]:
    """The kvo proxy's record of the request it served last (its phase times)."""
    with urllib.request.urlopen(proxy_url + "/kvo/v1/metadata", timeout=30) as reply:
        records = json.loads(reply.read())["requests"]
    return dict(records[-1]) if records else {}


def measure(urls: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rounds over ``urls`` ("plain" first, then the P/D contenders), order rotating per round."""
    rng = random.Random(0)

    def fresh(length: int) -> list[int]:
        return [rng.randrange(256) for _ in range(length)]

    names = list(urls)
    rows = []
    for length in args.lengths:
        for url in urls.values():  # one untimed request per length and path
            complete(url, completion_body(fresh(length), 2, stream=True))
        answers: dict[str, list[Answer]] = {name: [] for name in names}
        warm_answers: list[Answer] = []
        phases: dict[str, list[dict[str, Any]]] = {n: [] for n in KVO_CONTENDERS if n in urls}
        for rep in range(args.reps):
            body = completion_body(fresh(length), args.max_tokens, stream=True)
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                answer = complete(urls[name], body)
                if not answer.ok:
                    raise RuntimeError(f"{name} request of {length} tokens failed: "
                                       f"{answer.error}")
                answers[name].append(answer)
                if name in phases:
                    phases[name].append(_last_proxy_record(urls[name]))
            # The reference for exactness: plain's answer with the prompt in its prefix cache.
            # A P/D decode starts from the pulled prompt KV and computes only the prompt's
            # tail, as plain does on a warm cache; plain's cold answer (timed above) computes
            # the whole prompt in one prefill pass, whose attention sums in another order, so
            # at 1024 and 4096 tokens its logprobs differ in the last bits (tokens stay equal).
            warm = complete(urls["plain"], body)
            if not warm.ok:
                raise RuntimeError(f"plain warm request of {length} tokens failed: "
                                   f"{warm.error}")
            warm_answers.append(warm)
            plain = warm
            print(f"  {length} tokens, round {rep + 1}/{args.reps}: TTFT "
                  + ", ".join(f"{n} {answers[n][-1].ttft_s or float('nan'):.3f} s"
                              for n in names)
                  + "; bit-equal to plain (warm): "
                  + ", ".join(f"{n} {answers[n][-1].same_output(plain)}" for n in names[1:]),
                  flush=True)
        row: dict[str, Any] = {"prompt_tokens": length, "new_tokens": args.max_tokens,
                               "rounds": args.reps}
        for name, got in answers.items():
            row[f"ttft_{name}_s"] = _median([a.ttft_s for a in got if a.ttft_s is not None])
            row[f"decode_tps_{name}"] = _median([t for a in got
                                                 if (t := a.decode_tokens_per_s) is not None])
        cold = answers["plain"]
        row["plain_cold_equals_warm"] = sum(c.same_output(w)
                                            for c, w in zip(cold, warm_answers, strict=True))
        for name in names[1:]:
            row[f"ttft_ratio_{name}_to_plain"] = _paired_ratio(answers, name, "plain")
            got = answers[name]
            row[f"exact_{name}"] = sum(a.same_output(w)
                                       for a, w in zip(got, warm_answers, strict=True))
            row[f"exact_cold_{name}"] = sum(a.same_output(c)
                                            for a, c in zip(got, cold, strict=True))
            row[f"same_tokens_{name}"] = sum(a.token_ids == c.token_ids
                                             for a, c in zip(got, cold, strict=True))
        # Where kvo's TTFT goes, as the proxy saw it (seconds from the request's arrival).
        for name, seen in phases.items():
            for key in ("ready_s", "prefill_s", "first_byte_s"):
                row[f"{name}_proxy_{key}"] = _median([p[key] for p in seen
                                                      if p.get(key) is not None])
            row[f"{name}_concurrent_posts"] = sum(bool(p.get("concurrent")) for p in seen)
            if "peer" in answers:
                row[f"ttft_ratio_{name}_to_peer"] = _paired_ratio(answers, name, "peer")
        row["same_tokens"] = all(p.token_ids == d.token_ids
                                 for p, d in zip(answers["plain"], answers["pd"], strict=True))
        rows.append(row)
    return rows


KVO_CONTENDERS = ("pd", "pd_d2h", "pd_tp2")
"""kvo's proxies: the full prefill, the P/D-only one, the P/D-only one at TP 2 -> TP 2."""
TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per TP worker
DSA_BLOCK_SIZE = 64  # the DSA model's block size on vLLM-CPU
DSA_STEP_TOKENS = 512  # prefill chunk of every DSA engine (kvo's offload tests use the same)


def _model(kind: str, kernel_backend: str = "auto", mtp: int = 0
           ) -> tuple[Path, dict[str, Any], list[str]]:
    """The model, start_vllm's shape arguments and the decode's extra arguments; ``mtp`` > 0
    (DSA): one MTP layer, every engine drafting that many tokens."""
    base = Path(os.environ.get("KVO_MODEL_DIR", tempfile.gettempdir()))
    if kind == "llama":
        from kvo_tools.models.tiny_llama import build_tiny_llama

        return build_tiny_llama(base / "kvo-tiny-llama-8", num_layers=8), {}, []
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32

    model = build_tiny_dsv32(base / ("kvo-tiny-dsv32-8-mtp" if mtp else "kvo-tiny-dsv32-8"),
                             num_layers=8, index_topk=32, mtp=mtp > 0)
    # Requests go one at a time; a few sequences keep the offload host pool (sized for
    # max_num_seqs full-length requests) and its hot buffers small on a shared machine.
    shape = {"block_size": DSA_BLOCK_SIZE,
             "extra_args": ["--max-num-batched-tokens", str(DSA_STEP_TOKENS),
                            "--max-num-seqs", "4",
                            *(["--speculative-config", json.dumps(
                                {"method": "mtp", "num_speculative_tokens": mtp})]
                              if mtp else [])]}
    offload = ["--additional-config", json.dumps(
        {"kvo_sparse": {"mode": "offload", "kernel_backend": kernel_backend}})]
    return model, shape, offload


def run(args: argparse.Namespace, kind: str = "llama") -> dict[str, Any]:
    from kvo_vllm.remote_d2h.stats_file import rank_stats_path, read_stats

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvo-bench-e2e-"))
    workdir = workdir / kind
    workdir.mkdir(parents=True, exist_ok=True)
    model, shape, decode_args = _model(kind, args.kernel_backend, args.mtp)
    steps = list(shape.pop("extra_args", []))
    max_len = max(args.lengths) + args.max_tokens + 64
    with_peer = args.peer and kind == "llama"
    master = start_master()
    try:
        with Cluster(workdir) as cluster:
            kv_port = free_port()
            prefill_stats, decode_stats = workdir / "prefill.json", workdir / "decode.json"
            plain = cluster.start_vllm("plain", model, free_port(), max_model_len=max_len,
                                       extra_args=steps, **shape)
            prefill = cluster.start_vllm(
                "prefill", model, free_port(),
                prefill_transfer_config(master.address, kv_port, prefill_stats),
                max_model_len=max_len, extra_args=steps, **shape)
            decode = cluster.start_vllm("decode", model, free_port(),
                                        decode_transfer_config(kv_port, decode_stats),
                                        max_model_len=max_len,
                                        extra_args=[*steps, *decode_args], **shape)
            flow_args = ["--decode-first"] if args.decode_first else []
            proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "",
                                        extra_args=flow_args)
            servers = [plain, prefill, decode, proxy]
            urls = {"plain": plain.url or "", "pd": proxy.url or ""}
            if args.d2h:
                # Its own decode: a decode shared with the other kvo pair would find the same
                # prompt in its prefix cache on the second request of a round.
                kv_port_d2h = free_port()
                prefill_d2h = cluster.start_vllm(
                    "prefill-d2h", model, free_port(), d2h_prefill_transfer_config(kv_port_d2h),
                    max_model_len=max_len, extra_args=steps, **shape)
                decode_d2h = cluster.start_vllm(
                    "decode-d2h", model, free_port(), decode_transfer_config(kv_port_d2h),
                    max_model_len=max_len, extra_args=[*steps, *decode_args], **shape)
                proxy_d2h = cluster.start_proxy(free_port(), prefill_d2h.url or "",
                                                decode_d2h.url or "", extra_args=flow_args,
                                                name="proxy-d2h")
                servers += [prefill_d2h, decode_d2h, proxy_d2h]
                urls["pd_d2h"] = proxy_d2h.url or ""
            tp2_stats = workdir / "decode-tp2.json"
            if args.tp2 and kind == "dsa":
                kv_port_tp2 = free_port()
                prefill_tp2 = cluster.start_vllm(
                    "prefill-tp2", model, free_port(), d2h_prefill_transfer_config(kv_port_tp2),
                    max_model_len=max_len, extra_args=[*steps, *TP2], env=TP2_ENV, **shape)
                decode_tp2 = cluster.start_vllm(
                    "decode-tp2", model, free_port(),
                    decode_transfer_config(kv_port_tp2, tp2_stats), max_model_len=max_len,
                    extra_args=[*steps, *decode_args, *TP2], env=TP2_ENV, **shape)
                proxy_tp2 = cluster.start_proxy(free_port(), prefill_tp2.url or "",
                                                decode_tp2.url or "", extra_args=flow_args,
                                                name="proxy-tp2")
                servers += [prefill_tp2, decode_tp2, proxy_tp2]
                urls["pd_tp2"] = proxy_tp2.url or ""
            if with_peer:
                peer = start_peer(cluster, model, max_len)
                servers += peer.servers
                urls["peer"] = peer.proxy.url or ""
            print(f"starting {', '.join(s.name for s in servers)} (logs in {workdir}) ...",
                  flush=True)
            wait_healthy(servers, 900, lambda note: print(f"  {note}", flush=True))
            rows = measure(urls, args)
            peer_tokens = external_prefix_tokens(peer.decode.url or "") if with_peer else None
            time.sleep(1.0)
            prefill_report, decode_report = read_stats(prefill_stats), read_stats(decode_stats)
            tp2_reports = [read_stats(rank_stats_path(str(tp2_stats), r) or "")
                           for r in range(2)] if "pd_tp2" in urls else []
    finally:
        master.stop()
    layout = prefill_report.get("layout", {})
    puller = decode_report.get("decode", {})
    per_layer = puller.get("per_layer", {})
    reads = sum(v["reads"] for v in per_layer.values())
    device_kv = puller.get("device_kv") or {}
    resident = device_kv.get("main_resident", 0) + device_kv.get("indexer", 0)
    used = sum(device_kv.get(k, 0) for k in ("main_cache", "hot_buffers", "indexer"))
    flavour = "tiny DSA model, sparse offload decode" if kind == "dsa" else "tiny Llama"
    if kind == "dsa" and args.kernel_backend == "fused":
        flavour += " with the fused ops"
    return {
        "model": kind,
        "kernel_backend": args.kernel_backend if kind == "dsa" else None,
        "title": f"Latency: plain vLLM vs P/D ({flavour})",
        "rows": rows,
        "decode_device_kv": device_kv,
        "decode_kv_ratio": used / resident if device_kv.get("host_pool") and resident else None,
        "prefill_kv_physical_bytes": layout.get("physical_bytes"),
        "prefill_kv_logical_bytes": layout.get("logical_bytes"),
        "prefill_kv_footprint_ratio": (layout["physical_bytes"] / layout["logical_bytes"]
                                       if layout else None),
        "requests_pulled": puller.get("received"),
        "pull_failures": puller.get("failed"),
        "pulled_bytes": sum(v["bytes"] for v in per_layer.values()),
        "same_host_bytes": puller.get("same_host_bytes"),
        "pull_ms_per_layer_read": (1e3 * sum(v["seconds"] for v in per_layer.values()) / reads
                                   if reads else None),
        "store_saved_bytes": prefill_report.get("layerwise", {}).get("saved_bytes"),
        "tp2_decode_ranks": [_rank_pull(report.get("decode", {})) for report in tp2_reports],
        "peer_decode_external_hit_tokens": peer_tokens[0] if peer_tokens else None,
        "peer_decode_external_query_tokens": peer_tokens[1] if peer_tokens else None,
    }


def _rank_pull(puller: dict[str, Any]) -> dict[str, Any]:
    """One decode TP rank's pulls: requests, failures, bytes of main KV and of indexer."""
    per_part = puller.get("per_part", {})
    return {"tp_rank": puller.get("tp_rank"), "received": puller.get("received"),
            "failed": puller.get("failed"),
            "main_bytes": per_part.get("kv", {}).get("bytes", 0),
            "indexer_bytes": per_part.get("idx", {}).get("bytes", 0)}


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def print_table(result: dict[str, Any]) -> None:
    if result.get("model") == "dsa":
        print("\n--- tiny DeepSeek-V3.2 architecture (8 layers, top-k 32; decode in kvo's sparse "
              f"offload mode; prefill chunks of {DSA_STEP_TOKENS} tokens) ---")
    rows = result["rows"]
    model_name = "tiny 8-layer DSA model" if result.get("model") == "dsa" else \
        "tiny 8-layer Llama"
    peer = bool(rows) and "ttft_peer_s" in rows[0]
    kvo = [n for n in KVO_CONTENDERS if bool(rows) and f"ttft_{n}_s" in rows[0]]
    names = ["plain", *kvo, *(["peer"] if peer else [])]
    label = {"plain": "plain", "pd": "kvo", "pd_d2h": "kvo-d2h", "pd_tp2": "kvo-tp2",
             "peer": "vLLM-MC"}
    print("\nP/D with kvo" + (" vs vLLM's MooncakeConnector P/D (vLLM-MC)" if peer else "")
          + f" vs one plain vLLM (CPU, {model_name}, streamed; medians over rounds; "
          "ratios: median of per-round pairs; exact: answers bit-equal in tokens and logprobs "
          "to plain's warm-cache answer (the same arithmetic: only the prompt's tail "
          "computed) / to plain's cold answer / equal in tokens to the cold answer / rounds; "
          "cold=warm: plain's cold answers bit-equal to its warm ones)")
    header = f"{'prompt':>7} " + " ".join(f"{'TTFT ' + label[n]:>13}" for n in names)
    header += " " + " ".join(f"{label[n] + '/plain':>13}" for n in names[1:])
    if peer:
        header += " " + " ".join(f"{label[n] + '/vLLM-MC':>16}" for n in kvo)
    header += " " + " ".join(f"{'tok/s ' + label[n]:>13}" for n in names)
    header += " " + " ".join(f"{'exact ' + label[n]:>15}" for n in names[1:])
    header += f" {'cold=warm':>10}"
    print(header)
    for row in rows:
        line = f"{row['prompt_tokens']:>7} "
        line += " ".join(f"{_fmt(row[f'ttft_{n}_s'], 1e3):>10} ms" for n in names)
        line += " " + " ".join(f"{_fmt(row[f'ttft_ratio_{n}_to_plain'], 1, 2):>12}x"
                               for n in names[1:])
        if peer:
            line += " " + " ".join(f"{_fmt(row[f'ttft_ratio_{n}_to_peer'], 1, 2):>15}x"
                                   for n in kvo)
        line += " " + " ".join(f"{_fmt(row[f'decode_tps_{n}']):>13}" for n in names)
        line += " " + " ".join(
            f"{row[f'exact_{n}']}/{row[f'exact_cold_{n}']}/{row[f'same_tokens_{n}']}/"
            f"{row['rounds']}".rjust(15) for n in names[1:])
        line += f" {row['plain_cold_equals_warm']}/{row['rounds']}".rjust(11)
        print(line)
    for row in rows:
        for name in kvo:
            print(f"{label[name]} at {row['prompt_tokens']} tokens, medians at the proxy: decode "
                  f"advertised the destination {_fmt(row.get(f'{name}_proxy_ready_s'), 1e3)} "
                  f"ms after the request arrived, prefill answered "
                  f"{_fmt(row.get(f'{name}_proxy_prefill_s'), 1e3)} ms after it was posted, "
                  f"first decode byte {_fmt(row.get(f'{name}_proxy_first_byte_s'), 1e3)} ms "
                  f"after arrival; prefill posted with decode at once in "
                  f"{row.get(f'{name}_concurrent_posts', 0)}/{row['rounds']} rounds")
    ratio = result["prefill_kv_footprint_ratio"]
    print(f"kvo: prefill device KV footprint ratio (reuse / none): {_fmt(ratio, 1, 3)}; "
          f"pulled {result['pulled_bytes'] / (1 << 20):.1f} MiB in "
          f"{result['requests_pulled']} requests, {_fmt(result['pull_ms_per_layer_read'], 1, 2)}"
          f" ms per layer read, {result['pull_failures']} failures; "
          f"{(result.get('same_host_bytes') or 0) / (1 << 20):.1f} MiB copied directly "
          "(same host)")
    if result.get("decode_kv_ratio") is not None:
        kv = result["decode_device_kv"]
        print(f"kvo: decode device KV with offload / resident: {result['decode_kv_ratio']:.3f} "
              f"(hot buffers {kv['hot_buffers'] / (1 << 20):.2f} MiB + placeholder "
              f"{kv['main_cache'] / (1 << 20):.2f} MiB + indexer {kv['indexer'] / (1 << 20):.2f} "
              f"MiB vs main KV {kv['main_resident'] / (1 << 20):.2f} MiB + indexer; host pool "
              f"{kv['host_pool'] / (1 << 20):.2f} MiB)")
    for rank in result.get("tp2_decode_ranks") or []:
        print(f"kvo-tp2: decode TP rank {rank['tp_rank']} pulled {rank['received']} requests "
              f"({rank['failed']} failed): main KV {rank['main_bytes'] / (1 << 20):.2f} MiB "
              f"(its share; the ranks share one host pool), indexer "
              f"{rank['indexer_bytes'] / (1 << 20):.2f} MiB (its own cache)")
    if result.get("peer_decode_external_query_tokens"):
        print(f"vLLM-MC: decode got {result['peer_decode_external_hit_tokens']:.0f} of "
              f"{result['peer_decode_external_query_tokens']:.0f} prompt tokens through its "
              "connector (vllm:external_prefix_cache_hits)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        reexec_in_namespace(["-m", "kvo_tools.bench.e2e", *(argv if argv is not None
                                                          else sys.argv[1:])])
    except ClusterError as error:
        print(f"e2e benchmark: {error}", file=sys.stderr)
        return 2
    kinds = ["llama", "dsa"] if args.model == "all" else [args.model]
    results = {}
    with stopping_on_signals():
        for kind in kinds:
            results[kind] = run(args, kind)
            print_table(results[kind])
    # The Llama result stays at the top level (its chart reads "rows"); the DSA one beside it.
    result = dict(results.get("llama") or results["dsa"])
    if "llama" in results and "dsa" in results:
        result["dsa"] = results["dsa"]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
