"""P/D into the fused decode's host pool: pull whole blocks into staging, split them on arrival.

The prefill's MLA cache keeps a token's main KV as one row, latent then rope. The fused decode's
pool (``kernel_backend="fused"``) keeps each layer's latents in one array and its ropes in
another, since Copy-SFA takes ``dram_kv_cache`` and ``dram_k_rope`` as two contiguous tensors.
The transport plans reads as if the layer's pool region held interleaved rows (the region has
exactly their bytes; :func:`fused_pool_layers`); :class:`RowSplittingEngine`, between the
decode's guarded engine and the real one, turns every descriptor into that region into a read
of the same rows into a registered staging slot, and once the read returned, copies the slot's
rows into the two arrays (one strided copy per part). The step path never sees it: the split runs on
the receiver's thread, before the layer is answered, and the decode's forward reads the
arrays as it reads rows it wrote itself.

Why not two descriptors per row straight into the arrays: that is 128 descriptors per block of
64 rows instead of one; they cost many times the block read, and a long chunk's batch exceeds
what Mooncake's TCP batch read takes, while the split costs one memory pass
(kvo_tools.bench._fused_pull; the numbers: docs/benchmarks.md).

Safety (the transport's rules hold unchanged, plus the staging slots):

- what lands in the pool is what the engine read, exactly as a direct pull would have written
  it; the fence is checked after the whole read (``DecodeReceiver``), and a stale or failed
  layer invalidates its destination blocks as before;
- a failed read (any error: Mooncake's failed batch may still land slices later) retires its
  staging slot: it is not read into again until the receiver's quarantine passed, the same
  bound the transport uses before handing failed destination blocks back. When every slot is
  quarantined, a read fails at once naming that (the layer takes the load-failure path); it
  never waits and never reuses a slot a late slice may still write. Nothing of a failed read
  is split into the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from kvo_transport.destinations import DEFAULT_QUARANTINE_S
from kvo_transport.engine import DelegatingEngine, TransferEngine
from kvo_transport.errors import TransferArgumentError, TransferError

logger = logging.getLogger(__name__)

STAGING_SLOTS = 4
"""Staging slots per decode rank: one in use, the others for after failed reads."""
STAGING_ROWS = 1024
"""Rows one slot holds (a longer read is done in pieces of this many rows)."""


@attrs.frozen(eq=False)
class SplitLayer:
    """One layer of the fused pool as the transport addresses it, and its two arrays."""

    base: int
    """Address of the layer's region: interleaved row ``r`` is ``base + r * row_bytes``."""
    rows: int
    latent: torch.Tensor   # [rows, latent] (contiguous, a view of the pool)
    rope: torch.Tensor     # [rows, rope]

    @property
    def row_bytes(self) -> int:
        return int(self.latent.shape[1] * self.latent.element_size()
                   + self.rope.shape[1] * self.rope.element_size())

    @property
    def end(self) -> int:
        return self.base + self.rows * self.row_bytes


def fused_pool_layers(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: int
                      ) -> list[SplitLayer]:
    """Each layer's :class:`SplitLayer` for its first ``rows`` rows, from its whole pool
    ``(latent, rope)`` arrays ``[total_rows, D]``: the latents followed by the ropes in one
    region, as ``HostKVStore(rope_apart=True)`` lays a layer out, so ``rows`` interleaved rows
    from the region's start stay inside it."""
    layers = []
    for latent, rope in parts:
        if not (latent.dim() == rope.dim() == 2 and latent.shape[0] == rope.shape[0] >= rows
                and latent.is_contiguous() and rope.is_contiguous()):
            raise ValueError(f"latent {tuple(latent.shape)} and rope {tuple(rope.shape)} must "
                             f"be contiguous [rows, D] arrays of at least {rows} rows")
        latent_end = latent.data_ptr() + latent.numel() * latent.element_size()
        if rope.data_ptr() != latent_end:
            raise ValueError("the rope array must follow the latent array in one region")
        layers.append(SplitLayer(base=int(latent.data_ptr()), rows=rows,
                                 latent=latent[:rows], rope=rope[:rows]))
    return layers


@attrs.define
class _Slot:
    rows: torch.Tensor            # [STAGING_ROWS, row_bytes] uint8, a view of the arena
    retired_at: float | None = None


@attrs.frozen
class _Piece:
    """A run of rows read into staging rows ``[at, at + count)``, then split to ``layer``."""

    layer: SplitLayer
    first_row: int
    count: int
    at: int


class StagingArena:
    """The registered staging memory: ``slots`` slots of ``rows`` rows of ``row_bytes``."""

    def __init__(self, row_bytes: int, *, slots: int = STAGING_SLOTS,
                 rows: int = STAGING_ROWS) -> None:
        self.memory = torch.zeros(slots, rows, row_bytes, dtype=torch.uint8)
        self.slots = [_Slot(rows=self.memory[i]) for i in range(slots)]

    @property
    def region(self) -> tuple[int, int]:
        return int(self.memory.data_ptr()), int(self.memory.numel())


