"""RemoteD2HConnector settings: kvo-core's validated RemoteD2HConfig plus two glue options.

``kv_connector_extra_config`` holds the RemoteD2HConfig keys (``kv_port`` is required) and:

- ``stats_file``: a path the connector rewrites with its counters as JSON (the demo and the
  benchmark read it; vLLM runs the connector in another process);
- ``fault_injection``: test-only faults on decode's data path, ``{"corrupt_reads": bool,
  "fail_reads": int, "control_file": path}`` (corrupt every pulled byte range after it
  arrived; fail the first N engine reads; or read those two settings from a JSON file whenever
  it changes, so a test can switch faults on and off in a running server). They exist so
  end-to-end tests can show that a damaged transfer changes the output and that a failed one
  ends in recompute, with the real engines in other processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError

STATS_FILE = "stats_file"
FAULT_INJECTION = "fault_injection"
OWN_KEYS = (STATS_FILE, FAULT_INJECTION)


@attrs.frozen
class FaultInjection:
    """Deliberate decode-side transfer faults (tests only; all off by default)."""

    corrupt_reads: bool = False
    fail_reads: int = 0
    control_file: str | None = None
    stall_reads_s: float = 0.0  # every read first sleeps this long: a decode that stops answering

    @property
    def active(self) -> bool:
        return (self.corrupt_reads or self.fail_reads > 0 or self.control_file is not None
                or self.stall_reads_s > 0)

    @classmethod
    def from_value(cls, value: Any, *, allow_control_file: bool = True) -> FaultInjection:
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ConfigError(f"{FAULT_INJECTION} must be a mapping like "
                              f"{{'corrupt_reads': true, 'fail_reads': 2}}, got {value!r}")
        known = ("corrupt_reads", "fail_reads", "stall_reads_s",
                 *(("control_file",) if allow_control_file
                                                   else ()))
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(f"{FAULT_INJECTION}: unknown key(s) {unknown}; known keys: "
                              f"{', '.join(known)}")
        corrupt = value.get("corrupt_reads", False)
        fail = value.get("fail_reads", 0)
        if not isinstance(corrupt, bool):
            raise ConfigError(f"{FAULT_INJECTION}.corrupt_reads must be true or false, "
                              f"got {corrupt!r}")
        if not isinstance(fail, int) or isinstance(fail, bool) or fail < 0:
            raise ConfigError(f"{FAULT_INJECTION}.fail_reads must be an integer >= 0, "
                              f"got {fail!r}")
        stall = value.get("stall_reads_s", 0.0)
        if (not isinstance(stall, (int, float)) or isinstance(stall, bool)
                or not 0 <= stall <= 600):
            raise ConfigError(f"{FAULT_INJECTION}.stall_reads_s must be a number of seconds in "
                              f"[0, 600], got {stall!r}")
        control = value.get("control_file")
        if control is not None and (not isinstance(control, str) or not control):
            raise ConfigError(f"{FAULT_INJECTION}.control_file must be a file path, "
                              f"got {control!r}")
        return cls(corrupt_reads=corrupt, fail_reads=fail, control_file=control,
                   stall_reads_s=float(stall))


@attrs.frozen
class RemoteD2HOptions:
    """Everything the connector reads from its ``kv_connector_extra_config``."""

    config: RemoteD2HConfig
    stats_file: str | None = None
    faults: FaultInjection = FaultInjection()

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
                   faults=FaultInjection.from_value(extra.get(FAULT_INJECTION)))
