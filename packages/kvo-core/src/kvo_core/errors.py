"""Exceptions shared by every kvo package, so callers can catch kvo's errors by kind."""

from __future__ import annotations


class KvoError(Exception):
    """Base of every error kvo raises on purpose."""


class ConfigError(KvoError, ValueError):
    """A configuration value is invalid; the message names the field, the value and the allowed."""


class PlanError(KvoError, ValueError):
    """A layer buffer plan cannot be built for the given layers (e.g. incompatible sizes)."""


class SlotFailedError(KvoError):
    """A consumer of a physical buffer slot (store save, remote read) reported a failure."""


class SlotTimeoutError(KvoError, TimeoutError):
    """Waiting on a physical buffer slot passed its deadline; names the slot and missing parts."""
