"""Beyond loopback: prefill, decode, the Mooncake master and the proxy as separate hosts.

Each runs in a network namespace of its own (kvo_tools.pd.netns: 10.77.0.1-4 on veth pairs to a
bridge in this test's private namespace), so the Mooncake Store traffic, the transfer engine's
pulls, the authenticated ZMQ control plane and the proxy's signed notifications all cross a
network link. With the control secret set (the decode through its ``control_secret`` config
key, the prefill and the proxy through ``KVO_CONTROL_SECRET``), answers equal plain vLLM's bit
for bit. Without it, a decode and a proxy bound to those addresses refuse to start.

Needs root and a private network namespace (``nox -s e2e`` provides both); the namespaces are
deleted at the end, also after a failure.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

SECRET = "e2e control secret across hosts"
NUM_LAYERS = 4
MAX_TOKENS = 6
HOSTS = ("master", "prefill", "decode", "proxy")
MASTER_PORT, KV_PORT, PREFILL_PORT, DECODE_PORT, PROXY_PORT = 50051, 20100, 8100, 8200, 8000
REFUSAL = "not a loopback address and no control secret is set"


def _unavailable() -> str | None:
    from kvo_tools.pd.netns import why_unavailable

    return why_unavailable()


pytestmark = pytest.mark.skipif(_unavailable() is not None,
                                reason=f"beyond-loopback e2e: {_unavailable()}")


@attrs.frozen
class Hosts:
    plain: str
    proxy: str
    hosts: Any
    cluster: Any
    model: Path
    workdir: Path


def _wait_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing accepts {host}:{port} after {timeout_s} s")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    from kvo_tools.models.tiny_llama import build_tiny_llama
    from kvo_tools.pd.cluster import (
        STORE_LEASE_MS,
        Cluster,
        decode_transfer_config,
        free_port,
        prefill_transfer_config,
        wait_healthy,
    )
    from kvo_tools.pd.netns import VirtualHosts
    from kvo_transport.mooncake_master import find_master_binary

    workdir = tmp_path_factory.mktemp("pd-netns")
    model = build_tiny_llama(workdir / "model", num_layers=NUM_LAYERS)
    with VirtualHosts(HOSTS) as hosts, Cluster(workdir / "logs") as cluster:
        ip = hosts.addresses
        ns = hosts.namespaces
        cluster.start("master", [
            find_master_binary(), f"--rpc_address={ip['master']}", f"--rpc_port={MASTER_PORT}",
            f"--metrics_host={ip['master']}", "--metrics_port=9003",
            f"--default_kv_lease_ttl={STORE_LEASE_MS}"], netns=ns["master"])
        _wait_port(ip["master"], MASTER_PORT, 60)
        prefill_config = prefill_transfer_config(f"{ip['master']}:{MASTER_PORT}", KV_PORT,
                                                 workdir / "prefill-stats.json",
                                                 layer_deadline_s=30, handshake_timeout_s=30)
        extra = prefill_config["kv_connector_extra_config"]
        extra["layerwise"]["local_hostname"] = ip["prefill"]
        extra["remote_d2h"]["local_hostname"] = ip["prefill"]
        decode_config = decode_transfer_config(KV_PORT, workdir / "decode-stats.json",
                                               layer_deadline_s=30, handshake_timeout_s=30)
        decode_config["kv_connector_extra_config"].update(local_hostname=ip["decode"],
                                                          control_secret=SECRET)
        secret_env = {"KVO_CONTROL_SECRET": SECRET}
        plain = cluster.start_vllm("plain", model, free_port())
        prefill = cluster.start_vllm("prefill", model, PREFILL_PORT, prefill_config,
                                     host=ip["prefill"], netns=ns["prefill"], env=secret_env)
        decode = cluster.start_vllm("decode", model, DECODE_PORT, decode_config,
                                    host=ip["decode"], netns=ns["decode"])
        proxy = cluster.start_proxy(PROXY_PORT, prefill.url or "", decode.url or "",
                                    host=ip["proxy"], netns=ns["proxy"], env=secret_env)
        wait_healthy([plain, prefill, decode, proxy], 900)
        yield Hosts(plain=plain.url or "", proxy=proxy.url or "", hosts=hosts, cluster=cluster,
                    model=model, workdir=workdir)
    # Leaving both contexts stopped every process and deleted the namespaces and the bridge.


def _complete(url: str, prompt: str, **kwargs: Any) -> Any:
    from kvo_tools.pd.client import complete, completion_body

    return complete(url, completion_body(prompt, MAX_TOKENS, **kwargs), timeout_s=300)


def _stats(deployment: Hosts, name: str) -> dict[str, Any]:
    from kvo_vllm.remote_d2h.stats_file import read_stats

    return read_stats(deployment.workdir / f"{name}-stats.json")


def test_pd_across_hosts_answers_equal_plain_vllm(deployment: Hosts) -> None:
    text = "Prefill and decode live on different hosts; the KV crosses a network link. "
    for tag, length, stream in (("across-1", 300, False), ("across-2", 900, True)):
        prompt = (f"{tag}: " + text * 40)[:length]
        cold = _complete(deployment.plain, prompt, stream=stream)
        warm = _complete(deployment.plain, prompt, stream=stream)
        got = _complete(deployment.proxy, prompt, stream=stream)
        assert cold.ok and warm.ok and got.ok, (cold.error, warm.error, got.error)
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == cold.token_ids == warm.token_ids, tag
        assert got.logprobs == warm.logprobs, tag
    time.sleep(1.0)
    decode = _stats(deployment, "decode")["decode"]
    assert decode["received"] >= 2 and decode["failed"] == 0
    from kvo_tools.pd.cluster import get_json

    meta = get_json(deployment.proxy + "/kvo/v1/metadata")
    assert meta["decode_endpoints"] == {"0/0": f"tcp://{deployment.hosts.addresses['decode']}:"
                                               f"{KV_PORT}"}
    assert sum(meta["refused_notifications"].values()) == 0


def test_without_the_secret_a_non_loopback_decode_and_proxy_refuse_to_start(
        deployment: Hosts) -> None:
    from kvo_tools.pd.cluster import decode_transfer_config

    hosts, cluster = deployment.hosts, deployment.cluster
    os_env_secret = os.environ.pop("KVO_CONTROL_SECRET", None)
    try:
        proxy = cluster.start_proxy(PROXY_PORT + 1, "http://10.77.0.2:1", "http://10.77.0.3:1",
                                    name="proxy-no-secret", host=hosts.addresses["proxy"],
                                    netns=hosts.namespaces["proxy"])
        assert proxy.process.wait(300) == 2  # its start imports vLLM: ~100 s on a loaded machine
        assert REFUSAL in proxy.log_tail()

        config = decode_transfer_config(KV_PORT + 50)
        config["kv_connector_extra_config"]["local_hostname"] = hosts.addresses["decode"]
        decode = cluster.start_vllm("decode-no-secret", deployment.model, DECODE_PORT + 1,
                                    config, host=hosts.addresses["decode"],
                                    netns=hosts.namespaces["decode"])
        code = decode.process.wait(600)
        assert code != 0
        assert REFUSAL in decode.log_path.read_text(errors="replace")
    finally:
        if os_env_secret is not None:
            os.environ["KVO_CONTROL_SECRET"] = os_env_secret
