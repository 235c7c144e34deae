"""Decode-side residency of the hot KV buffer (docs/design.md section 6).

Per layer, R decode rows x C slots: which token each slot holds, LRU replacement, and per step
the slot of every top-k position plus the host -> device copies (misses). Two implementations
that agree slot for slot: ``ReferenceResidency`` (pure Python, reads like the rules) and
``ResidencyTable`` (vectorised torch, used at run time); ``belady_min_misses`` is the offline
optimum to judge the policy by; ``ResidencyTableLike`` is what a caller holding any of
them (or kvo-kernels' native table) relies on.
"""

from kvo_core.residency.belady import belady_min_misses
from kvo_core.residency.inputs import (
    DEFAULT_MAX_SEQ_LEN,
    MAX_CAPACITY,
    MAX_SEQ_LEN,
    RESULT_DTYPE,
    TOPK_DTYPES,
)
from kvo_core.residency.protocol import ResidencyTableLike
from kvo_core.residency.reference import ReferenceResidency
from kvo_core.residency.state import (
    EMPTY,
    NO_REQUEST,
    RequestState,
    ResidencyInputError,
    ResidencyOverflowError,
    ResidencyResult,
)
from kvo_core.residency.table import ResidencyTable

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "EMPTY",
    "MAX_CAPACITY",
    "MAX_SEQ_LEN",
    "NO_REQUEST",
    "RESULT_DTYPE",
    "TOPK_DTYPES",
    "ReferenceResidency",
    "RequestState",
    "ResidencyInputError",
    "ResidencyOverflowError",
    "ResidencyResult",
    "ResidencyTable",
    "ResidencyTableLike",
    "belady_min_misses",
]
