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

import torch

_I64 = torch.int64


class RowIdentity:
    """Block versions and per-row serials of one layer (module docstring)."""

    def __init__(self, *, max_rows: int, num_blocks: int, block_size: int,
                 max_blocks_per_row: int) -> None:
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_blocks = max_blocks_per_row
        self._versions = torch.zeros(num_blocks, dtype=_I64)
        self._write_counter = 0
        self._blocks = torch.full((max_rows, max_blocks_per_row), -1, dtype=_I64)
        self._block_versions = torch.full((max_rows, max_blocks_per_row), -1, dtype=_I64)
        self._covered = torch.zeros(max_rows, dtype=_I64)   # blocks recorded per row
        self._serials = torch.full((max_rows,), -1, dtype=_I64)
        self._next_serial = 0

    def note_writes(self, slots: torch.Tensor) -> None:
        """Pool rows ``slots`` (vLLM slot ids, -1 = none) were just written."""
        slots = slots.to(_I64)
        first_rows = slots[(slots >= 0) & (slots % self.block_size == 0)]
        if first_rows.numel():
            self._write_counter += 1
            self._versions[first_rows // self.block_size] = self._write_counter

    def serials(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                query_lens: torch.Tensor) -> torch.Tensor:
        """The request serial of batch rows ``0..R-1`` for this call, ``[R]`` int64."""
        rows = int(seq_lens.shape[0])
        if rows > self.max_rows:
            raise ValueError(f"{rows} batch rows, at most {self.max_rows} (max_num_seqs)")
        bs = self.block_size
        width = min(int(block_table.shape[1]), self.max_blocks)
        blocks = block_table[:rows, :width].to(_I64)
        seq_lens = seq_lens.to(_I64)
        stable = seq_lens - query_lens.to(_I64)
        need = (stable + bs - 1) // bs                       # blocks of the stable prefix
        covered = (seq_lens + bs - 1) // bs                  # blocks holding this row's tokens
        cols = torch.arange(width, dtype=_I64)[None, :]
        in_need = cols < need[:, None]
        in_cover = cols < covered[:, None]
        versions = torch.where(in_cover, self._versions[blocks.clamp(min=0)],
                               torch.full_like(blocks, -1))
        blocks = torch.where(in_cover, blocks, torch.full_like(blocks, -1))
        same = ((blocks == self._blocks[:rows, :width]) & (
            versions == self._block_versions[:rows, :width])) | ~in_need
        keep = same.all(dim=1) & (need >= 1) & (need <= self._covered[:rows])
        keep &= self._serials[:rows] >= 0
        fresh = int((~keep).sum())
        if fresh:
            new = torch.arange(self._next_serial, self._next_serial + fresh, dtype=_I64)
            self._next_serial += fresh
            self._serials[:rows][~keep] = new
        self._blocks[:rows, :width] = blocks
        self._block_versions[:rows, :width] = versions
        self._covered[:rows] = covered
        return self._serials[:rows].clone()

    def forget(self, rows: torch.Tensor) -> None:
        """Rows (bool ``[R]``) whose residency row this call did not update: their next call
        starts a fresh serial (their positions past the stable prefix were not dropped)."""
        self._serials[:rows.shape[0]][rows] = -1
