"""The memfabric TransferEngine backend.

Without an Ascend driver MemFabric's data path cannot run, so this covers what can: protocol
selection and validation, the mapping of kvo's calls onto MemFabric's API (through a recording
stand-in for the memfabric_hybrid module), error translation, and, with the real package, that
engine start-up fails with the library's own reason. The data-path test skips with that reason.
"""

from __future__ import annotations

import enum
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvo_core.errors import ConfigError
from kvo_transport.ascend_log import DRIVER_MISSING
from kvo_transport.engine import create_transfer_engine
from kvo_transport.errors import BackendUnavailableError, TransferArgumentError, TransferError
from kvo_transport.memfabric_engine import (
    MEMFABRIC_PROTOCOLS,
    MemFabricTransferEngine,
    normalize_protocol,
    op_type,
)

STORE_URL = "tcp://127.0.0.1:29555"
DRIVER_FILES = (Path("/usr/local/Ascend/driver/version.info"), Path("/etc/ascend_install.info"))


def real_memfabric() -> Any:
    return pytest.importorskip(
        "memfabric_hybrid", reason="memfabric_hybrid is not installed (kvo-transport[ascend])"
    )


def ascend_driver_present() -> bool:
    return any(p.exists() for p in DRIVER_FILES)


class FakeOpType(enum.IntEnum):
    SDMA = 1
    HOST_RDMA = 2
    DEVICE_RDMA = 8
    DEVICE_URMA = 64


class FakeMemFabric:
    """Records calls the way memfabric_hybrid's TransferEngine receives them."""

    TransDataOpType = FakeOpType

    def __init__(self, init_rc: int = 0, transfer_rc: int = 0) -> None:
        self.init_rc, self.transfer_rc = init_rc, transfer_rc
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.logger: Any = None
        fake = self

        class Engine:
            def initialize(self, *args: Any) -> int:
                fake.calls.append(("initialize", args))
                if fake.init_rc:
                    fake.logger(3, f"[HYBM hybm_entry.cpp:97 hybm_init] {DRIVER_MISSING}")
                return fake.init_rc

            def get_rpc_port(self) -> int:
                return 40123

            def register_memory(self, ptr: int, size: int) -> int:
                fake.calls.append(("register_memory", (ptr, size)))
                return 0

            def unregister_memory(self, ptr: int) -> int:
                fake.calls.append(("unregister_memory", (ptr,)))
                return 0

            def batch_transfer_sync_read(self, *args: Any) -> int:
                fake.calls.append(("read", args))
                if fake.transfer_rc:
                    fake.logger(3, "[SMEM smem_trans.cpp:1 x] peer segment not found")
                return fake.transfer_rc

            def batch_transfer_sync_write(self, *args: Any) -> int:
                fake.calls.append(("write", args))
                return fake.transfer_rc

            def destroy(self) -> None:
                fake.calls.append(("destroy", ()))

        self.TransferEngine = Engine

    def set_extern_logger(self, fn: Any) -> int:
        self.logger = fn
        return 0


@pytest.mark.parametrize(
    ("given", "expected"),
    [(None, "sdma"), ("sdma", "sdma"), ("device_rdma", "device_rdma"),
     (" Device_URMA ", "device_urma")],
)
def test_protocol_names_are_normalized(given: str | None, expected: str) -> None:
    assert normalize_protocol(given) == expected


@pytest.mark.parametrize("bad", ["rdma", "host_rdma", "", 8, "device-rdma"])
def test_unknown_protocols_are_refused_naming_the_allowed_ones(bad: object) -> None:
    with pytest.raises(ConfigError, match="allowed: sdma, device_rdma, device_urma"):
        normalize_protocol(bad)


@pytest.mark.parametrize("protocol", list(MEMFABRIC_PROTOCOLS))
def test_protocols_map_to_the_op_type_enum(protocol: str) -> None:
    assert op_type(FakeMemFabric(), protocol) is getattr(FakeOpType, MEMFABRIC_PROTOCOLS[protocol])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "store_url is required"),
        ({"store_url": "127.0.0.1:1"}, "must be tcp://host:port"),
        ({"store_url": STORE_URL, "role": "prefill"}, "role='prefill'; allowed: Prefill, Decode"),
        ({"store_url": STORE_URL, "device_id": -1}, "device_id=-1 must be an int >= 0"),
        ({"store_url": STORE_URL, "hostname": "localhost"}, "numeric IPv4"),
        ({"store_url": STORE_URL, "protocol": "tcp"}, "memfabric_transfer_protocol='tcp'"),
        ({"store_url": STORE_URL, "stream": 1}, r"option\(s\) \['stream'\]"),
    ],
)
def test_options_are_validated_before_any_library_call(
    options: dict[str, Any], message: str
) -> None:
    fake = FakeMemFabric()
    with pytest.raises(ConfigError, match=message):
        MemFabricTransferEngine(fake, **options)
    assert fake.calls == []


