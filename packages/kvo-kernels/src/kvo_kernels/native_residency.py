"""``NativeResidencyTable``: kvo-core's residency rules run by the C++/OpenMP host op.

The non-fused decode path updates residency on the host CPU once per layer and step, so the
update has to cost microseconds, not a Python loop over rows: ``torch.ops.kvo.residency_update``
(``csrc/residency.cpp``) does one row per OpenMP task. Each row keeps its LRU order between
steps as a deep log plus a window (what the last step selected), with every slot's token in
the entries, so a steady step does O(K) random work in per-thread tables and reads the row's
own arrays front to back (``csrc/residency_rows.h``). The API and the results are those of
``kvo_core.residency.ResidencyTable`` and ``ReferenceResidency``, slot for slot.

Every argument and value is checked inside the op, before any state changes, so a valid call
costs no Python checks at all; when the op refuses a call, the Python checks run to name the
bad argument in kvo-core's words. The table calls the op's C++ function through its Python
binding, without the dispatcher (the same function ``torch.ops.kvo.residency_update`` runs).
"""

from __future__ import annotations

import torch

from kvo_core.residency import (
    DEFAULT_MAX_SEQ_LEN,
    EMPTY,
    NO_REQUEST,
    TOPK_DTYPES,
    RequestState,
    ResidencyInputError,
    ResidencyOverflowError,
    ResidencyResult,
)
from kvo_core.residency.inputs import out_buffers
from kvo_kernels.native_build import load_native_ops

_I64 = torch.int64
_CPU = torch.device("cpu")
_OVERFLOW_PREFIX = "residency overflow: "
SLOT_BITS = 20
MAX_CAPACITY = 1 << SLOT_BITS
"""The largest capacity the op takes (an entry packs its slot in 20 bits)."""
MAX_SEQ_LEN = 1 << 31
"""The largest max_seq_len the op takes (tokens are int32 outputs; an entry packs its token in
the other 43 bits)."""
TOMBSTONE = NO_ENTRY = -(1 << 63)
"""A hole in the deep log, and a window entry past the window's end: no entry equals it."""


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ResidencyInputError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _row_tensor(name: str, value: object, ndim: int, rows: int,
                dtypes: tuple[torch.dtype, ...] = (_I64,)) -> torch.Tensor:
    """A CPU tensor with one entry (ndim 1) or one row (ndim 2) per residency row."""
    if not isinstance(value, torch.Tensor):
        raise ResidencyInputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise ResidencyInputError(f"{name} must have dtype {allowed}, got {value.dtype}")
    if value.dim() != ndim or value.shape[0] != rows:
        want = f"[{rows}, K]" if ndim == 2 else f"[{rows}]"
        raise ResidencyInputError(
            f"{name} must have shape {want} (one entry per residency row), "
            f"got {list(value.shape)}")
    if value.device != _CPU:
        raise ResidencyInputError(
            f"{name} must be on cpu (the native residency op runs on the host), "
            f"got {value.device}")
    return value


