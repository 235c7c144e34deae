"""The KVStore protocol and the factory that picks a backend by name.

A KV store holds blocks by key (the prefill host pool). Values move between the store and
registered local memory without a Python copy: put_from reads the given ranges, get_into writes
them. Backends are imported only when selected.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from kvo_core.config import STORE_BACKENDS  # one owner: kvo-core's config validates it too
from kvo_core.errors import ConfigError


class KVStore(Protocol):
    """Batched put/get of registered memory ranges by key."""

    @property
    def backend(self) -> str:
        """Backend name as given to create_kv_store ("mooncake" or "memcache")."""
        ...

    def register(self, ptr: int, length: int) -> None:
        """Make [ptr, ptr + length) usable as a put source or get destination."""
        ...

    def unregister(self, ptr: int) -> None:
        """Forget the region registered at exactly ``ptr``."""
        ...

    def put_from(
        self, keys: Sequence[str], addrs: Sequence[int], lengths: Sequence[int], *,
        settle: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """Store each range under its key, replacing an existing value (upsert).

        ``settle``, when given, is called once every range has been read (copied aside),
        before any value is published; the keys it returns are left out of the put (their
        range may have changed while it was read). A put that raises before calling it stored
        nothing. Raises StoreError naming the keys that failed.
        """
        ...

    def get_into(
        self, keys: Sequence[str], addrs: Sequence[int], lengths: Sequence[int]
    ) -> list[bool]:
        """Copy each key's value into its range; False where the key is absent.

        Raises StoreError when a present value cannot be copied (e.g. its size differs).
        """
        ...

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present."""
        ...

    def remove(self, keys: Sequence[str]) -> None:
        """Remove the keys; absent keys are ignored. Raises StoreError naming keys that stay."""
        ...

    def close(self) -> None:
        """Unregister everything and disconnect; later calls raise StoreError."""
        ...


def create_kv_store(backend: str = "mooncake", **options: Any) -> KVStore:
    """Build the named store backend.

    mooncake options: see kvo_transport.mooncake_store.MooncakeStoreOptions (master_address is
    required). memcache options: see kvo_transport.memcache_store.MemcacheStoreOptions.
    Raises ConfigError for an unknown backend or option, BackendUnavailableError (naming the pip
    extra) when the backend's package is missing, StoreError when the client fails to start.
    """
    if backend == "mooncake":
        from kvo_transport.mooncake_store import MooncakeKVStore

        return MooncakeKVStore(**options)
    if backend == "memcache":
        from kvo_transport.memcache_store import MemcacheKVStore

        return MemcacheKVStore(**options)
    raise ConfigError(
        f"KV store backend {backend!r} is not known; allowed: {', '.join(STORE_BACKENDS)}"
    )
