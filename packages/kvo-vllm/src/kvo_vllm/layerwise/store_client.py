"""One KV-store client per process and configuration, shared by the connector's two halves.

With an in-process engine the scheduler and the worker connector live in the same process;
one Mooncake client (one transfer engine, one contributed segment) serves both, with the
worker's batched puts in flight through it (``SharedStore``), which the scheduler's prefix
lookup waits for. vLLM builds the two halves separately and hands them nothing in common, so
the process's ``StoreClients`` (``STORE_CLIENTS``) is where they meet: each half holds a
``StoreLease`` and the client is closed when its last lease is released.

Backend options come from ``LayerwiseOffloadConfig`` (Mooncake: master address, protocol,
segment size, hostname) plus ``store_options``, a dict in ``kv_connector_extra_config`` passed
to ``kvo_transport.store.create_kv_store`` as is (Memcache needs its service URLs there).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import ConfigError
from kvo_vllm.layerwise.staging import PendingPuts

STORE_OPTIONS_KEY = "store_options"
"""The extra-config key holding backend options beyond LayerwiseOffloadConfig's fields."""


@attrs.frozen(eq=False)
class SharedStore:
    """A store client and the batched puts in flight through it."""

    store: Any
    pending_puts: PendingPuts = attrs.Factory(PendingPuts)


@attrs.frozen(eq=False)
class StoreLease:
    """One user's share of a ``SharedStore``; released once (again: nothing happens)."""

    shared: SharedStore
    settings: str
    _owner: StoreClients

    def release(self) -> None:
        """Drop this user; the last one closes the client."""
        self._owner.release(self)


class StoreClients:
    """The store clients of a process by their settings, each with its live leases."""

    def __init__(self, create: Callable[..., Any] | None = None) -> None:
        """``create(backend, **options)`` makes a client (``create_kv_store`` by default)."""
        self._create = create
        self._lock = threading.Lock()
        self._shared: dict[str, SharedStore] = {}
        self._leases: dict[str, set[StoreLease]] = {}
        """Per settings, the leases not released yet: the client lives while there is one."""

    def acquire(self, config: LayerwiseOffloadConfig, extra_options: Mapping[str, Any]
                ) -> StoreLease:
        """A share of the client for these settings (created on first use)."""
        options = backend_options(config, extra_options)
        settings = json.dumps([config.store_backend, options], sort_keys=True, default=repr)
        with self._lock:
            shared = self._shared.get(settings)
            if shared is None:
                shared = self._shared[settings] = SharedStore(
                    store=self._creator()(config.store_backend, **options))
                self._leases[settings] = set()
            lease = StoreLease(shared=shared, settings=settings, owner=self)
            self._leases[settings].add(lease)
            return lease

    def release(self, lease: StoreLease) -> None:
        """Drop ``lease``; the client closes with its last one."""
        with self._lock:
            leases = self._leases.get(lease.settings)
            if leases is None or lease not in leases:  # released already
                return
            leases.remove(lease)
            if leases:
                return
            del self._leases[lease.settings], self._shared[lease.settings]
        lease.shared.store.close()

    def _creator(self) -> Callable[..., Any]:
        if self._create is not None:
            return self._create
        from kvo_transport.store import create_kv_store

        return create_kv_store


STORE_CLIENTS = StoreClients()
"""The process's store clients: where the connector halves vLLM builds separately meet."""


def store_options_from(extra: Mapping[str, Any]) -> dict[str, Any]:
    options = extra.get(STORE_OPTIONS_KEY, {})
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(f"{STORE_OPTIONS_KEY} must be a mapping of option names to values, "
                          f"got {options!r}")
    return dict(options)


def backend_options(config: LayerwiseOffloadConfig, extra_options: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """Keyword arguments for ``create_kv_store(config.store_backend, ...)``."""
    options: dict[str, Any] = {}
    if config.store_backend == "mooncake":
        if config.store_master_address is None:
            raise ConfigError(
                "store_master_address must be set for store_backend 'mooncake' (host:port of "
                "a running mooncake_master, e.g. '127.0.0.1:50051'), got None")
        options = {"master_address": config.store_master_address,
                   "hostname": config.local_hostname, "protocol": config.store_protocol,
                   "global_segment_size": config.store_segment_bytes}
    options.update(extra_options)
    return options
