"""Which request a batch row serves, told from vLLM's block tables alone (no request ids).

vLLM's attention metadata carries block tables, sequence and query lengths, but not request
ids, and a request may move to another batch row between steps (finishes condense the batch).
The offload path keys each residency row by batch row, so it must know when a row's hot slots
stop describing the request now in that row. A hot slot holding position ``p`` is a copy of
one pool row; the copy is still right iff the row now in that batch slot reads position ``p``
from the same pool row, and that pool row was not rewritten since. So, per layer:

* every pool block has a *version*, renewed whenever a write lands on the block's first row
  (a block handed to a new request, or re-filled after a preemption, is always written from
  its first row: prefix-cache hits and chunk boundaries are block aligned);
* a batch row keeps its request *serial* iff the blocks (and their versions) covering its
  stable prefix ``[0, seq_len - query_len)`` are the ones recorded for that row last time;
  otherwise it gets a fresh serial, and the residency table resets the row;
* positions ``>= seq_len - query_len`` are being (re)written in this step: the residency
  table's stable-prefix rule drops them (rejected speculative rows included);
* a row whose call skipped residency (a prefill chunk read straight from the pool) had no
  such drop, so its next call starts a fresh serial too (``forget``).

A request that moved to another row is thus treated as new there (more misses, same bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from kvo_kernels.host_identity import RowSerialsState, row_serials_host

_I64 = np.int64


class RowIdentity:
    """Block versions and per-row serials of one layer (module docstring).

    The state lives in int64 CPU tensors, worked on through NumPy views of the same memory: a
    decode step calls :meth:`serials` once per layer with a handful of rows, where each PyTorch
    op's dispatch costs more than its arithmetic. With ``native=True`` :meth:`serials` runs
    kvo-kernels' C++ ``row_serials`` on the same state (one call instead of a dozen NumPy
    operations; the NumPy code below is its reference, checked equal call by call in tests).
    """

    def __init__(self, *, max_rows: int, num_blocks: int, block_size: int,
                 max_blocks_per_row: int, native: bool = False) -> None:
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_blocks = max_blocks_per_row
        self.native = native
        self.state = RowSerialsState(
            versions=torch.zeros(num_blocks, dtype=torch.int64),
            recorded_blocks=torch.full((max_rows, max_blocks_per_row), -1, dtype=torch.int64),
            recorded_versions=torch.full((max_rows, max_blocks_per_row), -1,
                                         dtype=torch.int64),
            covered=torch.zeros(max_rows, dtype=torch.int64),   # blocks recorded per row
            serials=torch.full((max_rows,), -1, dtype=torch.int64),
            next_serial=torch.zeros(1, dtype=torch.int64))
        self._versions = self.state.versions.numpy()
        # Bumped by every call that writes some block's first row (a tensor: kvo-kernels'
        # pool_write_rows advances it in the write itself).
        self.write_counter = torch.zeros(1, dtype=torch.int64)
        self._write_counter = self.write_counter.numpy()
        self._blocks = self.state.recorded_blocks.numpy()
        self._block_versions = self.state.recorded_versions.numpy()
        self._covered = self.state.covered.numpy()
        self._serials = self.state.serials.numpy()
        self._next_serial = self.state.next_serial.numpy()
        # The last call's inputs, for the unchanged-rows shortcut in ``serials``.
        self._last_table: np.ndarray | None = None
        self._last_counter = -1

    def note_writes(self, slots: torch.Tensor) -> None:
        """Pool rows ``slots`` (vLLM slot ids, -1 = none) were just written."""
        self.note_written_rows(slots.cpu().numpy().astype(_I64, copy=False).reshape(-1))

    def note_written_rows(self, written: np.ndarray) -> None:
        """:meth:`note_writes` of int64 slot ids ``[N]`` already in NumPy."""
        first_rows = written[(written >= 0) & (written % self.block_size == 0)]
        if first_rows.size:
            self._write_counter[0] += 1
            self._versions[first_rows // self.block_size] = self._write_counter[0]

    def serials(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                query_lens: torch.Tensor) -> torch.Tensor:
        """The request serial of batch rows ``0..R-1`` for this call, ``[R]`` int64."""
        rows = int(seq_lens.shape[0])
        if rows > self.max_rows:
            raise ValueError(f"{rows} batch rows, at most {self.max_rows} (max_num_seqs)")
        if self.native:
            row_serials_host(self.state, block_table, seq_lens, query_lens, rows=rows,
                             block_size=self.block_size)
            return self.state.serials[:rows].clone()
        bs = self.block_size
        lens = seq_lens.cpu().numpy().astype(_I64, copy=False)
        stable = lens - query_lens.cpu().numpy().astype(_I64, copy=False)
        need = (stable + bs - 1) // bs                       # blocks of the stable prefix
        covered = (lens + bs - 1) // bs                      # blocks holding this row's tokens
        # Only the columns some row covers can differ from what was recorded (the rest were
        # recorded as -1 and are -1 again below), so the comparison stops there.
        width = min(int(block_table.shape[1]), self.max_blocks,
                    int(max(int(covered.max(initial=0)), int(self._covered[:rows].max(initial=0)))))
        blocks = block_table[:rows, :width].cpu().numpy().astype(_I64)
        # Shortcut (most decode steps): the same rows cover the same blocks as last call, no
        # block was rewritten since, every row kept its serial and has a stable prefix: then
        # the comparison below would keep every serial and record the same state again.
        last = self._last_table
        if (last is not None and self._last_counter == int(self._write_counter[0])
                and last.shape == blocks.shape and (covered == self._covered[:rows]).all()
                and (stable >= 1).all() and (self._serials[:rows] >= 0).all()
                and np.array_equal(last, blocks)):
            return torch.from_numpy(self._serials[:rows].copy())
        self._last_table, self._last_counter = blocks, int(self._write_counter[0])
        cols = np.arange(width, dtype=_I64)[None, :]
        in_cover = cols < covered[:, None]
        versions = np.where(in_cover, self._versions[np.maximum(blocks, 0)], -1)
        blocks = np.where(in_cover, blocks, -1)
        same = ((blocks == self._blocks[:rows, :width])
                & (versions == self._block_versions[:rows, :width])) | (cols >= need[:, None])
        keep = (same.all(axis=1) & (need >= 1) & (need <= self._covered[:rows])
                & (self._serials[:rows] >= 0))
        fresh = int((~keep).sum())
        if fresh:
            first = int(self._next_serial[0])
            self._serials[:rows][~keep] = np.arange(first, first + fresh, dtype=_I64)
            self._next_serial[0] = first + fresh
        self._blocks[:rows, :width] = blocks
        self._block_versions[:rows, :width] = versions
        self._covered[:rows] = covered
        return torch.from_numpy(self._serials[:rows].copy())

    def forget(self, rows: torch.Tensor) -> None:
        """Rows (bool ``[R]``) whose residency row this call did not update: their next call
        starts a fresh serial (their positions past the stable prefix were not dropped)."""
        mask = rows.cpu().numpy()
        self._serials[:mask.shape[0]][mask] = -1
