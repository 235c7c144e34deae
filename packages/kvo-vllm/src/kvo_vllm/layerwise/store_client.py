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

from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import ConfigError

STORE_OPTIONS_KEY = "store_options"
"""The extra-config key holding backend options beyond LayerwiseOffloadConfig's fields."""

_lock = threading.Lock()
_clients: dict[str, list[Any]] = {}  # settings -> [store, number of users]


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


def acquire_store(config: LayerwiseOffloadConfig, extra_options: Mapping[str, Any]) -> Any:
    """The process's store client for these settings (created on first use)."""
    options = backend_options(config, extra_options)
    key = json.dumps([config.store_backend, options], sort_keys=True, default=repr)
    with _lock:
        entry = _clients.get(key)
        if entry is None:
            from kvo_transport.store import create_kv_store

            entry = [create_kv_store(config.store_backend, **options), 0]
            _clients[key] = entry
        entry[1] += 1
        return entry[0]


def release_store(store: Any) -> None:
    """Drop one user of ``store``; the last one closes the client."""
    with _lock:
        for key, entry in _clients.items():
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _clients[key]
                break
        else:
            return
    store.close()
