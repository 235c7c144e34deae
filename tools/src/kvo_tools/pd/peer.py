"""Start the P/D peer a user would pick instead of kvo: vLLM's own MooncakeConnector pair.

A prefill and a decode vLLM with ``CpuMooncakeConnector`` (``pd.peer_mooncake``: vLLM's
``MooncakeConnector`` as shipped, made to start without an accelerator), Mooncake's Transfer
Engine over tcp, and ``pd/peer_proxy.py`` in front. The prefill serves vLLM's Mooncake bootstrap
endpoint on its own port. Used by ``kvo_tools.bench.e2e``; everything binds loopback except
Mooncake and the bootstrap server (which bind every interface), so callers run inside a
loopback-only network namespace like the rest of the deployment.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import attrs

from kvo_tools.pd.cluster import PYTHON, Cluster, Managed, free_port

PREFILL_ENGINE_ID = "peer-prefill"
DECODE_ENGINE_ID = "peer-decode"


@attrs.frozen
class PeerPair:
    prefill: Managed
    decode: Managed
    proxy: Managed

    @property
    def servers(self) -> list[Managed]:
        return [self.prefill, self.decode, self.proxy]


def peer_transfer_config(role: str, engine_id: str) -> dict[str, Any]:
    """vLLM's MooncakeConnector (through the CPU shim) over Mooncake's tcp transport."""
    return {"kv_connector": "CpuMooncakeConnector",
            "kv_connector_module_path": "kvo_tools.pd.peer_mooncake",
            "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def start_peer(cluster: Cluster, model: Path, max_model_len: int) -> PeerPair:
    """Start (not wait for) the peer's prefill, decode and proxy."""
    bootstrap_port = free_port()
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port)}
    prefill = cluster.start_vllm(
        "peer-prefill", model, free_port(),
        peer_transfer_config("kv_producer", PREFILL_ENGINE_ID), env=env,
        max_model_len=max_model_len)
    decode = cluster.start_vllm(
        "peer-decode", model, free_port(),
        peer_transfer_config("kv_consumer", DECODE_ENGINE_ID), env=env,
        max_model_len=max_model_len)
    port = free_port()
    proxy = cluster.start(
        "peer-proxy",
        [PYTHON, "-m", "kvo_tools.pd.peer_proxy", "--prefill", prefill.url or "",
         "--decode", decode.url or "", "--bootstrap", f"http://127.0.0.1:{bootstrap_port}",
         "--engine-id", PREFILL_ENGINE_ID, "--port", str(port)],
        url=f"http://127.0.0.1:{port}")
    return PeerPair(prefill=prefill, decode=decode, proxy=proxy)


def external_prefix_tokens(decode_url: str) -> tuple[float, float]:
    """(prompt tokens decode got through its connector, tokens it asked for), from vLLM's own
    ``/metrics``: shows the peer pulled the KV rather than recomputing the prompt."""
    with urllib.request.urlopen(decode_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = {"vllm:external_prefix_cache_hits_total": 0.0,
              "vllm:external_prefix_cache_queries_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return (totals["vllm:external_prefix_cache_hits_total"],
            totals["vllm:external_prefix_cache_queries_total"])
