"""What both TransferEngine backends share: a library engine behind region bookkeeping.

Mooncake's and MemFabric's engines have the same surface (register_memory, unregister_memory,
batch_transfer_sync_read / _write, return code 0 on success), so the checks kvo adds in front
of them live here once: every batch is validated against the registered regions before the
library sees it, every failure becomes a TransferError naming the call and the batch, and close
unregisters whatever is left. A backend supplies the started library engine and, if it can,
a reason for a failure (``_reason_since``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvo_transport.engine import inner_session_id
from kvo_transport.errors import TransferError
from kvo_transport.region_owner import RegionOwner
from kvo_transport.regions import MemoryRegion, RegionRegistry, TransferBatch


class LibraryTransferEngine(RegionOwner):
    """Base of the backends; a subclass calls ``_start`` once its library engine is up."""

    backend = ""
    _label = ""
    """The library's name in messages ("Mooncake", "MemFabric")."""

    options: Any

    def _start(self, engine: Any, session_id: str) -> None:
        self._engine: Any = engine
        self._session_id = session_id
        self._own(RegionRegistry())

    # -- what a backend may refine -------------------------------------------------------------

    def _mark(self) -> int:
        """A point to collect the library's diagnostics from (see ``_reason_since``)."""
        return 0

    def _reason_since(self, mark: int) -> str:
        """Why the library call since ``mark`` failed, as far as the backend can tell."""
        return ""

    def _transfer_hint(self) -> str:
        """What to check when a batch transfer fails and the library gave no reason."""
        return ""

    def _failure_note(self) -> str:
        """What the caller must know about a failed batch's local ranges, if anything."""
        return ""

    def _release(self, engine: Any) -> None:
        """Free the library engine at close, after every region was unregistered."""

    # -- the TransferEngine protocol -----------------------------------------------------------

    @property
    def protocol(self) -> str:
        return str(self.options.protocol)

    @property
    def session_id(self) -> str:
        return self._session_id

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self._label} transfer engine {self._session_id} is closed")

    def register(self, ptr: int, length: int) -> None:
        self._check_open()
        with self._lock:
            region = self._registry.add(ptr, length)
            mark = self._mark()
            rc = self._engine.register_memory(region.ptr, region.length)
            if rc != 0:
                self._registry.remove(region.ptr)
                raise TransferError(f"{self._label} register_memory({region}) failed with "
                                    f"return code {rc}{_colon(self._reason_since(mark))}")

    def unregister(self, ptr: int) -> None:
        self._check_open()
        with self._lock:
            region = self._registry.remove(ptr)
            rc = self._engine.unregister_memory(region.ptr)
        if rc != 0:
            raise TransferError(
                f"{self._label} unregister_memory({region}) failed with return code {rc}")

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        self._transfer("read from", peer, local_addrs, remote_addrs, lengths)

    def write(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        self._transfer("write to", peer, local_addrs, remote_addrs, lengths)

    def _transfer(self, direction: str, peer: str, local_addrs: Sequence[int],
                  remote_addrs: Sequence[int], lengths: Sequence[int]) -> None:
        self._check_open()
        batch = self._registry.check_batch(inner_session_id(peer), local_addrs, remote_addrs,
                                           lengths)
        call = (self._engine.batch_transfer_sync_read if direction == "read from"
                else self._engine.batch_transfer_sync_write)
        mark = self._mark()
        rc = call(batch.peer, batch.local_addrs, batch.remote_addrs, batch.lengths)
        if rc != 0:
            raise self._failed(direction, batch, rc, mark)

    def _failed(self, direction: str, batch: TransferBatch, rc: int, mark: int) -> TransferError:
        reason = self._reason_since(mark)
        detail = _colon(reason) if reason else f" {self._transfer_hint()}".rstrip()
        note = self._failure_note()
        return TransferError(f"{self._label} ({self.protocol}) batch {direction} "
                             f"{batch.describe()} failed with return code {rc}{detail}"
                             f"{'; ' + note if note else ''}")

    def _drop_region(self, region: MemoryRegion) -> None:
        self._engine.unregister_memory(region.ptr)

    def _release_handle(self) -> None:
        engine, self._engine = self._engine, None
        self._release(engine)

    def _describe(self) -> str:
        return f"{self._session_id}, {self.protocol}"


def _colon(reason: str) -> str:
    return f": {reason}" if reason else ""
