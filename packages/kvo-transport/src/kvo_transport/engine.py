"""The TransferEngine protocol and the factory that picks a backend by name.

Callers (the control plane, the vLLM glue) only see this protocol: register memory, then move
batches of (local, remote, length) descriptors to or from a peer named by its session id. The
backends live in their own modules and are imported only when selected, so a missing optional
package costs nothing until someone asks for that backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvo_core.config import TRANSFER_BACKENDS  # one owner: kvo-core's config validates it too
from kvo_core.errors import ConfigError

SAME_HOST_MARK = " samehost="
"""Separates a session id from the same-host address a SameHostEngine appends to it."""


def inner_session_id(session_id: str) -> str:
    """The session id without a same-host part: what a library engine addresses the peer by.

    Lets an engine that copies through its library (no same-host path, or device memory) talk
    to a peer whose SameHostEngine advertises one.
    """
    return session_id.partition(SAME_HOST_MARK)[0]


class TransferEngine(Protocol):
    """Batched, synchronous one-sided transfers between registered memory of two processes."""

    @property
    def backend(self) -> str:
        """Backend name as given to create_transfer_engine ("mooncake" or "memfabric")."""
        ...

    @property
    def protocol(self) -> str:
        """Data-path protocol in use ("tcp"/"rdma" for Mooncake; "sdma"/... for MemFabric).

        Both sides of a session must agree; the handshake compares it.
        """
        ...

    @property
    def session_id(self) -> str:
        """What a peer passes as ``peer`` to read from or write to this engine's memory."""
        ...

    def register(self, ptr: int, length: int) -> None:
        """Make [ptr, ptr + length) usable as a local or remote transfer range."""
        ...

    def unregister(self, ptr: int) -> None:
        """Forget the region registered at exactly ``ptr``."""
        ...

    def read(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Copy peer memory into local memory, descriptor by descriptor; raise TransferError.

        After a TransferError, other descriptors of the same batch may still be landing in the
        local ranges for a while (Mooncake reports a batch failed at its first failed slice,
        without waiting for the rest): keep those ranges allocated and registered, and do not
        trust their contents.
        """
        ...

    def write(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Copy local memory into peer memory, descriptor by descriptor; raise TransferError."""
        ...

    def close(self) -> None:
        """Unregister everything and release the engine; later calls raise TransferError."""
        ...


class DelegatingEngine:
    """A TransferEngine that forwards every call to the engine it wraps.

    The base of wrappers that change one thing (count, time or fault a read): a subclass
    overrides only that method. Attributes outside the protocol (a backend's extras) reach the
    wrapped engine too, so a wrapper never hides what the engine underneath offers.
    """

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine

    @property
    def inner(self) -> TransferEngine:
        """The engine this one forwards to."""
        return self._engine

    def __getattr__(self, name: str) -> Any:
        if name == "_engine":  # not set yet (copy, unpickling): never recurse
            raise AttributeError(name)
        return getattr(self._engine, name)

    @property
    def backend(self) -> str:
        return self._engine.backend

    @property
    def protocol(self) -> str:
        return self._engine.protocol

    @property
    def session_id(self) -> str:
        return self._engine.session_id

    def register(self, ptr: int, length: int) -> None:
        self._engine.register(ptr, length)

    def unregister(self, ptr: int) -> None:
        self._engine.unregister(ptr)

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        self._engine.read(peer, local_addrs, remote_addrs, lengths)

    def write(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        self._engine.write(peer, local_addrs, remote_addrs, lengths)

    def close(self) -> None:
        self._engine.close()


def create_transfer_engine(backend: str = "mooncake", *, same_host: bool = False,
                           **options: Any) -> TransferEngine:
    """Build the named backend with its options.

    mooncake options: hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="tcp",
    device_name="". memfabric options: see kvo_transport.memfabric_engine.MemFabricOptions.
    ``same_host=True`` (mooncake, registered memory in host RAM only) wraps the engine in a
    SameHostEngine: peers on the same host are then copied to and from directly
    (process_vm_readv), every other peer through Mooncake.
    Raises ConfigError for an unknown backend or option, BackendUnavailableError (naming the pip
    extra) when the backend's package is missing, TransferError when the engine fails to start.
    """
    if backend == "mooncake":
        from kvo_transport.mooncake_engine import MooncakeTransferEngine

        engine = MooncakeTransferEngine(**options)
        if not same_host:
            return engine
        from kvo_transport.samehost_engine import SameHostEngine

        return SameHostEngine(engine)
    if same_host:
        raise ConfigError(f"same_host=True is for the mooncake backend (host memory), not "
                          f"{backend!r}")
    if backend == "memfabric":
        from kvo_transport.memfabric_engine import MemFabricTransferEngine

        return MemFabricTransferEngine(**options)
    raise ConfigError(
        f"transfer backend {backend!r} is not known; allowed: {', '.join(TRANSFER_BACKENDS)}"
    )
