"""RemoteD2HConnector settings: kvo-core's validated RemoteD2HConfig plus two glue options.

``kv_connector_extra_config`` holds the RemoteD2HConfig keys (``kv_port`` is required) and:

- ``stats_file``: a path the connector rewrites with its counters as JSON (the demo and the
  benchmark read it; vLLM runs the connector in another process);
- ``engine_wrapper``: ``{"factory": "module:callable", "options": {...}}``, a callable that
  wraps decode's transfer engine (``EngineWrapperSpec``). kvo ships none; the end-to-end tests
  use it to inject faults (tools/pd/faulty_engine.py) into a running server.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError

if TYPE_CHECKING:
    from kvo_vllm.remote_d2h.guarded_engine import EngineWrapper

STATS_FILE = "stats_file"
ENGINE_WRAPPER = "engine_wrapper"
OWN_KEYS = (STATS_FILE, ENGINE_WRAPPER)


@attrs.frozen
class EngineWrapperSpec:
    """``engine_wrapper``: ``{"factory": "module:callable", "options": {...}}``.

    The callable is called as ``factory(engine, layer_regions, **options)`` once decode's
    transfer engine exists and returns the engine the receiver reads through. An extension
    point (tracing, or a test's fault injection); kvo ships no wrapper.
    """

    factory: str
    options: Mapping[str, Any] = attrs.Factory(dict)

    @classmethod
    def from_value(cls, value: Any) -> EngineWrapperSpec | None:
        if value is None:
            return None
        if not isinstance(value, Mapping) or set(value) - {"factory", "options"}:
            raise ConfigError(f"{ENGINE_WRAPPER} must be a mapping with keys 'factory' "
                              f"('module:callable') and optionally 'options', got {value!r}")
        factory = value.get("factory")
        if not isinstance(factory, str) or factory.count(":") != 1 \
                or not all(factory.split(":")):
            raise ConfigError(f"{ENGINE_WRAPPER}.factory must be 'module:callable', "
                              f"got {factory!r}")
        options = value.get("options", {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"{ENGINE_WRAPPER}.options must be a mapping, got {options!r}")
        return cls(factory=factory, options=dict(options))

    def load(self) -> EngineWrapper:
        """The factory with its options bound; ConfigError naming it if it cannot be found."""
        module_name, attribute = self.factory.split(":")
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ConfigError(f"{ENGINE_WRAPPER}.factory {self.factory!r} cannot be loaded: "
                              f"{error}") from error
        if not callable(factory):
            raise ConfigError(f"{ENGINE_WRAPPER}.factory {self.factory!r} is not callable")
        return functools.partial(factory, **self.options)


@attrs.frozen
class RemoteD2HOptions:
    """Everything the connector reads from its ``kv_connector_extra_config``."""

    config: RemoteD2HConfig
    stats_file: str | None = None
    engine_wrapper: EngineWrapperSpec | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> RemoteD2HOptions:
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise ConfigError(f"RemoteD2HConnector: kv_connector_extra_config must be a "
                              f"mapping, got {type(extra).__name__}")
        config = RemoteD2HConfig.from_extra_config(extra, ignore_keys=OWN_KEYS)
        stats_file = extra.get(STATS_FILE)
        if stats_file is not None and (not isinstance(stats_file, str) or not stats_file):
            raise ConfigError(f"{STATS_FILE} must be a file path (non-empty string) or absent, "
                              f"got {stats_file!r}")
        return cls(config=config, stats_file=stats_file,
                   engine_wrapper=EngineWrapperSpec.from_value(extra.get(ENGINE_WRAPPER)))