class NativeResidencyTable:
    """R decode rows x C hot-buffer slots with LRU replacement, updated by the native op.

    Per row the state is (``csrc/lru_log.h``): ``_tokens`` [R, C] int64, the token of each
    slot (-1 empty); the LRU order as ``_deep`` [R, L] (the older slots, oldest first, a
    circular log) followed by ``_window`` [R, W] (the slots the last step filled or hit),
    entries ``token << 20 | slot`` (W, L: the power of two >= C); ``_meta`` [R, 4] (an upper
    bound on the resident tokens, the window length, the deep log's head and tail
    positions); ``_requests`` [R]. 8 * (C + W + L) + 40 bytes per row: 6 MiB for R=32,
    C=8192.
    """

    def __init__(self, rows: int, capacity: int, *, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                 device: torch.device | str = "cpu") -> None:
        self._rows = _positive_int("rows", rows)
        self._capacity = _positive_int("capacity", capacity)
        self._max_seq_len = _positive_int("max_seq_len", max_seq_len)
        if capacity > MAX_CAPACITY:
            raise ResidencyInputError(
                f"capacity must be <= 2**20 = {MAX_CAPACITY} (slot ids are int32 results and "
                f"packed in 20 bits), got {capacity}")
        if max_seq_len > MAX_SEQ_LEN:
            raise ResidencyInputError(
                f"max_seq_len must be <= 2**31 = {MAX_SEQ_LEN} (token positions are int32 "
                f"results), got {max_seq_len}")
        if torch.device(device) != _CPU:
            raise ResidencyInputError(
                f"device must be cpu (the native residency op runs on the host), got {device!r}")
        ops = load_native_ops()
        self._op, self._op_out = ops.residency_update, ops.residency_update_out
        width = 1 << (capacity - 1).bit_length()  # W = L: the power of two >= C
        self._fresh_deep = torch.full((width,), TOMBSTONE, dtype=_I64)
        self._fresh_deep[:capacity] = pack(-1, torch.arange(capacity, dtype=_I64))
        self._fresh_meta = torch.tensor([EMPTY, 0, 0, capacity], dtype=_I64)
        self._tokens = torch.full((rows, capacity), EMPTY, dtype=_I64)
        self._window = torch.full((rows, width), NO_ENTRY, dtype=_I64)
        self._deep = self._fresh_deep.repeat(rows, 1)
        self._meta = self._fresh_meta.repeat(rows, 1)
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
        """[R, C] int64 (new): slot ids, least recently used first (read out in O(C))."""
        try:
            order: torch.Tensor = torch.ops.kvo.residency_lru_order.default(
                self._tokens, self._window, self._deep, self._meta)
        except ValueError as error:
            raise ResidencyInputError(_first_line(error)) from error
        return order

    @property
    def row_requests(self) -> torch.Tensor:
        """[R] int64 (a copy): the request each row serves, -1 for none."""
        return self._requests.clone()

    def reset_row(self, row: int) -> None:
        """Forget everything a row holds (all slots empty, LRU order 0..C-1, no request)."""
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < self._rows:
            raise ResidencyInputError(f"row must be in [0, {self._rows}), got {row!r}")
        self._tokens[row] = EMPTY
        self._window[row] = NO_ENTRY
        self._deep[row] = self._fresh_deep
        self._meta[row] = self._fresh_meta
        self._requests[row] = NO_REQUEST

    def update(self, topk: torch.Tensor, request_ids: torch.Tensor, stable_lens: torch.Tensor,
               states: torch.Tensor | None = None, *, seq_lens: torch.Tensor | None = None,
               out: ResidencyResult | None = None) -> ResidencyResult:
        """Apply one decode step's top-k selection to every row (rules: docs/design.md section 6).

        ``topk`` [R, K] token positions, int32 or int64 (negative, or at/after ``seq_lens[r]``
        when given, are padding; a repeat counts once); ``request_ids`` [R]; ``stable_lens``
        [R] (resident tokens at or after it are dropped first); ``states`` [R]
        ``RequestState`` codes, default STEADY; these int64. All CPU tensors. ``out``: buffers
        to write the int32 result into and return (contiguous int32, shapes [R, K], [R],
        [R, K], [R, K], sharing no memory with the arguments or each other), e.g. allocated
        once for a decode loop; by default the result is new tensors. Raises
        ResidencyInputError / ResidencyOverflowError with the table unchanged (``out`` may
        then hold anything).
        """
        if states is None:
            states = self._steady
        if out is None:
            buffers = None
        elif type(out) is ResidencyResult:  # the common case, without out_buffers' checks:
            # the op refuses anything but tensors, and then out_buffers names the bad field
            buffers = (out.slots, out.miss_counts, out.miss_tokens, out.miss_slots)
        else:
            buffers = out_buffers(out)
        try:
            if buffers is None:
                slots, miss_counts, miss_tokens, miss_slots = self._op(
                    self._tokens, self._window, self._deep, self._meta, self._requests, topk,
                    request_ids, stable_lens, states, seq_lens, self._max_seq_len)
            else:
                self._op_out(self._tokens, self._window, self._deep, self._meta,
                             self._requests, topk, request_ids, stable_lens, states, seq_lens,
                             self._max_seq_len, *buffers)
                slots, miss_counts, miss_tokens, miss_slots = buffers
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
            if out is not None:
                out_buffers(out)  # a field that is not a tensor, named
            message = _first_line(error)
            if isinstance(error, RuntimeError) and message.startswith(_OVERFLOW_PREFIX):
                raise ResidencyOverflowError(message[len(_OVERFLOW_PREFIX):]) from error
            # Name the bad argument the way kvo-core does, where a Python check can see it.
            self._check_arguments(topk, request_ids, stable_lens, states, seq_lens)
            if isinstance(error, ValueError):
                raise ResidencyInputError(message) from error
            raise
        if out is not None:
            return out
        return ResidencyResult(slots=slots, miss_counts=miss_counts,
                               miss_tokens=miss_tokens, miss_slots=miss_slots)

    def _check_arguments(self, topk: object, request_ids: object, stable_lens: object,
                         states: object, seq_lens: object) -> None:
        """Type, dtype, shape and device of every argument (values: the op's own messages)."""
        rows = self._rows
        checked = _row_tensor("topk", topk, 2, rows, TOPK_DTYPES)
        if checked.shape[1] < 1:
            raise ResidencyInputError(
                f"topk must have at least one column, got {list(checked.shape)}")
        _row_tensor("request_ids", request_ids, 1, rows)
        _row_tensor("stable_lens", stable_lens, 1, rows)
        _row_tensor("states", states, 1, rows)
        if seq_lens is not None:
            _row_tensor("seq_lens", seq_lens, 1, rows)


def pack(token: int | torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
    """``token << 20 | slot``: how the LRU order's entries carry a slot and its token."""
    return (torch.as_tensor(token, dtype=_I64) << SLOT_BITS) | torch.as_tensor(slot, dtype=_I64)


def _first_line(error: BaseException) -> str:
    """The op's own message, without the C++ location torch may append."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
