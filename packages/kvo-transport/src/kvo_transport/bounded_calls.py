"""Store calls with a per-call time bound that never leave caller memory in a late call's hands.

Why: a Mooncake client call waits for its master; a master that is frozen (SIGSTOP, a stuck
host) still has its TCP connection accepted by the kernel, and each call then blocks for the
client's RPC timeout (30 s, measured) in vLLM's forward or scheduler. The client's calls release
the GIL, so a call can run in a worker thread while the caller waits at most ``timeout_s`` and
then fails (StoreUnavailableError, which opens the store's circuit breaker).

An abandoned call is still running: when the master wakes up it completes, writing its get's
destinations and reading its put's sources. So no call is ever given caller memory: a get lands
in a bounce buffer (registered with the client, owned here) and is copied to the caller's
ranges only when it finished in time; a put copies the caller's ranges into a bounce buffer
before the call, so whatever it stores, however late, is the bytes the caller asked to store. A
bounce buffer whose call was abandoned goes back to the pool only once that call returned.
The price is one memory copy per call; ``timeout_s`` 0 calls the client directly (unbounded),
except for a put whose caller wants to know when its ranges have been read (``put_keyed``'s
``settle``, ``KVStore.put_from``): that one is still made from a copy.

The pool keeps at most ``max_pooled_bytes`` of free bounce memory: a buffer given back beyond
that (after a burst of concurrent calls, or the late return of calls abandoned while a master
was frozen, each of which made the next call map a buffer of its own) is unregistered and
unmapped, least recently used first. Only a buffer whose call returned is ever given back, so
nothing a late call may still write is unmapped.

Calls that touch no memory (exists, remove) only run in the worker. ``running`` counts the
calls still inside the client: a client with calls running must not be closed (its owner
abandons it instead, see buffer_store.py).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import attrs

from kvo_core.errors import ConfigError
from kvo_transport.errors import StoreError, StoreUnavailableError

log = logging.getLogger("kvo.transport.store")

_R = TypeVar("_R")

DEFAULT_CALL_TIMEOUT_S = 0.75
MAX_CALL_TIMEOUT_S = 600.0
MIN_BOUNCE_BYTES = 1 << 20
MAX_POOLED_BYTES = 64 << 20
"""Free bounce memory kept for later calls at most (one batched put of the default 64 MiB
layerwise save staging fits)."""
MAX_WORKERS = 64
"""Worker threads at most; abandoned calls hold theirs until they return (the circuit breaker
stops new calls meanwhile)."""


def check_call_timeout(backend: str, value: object) -> None:
    """ConfigError unless ``value`` is a store option ``call_timeout_s`` that ``backend``'s
    store accepts: seconds between 0 (unbounded) and MAX_CALL_TIMEOUT_S."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= MAX_CALL_TIMEOUT_S:
        raise ConfigError(f"{backend} store option call_timeout_s={value!r} must be between 0 "
                          f"and {MAX_CALL_TIMEOUT_S:g} seconds (0: unbounded calls)")


def whole_value(code: int, length: int) -> bool:
    """Mooncake's answer for a range that got the whole value: its byte count."""
    return code == length


@attrs.define(eq=False)
class _Bounce:
    """One bounce buffer: anonymous memory registered with the client."""

    memory: mmap.mmap
    anchor: Any
    ptr: int
    capacity: int


