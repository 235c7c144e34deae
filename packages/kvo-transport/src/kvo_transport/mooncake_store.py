"""The ``mooncake`` KVStore backend: a Mooncake Store client (MooncakeDistributedStore).

Mooncake's plain put keeps an existing key's old value, so put_from uses the upsert call.
Mooncake grants a short read lease on put, get and exists (an existence query renews it too:
measured); remove() waits out a lease instead of forcing,
because forcing could pull a value from under a concurrent reader. A remove that gives up on a
lease (``remove_timeout_s``, shorter than the master's lease TTL) raises StoreLeaseHeldError,
which the circuit breaker does not count as an outage: the master answered every try (each try
is a breaker call of its own, see ``remove``).

A master that is down makes calls fail with RPC_FAIL; one that is frozen (its connections still
accepted) makes each call wait for the client's RPC timeout (30 s). Every call is therefore
bounded (``call_timeout_s``, bounded_calls.py: it runs in a worker thread, through bounce
memory, so an abandoned call never writes or reads the caller's ranges later). Such failures
raise StoreUnavailableError and open the store's circuit breaker (buffer_store.py). A health
probe every ``health_probe_interval_s`` asks the master something: a TCP connect (a dead master
fails it at once), then a bounded RPC (an existence query) that a frozen master leaves
unanswered; it opens the breaker before a call has to find out, and half-opens it once the
master answers again.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

from kvo_core.config import MIN_SEGMENT_BYTES, MOONCAKE_PROTOCOLS  # one owner: kvo-core's config
from kvo_core.errors import ConfigError
from kvo_transport.bounded_calls import DEFAULT_CALL_TIMEOUT_S, check_call_timeout
from kvo_transport.buffer_store import BufferStore, guarded
from kvo_transport.errors import (
    StoreError,
    StoreLeaseHeldError,
    StoreUnavailableError,
    backend_unavailable,
)
from kvo_transport.keyed_batch import check_keyed_batch, check_keys

# Mooncake Store ErrorCode values (mooncake-store/include/types.h) that kvo reports by name.
MOONCAKE_STORE_ERRORS = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -200: "NO_AVAILABLE_HANDLE (store full)",
    -600: "INVALID_PARAMS (e.g. destination smaller than the value)",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
RPC_TIMEOUT = -901
UNAVAILABLE = frozenset({RPC_FAIL, RPC_TIMEOUT})
"""Codes that mean the master could not be reached (not a problem of one key)."""


def error_name(code: int) -> str:
    return f"{code} {MOONCAKE_STORE_ERRORS.get(code, 'unknown error')}"


def import_mooncake_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise backend_unavailable("mooncake", "mooncake", exc) from exc
    return MooncakeDistributedStore


@attrs.frozen
class MooncakeStoreOptions:
    """Arguments of MooncakeDistributedStore.setup, plus kvo's remove() patience."""

    master_address: str
    hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = MIN_SEGMENT_BYTES
    local_buffer_size: int = MIN_SEGMENT_BYTES
    protocol: str = "tcp"
    rdma_devices: str = ""
    remove_timeout_s: float = 5.0
    """How long remove() waits out keys' read leases before it gives up on them
    (StoreLeaseHeldError, not an outage). mooncake_master's own default lease TTL is 10 s."""
    health_probe_interval_s: float = 0.25
    """How often the master is probed (a TCP connect, then a bounded RPC); 0: no probe."""
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    """The longest a store call may take before it fails (StoreUnavailableError) and opens the
    circuit breaker; 0: calls go to the client directly, unbounded (no bounce copy)."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MooncakeStoreOptions:
        allowed = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown mooncake store option(s) {unknown}; allowed: {allowed}")
        if "master_address" not in options:
            raise ConfigError(
                "mooncake store option master_address is required (host:port of mooncake_master)"
            )
        made = cls(**options)
        host, _, port = made.master_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"mooncake store option master_address={made.master_address!r} must be host:port"
            )
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(made, name)
            if not isinstance(value, int) or value < MIN_SEGMENT_BYTES:
                raise ConfigError(
                    f"mooncake store option {name}={value!r} must be an int >= {MIN_SEGMENT_BYTES} "
                    "(16 MiB; Mooncake rejects smaller segments)"
                )
        if made.protocol not in MOONCAKE_PROTOCOLS:
            raise ConfigError(
                f"mooncake store option protocol={made.protocol!r}; allowed: "
                f"{', '.join(MOONCAKE_PROTOCOLS)}"
            )
        if not made.remove_timeout_s > 0:
            raise ConfigError(
                f"mooncake store option remove_timeout_s={made.remove_timeout_s!r} must be > 0"
            )
        interval = made.health_probe_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
            raise ConfigError(f"mooncake store option health_probe_interval_s={interval!r} must "
                              f"be >= 0 seconds (0: no probe)")
        check_call_timeout("mooncake", made.call_timeout_s)
        return made


class MooncakeKVStore(BufferStore):
    """kvo's KVStore over one Mooncake Store client."""

    backend = "mooncake"
    _label = "Mooncake"

    def __init__(self, **options: Any) -> None:
        self.options = MooncakeStoreOptions.from_options(options)
        store_class = import_mooncake_store_class()
        client = store_class()
        o = self.options
        rc = client.setup(
            o.hostname,
            o.metadata_server,
            o.global_segment_size,
            o.local_buffer_size,
            o.protocol,
            o.rdma_devices,
            o.master_address,
        )
        if rc != 0:
            raise StoreError(
                f"Mooncake Store setup against master {o.master_address} failed with return code "
                f"{rc} (is mooncake_master running there?)"
            )
        self._start(client, f"for master {o.master_address}",
                    probe=MasterProbe(client, o.master_address, PROBE_TIMEOUT_S),
                    probe_interval_s=o.health_probe_interval_s,
                    call_timeout_s=o.call_timeout_s)

    def _code(self, rc: int) -> str:
        return error_name(rc)

    @guarded
    def put_from(
        self, keys: Sequence[str], addrs: Sequence[int], lengths: Sequence[int], *,
        settle: Callable[[], Collection[str]] | None = None,
    ) -> None:
        store = self._client()
        batch = check_keyed_batch(self._registry, keys, addrs, lengths, unique=True)
        if not batch.keys:
            if settle is not None:
                settle()
            return
        codes = self._calls.put_keyed(f"put of {len(batch.keys)} keys",
                                      store.batch_upsert_from, batch.keys, batch.addrs,
                                      batch.lengths, settle)
        failed = {k: error_name(c) for k, c in codes.items() if c != 0}
        if failed:
            raise _error(list(codes.values()))(
                f"Mooncake put of {len(failed)}/{len(codes)} keys failed: {failed}"
            )

    @guarded
    def get_into(
        self, keys: Sequence[str], addrs: Sequence[int], lengths: Sequence[int]
    ) -> list[bool]:
        store = self._client()
        batch = check_keyed_batch(self._registry, keys, addrs, lengths, unique=False)
        if not batch.keys:
            return []
        # Mooncake answers a key named twice in one batch with success for both destinations
        # but writes only one (measured): ask for each key once, then copy it locally.
        first: dict[str, int] = {}
        for i, key in enumerate(batch.keys):
            first.setdefault(key, i)
        asked = sorted(first.values())
        asked_keys = [batch.keys[i] for i in asked]
        asked_lengths = [batch.lengths[i] for i in asked]
        codes = self._calls.get_into(
            f"get of {len(asked_keys)} keys",
            lambda destinations: store.batch_get_into(asked_keys, destinations, asked_lengths),
            [batch.addrs[i] for i in asked], asked_lengths)
        code_of = dict(zip(asked, codes, strict=True))
        codes = [code_of[first[key]] for key in batch.keys]
        found: list[bool] = []
        failed: dict[str, str] = {}
        for i, (key, size, code) in enumerate(zip(batch.keys, batch.lengths, codes,
                                                  strict=True)):
            source = first[key]
            if source != i and code == batch.lengths[source] == size:
                ctypes.memmove(batch.addrs[i], batch.addrs[source], size)
            if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                found.append(False)
            elif code == size:
                found.append(True)
            elif code >= 0:
                failed[key] = f"stored value has {code} bytes, destination has {size}"
                found.append(False)
            else:
                failed[key] = error_name(code)
                found.append(False)
        if failed:
            raise _error(codes)(
                f"Mooncake get of {len(failed)}/{len(batch.keys)} keys failed: {failed}"
            )
        return found

    @guarded
    def exists(self, keys: Sequence[str]) -> list[bool]:
        store = self._client()
        checked = check_keys(keys)
        if not checked:
            return []
        codes = self._calls.call(f"exists() of {len(checked)} keys",
                                 lambda: store.batch_is_exist(checked))
        failed = {k: error_name(c) for k, c in zip(checked, codes, strict=True)
                  if c not in (0, 1)}
        if failed:
            raise _error(codes)(f"Mooncake exists() could not query keys {failed}")
        return [c == 1 for c in codes]

    def remove(self, keys: Sequence[str]) -> None:
        """Remove ``keys``, waiting out read leases for up to ``remove_timeout_s``.

        Each try is a store call of its own through the circuit breaker, so a try the master
        answers with OBJECT_HAS_LEASE counts as an answer (it closes a half-open breaker),
        and the wait between tries holds no breaker trial: a half-open breaker's trial that
        waited out a lease would fail every other call fast meanwhile. Giving up on a lease
        (StoreLeaseHeldError) is no outage."""
        pending = check_keys(keys)
        deadline = time.monotonic() + self.options.remove_timeout_s
        while pending:
            pending = self._remove_once(pending)
            if pending and time.monotonic() > deadline:
                raise StoreLeaseHeldError(
                    f"Mooncake remove: keys {pending} still hold a read lease after "
                    f"{self.options.remove_timeout_s} s (remove_timeout_s; the master's lease "
                    f"TTL is longer?): not removed"
                )
            if pending:
                time.sleep(0.02)

    @guarded
    def _remove_once(self, keys: list[str]) -> list[str]:
        """One batch_remove; the keys that still hold a read lease."""
        store = self._client()
        codes = self._calls.call(f"remove of {len(keys)} keys",
                                 functools.partial(store.batch_remove, keys))
        failed = {
            k: error_name(c)
            for k, c in zip(keys, codes, strict=True)
            if c not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)
        }
        if failed:
            raise _error(codes)(f"Mooncake remove failed for keys {failed}")
        return [k for k, c in zip(keys, codes, strict=True) if c == OBJECT_HAS_LEASE]

