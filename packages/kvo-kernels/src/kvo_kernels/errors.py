"""Errors raised by kvo-kernels at an op's boundary, before any tensor is read or written."""

from __future__ import annotations

from kvo_core.errors import KvoError


class KernelArgumentError(KvoError, ValueError):
    """An op argument has a bad shape, dtype, device, value or index; the message names it."""


class KernelUnsupportedError(KvoError, NotImplementedError):
    """The request is well formed but this build does not implement it (e.g. an fp8 indexer)."""