class BoundedCalls:
    """Run one store client's calls in worker threads, each waited for at most ``timeout_s``.

    ``register`` / ``unregister`` register bounce memory with the client (return code 0 on
    success). ``name`` names the store in errors and logs. ``max_pooled_bytes``: free bounce
    memory kept for later calls at most.
    """

    def __init__(self, name: str, timeout_s: float, register: Callable[[int, int], int],
                 unregister: Callable[[int, int], int],
                 max_pooled_bytes: int = MAX_POOLED_BYTES) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0 seconds (0: unbounded), got {timeout_s!r}")
        if isinstance(max_pooled_bytes, bool) or not isinstance(max_pooled_bytes, int) \
                or max_pooled_bytes < 0:
            raise ValueError(f"max_pooled_bytes must be an int >= 0, got {max_pooled_bytes!r}")
        self.max_pooled_bytes = max_pooled_bytes
        self.name = name
        self.timeout_s = float(timeout_s)
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._free: list[_Bounce] = []
        """Buffers no call holds, least recently given back first."""
        self._busy: set[_Bounce] = set()
        self._stranded: list[_Bounce] = []
        """Buffers the client would not unregister: kept mapped for good."""
        self.released = 0
        """Bounce buffers unmapped because the free pool was full, over this object's life."""
        self.running = 0
        """Calls inside the client now, abandoned ones included (under _lock)."""
        self.abandoned = 0
        """Calls given up on their deadline, over this object's life."""
        self.late_returns = 0
        """Abandoned calls that returned since (their bounce memory is free again)."""
        self._workers = _Workers(MAX_WORKERS) if self.timeout_s > 0 else None

    @property
    def bounded(self) -> bool:
        return self._workers is not None

    # -- the three kinds of call ---------------------------------------------------------------

    def call(self, what: str, run: Callable[[], _R]) -> _R:
        """A call that touches no caller memory."""
        return self._run(what, run, None)

    def get_into(self, what: str, run: Callable[[list[int]], list[int]],
                 addrs: Sequence[int], lengths: Sequence[int],
                 landed: Callable[[int, int], bool] = whole_value) -> list[int]:
        """``run(destinations)`` returns one code per range; the ranges for which
        ``landed(code, length)`` holds (the client says the value arrived whole) are copied to
        ``addrs``."""
        if not self.bounded:
            return run(list(addrs))
        bounce = self._take(sum(lengths))
        places = _offsets(bounce.ptr, lengths)
        codes = self._run(what, lambda: run(places), bounce)
        for code, source, target, length in zip(codes, places, addrs, lengths, strict=True):
            if landed(code, length):
                ctypes.memmove(target, source, length)
        self._give_back(bounce)
        return codes

    def put_from(self, what: str, run: Callable[[list[int]], _R], addrs: Sequence[int],
                 lengths: Sequence[int], *, copied: Callable[[], None] | None = None) -> _R:
        """``run(sources)`` stores from bounce memory holding a copy of ``addrs``' ranges.

        ``copied`` runs on the caller's thread once the copy is taken, before ``run`` starts;
        when it is given the ranges are copied even for an unbounded call (``timeout_s`` 0),
        so that what ``run`` stores is the copy ``copied`` saw taken, never the caller's
        memory read later."""
        if not self.bounded and copied is None:
            return run(list(addrs))
        bounce = self._take(sum(lengths))
        try:
            places = _offsets(bounce.ptr, lengths)
            for source, target, length in zip(addrs, places, lengths, strict=True):
                ctypes.memmove(target, source, length)
            if copied is not None:
                copied()
        except BaseException:
            self._give_back(bounce)
            raise
        if not self.bounded:
            try:
                return run(places)
            finally:
                self._give_back(bounce)
        result = self._run(what, lambda: run(places), bounce)
        self._give_back(bounce)
        return result

    def put_keyed(self, what: str,
                  put: Callable[[list[str], list[int], list[int]], Sequence[int]],
                  keys: Sequence[str], addrs: Sequence[int], lengths: Sequence[int],
                  settle: Callable[[], Collection[str]] | None = None) -> dict[str, int]:
        """``put(keys, sources, lengths)`` (one return code per key) from a copy of the
        ranges; the code of each key stored. ``settle`` (``KVStore.put_from``) runs once the
        copy is taken: the keys it names are left out of ``put``."""
        left_out: set[str] = set()

        def copied() -> None:
            if settle is not None:
                left_out.update(settle())

        def run(sources: list[int]) -> dict[str, int]:
            kept = [i for i, key in enumerate(keys) if key not in left_out]
            if not kept:
                return {}
            codes = put([keys[i] for i in kept], [sources[i] for i in kept],
                        [lengths[i] for i in kept])
            return {keys[i]: code for i, code in zip(kept, codes, strict=True)}

        return self.put_from(what, run, addrs, lengths,
                             copied=copied if settle is not None else None)

    # -- running -------------------------------------------------------------------------------

    def _run(self, what: str, run: Callable[[], _R], bounce: _Bounce | None) -> _R:
        workers = self._workers
        if workers is None:
            return run()
        with self._lock:
            self.running += 1
        started = time.monotonic()
        future: Future[_R] = workers.submit(run)
        try:
            result = future.result(self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self.abandoned += 1
            # From now on the call owns ``bounce`` until it returns.
            future.add_done_callback(lambda done: self._late(done, bounce, started, what))
            raise StoreUnavailableError(
                f"{self.name}: {what} did not finish within {self.timeout_s:g} s (master frozen "
                f"or unreachable?); the call was abandoned: if it still completes, it touches "
                f"only memory kvo keeps aside until then") from None
        except BaseException:
            self._in_time(bounce)
            raise
        self._in_time(None)
        return result

    def _in_time(self, bounce: _Bounce | None) -> None:
        with self._lock:
            self.running -= 1
        if bounce is not None:
            self._give_back(bounce)

    def _late(self, done: Future[Any], bounce: _Bounce | None, started: float,
              what: str) -> None:
        with self._lock:
            self.running -= 1
            self.late_returns += 1
        error = done.exception()
        log.warning("%s: an abandoned %s returned after %.1f s (%s); its bounce memory is "
                    "free again", self.name, what, time.monotonic() - started,
                    f"raised {error!r}" if error is not None else "its result was dropped")
        if bounce is not None:
            self._give_back(bounce)

    # -- bounce memory -------------------------------------------------------------------------

    def _take(self, nbytes: int) -> _Bounce:
        with self._lock:
            fitting = [b for b in self._free if b.capacity >= nbytes]
            if fitting:
                bounce = min(fitting, key=lambda b: b.capacity)
                self._free.remove(bounce)
                self._busy.add(bounce)
                return bounce
        capacity = max(MIN_BOUNCE_BYTES, 1 << max(0, nbytes - 1).bit_length())
        memory = mmap.mmap(-1, capacity)
        anchor = ctypes.c_char.from_buffer(memory)
        ptr = ctypes.addressof(anchor)
        rc = self._register(ptr, capacity)
        if rc != 0:
            del anchor
            memory.close()
            raise StoreError(f"{self.name}: registering {capacity} bytes of bounce memory "
                             f"failed with code {rc}")
        bounce = _Bounce(memory=memory, anchor=anchor, ptr=ptr, capacity=capacity)
        with self._lock:
            self._busy.add(bounce)
        return bounce

    @property
    def free_bytes(self) -> int:
        """Bounce memory no call holds (kept for later calls)."""
        with self._lock:
            return sum(b.capacity for b in self._free)

    @property
    def busy_bytes(self) -> int:
        """Bounce memory held by calls, abandoned ones that have not returned included."""
        with self._lock:
            return sum(b.capacity for b in self._busy)

    def _give_back(self, bounce: _Bounce) -> None:
        """``bounce``'s call returned: pool it, and unmap the least recently used free buffers
        beyond ``max_pooled_bytes``."""
        excess: list[_Bounce] = []
        with self._lock:
            if bounce not in self._busy:
                return
            self._busy.remove(bounce)
            self._free.append(bounce)
            pooled = sum(b.capacity for b in self._free)
            while pooled > self.max_pooled_bytes:
                oldest = self._free.pop(0)
                pooled -= oldest.capacity
                excess.append(oldest)
            self.released += len(excess)
        for extra in excess:
            self._release(extra)

    def _release(self, bounce: _Bounce) -> None:
        """Unregister and unmap a buffer no call holds or will touch again."""
        rc = self._unregister(bounce.ptr, bounce.capacity)
        if rc != 0:
            log.warning("%s: unregistering %d bytes of bounce memory failed with code %d; it "
                        "stays mapped (the client may still list it)", self.name,
                        bounce.capacity, rc)
            with self._lock:
                self._stranded.append(bounce)
            return
        bounce.anchor = None
        bounce.memory.close()

    def close(self, client_closes: bool) -> None:
        """Stop taking calls. ``client_closes``: the client is closed next (no call is running),
        so the bounce memory is unregistered and unmapped; otherwise it stays mapped for good,
        since an abandoned call may still write it."""
        if self._workers is not None:
            self._workers.stop()
        if not client_closes:
            return
        with self._lock:
            pool, self._free = self._free, []
        for bounce in pool:
            self._release(bounce)


class _Workers:
    """Daemon worker threads, started as calls need them (a stuck call must not hold the
    interpreter's exit, as ThreadPoolExecutor's threads do)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._count = 0

    def submit(self, run: Callable[[], _R]) -> Future[_R]:
        future: Future[_R] = Future()
        with self._lock:
            if self._idle:  # a waiting worker takes it
                self._idle -= 1
            elif self._count < self._limit:
                self._count += 1
                threading.Thread(target=self._work, name="kvo-store-call", daemon=True).start()
        self._tasks.put((future, run))
        return future

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, run = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(run())
                except BaseException as error:
                    future.set_exception(error)
            with self._lock:
                self._idle += 1

    def stop(self) -> None:
        """Idle workers end now, busy ones once their call returns."""
        with self._lock:
            count = self._count
        for _ in range(count):
            self._tasks.put(None)


def _offsets(base: int, lengths: Sequence[int]) -> list[int]:
    places = []
    offset = base
    for length in lengths:
        places.append(offset)
        offset += length
    return places