PROBE_TIMEOUT_S = 0.5
PROBE_KEY = "kvo/health-probe"
"""Asked for by the RPC probe; nothing stores it."""


def _error(codes: Sequence[int]) -> type[StoreError]:
    """StoreUnavailableError when a code says the master was not reached."""
    return StoreUnavailableError if UNAVAILABLE.intersection(codes) else StoreError


class MasterProbe:
    """The store's health probe: a TCP connect to the master, then an RPC through the client
    (an existence query) that must answer within ``timeout_s``. The RPC runs in a thread of its
    own; while one is stuck (a frozen master) no other is started and the probe reports it."""

    def __init__(self, client: Any, address: str, timeout_s: float) -> None:
        self._client = client
        self._address = address
        self._timeout_s = timeout_s
        self._stuck: threading.Thread | None = None
        self._stuck_since = 0.0

    def __call__(self) -> str | None:
        problem = probe_master(self._address, self._timeout_s)
        if problem is not None:
            return problem
        if self._stuck is not None:
            if self._stuck.is_alive():
                return (f"master {self._address} accepts connections but has not answered a "
                        f"probe RPC for {time.monotonic() - self._stuck_since:.1f} s (frozen?)")
            self._stuck = None
        answer: list[Any] = []

        def ask() -> None:
            try:
                answer.append(list(self._client.batch_is_exist([PROBE_KEY])))
            except Exception as exc:  # reported below
                answer.append(exc)

        thread = threading.Thread(target=ask, name="kvo-store-probe", daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(self._timeout_s)
        if thread.is_alive():
            self._stuck, self._stuck_since = thread, started
            return (f"master {self._address} accepts connections but did not answer a probe "
                    f"RPC within {self._timeout_s:g} s (frozen?)")
        result = answer[0] if answer else RuntimeError("no answer")
        if isinstance(result, BaseException):
            return f"probe RPC to master {self._address} raised {result!r}"
        if not result or result[0] not in (0, 1):
            code = result[0] if result else "none"
            return (f"master {self._address} answered the probe RPC with "
                    f"{error_name(code) if isinstance(code, int) else code}")
        return None


def probe_master(address: str, timeout_s: float) -> str | None:
    """None when the master at ``host:port`` accepts a TCP connection, else why not."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"master {address} does not accept connections: {exc}"
