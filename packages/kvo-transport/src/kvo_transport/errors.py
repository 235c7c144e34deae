"""Errors raised by kvo-transport, all catchable as kvo_core.errors.KvoError."""

from __future__ import annotations

from kvo_core.errors import KvoError


class TransferError(KvoError):
    """A batched read/write between registered regions failed or was refused before it started."""


class TransferArgumentError(TransferError, ValueError):
    """A transfer or registration request was refused before reaching the engine."""


class StoreError(KvoError):
    """A KV-store operation failed; the message names the keys that failed."""


class StoreUnavailableError(StoreError):
    """The store is unreachable (its master is down): the call failed, or was refused at once
    by the store's circuit breaker without reaching it."""


class StoreLeaseHeldError(StoreError):
    """A remove gave up on keys that still held a read lease: the store answered every try, so
    this is no outage (the circuit breaker does not count it)."""


class StoreArgumentError(StoreError, ValueError):
    """A KV-store request was refused before reaching the store (bad keys, ranges, sizes)."""


class ProtocolError(KvoError):
    """A control-plane frame did not decode, had an unknown version or broke a limit."""


class HandshakeTimeoutError(KvoError, TimeoutError):
    """The peer did not answer the session handshake in time; the message names the endpoint."""


class LayerDeadlineError(KvoError, TimeoutError):
    """A layer's READ_DONE/READ_FAILED did not arrive before its per-layer deadline."""


class HostPoolError(KvoError):
    """A host pool could not be created, attached or viewed; the message says why."""


class BackendUnavailableError(KvoError, ImportError):
    """A selected backend's package is not installed; the message names the pip extra to install."""


def backend_unavailable(backend: str, extra: str, cause: BaseException) -> BackendUnavailableError:
    """Build the error raised when a backend's optional package cannot be imported."""
    return BackendUnavailableError(
        f"the {backend!r} backend needs an optional package that is not importable ({cause}); "
        f"install it with: pip install 'kvo-transport[{extra}]'"
    )
