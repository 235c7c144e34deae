"""What both KVStore backends share: a store client behind registered-buffer bookkeeping.

Mooncake Store and Memcache both put from / get into registered buffers by key. The region
registry (every batch range must lie inside a registered buffer), register / unregister with
the client, the closed check and close itself are the same for both and live here; a backend
starts its client, then calls ``_start``, and says how its client unregisters a buffer and
names a return code.
"""

from __future__ import annotations

from typing import Any

from kvo_transport.errors import StoreArgumentError, StoreError
from kvo_transport.region_owner import RegionOwner
from kvo_transport.regions import MemoryRegion, RegionRegistry


class BufferStore(RegionOwner):
    """Base of the KVStore backends (see the module docstring)."""

    backend = ""
    _label = ""
    """The library's name in messages ("Mooncake", "Memcache")."""

    def _start(self, client: Any, description: str) -> None:
        """``description`` names the client in errors, e.g. the master it talks to."""
        self._store: Any = client
        self._description = description
        self._own(RegionRegistry(StoreArgumentError))

    # -- what a backend may refine -------------------------------------------------------------

    def _unregister_buffer(self, client: Any, region: MemoryRegion) -> int:
        return int(client.unregister_buffer(region.ptr))

    def _code(self, rc: int) -> str:
        """A client return code, as readable as the backend can make it."""
        return f"code {rc}"

    # -- shared --------------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._closed:
            raise StoreError(f"{self._label} store client {self._description} is closed")
        return self._store

    def register(self, ptr: int, length: int) -> None:
        store = self._client()
        with self._lock:
            region = self._registry.add(ptr, length)
            rc = store.register_buffer(region.ptr, region.length)
            if rc != 0:
                self._registry.remove(region.ptr)
                raise StoreError(
                    f"{self._label} register_buffer({region}) failed: {self._code(rc)}")

    def unregister(self, ptr: int) -> None:
        store = self._client()
        with self._lock:
            region = self._registry.remove(ptr)
            rc = self._unregister_buffer(store, region)
        if rc != 0:
            raise StoreError(f"{self._label} unregister_buffer({region}) failed: {self._code(rc)}")

    def _drop_region(self, region: MemoryRegion) -> None:
        self._unregister_buffer(self._store, region)

    def _release_handle(self) -> None:
        self._store.close()
        self._store = None

    def _describe(self) -> str:
        return str(self._description)
