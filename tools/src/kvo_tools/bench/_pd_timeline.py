"""Where a kvo P/D request's time to first token goes (a profiling aid, not a benchmark).

Starts (in a loopback-only network namespace) a Mooncake master, the kvo prefill (as in
``e2e.py``: ``KvoMultiConnector``; ``--remote-only``: ``RemoteD2HConnector`` alone), a decode
whose engine is wrapped by ``kvo_tools.pd.timing_engine`` and the kvo proxy, sends streamed
requests of the given lengths one at a time and prints, per request, the stamps on one clock
(CLOCK_MONOTONIC, shared by every process of the host), in ms from the client's send:
proxy got it, decode registered the destination, proxy saw DecodeReady, first and last layer
read, decode reported the pull to vLLM, proxy got the first decode byte, client got the first
token.

    python -m kvo_tools.bench._pd_timeline --lengths 128 1024 --reps 5
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

from kvo_tools.pd.client import complete, completion_body
from kvo_tools.pd.cluster import (
    Cluster,
    decode_transfer_config,
    free_port,
    prefill_transfer_config,
    reexec_in_namespace,
    start_master,
    stopping_on_signals,
    wait_healthy,
)
from kvo_tools.pd.sites import timed_decode_env, timed_prefill_env

COLUMNS = ("proxy", "register", "ready", "read0", "readN", "reported", "byte", "token")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--remote-only", action="store_true",
                        help="prefill with RemoteD2HConnector alone (no layerwise store)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    reexec_in_namespace(["-m", "kvo_tools.bench._pd_timeline", *sys.argv[1:]])
    from kvo_tools.models.tiny_llama import build_tiny_llama

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvo-timeline-"))
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "events.jsonl"
    events.write_text("")
    base = Path(os.environ.get("KVO_MODEL_DIR", tempfile.gettempdir()))
    model = build_tiny_llama(base / "kvo-tiny-llama-8", num_layers=8)
    max_len = max(args.lengths) + 64
    master = start_master()
    rows: list[dict[str, Any]] = []
    try:
        with stopping_on_signals(), Cluster(workdir / "logs") as cluster:
            kv_port = free_port()
            prefill_config = prefill_transfer_config(master.address, kv_port)
            if args.remote_only:
                prefill_config = {**prefill_config, "kv_connector": "RemoteD2HConnector",
                                  "kv_connector_extra_config":
                                      prefill_config["kv_connector_extra_config"]["remote_d2h"]}
            hooks = workdir / "prefill-hooks.jsonl"
            hooks.write_text("")
            prefill = cluster.start_vllm("prefill", model, free_port(), prefill_config,
                                         max_model_len=max_len, env=timed_prefill_env(hooks))
            decode = cluster.start_vllm("decode", model, free_port(),
                                        decode_transfer_config(kv_port), max_model_len=max_len,
                                        env=timed_decode_env(events))
            proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
            wait_healthy([prefill, decode, proxy], 900, lambda n: print(f"  {n}", flush=True))
            rng = random.Random(0)
            for length in args.lengths:
                for rep in range(args.reps + 1):  # the first one is untimed
                    body = completion_body([rng.randrange(256) for _ in range(length)], 4,
                                           stream=True)
                    sent = time.monotonic()
                    answer = complete(proxy.url or "", body)
                    if not answer.ok or answer.ttft_s is None:
                        raise RuntimeError(f"request failed: {answer.error}")
                    time.sleep(0.3)  # the stats of the last step land
                    if rep:
                        rows.append(_row(length, sent, sent + answer.ttft_s, proxy.url or "",
                                         events))
                        print(_line(rows[-1]), flush=True)
    finally:
        master.stop()
    _summary(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _row(length: int, sent: float, token: float, proxy_url: str, events: Path
         ) -> dict[str, Any]:
    with urllib.request.urlopen(proxy_url + "/kvo/v1/metadata", timeout=30) as reply:
        record = json.loads(reply.read())["requests"][-1]
    log = [json.loads(line) for line in events.read_text().splitlines() if line]
    register = next(e for e in log if e["event"] == "register"
                    and e["transfer"] == record["transfer_id"])
    reads = [e for e in log if e["event"] == "read" and e["layer"] is not None
             and e["start"] >= register["t"]]
    reported = next((e["t"] for e in log if e["event"] == "reported"
                     and register["request"] in e["requests"]), None)
    started = record["started"]
    stamps = {"proxy": started, "register": register["t"],
              "ready": started + record["ready_s"] if record["ready_s"] else None,
              "read0": min(e["start"] for e in reads) if reads else None,
              "readN": max(e["end"] for e in reads) if reads else None,
              "reported": reported,
              "byte": started + record["first_byte_s"] if record["first_byte_s"] else None,
              "token": token}
    row: dict[str, Any] = {"length": length}
    row.update({k: None if v is None else 1e3 * (v - sent) for k, v in stamps.items()})
    row["reads"] = len(reads)
    row["read_ms"] = sum(1e3 * (e["end"] - e["start"]) for e in reads)
    return row


def _line(row: dict[str, Any]) -> str:
    return f"{row['length']:>6} " + " ".join(
        f"{k} {row[k]:7.1f}" if row[k] is not None else f"{k} n/a" for k in COLUMNS) \
        + f"  ({row['reads']} reads, {row['read_ms']:.1f} ms reading)"


def _summary(rows: list[dict[str, Any]]) -> None:
    print("\nmedians (ms from the client's send):")
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        med = {k: statistics.median([r[k] for r in mine if r[k] is not None] or [float("nan")])
               for k in (*COLUMNS, "read_ms")}
        print(f"{length:>6} " + " ".join(f"{k} {v:7.1f}" for k, v in med.items()))


if __name__ == "__main__":
    sys.exit(main())
