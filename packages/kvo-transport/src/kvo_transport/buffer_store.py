"""What both KVStore backends share: a store client behind registered-buffer bookkeeping.

Mooncake Store and Memcache both put from / get into registered buffers by key. The region
registry (every batch range must lie inside a registered buffer), register / unregister with
the client, the closed check and close itself are the same for both and live here; a backend
starts its client, then calls ``_start``, and says how its client unregisters a buffer and
names a return code.

Every store call goes through a circuit breaker (circuit_breaker.py, decorator ``guarded``): once
the store is known to be down, calls fail at once with StoreUnavailableError; a backend with a
health probe (Mooncake: a bounded RPC to its master) notices an outage and a recovery in the
background. A backend may bound each call (bounded_calls.py: the call runs in a worker thread
and fails after ``call_timeout_s``; an abandoned call only ever holds bounce memory, never the
caller's). Closing is bounded: the regions are dropped first (a local call), then a client
whose service is down (breaker not closed, the probe fails now, or an abandoned call is still
running) is abandoned instead of closed: Mooncake's close retries a dead master for 7-11 s while
holding the GIL (measured), so no thread could bound it. An abandoned client no longer touches
kvo's memory (its regions are unregistered; its bounce memory stays mapped) and is kept alive
until the process exits.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvo_transport.bounded_calls import BoundedCalls
from kvo_transport.circuit_breaker import BreakerState, CircuitBreaker, HealthWatcher, Probe
from kvo_transport.errors import StoreArgumentError, StoreError, StoreUnavailableError
from kvo_transport.region_owner import RegionOwner
from kvo_transport.regions import MemoryRegion, RegionRegistry

log = logging.getLogger("kvo.transport.store")

_abandoned: list[Any] = []
"""Clients closed while their service was down (see the module docstring)."""


def _abandon(client: Any) -> None:
    """Keep ``client`` alive for good: its destructor would run the same slow teardown at exit."""
    _abandoned.append(client)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="BufferStore")


def guarded(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Run a store call through the store's circuit breaker."""

    def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        breaker = self._breaker
        breaker.before_call()
        started = time.monotonic()
        try:
            result = method(self, *args, **kwargs)
        except StoreUnavailableError as error:
            breaker.on_failure(str(error))
            raise
        except StoreArgumentError:
            breaker.on_neutral()
            raise
        except Exception as error:
            if breaker.timed(started):
                breaker.on_failure(f"a call failed after {time.monotonic() - started:.1f} s: "
                                   f"{error}")
            else:
                breaker.on_neutral()
            raise
        breaker.on_success()
        return result

    functools.update_wrapper(call, method)
    return call


class BufferStore(RegionOwner):
    """Base of the KVStore backends (see the module docstring)."""

    backend = ""
    _label = ""
    """The library's name in messages ("Mooncake", "Memcache")."""

    def _start(self, client: Any, description: str, *, probe: Probe | None = None,
               probe_interval_s: float = 0.25, call_timeout_s: float = 0.0) -> None:
        """``description`` names the client in errors, e.g. the master it talks to; ``probe``
        (optional) checks the service's health every ``probe_interval_s`` in the background;
        ``call_timeout_s`` > 0 bounds each call run through ``self._calls``."""
        self._store: Any = client
        self._description = description
        self._probe = probe
        name = f"{self._label} store {description}"
        self._breaker = CircuitBreaker(name=name, open_error=StoreUnavailableError,
                                       has_probe=probe is not None)
        self._calls = BoundedCalls(
            name, call_timeout_s, register=lambda ptr, n: int(client.register_buffer(ptr, n)),
            unregister=lambda ptr, n: self._unregister_buffer(client, MemoryRegion(ptr, n)))
        self._watcher = (HealthWatcher(self._breaker, probe, probe_interval_s)
                         if probe is not None and probe_interval_s > 0 else None)
        self._own(RegionRegistry(StoreArgumentError))

    @property
    def breaker(self) -> CircuitBreaker:
        """The store's circuit breaker (its state and counters, for logs and tests)."""
        return self._breaker

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
        if self._watcher is not None:
            self._watcher.stop()
        client, self._store = self._store, None
        problem = self._service_problem()
        self._calls.close(client_closes=problem is None)
        if problem is None:
            client.close()
            return
        _abandon(client)
        _abandoned.append(self._calls)  # its bounce memory may still be written
        log.warning("%s store client %s: not closed because the store is down (%s); its "
                    "regions are unregistered and the client is left to the process exit",
                    self._label, self._description, problem)

    def _service_problem(self) -> str | None:
        """Why the service is down now, or None when it seems up."""
        if self._calls.running:
            return (f"{self._calls.running} call(s) abandoned on their deadline are still "
                    f"running in the client")
        if self._breaker.state is not BreakerState.CLOSED:
            return self._breaker.last_error or f"circuit {self._breaker.state.value}"
        return self._probe() if self._probe is not None else None

    def _describe(self) -> str:
        return str(self._description)
