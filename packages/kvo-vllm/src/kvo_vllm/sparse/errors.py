"""The error of a host pool shared by TP ranks, catchable as ``kvo_core.errors.KvoError``."""

from __future__ import annotations

from kvo_core.errors import KvoError


class TensorParallelError(KvoError):
    """TP ranks sharing one host pool disagree (pool geometry, or one could not attach)."""
