"""The MemFabric backend is reachable from the connectors' config: every option MemFabric's
engine needs is a ``kv_connector_extra_config`` key, validated when the config is built, and
the remote-D2H workers build the engine with it (MemFabric's data path needs the Ascend driver,
so the library is a recording stand-in here; without it, the error names the extra)."""

from __future__ import annotations

import enum
import sys
from typing import Any

import pytest
import torch

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError
from kvo_transport.errors import BackendUnavailableError
from kvo_vllm.remote_d2h.kv_caches import transfer_engine_for

STORE_URL = "tcp://10.0.0.7:26000"
LAYERS = [("model.layers.0.self_attn.attn", 0, torch.zeros(4, 16))]


class _OpType(enum.IntEnum):
    SDMA = 1
    DEVICE_RDMA = 8
    DEVICE_URMA = 64


class _RecordingMemFabric:
    """Records ``TransferEngine.initialize`` the way memfabric_hybrid receives it."""

    TransDataOpType = _OpType

    def __init__(self) -> None:
        self.initialized: list[tuple[Any, ...]] = []
        recorder = self

        class Engine:
            def initialize(self, *args: Any) -> int:
                recorder.initialized.append(args)
                return 0

            def get_rpc_port(self) -> int:
                return 40123

            def destroy(self) -> None:
                return None

        self.TransferEngine = Engine

    def set_extern_logger(self, fn: Any) -> int:
        return 0


def _config(**extra: Any) -> RemoteD2HConfig:
    return RemoteD2HConfig.from_extra_config({"kv_port": 27000, **extra})


def test_memfabric_needs_its_config_store() -> None:
    with pytest.raises(ConfigError, match="transfer_backend 'memfabric' needs memfabric_store_url"):
        _config(transfer_backend="memfabric")
    with pytest.raises(ConfigError, match=r"memfabric_store_url='10\.0\.0\.7:26000' must be tcp://"):
        _config(transfer_backend="memfabric", memfabric_store_url="10.0.0.7:26000")
    with pytest.raises(ConfigError, match="memfabric_store_server_role must be one of Prefill, "
                                          "Decode; got 'prefill'"):
        _config(transfer_backend="memfabric", memfabric_store_url=STORE_URL,
                memfabric_store_server_role="prefill")
    with pytest.raises(ConfigError, match="memfabric_device_id must be an integer >= 0, got -1"):
        _config(transfer_backend="memfabric", memfabric_store_url=STORE_URL,
                memfabric_device_id=-1)


def test_memfabric_keys_with_another_backend_are_refused() -> None:
    with pytest.raises(ConfigError, match="memfabric_store_url, memfabric_device_id set, but "
                                          "transfer_backend is 'mooncake'"):
        _config(memfabric_store_url=STORE_URL, memfabric_device_id=1)


@pytest.mark.parametrize(("role", "device_index", "device_id", "expected_device"),
                         [("Prefill", 2, None, 2), ("Decode", 1, 5, 5)])
def test_workers_build_the_engine_with_every_option(
        monkeypatch: pytest.MonkeyPatch, role: str, device_index: int, device_id: int | None,
        expected_device: int) -> None:
    library = _RecordingMemFabric()
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", library)
    config = _config(transfer_backend="memfabric", memfabric_store_url=STORE_URL,
                     memfabric_transfer_protocol="device_rdma", memfabric_device_id=device_id,
                     memfabric_store_server_role="Decode", memfabric_nic="eth1",
                     local_hostname="10.0.0.8")
    engine = transfer_engine_for(config, LAYERS, role=role, device_index=device_index)
    assert engine.backend == "memfabric" and engine.protocol == "device_rdma"
    assert library.initialized == [(STORE_URL, "10.0.0.8", role, expected_device,
                                     _OpType.DEVICE_RDMA, "Decode", "eth1")]


def test_without_the_library_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", None)
    config = _config(transfer_backend="memfabric", memfabric_store_url=STORE_URL)
    with pytest.raises(BackendUnavailableError, match=r"kvo-transport\[ascend\]"):
        transfer_engine_for(config, LAYERS, role="Decode", device_index=0)


def test_a_hostname_memfabric_cannot_use_is_refused_before_the_library_is_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    library = _RecordingMemFabric()
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", library)
    config = _config(transfer_backend="memfabric", memfabric_store_url=STORE_URL,
                     local_hostname="decode-0.internal")
    with pytest.raises(ConfigError, match="numeric IPv4"):
        transfer_engine_for(config, LAYERS, role="Decode", device_index=0)
    assert library.initialized == []
