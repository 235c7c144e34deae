"""The ``memfabric`` TransferEngine backend: MemFabric Hybrid's TransferEngine (Ascend).

The data-path protocol comes from kv_connector_extra_config["memfabric_transfer_protocol"]:
"sdma" (default), "device_rdma" or "device_urma"; prefill and decode must use the same one
(the control-plane handshake compares ``engine.protocol``). Every MemFabric data-path call needs
the Ascend driver; without it initialize() fails and kvo raises TransferError quoting the
library's reason.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvo_core.errors import ConfigError
from kvo_transport.ascend_log import explain, log_tap
from kvo_transport.errors import TransferError, backend_unavailable
from kvo_transport.regions import RegionRegistry, TransferBatch

# kvo protocol name -> memfabric_hybrid.TransDataOpType member.
MEMFABRIC_PROTOCOLS = {"sdma": "SDMA", "device_rdma": "DEVICE_RDMA", "device_urma": "DEVICE_URMA"}
DEFAULT_PROTOCOL = "sdma"
MEMFABRIC_ROLES = ("Prefill", "Decode")


def normalize_protocol(protocol: object) -> str:
    """Validate a memfabric_transfer_protocol value; case and surrounding spaces are ignored."""
    if protocol is None:
        return DEFAULT_PROTOCOL
    name = protocol.strip().lower() if isinstance(protocol, str) else None
    if name not in MEMFABRIC_PROTOCOLS:
        raise ConfigError(
            f"memfabric_transfer_protocol={protocol!r} is not supported; "
            f"allowed: {', '.join(MEMFABRIC_PROTOCOLS)}"
        )
    return name


def import_memfabric() -> Any:
    try:
        import memfabric_hybrid
    except ImportError as exc:
        raise backend_unavailable("memfabric", "ascend", exc) from exc
    return memfabric_hybrid


def op_type(memfabric: Any, protocol: str) -> Any:
    """The TransDataOpType enum member for a normalized protocol name."""
    return getattr(memfabric.TransDataOpType, MEMFABRIC_PROTOCOLS[protocol])


@attrs.frozen
class MemFabricOptions:
    """Arguments of MemFabric's TransferEngine.initialize, validated before any library call.

    store_url: the MemFabric config store ("tcp://host:port"), created by the process whose role
    is ``store_server_role``. hostname: numeric IPv4 this engine is reached at; the session id
    is "hostname:rpc_port".
    """

    store_url: str
    protocol: str = DEFAULT_PROTOCOL
    role: str = "Decode"
    device_id: int = 0
    hostname: str = "127.0.0.1"
    store_server_role: str = "Prefill"
    nic: str = ""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MemFabricOptions:
        allowed = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown memfabric engine option(s) {unknown}; allowed: {allowed}")
        if "store_url" not in options:
            raise ConfigError(
                "memfabric engine option store_url is required (tcp://host:port of the "
                "MemFabric config store)"
            )
        values = dict(options)
        values["protocol"] = normalize_protocol(values.get("protocol"))
        made = cls(**values)
        scheme, _, rest = made.store_url.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme != "tcp" or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"memfabric engine option store_url={made.store_url!r} must be tcp://host:port"
            )
        for name in ("role", "store_server_role"):
            if getattr(made, name) not in MEMFABRIC_ROLES:
                raise ConfigError(
                    f"memfabric engine option {name}={getattr(made, name)!r}; "
                    f"allowed: {', '.join(MEMFABRIC_ROLES)}"
                )
        if isinstance(made.device_id, bool) or not isinstance(made.device_id, int) or (
            made.device_id < 0
        ):
            raise ConfigError(
                f"memfabric engine option device_id={made.device_id!r} must be an int >= 0"
            )
        try:
            ipaddress.IPv4Address(made.hostname)
        except ValueError:
            raise ConfigError(
                f"memfabric engine option hostname={made.hostname!r} must be a numeric IPv4 "
                "address (MemFabric does not resolve names)"
            ) from None
        return made


class MemFabricTransferEngine:
    """kvo's TransferEngine over MemFabric Hybrid.

    ``module`` is the memfabric_hybrid module; it is imported when not given (tests pass a
    recording stand-in to check the argument mapping without an Ascend driver).
    """

    backend = "memfabric"

    def __init__(self, module: Any = None, **options: Any) -> None:
        self.options = MemFabricOptions.from_options(options)
        self._mf = module if module is not None else import_memfabric()
        self._tap = log_tap(self._mf)
        o = self.options
        self._engine: Any = self._mf.TransferEngine()
        mark = self._tap.mark()
        rc = self._engine.initialize(
            o.store_url,
            o.hostname,
            o.role,
            o.device_id,
            op_type(self._mf, o.protocol),
            o.store_server_role,
            o.nic,
        )
        if rc != 0:
            reason = explain(self._tap.errors_since(mark))
            self._engine.destroy()
            raise TransferError(
                f"MemFabric TransferEngine.initialize(store_url={o.store_url!r}, "
                f"role={o.role!r}, device_id={o.device_id}, protocol={o.protocol!r}) failed "
                f"with return code {rc}: {reason}"
            )
        self._session_id = f"{o.hostname}:{self._engine.get_rpc_port()}"
        self._registry = RegionRegistry()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def protocol(self) -> str:
        return self.options.protocol

    @property
    def session_id(self) -> str:
        return self._session_id

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"MemFabric transfer engine {self._session_id} is closed")

    def register(self, ptr: int, length: int) -> None:
        self._check_open()
        with self._lock:
            region = self._registry.add(ptr, length)
            mark = self._tap.mark()
            rc = self._engine.register_memory(region.ptr, region.length)
            if rc != 0:
                self._registry.remove(region.ptr)
                raise TransferError(
                    f"MemFabric register_memory({region}) failed with return code {rc}: "
                    f"{explain(self._tap.errors_since(mark))}"
                )

    def unregister(self, ptr: int) -> None:
        self._check_open()
        with self._lock:
            region = self._registry.remove(ptr)
            rc = self._engine.unregister_memory(region.ptr)
        if rc != 0:
            raise TransferError(
                f"MemFabric unregister_memory({region}) failed with return code {rc}"
            )

    def read(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        self._check_open()
        batch = self._registry.check_batch(peer, local_addrs, remote_addrs, lengths)
        mark = self._tap.mark()
        rc = self._engine.batch_transfer_sync_read(
            batch.peer, batch.local_addrs, batch.remote_addrs, batch.lengths
        )
        if rc != 0:
            raise self._failed("read from", batch, rc, mark)

    def write(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        self._check_open()
        batch = self._registry.check_batch(peer, local_addrs, remote_addrs, lengths)
        mark = self._tap.mark()
        rc = self._engine.batch_transfer_sync_write(
            batch.peer, batch.local_addrs, batch.remote_addrs, batch.lengths
        )
        if rc != 0:
            raise self._failed("write to", batch, rc, mark)

    def _failed(self, direction: str, batch: TransferBatch, rc: int, mark: int) -> TransferError:
        return TransferError(
            f"MemFabric ({self.options.protocol}) batch {direction} {batch.describe()} failed "
            f"with return code {rc}: {explain(self._tap.errors_since(mark))}"
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for region in self._registry.regions():
                self._engine.unregister_memory(region.ptr)
                self._registry.remove(region.ptr)
            self._engine.destroy()
            self._engine = None

    def __enter__(self) -> MemFabricTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._registry)} regions"
        return f"MemFabricTransferEngine({self._session_id}, {self.options.protocol}, {state})"