class RowSplittingEngine(DelegatingEngine):
    """Reads into the fused pool's layer regions go through staging (module docstring); every
    other read (indexer caches, fence words) passes through unchanged."""

    def __init__(self, engine: TransferEngine, layers: Sequence[SplitLayer],
                 arena: StagingArena, *, quarantine_s: float = DEFAULT_QUARANTINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(engine)
        if not layers:
            raise ValueError("a row-splitting engine needs at least one pool layer")
        widths = {layer.row_bytes for layer in layers}
        if widths != {int(arena.memory.shape[2])}:
            raise ValueError(f"pool rows of {sorted(widths)} bytes, staging rows of "
                             f"{int(arena.memory.shape[2])}")
        self._layers = sorted(layers, key=lambda layer: layer.base)
        self._arena = arena
        self._quarantine_s = quarantine_s
        self._clock = clock
        self._lock = threading.Lock()
        self._slot = arena.slots[0]
        self.split_rows = 0
        self.retired_slots = 0

    def _layer_of(self, address: int) -> SplitLayer | None:
        for layer in self._layers:
            if layer.base <= address < layer.end:
                return layer
        return None

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        if not (len(local_addrs) == len(remote_addrs) == len(lengths)):
            raise TransferArgumentError(
                f"{len(local_addrs)} local addresses, {len(remote_addrs)} remote, "
                f"{len(lengths)} lengths: one of each per descriptor")
        passed: tuple[list[int], list[int], list[int]] = ([], [], [])
        runs: list[tuple[SplitLayer, int, int, int]] = []   # layer, first row, rows, remote
        for local, remote, length in zip(local_addrs, remote_addrs, lengths, strict=True):
            layer = self._layer_of(local)
            if layer is None:
                for out, value in zip(passed, (local, remote, length), strict=True):
                    out.append(value)
                continue
            offset, size = local - layer.base, layer.row_bytes
            if offset % size or length % size or length <= 0 or local + length > layer.end:
                raise TransferArgumentError(
                    f"descriptor ({local:#x}, {length} bytes) into the fused host pool's layer "
                    f"at {layer.base:#x} is not whole rows of {size} bytes inside its "
                    f"{layer.rows} rows: nothing read")
            runs.append((layer, offset // size, length // size, remote))
        with self._lock:   # one staging slot in use at a time
            self._read_locked(peer, passed, runs)

    def _read_locked(self, peer: str, passed: tuple[list[int], list[int], list[int]],
                     runs: list[tuple[SplitLayer, int, int, int]]) -> None:
        capacity = int(self._arena.memory.shape[1])
        batch: list[_Piece] = []
        local, remote, lengths = passed
        used = 0
        for layer, first, count, source in runs:
            done = 0
            while done < count:
                if used == capacity:
                    self._read_pieces(peer, batch, local, remote, lengths)
                    batch, local, remote, lengths, used = [], [], [], [], 0
                take = min(count - done, capacity - used)
                batch.append(_Piece(layer=layer, first_row=first + done, count=take, at=used))
                local.append(0)   # the slot's address, known once a slot is chosen
                remote.append(source + done * layer.row_bytes)
                lengths.append(take * layer.row_bytes)
                used += take
                done += take
        if batch or local:
            self._read_pieces(peer, batch, local, remote, lengths)

    def _read_pieces(self, peer: str, pieces: list[_Piece], local: list[int],
                     remote: list[int], lengths: list[int]) -> None:
        """One engine read: the pass-through descriptors first, then the pieces' staging rows;
        the split once it returned."""
        if not pieces:
            self._engine.read(peer, local, remote, lengths)
            return
        slot = self._usable_slot()
        row_bytes = int(slot.rows.shape[1])
        base = int(slot.rows.data_ptr())
        first_piece = len(local) - len(pieces)
        for i, piece in enumerate(pieces):
            local[first_piece + i] = base + piece.at * row_bytes
        try:
            self._engine.read(peer, local, remote, lengths)
        except BaseException:   # a failed read, or an engine bug: either may still land
            slot.retired_at = self._clock()
            self.retired_slots += 1
            logger.warning("kvo remote_d2h fused pool: a read into staging slot %#x failed; "
                           "the slot is not reused for %.1f s (late slices may land in it), "
                           "nothing of it reaches the pool", base, self._quarantine_s)
            raise
        for piece in pieces:
            staged = slot.rows[piece.at:piece.at + piece.count]
            split_rows(staged, piece.layer, piece.first_row)
            self.split_rows += piece.count

    def _usable_slot(self) -> _Slot:
        """The slot in use if it is usable, else one whose quarantine passed (oldest first)."""
        now = self._clock()
        if self._slot.retired_at is None:
            return self._slot
        free = [s for s in self._arena.slots
                if s.retired_at is None or now - s.retired_at >= self._quarantine_s]
        if not free:
            raise TransferError(
                f"every staging slot of the fused host pool ({len(self._arena.slots)}) is "
                f"quarantined after failed reads (for {self._quarantine_s:g} s each): this "
                f"read is refused rather than land where a late slice may still write")
        slot = min(free, key=lambda s: -1.0 if s.retired_at is None else s.retired_at)
        slot.retired_at = None
        self._slot = slot
        return slot

    def snapshot(self) -> dict[str, int]:
        """Counters for the decode's stats file (under ``engine_wrapper``)."""
        inner = getattr(self._engine, "snapshot", None)
        base = dict(inner()) if callable(inner) else {}
        return {**base, "fused_pool_split_rows": self.split_rows,
                "fused_pool_retired_slots": self.retired_slots}


def split_rows(staged: torch.Tensor, layer: SplitLayer, first_row: int) -> None:
    """Copy staged interleaved rows ``[n, row_bytes]`` (uint8) into the layer's latent and
    rope arrays at rows ``[first_row, first_row + n)``. Through NumPy: one thread, no OpenMP
    team (torch's copy here met the forward's busy OpenMP threads and took milliseconds)."""
    count = int(staged.shape[0])
    latent_bytes = layer.latent.shape[1] * layer.latent.element_size()
    rows = staged.numpy()
    np.copyto(layer.latent[first_row:first_row + count].view(torch.uint8).numpy(),
              rows[:, :latent_bytes])
    np.copyto(layer.rope[first_row:first_row + count].view(torch.uint8).numpy(),
              rows[:, latent_bytes:])
