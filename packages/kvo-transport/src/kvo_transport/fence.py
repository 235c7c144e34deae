"""Epoch words that fence one-sided reads of prefill memory (a seqlock over one-sided reads).

The problem: a decode reads a prefill buffer with a one-sided read while the prefill may, after
giving up on that reader (deadline, failure), hand the buffer to its next occupant. A timeout is
not a fence: a slow read can still be running when the new bytes are written.

The fence: the prefill keeps an array of 64-bit *epoch words* in memory registered with its
transfer engine. Each word guards something the prefill may overwrite: a physical layer slot
(``slot_word``) or a request's blocks (``lease``). READY carries, for every word guarding its
source, the epoch the word held when the READY was built. The rules:

1. prefill advances a word BEFORE anything overwrites what it guards (a slot's round ended
   without every reader's READ_DONE, a request's blocks go back to the allocator);
2. decode reads the words with a one-sided read through the same engine only AFTER its data
   read returned, and accepts the layer only if every word still holds the READY's epoch;
   otherwise it answers READ_FAILED and invalidates the destination.

Why this holds for any engine that reads memory as it is at some instant between the call and
its return (Mooncake over TCP or RDMA, MemFabric's SDMA / device RDMA alike), with no clocks:
the data read ends before the epoch read starts (decode issues it after the first returned).
If the epoch read sees the old value, the advance had not happened when the word was read, so
no overwrite (which prefill orders after the advance: a store followed by the thread's later
work, and for device memory a kernel launched after the store) had happened before the data read
ended: every byte read was the published content. If the advance happened first, decode sees
the new value and refuses. A word only grows, so a stale READY can never match a later epoch,
and words may be reused across requests.

A successful round needs no advance: the reader verified its fence before answering READ_DONE,
so nothing it accepted can be overwritten later.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvo_core.gates import SlotKey
from kvo_transport.protocol import Fence

WORD_BYTES = 8
DEFAULT_CAPACITY = 1 << 16
"""Words per table: slots (a handful) plus requests in flight (64 Ki: 512 KiB of memory)."""


class FenceExhaustedError(RuntimeError):
    """Every epoch word is leased; publish fewer requests at once or make the table larger."""


class _Registrar(Protocol):
    def register(self, ptr: int, length: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class _Reader(_Registrar, Protocol):
    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None: ...


class FenceWords:
    """The prefill's epoch words: page-aligned, registered with ``engine`` when one is given.

    Thread-safe. ``slot_word(key)`` is stable for a slot; ``lease(owner)`` gives a request its
    own word until ``release(owner)``, which advances it (its blocks may now be overwritten) and
    returns it to the free list (still advanced: a late reader of the old owner never matches).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, engine: _Registrar | None = None
                 ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive number of words, got {capacity!r}")
        self.capacity = capacity
        self._map = mmap.mmap(-1, capacity * WORD_BYTES)  # anonymous: zeroed, page-aligned
        self._words = (ctypes.c_uint64 * capacity).from_buffer(self._map)
        self.address = ctypes.addressof(self._words)
        self._lock = threading.Lock()
        self._slots: dict[SlotKey, int] = {}
        self._leases: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._engine = engine
        if engine is not None:
            engine.register(self.address, capacity * WORD_BYTES)

    @property
    def nbytes(self) -> int:
        return self.capacity * WORD_BYTES

    def epoch(self, word: int) -> int:
        return int(self._words[word])

    def advance(self, key: SlotKey) -> None:
        """The slot ``key`` may be overwritten now: readers of its current content must fail.

        kvo_core's ``SlotFence``: SlotGates call it when a round ends without every reader's
        READ_DONE, before any waiter may write the slot.
        """
        with self._lock:
            word = self._slots.get(key)
            if word is not None:
                self._bump(word)

    def slot_word(self, key: SlotKey) -> int:
        """The word guarding physical slot ``key`` (allocated on first use, then fixed)."""
        with self._lock:
            word = self._slots.get(key)
            if word is None:
                word = self._slots[key] = self._take(f"slot {key}")
            return word

    def lease(self, owner: str) -> int:
        """The word guarding ``owner``'s blocks (the same word until ``release``)."""
        with self._lock:
            word = self._leases.get(owner)
            if word is None:
                word = self._leases[owner] = self._take(f"request {owner!r}")
            return word

    def release(self, owner: str) -> None:
        """``owner``'s blocks may be overwritten now: advance its word and free it."""
        with self._lock:
            word = self._leases.pop(owner, None)
            if word is not None:
                self._bump(word)
                self._free.append(word)

    def advance_leases(self, leases: Iterable[tuple[str, int]]) -> None:
        """Advance each ``(owner, word)`` whose word is still leased to that owner (a READY of
        the owner that will never be answered READ_DONE).

        A word its owner released since was advanced by ``release`` after the READY took its
        epoch, so a reader of that READY fails already; the word may guard another request
        now, whose reads a second advance would fail for nothing.
        """
        with self._lock:
            for owner, word in leases:
                if self._leases.get(owner) == word:
                    self._bump(word)

    def leased(self) -> int:
        with self._lock:
            return len(self._leases)

    def _take(self, what: str) -> int:
        if not self._free:
            raise FenceExhaustedError(
                f"no epoch word left for {what}: all {self.capacity} are in use "
                f"({len(self._slots)} slots, {len(self._leases)} requests in flight)")
        return self._free.pop()

    def _bump(self, word: int) -> None:
        # One aligned 8-byte store; the lock release after it is a full barrier, and every
        # overwrite it guards is ordered after this call returns.
        self._words[word] = int(self._words[word]) + 1

    def close(self) -> None:
        if self._engine is not None:
            self._engine.unregister(self.address)
            self._engine = None
        # The mapping is left to the garbage collector: a late remote reader must not fault.


class FenceReader:
    """Decode side: read a READY's epoch words after its data read and compare (one per
    receiver thread; its scratch words are registered with ``engine``)."""

    def __init__(self, engine: _Reader, max_fences: int) -> None:
        self._engine = engine
        self._map = mmap.mmap(-1, max(1, max_fences) * WORD_BYTES)
        self._words = (ctypes.c_uint64 * max(1, max_fences)).from_buffer(self._map)
        self._address = ctypes.addressof(self._words)
        self._max = max(1, max_fences)
        engine.register(self._address, self._max * WORD_BYTES)
        self._registered = True

    def stale(self, peer: str, fence_addr: int, fences: Sequence[Fence]) -> str | None:
        """Why the source may have been reused while it was read (a word moved), or None.

        Raises TransferError when the words cannot be read (nothing can be accepted then).
        """
        if not fences:
            return None
        if len(fences) > self._max:
            return f"{len(fences)} fences in one READY; at most {self._max} are accepted"
        count = len(fences)
        self._engine.read(peer, [self._address + i * WORD_BYTES for i in range(count)],
                          [fence_addr + f.word * WORD_BYTES for f in fences],
                          [WORD_BYTES] * count)
        moved = [(f, int(self._words[i])) for i, f in enumerate(fences)
                 if int(self._words[i]) != f.epoch]
        if not moved:
            return None
        shown = ", ".join(f"word {f.word}: epoch {f.epoch} published, {now} after the read"
                          for f, now in moved[:4])
        return (f"fence: the prefill reused the source while it was read ({shown}); the "
                f"bytes read are not trusted")

    def close(self) -> None:
        if self._registered:
            self._registered = False
            self._engine.unregister(self._address)
