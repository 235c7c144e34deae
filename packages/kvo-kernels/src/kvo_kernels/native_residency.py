"""``NativeResidencyTable``: kvo-core's residency rules run by the C++/OpenMP host op.

The non-fused decode path updates residency on the host CPU once per layer and step, so the
update has to cost microseconds, not a Python loop over rows: ``torch.ops.kvo.residency_update``
(``csrc/residency.cpp``) does one row per OpenMP task in O(K + C). The API and the results are
those of ``kvo_core.residency.ResidencyTable`` and ``ReferenceResidency``, slot for slot.

Input values (stable lengths, states, positions against ``max_seq_len``) are checked inside
the op, before any state changes, to keep the per-call Python overhead to attribute checks.
"""

from __future__ import annotations

import torch

from kvo_core.residency import (
    DEFAULT_MAX_SEQ_LEN,
    EMPTY,
    NO_REQUEST,
    RequestState,
    ResidencyInputError,
    ResidencyOverflowError,
    ResidencyResult,
)
from kvo_kernels.native_build import load_native_ops

_I64 = torch.int64
_CPU = torch.device("cpu")
_OVERFLOW_PREFIX = "residency overflow: "


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ResidencyInputError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _row_tensor(name: str, value: object, ndim: int, rows: int) -> torch.Tensor:
    """An int64 CPU tensor with one entry (ndim 1) or one row (ndim 2) per residency row."""
    if not isinstance(value, torch.Tensor):
        raise ResidencyInputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != _I64:
        raise ResidencyInputError(f"{name} must have dtype torch.int64, got {value.dtype}")
    if value.dim() != ndim or value.shape[0] != rows:
        want = f"[{rows}, K]" if ndim == 2 else f"[{rows}]"
        raise ResidencyInputError(
            f"{name} must have shape {want} (one entry per residency row), "
            f"got {list(value.shape)}")
    if value.device != _CPU:
        raise ResidencyInputError(
            f"{name} must be on cpu (the native residency op runs on the host), "
            f"got {value.device}")
    return value.contiguous()


class NativeResidencyTable:
    """R decode rows x C hot-buffer slots with LRU replacement, updated by the native op."""

    def __init__(self, rows: int, capacity: int, *, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                 device: torch.device | str = "cpu") -> None:
        self._rows = _positive_int("rows", rows)
        self._capacity = _positive_int("capacity", capacity)
        self._max_seq_len = _positive_int("max_seq_len", max_seq_len)
        if torch.device(device) != _CPU:
            raise ResidencyInputError(
                f"device must be cpu (the native residency op runs on the host), got {device!r}")
        load_native_ops()
        self._op = torch.ops.kvo.residency_update
        self._tokens = torch.full((rows, capacity), EMPTY, dtype=_I64)
        self._lru = torch.arange(capacity, dtype=_I64).repeat(rows, 1)
        self._requests = torch.full((rows,), NO_REQUEST, dtype=_I64)
        self._steady = torch.full((rows,), int(RequestState.STEADY), dtype=_I64)

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def device(self) -> torch.device:
        return _CPU

    @property
    def slot_tokens(self) -> torch.Tensor:
        """[R, C] int64 (a copy): the token each slot holds, -1 when empty."""
        return self._tokens.clone()

    @property
    def lru_order(self) -> torch.Tensor:
        """[R, C] int64 (a copy): slot ids, least recently used first."""
        return self._lru.clone()

    @property
    def row_requests(self) -> torch.Tensor:
        """[R] int64 (a copy): the request each row serves, -1 for none."""
        return self._requests.clone()

    def reset_row(self, row: int) -> None:
        """Forget everything a row holds (all slots empty, LRU order 0..C-1, no request)."""
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < self._rows:
            raise ResidencyInputError(f"row must be in [0, {self._rows}), got {row!r}")
        self._tokens[row] = EMPTY
        self._lru[row] = torch.arange(self._capacity, dtype=_I64)
        self._requests[row] = NO_REQUEST

    def update(self, topk: torch.Tensor, request_ids: torch.Tensor, stable_lens: torch.Tensor,
               states: torch.Tensor | None = None, *,
               seq_lens: torch.Tensor | None = None) -> ResidencyResult:
        """Apply one decode step's top-k selection to every row (rules: DESIGN.md section 6).

        ``topk`` [R, K] token positions (negative, or at/after ``seq_lens[r]`` when given, are
        padding; a repeat counts once); ``request_ids`` [R]; ``stable_lens`` [R] (resident
        tokens at or after it are dropped first); ``states`` [R] ``RequestState`` codes,
        default STEADY. Raises ResidencyInputError / ResidencyOverflowError with the table
        unchanged.
        """
        rows = self._rows
        topk = _row_tensor("topk", topk, 2, rows)
        if topk.shape[1] < 1:
            raise ResidencyInputError(
                f"topk must have at least one column, got {list(topk.shape)}")
        request_ids = _row_tensor("request_ids", request_ids, 1, rows)
        stable_lens = _row_tensor("stable_lens", stable_lens, 1, rows)
        states = self._steady if states is None else _row_tensor("states", states, 1, rows)
        if seq_lens is not None:
            seq_lens = _row_tensor("seq_lens", seq_lens, 1, rows)
        try:
            slots, miss_counts, miss_tokens, miss_slots = self._op(
                self._tokens, self._lru, self._requests, topk, request_ids, stable_lens,
                states, seq_lens, self._max_seq_len)
        except ValueError as error:
            raise ResidencyInputError(_first_line(error)) from error
        except RuntimeError as error:
            message = _first_line(error)
            if message.startswith(_OVERFLOW_PREFIX):
                raise ResidencyOverflowError(message[len(_OVERFLOW_PREFIX):]) from error
            raise
        return ResidencyResult(slots=slots, miss_counts=miss_counts,
                               miss_tokens=miss_tokens, miss_slots=miss_slots)


def _first_line(error: BaseException) -> str:
    """The op's own message, without the C++ location torch may append."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
