"""The offload path's row serials through kvo's C++ ops (``csrc/row_identity.cpp``).

kvo-vllm's ``RowIdentity`` tells, per layer call, whether each batch row still serves the
request whose rows its hot buffer holds, from vLLM's block tables alone. Its NumPy version is
the reference (and states the rules); on the decode path its dozen small array operations
cost more than the comparison itself, so with kvo's native ops loaded it calls this instead.
"""

from __future__ import annotations

import attrs
import torch

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.native_build import load_native_ops


@attrs.frozen(eq=False)
class RowSerialsState:
    """The state one layer's serials live in (int64 CPU tensors, updated in place)."""

    versions: torch.Tensor            # [num_blocks] per pool block, renewed on a first-row write
    recorded_blocks: torch.Tensor     # [max_rows, max_blocks] blocks each row covered last call
    recorded_versions: torch.Tensor   # [max_rows, max_blocks] their versions then
    covered: torch.Tensor             # [max_rows] how many blocks each row covered
    serials: torch.Tensor             # [max_rows] each row's request serial, -1 none
    next_serial: torch.Tensor         # [1] the next fresh serial


def row_serials_host(state: RowSerialsState, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_lens: torch.Tensor, *, rows: int,
                     block_size: int) -> None:
    """Update ``state.serials[:rows]`` for this call (rules: ``row_identity.h``). A refused
    call (a shape, a dtype, a block id outside the pool) changes nothing and raises
    :class:`KernelArgumentError`."""
    module = load_native_ops()
    try:
        module.row_serials(block_table, seq_lens, query_lens, state.versions,
                           state.recorded_blocks, state.recorded_versions, state.covered,
                           state.serials, state.next_serial, rows, block_size)
    except (ValueError, IndexError, RuntimeError) as error:
        raise KernelArgumentError(f"row_serials (host op): {error}") from None


def identity_decode_step_host(pool: torch.Tensor, hot: torch.Tensor, block_table: torch.Tensor,
                              seq_lens: torch.Tensor, serials: torch.Tensor, held: torch.Tensor,
                              filled: torch.Tensor, topk: torch.Tensor, hot_slots: torch.Tensor,
                              valid: torch.Tensor, *, rows: int, block_size: int,
                              capacity: int) -> tuple[int, int] | None:
    """A decode step of batch rows that all stay NOT_OFFLOADED (kvo-vllm's
    ``offload_hot_rows``), in one call: each row's new position copied pool -> its identity
    slot, ``filled`` advanced, and each top-k entry's hot row (``hot_slots`` [rows, K], -1
    none) and ``valid`` [rows, K] written. Returns (selected entries, sum of seq_lens), or
    None, with nothing changed, when some row is not in that steady state (``held[r]`` is not
    ``serials[r]`` or ``filled[r]`` is not ``seq_lens[r] - 1``). Rules: ``row_identity.h``.
    A refused call (a shape, an index, a top-k entry at or past its row's sequence) changes
    nothing and raises :class:`KernelArgumentError`."""
    module = load_native_ops()
    try:
        selected, context = module.identity_decode_step(
            pool, hot, block_table, seq_lens, serials, held, filled, topk, hot_slots, valid,
            rows, block_size, capacity)
    except (ValueError, IndexError, RuntimeError) as error:
        raise KernelArgumentError(f"identity_decode_step (host op): {error}") from None
    if selected < 0:
        return None
    return int(selected), int(context)


def identity_decode_lane_host(pool: torch.Tensor, hot: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, state: RowSerialsState,
                              held: torch.Tensor, filled: torch.Tensor, topk: torch.Tensor,
                              hot_slots: torch.Tensor, valid: torch.Tensor, *, rows: int,
                              block_size: int, capacity: int) -> tuple[int, int] | None:
    """:func:`row_serials_host` then :func:`identity_decode_step_host` in one call, for the
    steady state of short requests only (every row decodes one token, keeps its serial and
    holds its request filled to its new position): the same state changes and answer. None,
    with nothing changed, in every other case, including input the two ops would refuse:
    the caller then takes the two-call path, which names the problem. Rules:
    ``row_identity.h``. A malformed argument (dtype, shape) raises
    :class:`KernelArgumentError` and changes nothing."""
    module = load_native_ops()
    try:
        selected, context = module.identity_decode_lane(
            pool, hot, query_start_loc, seq_lens, block_table, state.versions,
            state.recorded_blocks, state.recorded_versions, state.covered, state.serials,
            held, filled, topk, hot_slots, valid, rows, block_size, capacity)
    except (ValueError, IndexError, RuntimeError) as error:
        raise KernelArgumentError(f"identity_decode_lane (host op): {error}") from None
    if selected < 0:
        return None
    return int(selected), int(context)


def pool_write_rows_host(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                         versions: torch.Tensor, write_counter: torch.Tensor, *,
                         block_size: int) -> int:
    """``pool[slots[i]] = rows[i]`` (slots < 0 skipped) and the block versions of kvo-vllm's
    ``RowIdentity.note_writes`` (a block written at its first row gets the next write
    counter), in one call; returns the rows written. A refused call (a slot outside the pool,
    rows that do not match its rows) changes nothing and raises :class:`KernelArgumentError`."""
    module = load_native_ops()
    try:
        written: int = module.pool_write_rows(pool, rows, slots, versions, write_counter,
                                              block_size)
    except (ValueError, IndexError, RuntimeError) as error:
        raise KernelArgumentError(f"pool_write_rows (host op): {error}") from None
    return written
