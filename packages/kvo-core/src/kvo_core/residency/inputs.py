"""Boundary checks for residency tables: bad input fails here, with the value and what is allowed.

Both implementations call these before touching any state, so an invalid call never leaves a
table half updated.
"""

from __future__ import annotations

import attrs
import torch

from kvo_core.residency.state import (
    RESULT_FIELDS,
    RequestState,
    ResidencyInputError,
    ResidencyResult,
)

DEFAULT_MAX_SEQ_LEN = 1 << 20
"""Default bound on token positions (exclusive). A larger selected position is a caller bug."""

MAX_CAPACITY = 1 << 20
"""The most slots a row may have: slot ids below 2**20 (the native op packs them in 20 bits)."""

MAX_SEQ_LEN = 1 << 31
"""The largest max_seq_len a table takes: every token position fits the int32 results."""

RESULT_DTYPE = torch.int32
"""The dtype of every ResidencyResult field."""

TOPK_DTYPES = (torch.int32, torch.int64)
"""The dtypes a top-k selection may come in (vLLM's indexers give int32)."""


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ResidencyInputError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_dimensions(rows: object, capacity: object, max_seq_len: object) -> tuple[int, int, int]:
    """Validate a table's constructor arguments and return them as ints."""
    checked = (_positive_int("rows", rows), _positive_int("capacity", capacity),
               _positive_int("max_seq_len", max_seq_len))
    if checked[1] > MAX_CAPACITY:
        raise ResidencyInputError(
            f"capacity must be <= 2**20 = {MAX_CAPACITY} (slot ids are int32 results and "
            f"packed in 20 bits), got {checked[1]}")
    if checked[2] > MAX_SEQ_LEN:
        raise ResidencyInputError(
            f"max_seq_len must be <= 2**31 = {MAX_SEQ_LEN} (token positions are int32 results), "
            f"got {checked[2]}")
    return checked


def _index_tensor(name: str, value: object, ndim: int, rows: int,
                  device: torch.device | None,
                  dtypes: tuple[torch.dtype, ...] = (torch.int64,)) -> torch.Tensor:
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
    if device is not None and value.device != device:
        raise ResidencyInputError(f"{name} must be on {device}, got {value.device}")
    return value


@attrs.frozen(eq=False)
class CheckedUpdate:
    """What validation learned and both implementations need next."""

    states: torch.Tensor
    """[R] int64 request states (STEADY where the caller passed None)."""
    in_range: torch.Tensor
    """[R, K] bool: False for padding (negative, or at/after ``seq_lens[r]`` when given)."""
    max_token: int
    """Largest in-range top-k entry, -1 when there is none."""


def check_update_inputs(rows: int, max_seq_len: int, topk: object, request_ids: object,
                        stable_lens: object, states: object, seq_lens: object,
                        device: torch.device | None = None) -> CheckedUpdate:
    """Validate one update's arguments (nothing is changed yet when this raises).

    Top-k entries that are negative, or at/after ``seq_lens[r]`` when given, are padding.
    Every other entry must be below ``max_seq_len``.
    """
    topk_t = _index_tensor("topk", topk, 2, rows, device, TOPK_DTYPES)
    if topk_t.shape[1] < 1:
        raise ResidencyInputError(f"topk must have at least one column, got {list(topk_t.shape)}")
    _index_tensor("request_ids", request_ids, 1, rows, device)
    stable = _index_tensor("stable_lens", stable_lens, 1, rows, device)
    if bool((stable < 0).any()):
        raise ResidencyInputError(
            f"stable_lens must be >= 0, got {stable.tolist()}")
    in_range = topk_t >= 0
    if seq_lens is not None:
        lens = _index_tensor("seq_lens", seq_lens, 1, rows, device)
        if bool((lens < 0).any()):
            raise ResidencyInputError(f"seq_lens must be >= 0, got {lens.tolist()}")
        in_range &= topk_t < lens[:, None]
    # Largest in-range entry (-1 if none), without a where (slow on CPU for integers).
    if seq_lens is None:
        max_token = max(int(topk_t.max()), -1)
    else:
        max_token = int(((topk_t.long() + 1) * in_range).max()) - 1
    if max_token >= max_seq_len:
        raise ResidencyInputError(
            f"topk holds token position {max_token}, at or beyond max_seq_len={max_seq_len}; "
            f"raise max_seq_len or pass seq_lens so such entries count as padding")
    if states is None:
        steady = torch.full((rows,), int(RequestState.STEADY), dtype=torch.int64,
                            device=topk_t.device)
        return CheckedUpdate(steady, in_range, max_token)
    states_t = _index_tensor("states", states, 1, rows, device)
    allowed = sorted(int(s) for s in RequestState)  # a contiguous range: -3, -2, -1
    if bool(((states_t < allowed[0]) | (states_t > allowed[-1])).any()):
        raise ResidencyInputError(
            f"states must hold only {allowed} (NOT_OFFLOADED, FIRST_OFFLOAD, STEADY), "
            f"got {states_t.tolist()}")
    return CheckedUpdate(states_t, in_range, max_token)


def check_out(out: object, rows: int, width: int, device: torch.device) -> None:
    """The caller's output buffers of an update, checked before anything changes.

    int32 tensors on the table's device shaped like the result ([R, K], [R], [R, K], [R, K]),
    no two sharing memory (each is written whole).
    """
    spans = []
    for name, buffer in zip(RESULT_FIELDS, out_buffers(out), strict=True):
        shape = [rows] if name == "miss_counts" else [rows, width]
        if buffer.dtype != RESULT_DTYPE or list(buffer.shape) != shape:
            raise ResidencyInputError(
                f"out.{name} must be int32 of shape {shape}, got {buffer.dtype} "
                f"{list(buffer.shape)}")
        if buffer.device != device:
            raise ResidencyInputError(
                f"out.{name} must be on {device} (the table's device), got {buffer.device}")
        spans.append((name, *_byte_span(buffer)))
    for i, (name, begin, end) in enumerate(spans):
        for other, other_begin, other_end in spans[i + 1:]:
            if begin < other_end and other_begin < end:
                raise ResidencyInputError(
                    f"out.{name} shares memory with out.{other}; pass separate buffers")


def out_buffers(out: object) -> tuple[torch.Tensor, ...]:
    """The four tensors of an ``out`` argument, in RESULT_FIELDS order (types checked only)."""
    if not isinstance(out, ResidencyResult):
        raise ResidencyInputError(
            f"out must be a ResidencyResult of buffers, got {type(out).__name__}")
    buffers = tuple(getattr(out, name) for name in RESULT_FIELDS)
    for name, buffer in zip(RESULT_FIELDS, buffers, strict=True):
        if not isinstance(buffer, torch.Tensor):
            raise ResidencyInputError(
                f"out.{name} must be a torch.Tensor, got {type(buffer).__name__}")
    return buffers


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses a tensor's elements can occupy, [first, last + 1), whatever its strides."""
    if t.numel() == 0:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    return t.data_ptr() + low * t.element_size(), t.data_ptr() + (high + 1) * t.element_size()


def overflow_message(row: int, distinct: int, capacity: int) -> str:
    """The one wording both implementations use for ResidencyOverflowError."""
    return (f"row {row} selects {distinct} distinct tokens but the hot buffer has only "
            f"{capacity} slots; capacity must be >= the distinct top-k tokens of a row")
