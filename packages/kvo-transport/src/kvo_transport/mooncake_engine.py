"""The ``mooncake`` TransferEngine backend: Mooncake Transfer Engine with P2P handshake metadata.

With ``P2PHANDSHAKE`` no metadata server is needed: each engine listens on an RPC port and peers
address it as ``host:port``. Mooncake binds all interfaces; tests run it in a loopback-only netns.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvo_core.errors import ConfigError
from kvo_transport.errors import TransferError, backend_unavailable
from kvo_transport.regions import RegionRegistry, TransferBatch

MOONCAKE_PROTOCOLS = ("tcp", "rdma")


def import_mooncake_engine_class() -> Any:
    """Mooncake's pybind TransferEngine class, or BackendUnavailableError naming the extra."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise backend_unavailable("mooncake", "mooncake", exc) from exc
    return TransferEngine


@attrs.frozen
class MooncakeEngineOptions:
    """Arguments of Mooncake's ``initialize``; defaults are the loopback/tcp set-up used here."""

    hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MooncakeEngineOptions:
        allowed = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(
                f"unknown mooncake transfer engine option(s) {unknown}; allowed: {allowed}"
            )
        made = cls(**options)
        for name in ("hostname", "metadata_server", "protocol", "device_name"):
            if not isinstance(getattr(made, name), str):
                raise ConfigError(f"mooncake option {name}={getattr(made, name)!r} must be a str")
        if not made.hostname or ":" in made.hostname:
            raise ConfigError(
                f"mooncake option hostname={made.hostname!r} must be a bare host name or IP "
                "(the RPC port is chosen by the engine)"
            )
        if made.protocol not in MOONCAKE_PROTOCOLS:
            raise ConfigError(
                f"mooncake option protocol={made.protocol!r} is not supported; "
                f"allowed: {', '.join(MOONCAKE_PROTOCOLS)}"
            )
        return made


class MooncakeTransferEngine:
    """kvo's TransferEngine over one Mooncake engine (one per process is the usual set-up)."""

    backend = "mooncake"

    def __init__(self, **options: Any) -> None:
        self.options = MooncakeEngineOptions.from_options(options)
        engine_class = import_mooncake_engine_class()
        self._engine: Any = engine_class()
        o = self.options
        rc = self._engine.initialize(o.hostname, o.metadata_server, o.protocol, o.device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({o.hostname!r}, {o.metadata_server!r}, "
                f"{o.protocol!r}, {o.device_name!r}) failed with return code {rc}"
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

    @property
    def raw_engine(self) -> Any:
        """The underlying mooncake.engine.TransferEngine (for benchmarks comparing raw calls)."""
        self._check_open()
        return self._engine

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"Mooncake transfer engine {self._session_id} is closed")

    def register(self, ptr: int, length: int) -> None:
        self._check_open()
        with self._lock:
            region = self._registry.add(ptr, length)
            rc = self._engine.register_memory(region.ptr, region.length)
            if rc != 0:
                self._registry.remove(region.ptr)
                raise TransferError(
                    f"Mooncake register_memory({region}) failed with return code {rc}"
                )

    def unregister(self, ptr: int) -> None:
        self._check_open()
        with self._lock:
            region = self._registry.remove(ptr)
            rc = self._engine.unregister_memory(region.ptr)
        if rc != 0:
            raise TransferError(
                f"Mooncake unregister_memory({region}) failed with return code {rc}"
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
        rc = self._engine.batch_transfer_sync_read(
            batch.peer, batch.local_addrs, batch.remote_addrs, batch.lengths
        )
        if rc != 0:
            raise _failed("read from", batch, rc)

    def write(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        self._check_open()
        batch = self._registry.check_batch(peer, local_addrs, remote_addrs, lengths)
        rc = self._engine.batch_transfer_sync_write(
            batch.peer, batch.local_addrs, batch.remote_addrs, batch.lengths
        )
        if rc != 0:
            raise _failed("write to", batch, rc)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for region in self._registry.regions():
                self._engine.unregister_memory(region.ptr)
                self._registry.remove(region.ptr)
            self._engine = None

    def __enter__(self) -> MooncakeTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._registry)} regions"
        return f"MooncakeTransferEngine({self._session_id}, {self.options.protocol}, {state})"


def _failed(direction: str, batch: TransferBatch, rc: int) -> TransferError:
    return TransferError(
        f"Mooncake batch {direction} {batch.describe()} failed with return code {rc} "
        "(is the peer alive, and are the remote ranges registered there?)"
    )
