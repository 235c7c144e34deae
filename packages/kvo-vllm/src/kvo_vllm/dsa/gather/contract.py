"""The contract every offload gather implementation keeps: ``select_rows(call) -> rows``.

A :class:`LayerCall` is one offloaded layer's gather in one step (the layer, its top-k, the
step's metadata); an implementation answers it with :class:`Gathered` (the rows attention
reads and the call's counters) or declines with None, and the next one in the chain chosen
at start (:mod:`kvo_vllm.dsa.gather.choose`) is asked. The reference implementation answers
every call; the others are faster forms of it for the steps they accept and must leave the
same rows, hot buffers and residency state behind (checked call by call in
``test_dsa_offload_gather_differential``).
"""

from __future__ import annotations

import functools
from typing import Protocol

import attrs
import numpy as np
import torch

from kvo_vllm.dsa.main_kv import SelectedRows


def _host_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of one of vLLM's index tensors, on the CPU (a view there)."""
    return tensor[:rows] if tensor.device.type == "cpu" else tensor[:rows].cpu()


def _int64_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU index tensor as a new int64 tensor (never a view of vLLM's buffer). Through
    NumPy: half the time of torch's ``to``."""
    return torch.from_numpy(tensor.numpy().astype(np.int64))


@attrs.frozen(eq=False)
class StepInputs:
    """vLLM's step metadata as the gathers read it, the same for every layer of the step.

    ``vllm_*`` are vLLM's own index tensors as given (their first R rows are this step's,
    valid for this step only; int32 or int64; kvo's C++ ops read either width, so the native
    lane reads them as they are). Everything else is computed on first use and kept for the
    step's other layers (a small op costs microseconds here; a plain decode step's whole
    offload budget is tens of them)."""

    vllm_query_start_loc: torch.Tensor  # [>= R + 1]
    vllm_seq_lens: torch.Tensor         # [>= R]
    vllm_block_table: torch.Tensor      # [>= R, blocks]
    requests: int                       # R, the batch's rows

    @functools.cached_property
    def raw_query_start_loc(self) -> torch.Tensor:
        """``[R + 1]``, a CPU view where vLLM's is on the CPU."""
        return _host_rows(self.vllm_query_start_loc, self.requests + 1)

    @functools.cached_property
    def raw_seq_lens(self) -> torch.Tensor:
        return _host_rows(self.vllm_seq_lens, self.requests)

    @functools.cached_property
    def raw_blocks(self) -> torch.Tensor:
        """``[R, blocks]``: the block table's first R rows."""
        return _host_rows(self.vllm_block_table, self.requests)

    @functools.cached_property
    def tokens(self) -> int:
        """The step's query tokens (``query_start_loc[R]``)."""
        qsl, rows = self.vllm_query_start_loc, self.requests
        return int(qsl[rows]) if qsl.shape[0] > rows else 0

    @functools.cached_property
    def _scalars(self) -> tuple[bool, int, int]:
        """(one_token_each, shortest, longest) from Python lists: at a step's start (cold
        caches) a NumPy reduction over a few elements costs more than a list's ``min``."""
        starts: list[int] = self.raw_query_start_loc.numpy().tolist()
        lengths: list[int] = self.raw_seq_lens.numpy().tolist()
        # Every row one query token: the starts count up by one from the first.
        return (bool(starts) and starts == list(range(starts[0], starts[0] + self.requests + 1)),
                min(lengths, default=0), max(lengths, default=0))

    @property
    def one_token_each(self) -> bool:
        """Every row has exactly one query token (a plain decode step)."""
        return self._scalars[0]

    @property
    def shortest(self) -> int:
        return self._scalars[1]

    @property
    def longest(self) -> int:
        return self._scalars[2]

    @functools.cached_property
    def query_start_loc(self) -> torch.Tensor:
        """``[R + 1]`` int64, a copy."""
        return _int64_copy(self.raw_query_start_loc)

    @functools.cached_property
    def seq_lens(self) -> torch.Tensor:
        """``[R]`` int64, a copy."""
        return _int64_copy(self.raw_seq_lens)

    @functools.cached_property
    def blocks(self) -> torch.Tensor:
        """``[R, blocks]`` int64, a copy."""
        return _int64_copy(self.raw_blocks)

    @functools.cached_property
    def query_lens(self) -> torch.Tensor:
        """``[R]`` int64: each row's query tokens."""
        qsl = self.query_start_loc
        return qsl[1:self.requests + 1] - qsl[:self.requests]


@attrs.define(eq=False)
class LayerCall:
    """One layer's gather in one step. ``padded_topk`` [>= T, K] (CPU; request-local
    positions, -1 = none): the step's T tokens' rows, then any padding rows vLLM's buffer has.
    ``serials`` (each row's request serial, ``RowIdentity.serials``) is computed at most once
    per call, by the first implementation that needs it: asking twice would advance the row
    identity twice."""

    layer: int
    padded_topk: torch.Tensor
    step: StepInputs
    serials: torch.Tensor | None = None

    @functools.cached_property
    def topk(self) -> torch.Tensor:
        """``[T, K]``: the step's tokens' rows (counting them costs a few microseconds at a
        step's start, so only the implementations that need them ask)."""
        tokens, given = self.step.tokens, self.padded_topk
        return given if given.shape[0] == tokens else given[:tokens]


@attrs.define
class GatherCounts:
    """What one answered call did, summed over the batch (``OffloadLayerStats`` without the
    parts the recorder derives: hits, bytes and time)."""

    decode_rows: int         # requests served from hot rows (query rows <= the decode limit)
    decode_tokens: int       # their query rows
    pool_rows: int           # requests read straight from the pool (prefill)
    selected: int            # valid top-k entries of the decode tokens
    misses: int              # rows copied pool -> hot buffer
    reload_tokens: int       # the decode rows' sequence lengths summed
    pool_rows_used: int      # every row's sequence length summed
    identity_rows: int = 0   # decode rows NOT_OFFLOADED
    identity_fills: int = 0  # rows copied pool -> identity slots
    first_offloads: int = 0  # decode rows that left NOT_OFFLOADED in this call


@attrs.frozen(eq=False)
class Gathered:
    """An implementation's answer: the rows attention reads and what the call did."""

    rows: SelectedRows
    counts: GatherCounts


class RowSource(Protocol):
    """One gather implementation (module docstring)."""

    name: str

    def select_rows(self, call: LayerCall) -> Gathered | None:
        """The call's rows, or None (nothing changed) when this implementation does not
        serve such a call."""
        ...
