"""A library handle together with the memory regions registered with it.

The transfer engines and the KVStore clients both hold a C++ library object and the regions
registered with it; closing one must unregister every region it still holds before the library
object goes. That lifetime (open / closed flag, lock, close, context manager, repr) lives here
once; a subclass says how one region is dropped and how the handle is released.
"""

from __future__ import annotations

import threading
from typing import Self

from kvo_transport.regions import MemoryRegion, RegionRegistry


class RegionOwner:
    """Base of the engine and store backends: ``_own`` once the library handle is up."""

    def _own(self, registry: RegionRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._closed = False

    def _drop_region(self, region: MemoryRegion) -> None:
        """Unregister one region from the library at close (its return code is not checked)."""
        raise NotImplementedError

    def _release_handle(self) -> None:
        """Free the library handle at close, after every region was dropped."""
        raise NotImplementedError

    def _describe(self) -> str:
        """Who this is, in repr (e.g. the session id or the master it talks to)."""
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for region in self._registry.regions():
                self._drop_region(region)
                self._registry.remove(region.ptr)
            self._release_handle()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._registry)} regions"
        return f"{type(self).__name__}({self._describe()}, {state})"
