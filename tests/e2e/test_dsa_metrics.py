"""The sparse offload backend's metrics on a real vLLM API server's ``/metrics``.

One ``vllm serve`` of the tiny DeepSeek-V3.2-architecture model with kvo's offload mode and
``KvoOffloadMetricsConnector`` (no P/D: the connector only carries the backend's counters).
After a few completions, every ``vllm:kvo_sparse_offload_*`` counter equals the backend's own
accounting (the stats file the connector writes from the worker's totals), and the accounting
is self-consistent: hits + misses = selected entries, bytes host -> device = misses x row
bytes, a layer call per offloaded layer per step.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import attrs
import pytest

from kvo_tools.pd.cluster import Cluster, free_port, post_json, wait_healthy

NUM_LAYERS = 2
INDEX_TOPK = 32
ROW_BYTES = (512 + 64) * 4   # float32 latent + rope per token
PROMPTS = [
    "Decode keeps the whole history in host memory and copies only the misses. " * 4,
    "A hot buffer per layer holds the rows recent steps selected. " * 3,
]
COUNTERS = ("steps", "layer_calls", "selected_entries", "hits", "misses", "h2d_bytes",
            "full_reload_bytes")
T = TypeVar("T")


@attrs.frozen
class Server:
    url: str
    stats_file: Path

    def totals(self) -> dict[str, float]:
        try:
            data = json.loads(self.stats_file.read_text())
        except (OSError, ValueError):
            return {}
        return {name.removeprefix("sparse_offload_"): value
                for name, value in data.get("sparse_offload", {}).items()}

    def scrape(self) -> dict[str, float]:
        """Every kvo sparse-offload series by short name, summed over label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:kvo_sparse_offload_"):
                continue
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0].removeprefix("vllm:kvo_sparse_offload_")
            name = name.removesuffix("_total")
            if name.endswith("_created"):
                continue
            values[name] = values.get(name, 0.0) + float(value)
        return values


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32

    workdir = tmp_path_factory.mktemp("dsa-metrics")
    model = build_tiny_dsv32(workdir / "model", num_layers=NUM_LAYERS, index_topk=INDEX_TOPK)
    stats_file = workdir / "offload-stats.json"
    port = free_port()
    transfer = {"kv_connector": "KvoOffloadMetricsConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "kvo_vllm.connectors",
                "kv_connector_extra_config": {"stats_file": str(stats_file)}}
    with Cluster(workdir) as cluster:
        vllm = cluster.start_vllm(
            "dsa-offload", model, port, kv_transfer_config=transfer, max_model_len=1024,
            block_size=64, extra_args=["--max-num-seqs", "2", "--additional-config",
                                       json.dumps({"kvo_sparse": {"mode": "offload"}})])
        wait_healthy([vllm], timeout_s=900)
        yield Server(url=f"http://127.0.0.1:{port}", stats_file=stats_file)


def _eventually(check: Callable[[], T | None], timeout_s: float) -> T | None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result is not None or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_metrics_endpoint_counts_the_offload_backend(server: Server) -> None:
    for prompt in PROMPTS:
        status, body = post_json(server.url + "/v1/completions", {
            "model": "kvo-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 8

    def agree() -> tuple[dict[str, float], dict[str, float]] | None:
        totals, scraped = server.totals(), server.scrape()
        if not totals or any(scraped.get(name) != totals[name] for name in COUNTERS):
            return None
        return totals, scraped

    agreed = _eventually(agree, timeout_s=60)
    assert agreed is not None, (server.totals(), server.scrape())
    totals, scraped = agreed
    # the accounting holds together, and the requests really went through the offload path
    assert totals["misses"] > 0 and totals["hits"] > 0
    assert totals["hits"] + totals["misses"] == totals["selected_entries"]
    assert totals["h2d_bytes"] == totals["misses"] * ROW_BYTES
    assert totals["h2d_bytes"] < totals["full_reload_bytes"]
    assert totals["layer_calls"] == totals["steps"] * NUM_LAYERS
    assert totals["steps"] >= 2 * 8       # at least one step per generated token
    assert scraped["residency_seconds"] == pytest.approx(totals["residency_seconds"])
    assert scraped["residency_seconds"] > 0
    assert scraped["pool_rows_used"] > 0
