"""Config objects: defaults, every validation path, and building from kv_connector_extra_config."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvo_core.config import (
    LayerwiseOffloadConfig,
    RemoteD2HConfig,
    SparseDecodeOffloadConfig,
)
from kvo_core.errors import ConfigError


def test_defaults() -> None:
    layerwise = LayerwiseOffloadConfig()
    assert layerwise.shared_buffers == 2
    assert layerwise.independent_layers == (0,)
    assert layerwise.prefetch_depth == 1
    assert layerwise.store_backend == "mooncake"
    sparse = SparseDecodeOffloadConfig()
    assert (sparse.top_k, sparse.block_size, sparse.hot_capacity) == (2048, 128, 8192)
    assert sparse.max_query_rows == 14
    assert sparse.host_pool_bytes is None
    remote = RemoteD2HConfig(kv_port=30000)
    assert remote.handshake_timeout_s == 100.0
    assert remote.transfer_backend == "mooncake"
    assert remote.memfabric_transfer_protocol == "sdma"


def test_frozen() -> None:
    config = LayerwiseOffloadConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.shared_buffers = 3  # type: ignore[misc]


def test_valid_values_are_kept() -> None:
    assert LayerwiseOffloadConfig(independent_layers=[0, -1]).independent_layers == (0, -1)
    assert LayerwiseOffloadConfig(independent_layers="all").independent_layers == "all"
    assert LayerwiseOffloadConfig(independent_layers=[]).independent_layers == ()
    assert SparseDecodeOffloadConfig(hot_capacity=32640, block_size=128).hot_capacity == 32640
    assert SparseDecodeOffloadConfig(top_k=64, block_size=64, hot_capacity=64).hot_capacity == 64
    remote = RemoteD2HConfig(kv_port=65535, handshake_timeout_s=5, read_retries=0,
                             transfer_backend="memfabric",
                             memfabric_transfer_protocol="device_urma",
                             memfabric_store_url="tcp://10.0.0.7:26000", memfabric_device_id=3)
    assert remote.handshake_timeout_s == 5.0
    assert remote.memfabric_device_id == 3 and remote.memfabric_store_server_role == "Prefill"
    assert isinstance(remote.handshake_timeout_s, float)


# (class, keyword arguments, fragments the message must contain: field, value, what is allowed)
INVALID: list[tuple[type[Any], dict[str, Any], tuple[str, ...]]] = [
    (RemoteD2HConfig, {"kv_port": 1, "memfabric_store_url": "http://h:1"},
     ("memfabric_store_url", "'http://h:1'", "tcp://host:port")),
    (RemoteD2HConfig, {"kv_port": 1, "memfabric_nic": 3}, ("memfabric_nic", "3", "string")),
    (LayerwiseOffloadConfig, {"shared_buffers": 0}, ("shared_buffers", "got 0", ">= 1")),
    (LayerwiseOffloadConfig, {"shared_buffers": True}, ("shared_buffers", "True", ">= 1")),
    (LayerwiseOffloadConfig, {"shared_buffers": 2.0}, ("shared_buffers", "2.0", "integer")),
    (LayerwiseOffloadConfig, {"independent_layers": "some"},
     ("independent_layers", "'some'", "'all'")),
    (LayerwiseOffloadConfig, {"independent_layers": 0},
     ("independent_layers", "got 0", "list of layer indices")),
    (LayerwiseOffloadConfig, {"independent_layers": [0, "1"]},
     ("independent_layers", "'1'", "not an integer")),
    (LayerwiseOffloadConfig, {"independent_layers": [3, 3]},
     ("independent_layers", "[3, 3]", "each layer once")),
    (LayerwiseOffloadConfig, {"prefetch_depth": -1}, ("prefetch_depth", "-1", "[0, 64]")),
    (LayerwiseOffloadConfig, {"store_backend": "redis"},
     ("store_backend", "'redis'", "mooncake, memcache")),
    (LayerwiseOffloadConfig, {"store_protocol": "udp"}, ("store_protocol", "'udp'", "tcp, rdma")),
    (LayerwiseOffloadConfig, {"store_segment_bytes": 1024},
     ("store_segment_bytes", "1024", ">= 16777216")),
    (LayerwiseOffloadConfig, {"store_master_address": ""},
     ("store_master_address", "''", "non-empty")),
    (LayerwiseOffloadConfig, {"local_hostname": "  "}, ("local_hostname", "non-empty")),
    (LayerwiseOffloadConfig, {"layer_deadline_s": 0}, ("layer_deadline_s", "0.0", "> 0")),
    (LayerwiseOffloadConfig, {"layer_deadline_s": float("nan")}, ("layer_deadline_s", "nan")),
    (LayerwiseOffloadConfig, {"layer_deadline_s": float("inf")}, ("layer_deadline_s", "inf")),
    (LayerwiseOffloadConfig, {"layer_deadline_s": "10"}, ("layer_deadline_s", "'10'")),
    (SparseDecodeOffloadConfig, {"top_k": 0}, ("top_k", "got 0", ">= 1")),
    (SparseDecodeOffloadConfig, {"block_size": -128}, ("block_size", "-128", ">= 1")),
    (SparseDecodeOffloadConfig, {"hot_capacity": 1024},
     ("hot_capacity", "1024", ">= top_k (2048)")),
    (SparseDecodeOffloadConfig, {"hot_capacity": 4000},
     ("hot_capacity", "4000", "multiple of block_size (128)", "3968", "4096")),
    (SparseDecodeOffloadConfig, {"hot_capacity": 32768},
     ("hot_capacity", "32768", "[1, 32640]")),
    (SparseDecodeOffloadConfig, {"host_pool_bytes": 0}, ("host_pool_bytes", "got 0", ">= 1")),
    (SparseDecodeOffloadConfig, {"max_query_rows": 15}, ("max_query_rows", "15", "[1, 14]")),
    (SparseDecodeOffloadConfig, {"max_query_rows": 0}, ("max_query_rows", "0", "[1, 14]")),
    (SparseDecodeOffloadConfig, {"indexer_kv_dtype": "fp8"},
     ("indexer_kv_dtype", "'fp8'", "bfloat16, int8")),
    (SparseDecodeOffloadConfig, {"kernel_backend": "cuda"},
     ("kernel_backend", "'cuda'", "auto, reference, triton, native, fused")),
    (SparseDecodeOffloadConfig, {"residency_backend": "numpy"},
     ("residency_backend", "'numpy'", "torch, native")),
    (SparseDecodeOffloadConfig, {"mode": "remote"}, ("mode", "'remote'", "resident, offload")),
    (RemoteD2HConfig, {"kv_port": 0}, ("kv_port", "got 0", "[1, 65535]")),
    (RemoteD2HConfig, {"kv_port": 70000}, ("kv_port", "70000", "[1, 65535]")),
    (RemoteD2HConfig, {"kv_port": 1, "handshake_timeout_s": -1},
     ("handshake_timeout_s", "-1.0", "> 0")),
    (RemoteD2HConfig, {"kv_port": 1, "layer_deadline_s": 0}, ("layer_deadline_s", "> 0")),
    (RemoteD2HConfig, {"kv_port": 1, "read_retries": -1}, ("read_retries", "-1", "[0, 16]")),
    (RemoteD2HConfig, {"kv_port": 1, "read_retries": 17}, ("read_retries", "17", "[0, 16]")),
    (RemoteD2HConfig, {"kv_port": 1, "retry_backoff_s": -0.5},
     ("retry_backoff_s", "-0.5", ">= 0")),
    (RemoteD2HConfig, {"kv_port": 1, "transfer_backend": "nccl"},
     ("transfer_backend", "'nccl'", "mooncake, memfabric")),
    (RemoteD2HConfig, {"kv_port": 1, "memfabric_transfer_protocol": "roce"},
     ("memfabric_transfer_protocol", "'roce'", "sdma, device_rdma, device_urma")),
    (RemoteD2HConfig, {"kv_port": 1, "mooncake_protocol": "ib"},
     ("mooncake_protocol", "'ib'", "tcp, rdma")),
    (RemoteD2HConfig, {"kv_port": 1, "gil_switch_interval_s": 0},
     ("gil_switch_interval_s", "0.0", "(0, 0.1]")),
    (RemoteD2HConfig, {"kv_port": 1, "gil_switch_interval_s": 1.5},
     ("gil_switch_interval_s", "1.5", "(0, 0.1]")),
]


@pytest.mark.parametrize(("cls", "kwargs", "fragments"), INVALID,
                         ids=[f"{c.__name__}-{next(iter(k.items()))[0]}-{i}"
                              for i, (c, k, _) in enumerate(INVALID)])
def test_invalid_values_name_field_value_and_allowed(
        cls: type[Any], kwargs: dict[str, Any], fragments: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)
    # the same value through vLLM's extra-config dict fails the same way
    with pytest.raises(ConfigError):
        cls.from_extra_config(kwargs)


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="shared_buffers"):
        LayerwiseOffloadConfig(shared_buffers=-3)


@pytest.mark.parametrize("cls", [LayerwiseOffloadConfig, SparseDecodeOffloadConfig])
def test_unknown_key_lists_known_keys(cls: type[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        cls.from_extra_config({"shared_buffer": 3, "top_k": 2048} if cls is
                              LayerwiseOffloadConfig else {"hot_capacty": 4096})
    message = str(info.value)
    assert "unknown kv_connector_extra_config key" in message
    assert ("'shared_buffer'" in message) or ("'hot_capacty'" in message)
    for field in attrs.fields(cls):
        assert field.name in message


def test_from_extra_config_builds_and_round_trips() -> None:
    extra = {"shared_buffers": 3, "independent_layers": [0, -1], "store_backend": "memcache",
             "layer_deadline_s": 30}
    config = LayerwiseOffloadConfig.from_extra_config(extra)
    assert config == LayerwiseOffloadConfig(shared_buffers=3, independent_layers=(0, -1),
                                            store_backend="memcache", layer_deadline_s=30.0)
    assert LayerwiseOffloadConfig.from_extra_config(config.to_extra_config()) == config
    sparse = SparseDecodeOffloadConfig.from_extra_config({"hot_capacity": 4096, "top_k": 1024})
    assert SparseDecodeOffloadConfig.from_extra_config(sparse.to_extra_config()) == sparse
    remote = RemoteD2HConfig.from_extra_config({"kv_port": 25000, "read_retries": 0})
    assert RemoteD2HConfig.from_extra_config(remote.to_extra_config()) == remote
    assert LayerwiseOffloadConfig.from_extra_config({}) == LayerwiseOffloadConfig()


def test_from_extra_config_ignore_keys() -> None:
    extra = {"kv_port": 26000, "shared_buffers": 4}
    layerwise = LayerwiseOffloadConfig.from_extra_config(extra, ignore_keys=["kv_port"])
    assert layerwise.shared_buffers == 4
    remote = RemoteD2HConfig.from_extra_config(extra, ignore_keys={"shared_buffers"})
    assert remote.kv_port == 26000


def test_missing_required_key() -> None:
    with pytest.raises(ConfigError, match=r"missing the required key.*kv_port"):
        RemoteD2HConfig.from_extra_config({"read_retries": 1})


def test_extra_config_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"must be a mapping.*list"):
        SparseDecodeOffloadConfig.from_extra_config([("top_k", 1)])  # type: ignore[arg-type]
