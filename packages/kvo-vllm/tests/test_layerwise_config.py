"""Configuration boundary of LayerwiseStoreConnector: bad settings fail at start-up, clearly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import ConfigError
from kvo_vllm.connectors import LayerwiseStoreConnector as ByStablePath
from kvo_vllm.layerwise import EagerModeRequiredError, LayerwiseStoreConnector
from kvo_vllm.layerwise.store_client import StoreClients, backend_options, store_options_from


def fake_vllm_config(extra: dict[str, Any], enforce_eager: bool = True) -> Any:
    """Just the fields the constructor reads before it touches the KV cache or the store."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, engine_id="E"),
        model_config=SimpleNamespace(enforce_eager=enforce_eager))


def test_the_stable_module_path_exports_the_connector() -> None:
    assert ByStablePath is LayerwiseStoreConnector


def test_an_unknown_extra_config_key_is_refused_with_the_known_ones() -> None:
    config = fake_vllm_config({"shared_bufers": 2})
    with pytest.raises(ConfigError, match=r"unknown .*'shared_bufers'.*shared_buffers"):
        LayerwiseStoreConnector(config, KVConnectorRole.SCHEDULER, None)


def test_compiled_mode_is_refused() -> None:
    config = fake_vllm_config({"store_master_address": "127.0.0.1:1"}, enforce_eager=False)
    with pytest.raises(EagerModeRequiredError, match="enforce_eager=True"):
        LayerwiseStoreConnector(config, KVConnectorRole.WORKER, None)


def test_mooncake_options_come_from_the_config() -> None:
    config = LayerwiseOffloadConfig(store_master_address="127.0.0.1:5000",
                                    store_segment_bytes=64 << 20)
    assert backend_options(config, {}) == {
        "master_address": "127.0.0.1:5000", "hostname": "127.0.0.1", "protocol": "tcp",
        "global_segment_size": 64 << 20}


def test_mooncake_needs_a_master_address() -> None:
    with pytest.raises(ConfigError, match="store_master_address must be set"):
        backend_options(LayerwiseOffloadConfig(), {})


def test_memcache_takes_its_service_urls_from_store_options() -> None:
    extra = {"store_backend": "memcache",
             "store_options": {"meta_service_url": "tcp://127.0.0.1:1",
                               "config_store_url": "tcp://127.0.0.1:2"}}
    config = LayerwiseOffloadConfig.from_extra_config(extra, ignore_keys=("store_options",))
    assert backend_options(config, store_options_from(extra)) == extra["store_options"]


def test_store_options_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="store_options must be a mapping"):
        store_options_from({"store_options": ["tcp://x"]})


def test_one_store_client_per_settings_closed_by_its_last_user() -> None:
    """The scheduler and worker halves in one process share a client and its pending puts (a
    fake client here: this is the sharing, not the store); a lease released twice, even after
    the settings got a new client, never closes that new one."""

    class Client:
        closed = False

        def close(self) -> None:
            self.closed = True

    made: list[Client] = []
    clients = StoreClients(create=lambda backend, **options: made.append(Client()) or made[-1])
    acquire_store = clients.acquire
    config = LayerwiseOffloadConfig(store_master_address="127.0.0.1:1")
    first, second = acquire_store(config, {}), acquire_store(config, {})
    other = acquire_store(config, {"protocol": "rdma"})
    assert first.shared.store is second.shared.store is made[0] and other.shared.store is made[1]
    assert first.shared.pending_puts is second.shared.pending_puts is not other.shared.pending_puts
    first.release()
    assert not made[0].closed
    second.release()
    assert made[0].closed and not made[1].closed
    again = acquire_store(config, {})
    second.release()  # already released: ignored
    assert again.shared.store is made[2] and not made[2].closed
    again.release()
    other.release()
    assert made[2].closed and made[1].closed
