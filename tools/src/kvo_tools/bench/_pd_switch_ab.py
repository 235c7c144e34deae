"""Paired A/B of the P/D workers' GIL switch interval (``gil_switch_interval_s``).

Starts (in a loopback-only network namespace) two kvo P/D deployments as ``e2e.py`` runs them
(prefill with ``KvoMultiConnector``, decode with ``RemoteD2HConnector``, kvo proxy, each pair
with its own Mooncake master): A with ``gil_switch_interval_s: null`` (the interpreter's 5 ms),
B with the value given. Each round sends one fresh streamed prompt to both, in alternating
order, checks that both answers carry the same tokens and prints, per length, the TTFT medians
and the median of the per-round ratios B/A with the load next to it. A profiling aid for a
quiet machine, not part of ``nox -s bench``.

    python -m kvo_tools.bench._pd_switch_ab --lengths 128 1024 --reps 10 --interval 0.0005
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvo_tools.pd.client import Answer, complete, completion_body
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--interval", type=float, default=0.0005,
                        help="B's gil_switch_interval_s (A runs with null)")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    reexec_in_namespace(["-m", "kvo_tools.bench._pd_switch_ab", *sys.argv[1:]])
    from kvo_tools.models.tiny_llama import build_tiny_llama

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvo-switch-ab-"))
    base = Path(os.environ.get("KVO_MODEL_DIR", tempfile.gettempdir()))
    model = build_tiny_llama(base / "kvo-tiny-llama-8", num_layers=8)
    max_len = max(args.lengths) + 64
    masters = [start_master(), start_master()]
    try:
        with stopping_on_signals(), Cluster(workdir / "logs") as cluster:
            started = []
            for name, master, interval in (("a", masters[0], None),
                                           ("b", masters[1], args.interval)):
                kv_port = free_port()
                prefill = prefill_transfer_config(master.address, kv_port)
                prefill["kv_connector_extra_config"]["remote_d2h"]["gil_switch_interval_s"] = \
                    interval
                decode = decode_transfer_config(kv_port)
                decode["kv_connector_extra_config"]["gil_switch_interval_s"] = interval
                servers = [cluster.start_vllm(f"{name}-prefill", model, free_port(), prefill,
                                              max_model_len=max_len),
                           cluster.start_vllm(f"{name}-decode", model, free_port(), decode,
                                              max_model_len=max_len)]
                servers.append(cluster.start_proxy(free_port(), servers[0].url or "",
                                                   servers[1].url or "", name=f"{name}-proxy"))
                started.extend(servers)
            wait_healthy(started, 900, lambda n: print(f"  {n}", flush=True))
            proxies = [started[2].url or "", started[5].url or ""]
            rng = random.Random(0)
            for length in args.lengths:
                _rounds(proxies, length, args.reps, rng)
    finally:
        for master in masters:
            master.stop()
    return 0


def _rounds(proxies: list[str], length: int, reps: int, rng: random.Random) -> None:
    ttfts: dict[int, list[float]] = {0: [], 1: []}
    ratios = []
    for rep in range(reps + 1):  # the first round is untimed
        body: dict[str, Any] = completion_body([rng.randrange(256) for _ in range(length)], 4,
                                               stream=True)
        answers: dict[int, Answer] = {}
        for side in ((0, 1) if rep % 2 == 0 else (1, 0)):
            answer = complete(proxies[side], body)
            if not answer.ok or answer.ttft_s is None:
                raise RuntimeError(f"request failed: {answer.error}")
            answers[side] = answer
        if answers[0].token_ids != answers[1].token_ids:
            raise RuntimeError(f"A and B answered differently at {length} tokens")
        if rep:
            a, b = answers[0].ttft_s, answers[1].ttft_s
            assert a is not None and b is not None
            ttfts[0].append(1e3 * a)
            ttfts[1].append(1e3 * b)
            ratios.append(b / a)
    print(f"{length:>6} tokens: TTFT median A {statistics.median(ttfts[0]):8.1f} ms, "
          f"B {statistics.median(ttfts[1]):8.1f} ms; paired B/A median "
          f"{statistics.median(ratios):.3f}, B faster in {sum(r < 1 for r in ratios)}/"
          f"{len(ratios)} rounds; load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
