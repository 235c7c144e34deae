"""Errors of the sparse decode offload engine, catchable as ``kvo_core.errors.KvoError``."""

from __future__ import annotations

from kvo_core.errors import KvoError


class SparseOffloadError(KvoError):
    """Base of the engine's errors."""


class AdmissionError(SparseOffloadError, ValueError):
    """A request cannot be admitted (no room in the host pool, no free decode row, bad history).

    Raised before anything is written, so a refused request leaves every other request intact.
    """


class RequestCapacityError(SparseOffloadError):
    """A request reached the end of the host-pool rows reserved for it; nothing was written."""


class UnknownRequestError(SparseOffloadError, KeyError):
    """A call names a request the engine does not hold (never admitted, or already finished)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DecodeInputError(SparseOffloadError, ValueError):
    """A decode call's rows or queries have the wrong shape, or its layer is out of order."""


class TensorParallelError(SparseOffloadError):
    """TP ranks sharing one host pool disagree (pool geometry or row allocation)."""
