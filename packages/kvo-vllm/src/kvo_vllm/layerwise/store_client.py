"""One KV-store client per process and configuration, shared by the connector's two halves.

With an in-process engine the scheduler and the worker connector live in the same process;
one Mooncake client (one transfer engine, one contributed segment) serves both. The client is
closed when its last user releases it.

Backend options come from ``LayerwiseOffloadConfig`` (Mooncake: master address, protocol,
segment size, hostname) plus ``store_options``, a dict in ``kv_connector_extra_config`` passed
to ``kvo_transport.store.create_kv_store`` as is (Memcache needs its service URLs there).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import attrs

from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import ConfigError

STORE_OPTIONS_KEY = "store_options"
"""The extra-config key holding backend options beyond LayerwiseOffloadConfig's fields."""


@attrs.define(eq=False)
class _Client:
    store: Any
    users: int = 0


_lock = threading.Lock()
_clients: dict[str, _Client] = {}
"""The process's store clients by their settings."""


@attrs.frozen(eq=False)
class StoreLease:
    """One user's share of the process's store client for some settings; released once."""

    settings: str
    store: Any

    def release(self) -> None:
        """Drop this user; the last one closes the client."""
        with _lock:
            client = _clients.get(self.settings)
            if client is None or client.store is not self.store:  # released already
                return
            client.users -= 1
            if client.users > 0:
                return
            del _clients[self.settings]
        self.store.close()


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


def acquire_store(config: LayerwiseOffloadConfig, extra_options: Mapping[str, Any]
                  ) -> StoreLease:
    """A share of the process's store client for these settings (created on first use)."""
    options = backend_options(config, extra_options)
    settings = json.dumps([config.store_backend, options], sort_keys=True, default=repr)
    with _lock:
        client = _clients.get(settings)
        if client is None:
            from kvo_transport.store import create_kv_store

            client = _clients[settings] = _Client(
                store=create_kv_store(config.store_backend, **options))
        client.users += 1
        return StoreLease(settings=settings, store=client.store)
