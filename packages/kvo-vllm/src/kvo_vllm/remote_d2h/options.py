"""RemoteD2HConnector settings: kvo-core's validated RemoteD2HConfig plus one glue option.

``kv_connector_extra_config`` holds the RemoteD2HConfig keys (``kv_port`` is required) and
``stats_file``: a path the connector rewrites with its counters as JSON (the demo and the
benchmark read it; vLLM runs the connector in another process).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError

STATS_FILE = "stats_file"
OWN_KEYS = (STATS_FILE,)


@attrs.frozen
class RemoteD2HOptions:
    """Everything the connector reads from its ``kv_connector_extra_config``."""

    config: RemoteD2HConfig
    stats_file: str | None = None

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
        return cls(config=config, stats_file=stats_file)
