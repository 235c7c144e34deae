"""The memcache KVStore backend and its MetaService.

The MetaService and the client's set-up run here; the client's init and the data path need an
Ascend driver and skip with the library's own reason when it is missing.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvo_core.errors import ConfigError
from kvo_transport.ascend_log import DRIVER_MISSING
from kvo_transport.errors import BackendUnavailableError, StoreError
from kvo_transport.memcache_store import (
    META_SERVICE_LOCK,
    MemcacheKVStore,
    MemcacheMetaService,
    MemcacheStoreOptions,
    build_local_config,
    meta_service_lock_holder,
)
from kvo_transport.mooncake_master import accepts
from kvo_transport.store import create_kv_store

# The MetaService binds the loopback URLs it is given, but a client's init may open listeners of
# its own; keep the whole module inside the loopback-only namespace like Mooncake.
pytestmark = pytest.mark.needs_loopback_netns

URLS = {"meta_service_url": "tcp://127.0.0.1:1", "config_store_url": "tcp://127.0.0.1:2"}


def real_memcache() -> Any:
    return pytest.importorskip(
        "memcache_hybrid", reason="memcache_hybrid is not installed (kvo-transport[ascend])"
    )


@pytest.fixture(scope="module")
def meta_service() -> Iterator[MemcacheMetaService]:
    real_memcache()
    if meta_service_lock_holder():
        pytest.skip(f"another Memcache MetaService holds {META_SERVICE_LOCK} on this machine")
    with MemcacheMetaService() as service:
        yield service


def test_stopping_releases_the_lock() -> None:
    # First in this module: the shared MetaService below holds the machine-wide lock.
    real_memcache()
    if meta_service_lock_holder():
        pytest.skip(f"another Memcache MetaService holds {META_SERVICE_LOCK} on this machine")
    service = MemcacheMetaService().start()
    port = service.meta_port
    service.stop()
    assert not service.is_running()
    assert not meta_service_lock_holder()
    assert not accepts(port)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"\['meta_service_url', 'config_store_url'\] are required"),
        ({**URLS, "meta_service_url": "127.0.0.1:5"}, "must be tcp://host:port"),
        ({**URLS, "protocol": "tcp"}, "protocol='tcp'; allowed: host_rdma"),
        ({**URLS, "device_id": -2}, "device_id=-2 must be >= 0"),
        ({**URLS, "call_timeout_s": -1}, r"call_timeout_s=-1 must be between 0 and 600 seconds"),
        ({**URLS, "call_timeout_s": True}, r"call_timeout_s=True must be between 0 and 600"),
        ({**URLS, "size": 1}, r"unknown memcache store option\(s\) \['size'\]"),
    ],
)
def test_options_are_validated_before_any_library_call(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        MemcacheKVStore(modules=(object(), object()), **options)


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvo-transport\[ascend\]'"):
        create_kv_store("memcache", **URLS)


def test_meta_service_listens_on_loopback_and_holds_the_machine_lock(
    meta_service: MemcacheMetaService,
) -> None:
    assert meta_service.is_running()
    assert meta_service.meta_service_url == f"tcp://127.0.0.1:{meta_service.meta_port}"
    assert accepts(meta_service.meta_port) and accepts(meta_service.config_store_port)
    assert meta_service_lock_holder()
    assert f"= {meta_service.config_store_url}" in meta_service.meta_config_path.read_text()


def test_a_second_meta_service_is_refused(meta_service: MemcacheMetaService) -> None:
    with pytest.raises(StoreError, match=re.escape(f"holds the lock {META_SERVICE_LOCK}")):
        MemcacheMetaService().start()


def test_client_config_carries_the_options(meta_service: MemcacheMetaService) -> None:
    memcache = real_memcache()
    options = MemcacheStoreOptions.from_options(
        {"meta_service_url": meta_service.meta_service_url,
         "config_store_url": meta_service.config_store_url,
         "protocol": "device_sdma", "dram_size": "64MB", "world_size": 4}
    )
    config = build_local_config(memcache, options)
    assert config.meta_service_url == meta_service.meta_service_url
    assert config.config_store_url == meta_service.config_store_url
    assert config.protocol == "device_sdma" and config.dram_size == "64MB"
    assert config.world_size == 4


def connect(meta_service: MemcacheMetaService) -> MemcacheKVStore:
    try:
        return MemcacheKVStore(
            meta_service_url=meta_service.meta_service_url,
            config_store_url=meta_service.config_store_url,
            protocol="device_sdma",
            dram_size="64MB",
            world_size=4,
        )
    except StoreError as exc:
        if DRIVER_MISSING in str(exc):
            pytest.skip(str(exc))
        raise


def test_client_init_without_driver_fails_with_the_library_reason(
    meta_service: MemcacheMetaService,
) -> None:
    if os.path.exists("/usr/local/Ascend/driver/version.info"):
        pytest.skip("an Ascend driver is installed here")
    with pytest.raises(StoreError, match=f"no usable Ascend driver: .*{re.escape(DRIVER_MISSING)}"):
        MemcacheKVStore(meta_service_url=meta_service.meta_service_url,
                        config_store_url=meta_service.config_store_url, protocol="device_sdma",
                        dram_size="64MB", world_size=4)


def test_data_path_put_get_overwrite_remove(meta_service: MemcacheMetaService) -> None:
    store = connect(meta_service)
    buf = torch.zeros(4 << 16, dtype=torch.uint8)
    store.register(buf.data_ptr(), buf.numel())
    block = 1 << 16
    buf[:block] = 1
    store.put_from(["k"], [buf.data_ptr()], [block])
    buf[:block] = 2
    store.put_from(["k"], [buf.data_ptr()], [block])
    assert store.get_into(["k", "absent"], [buf.data_ptr() + block, buf.data_ptr() + 2 * block],
                          [block, block]) == [True, False]
    assert torch.all(buf[block : 2 * block] == 2)
    store.remove(["k"])
    assert store.exists(["k"]) == [False]
    store.close()


def test_a_service_that_is_not_running_is_refused_without_hanging() -> None:
    real_memcache()
    with pytest.raises(StoreError, match=r"tcp://127\.0\.0\.1:1 does not accept connections"):
        MemcacheKVStore(**URLS)


def test_a_second_client_configuration_in_one_process_is_refused(
    meta_service: MemcacheMetaService,
) -> None:
    with pytest.raises(StoreError, match="one client configuration per process"):
        MemcacheKVStore(meta_service_url=meta_service.meta_service_url,
                        config_store_url=meta_service.config_store_url, protocol="host_rdma")
