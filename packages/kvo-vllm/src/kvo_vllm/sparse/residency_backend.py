"""Picks the per-layer residency table: the native C++/OpenMP op if it builds, else torch.

Both implement kvo-core's rules slot for slot, so the choice changes speed, never results.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from kvo_core.residency import ResidencyTable, ResidencyTableLike

logger = logging.getLogger(__name__)
_fallback_logged = threading.Event()


def make_residency_table(backend: str, rows: int, capacity: int) -> ResidencyTableLike:
    """A table for ``rows`` decode rows of ``capacity`` slots (backend "torch" or "native").

    "native" falls back to the torch table, with one warning per process that says why and
    what it costs, when the C++ op is not available (no compiler, or a kvo-kernels without it).
    """
    if backend == "native":
        try:
            from kvo_kernels.native_residency import NativeResidencyTable

            table: ResidencyTableLike = NativeResidencyTable(rows, capacity)
            return table
        except Exception as error:  # ImportError, NativeBuildError: both mean "not here"
            if not _fallback_logged.is_set():  # once per process, not once per layer
                _fallback_logged.set()
                logger.warning(
                    "kvo: native residency op unavailable, falling back to kvo-core's torch "
                    "ResidencyTable (residency_backend='torch'): same results, but each layer's "
                    "decode step runs several torch ops instead of one C++ call and the miss "
                    "copies and row identity take their torch paths, so decode steps are "
                    "slower (compare: `nox -s bench -- residency`); to get the native op, "
                    "install g++ and run `kvo-build-native-ops`. Cause: %s", error)
    return ResidencyTable(rows, capacity)


def native_host_tables(tables: Sequence[ResidencyTableLike], device: torch.device) -> bool:
    """Whether ``tables`` all run kvo-kernels' native op (so its library is loaded) and the
    hot buffers are host memory: then the miss copies can take kvo's C++ host copy too."""
    if device.type != "cpu" or not tables:
        return False
    try:
        from kvo_kernels.native_residency import NativeResidencyTable
    except ImportError:
        return False
    return all(isinstance(table, NativeResidencyTable) for table in tables)
