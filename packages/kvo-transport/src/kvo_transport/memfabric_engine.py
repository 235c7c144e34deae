"""The ``memfabric`` TransferEngine backend: MemFabric Hybrid's TransferEngine (Ascend).

The data-path protocol comes from kv_connector_extra_config["memfabric_transfer_protocol"]:
"sdma" (default), "device_rdma" or "device_urma"; prefill and decode must use the same one
(the control-plane handshake compares ``engine.protocol``). Every MemFabric data-path call needs
the Ascend driver; without it initialize() fails and kvo raises TransferError quoting the
library's reason.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

import attrs

from kvo_core import config
from kvo_core.errors import ConfigError
from kvo_transport.ascend_log import explain, log_tap
from kvo_transport.errors import TransferError, backend_unavailable
from kvo_transport.library_engine import LibraryTransferEngine

# kvo protocol name -> memfabric_hybrid.TransDataOpType member.
MEMFABRIC_PROTOCOLS = {name: name.upper() for name in config.MEMFABRIC_PROTOCOLS}
"""kvo's protocol name -> MemFabric's TransDataOpType member (the names: kvo-core's config)."""
DEFAULT_PROTOCOL = "sdma"
MEMFABRIC_ROLES = config.MEMFABRIC_ROLES


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
        config.check_tcp_url("memfabric engine option store_url", made.store_url)
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


class MemFabricTransferEngine(LibraryTransferEngine):
    """kvo's TransferEngine over MemFabric Hybrid.

    ``module`` is the memfabric_hybrid module; it is imported when not given (tests pass a
    recording stand-in to check the argument mapping without an Ascend driver).
    """

    backend = "memfabric"
    _label = "MemFabric"

    def __init__(self, module: Any = None, **options: Any) -> None:
        self.options = MemFabricOptions.from_options(options)
        self._mf = module if module is not None else import_memfabric()
        self._tap = log_tap(self._mf)
        o = self.options
        engine = self._mf.TransferEngine()
        mark = self._tap.mark()
        rc = engine.initialize(
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
            engine.destroy()
            raise TransferError(
                f"MemFabric TransferEngine.initialize(store_url={o.store_url!r}, "
                f"role={o.role!r}, device_id={o.device_id}, protocol={o.protocol!r}) failed "
                f"with return code {rc}: {reason}"
            )
        self._start(engine, f"{o.hostname}:{engine.get_rpc_port()}")

    def _mark(self) -> int:
        return int(self._tap.mark())

    def _reason_since(self, mark: int) -> str:
        return str(explain(self._tap.errors_since(mark)))

    def _release(self, engine: Any) -> None:
        engine.destroy()