def test_initialize_receives_the_mapped_arguments() -> None:
    fake = FakeMemFabric()
    engine = MemFabricTransferEngine(
        fake, store_url=STORE_URL, protocol="device_urma", role="Prefill", device_id=3,
        hostname="10.0.0.7",
    )
    assert fake.calls[0] == (
        "initialize", (STORE_URL, "10.0.0.7", "Prefill", 3, FakeOpType.DEVICE_URMA, "Prefill", "")
    )
    assert engine.session_id == "10.0.0.7:40123"
    assert engine.protocol == "device_urma" and engine.backend == "memfabric"
    engine.close()
    assert fake.calls[-1] == ("destroy", ())


def test_transfers_pass_plain_lists_and_failures_quote_the_library() -> None:
    fake = FakeMemFabric()
    engine = MemFabricTransferEngine(fake, store_url=STORE_URL)
    buf = torch.zeros(8192, dtype=torch.uint8)
    engine.register(buf.data_ptr(), 8192)
    base = buf.data_ptr()
    engine.read("10.0.0.8:5000", (base, base + 4096), [0x1000, 0x9000], (4096, 4096))
    assert fake.calls[-1] == ("read", ("10.0.0.8:5000", [base, base + 4096], [0x1000, 0x9000],
                                       [4096, 4096]))
    engine.write("10.0.0.8:5000", [base], [0x1000], [16])
    assert fake.calls[-1][0] == "write"
    fake.transfer_rc = -1
    with pytest.raises(TransferError, match=r"(?s)peer '10\.0\.0\.8:5000', 1 descriptors, 16 bytes"
                       r".*return code -1.*peer segment not found"):
        engine.read("10.0.0.8:5000", [base], [0x1000], [16])
    with pytest.raises(TransferArgumentError, match="not inside registered memory"):
        engine.read("10.0.0.8:5000", [base + 8190], [0x1000], [16])
    engine.close()
    assert ("unregister_memory", (base,)) in fake.calls


def test_failed_start_raises_with_the_library_reason() -> None:
    fake = FakeMemFabric(init_rc=-1)
    reason = re.escape(DRIVER_MISSING)
    with pytest.raises(TransferError, match=f"return code -1: no usable Ascend driver: .*{reason}"):
        MemFabricTransferEngine(fake, store_url=STORE_URL)
    assert fake.calls[-1] == ("destroy", ())


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvo-transport\[ascend\]'"):
        create_transfer_engine("memfabric", store_url=STORE_URL)


def test_real_enum_values_match_the_mapping() -> None:
    memfabric = real_memfabric()
    assert [op_type(memfabric, p).name for p in MEMFABRIC_PROTOCOLS] == [
        "SDMA", "DEVICE_RDMA", "DEVICE_URMA"
    ]
    assert op_type(memfabric, "sdma") is memfabric.TransferEngine.TransDataOpType.SDMA


@pytest.mark.needs_loopback_netns
@pytest.mark.skipif(ascend_driver_present(), reason="an Ascend driver is installed here")
def test_real_engine_start_without_driver_quotes_the_library() -> None:
    real_memfabric()
    with pytest.raises(TransferError, match=f"Ascend driver: .*{re.escape(DRIVER_MISSING)}"):
        create_transfer_engine("memfabric", store_url=STORE_URL, protocol="device_rdma")


@pytest.mark.needs_loopback_netns
def test_data_path_between_two_engines() -> None:
    real_memfabric()
    try:
        prefill = create_transfer_engine("memfabric", store_url=STORE_URL, role="Prefill")
    except TransferError as exc:
        if DRIVER_MISSING in str(exc):
            pytest.skip(str(exc))
        raise
    decode = create_transfer_engine("memfabric", store_url=STORE_URL, role="Decode")
    src = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    prefill.register(src.data_ptr(), src.numel())
    decode.register(dst.data_ptr(), dst.numel())
    decode.read(prefill.session_id, [dst.data_ptr()], [src.data_ptr()], [src.numel()])
    assert torch.equal(src, dst)
    decode.close()
    prefill.close()
