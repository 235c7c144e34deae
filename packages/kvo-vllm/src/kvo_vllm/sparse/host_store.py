"""The decode host pool's layout: a small header, then every layer's main-KV rows.

One POSIX shared-memory pool per decode DP rank (``kvo_transport.host_pool.HostPool``): TP rank
0 creates it and writes; the other TP ranks attach by name and read the same pages. The header
records the geometry, so an attaching rank with a different model or block size fails at once,
and reserves one word per block (NO_OWNER). Layer ``l`` is a ``[rows, latent + rope]`` tensor;
all offsets are Python ints (64-bit), whatever the pool size.

``rope_apart=True`` lays each layer's region out as ``[rows, latent]`` followed by
``[rows, rope]`` instead (same bytes per layer): the fused Copy-SFA op
(``kvo::scatter_copy_sparse_flash_attention``) takes the host cache as two contiguous tensors,
``dram_kv_cache`` and ``dram_k_rope``, which interleaved rows cannot be viewed as.
"""

from __future__ import annotations

import attrs
import torch

from kvo_core.errors import ConfigError
from kvo_transport.host_pool import PAGE_SIZE, HostPool
from kvo_vllm.sparse.errors import TensorParallelError
from kvo_vllm.sparse.layout import KV_DTYPES, SparseModelLayout

MAGIC = 0x6B766F2D73706172  # "kvo-spar"
VERSION = 1
META_FIELDS = ("magic", "version", "num_layers", "row_dim", "dtype", "block_size",
               "total_blocks", "rope_apart")
_META_SLOTS = 16
NO_OWNER = -1
POOL_SIZE_SETTING = ("additional_config.kvo_sparse.host_pool_bytes, or max_num_seqs x "
                     "max_model_len when it is unset")
"""What decides the pool's size, named when /dev/shm cannot hold it."""


def _header_bytes(total_blocks: int) -> int:
    raw = (_META_SLOTS + total_blocks) * 8
    return -(-raw // PAGE_SIZE) * PAGE_SIZE


@attrs.frozen
class PoolGeometry:
    """How many blocks a pool holds and where the rows start."""

    block_size: int
    total_blocks: int
    header_bytes: int

    @property
    def total_rows(self) -> int:
        return self.total_blocks * self.block_size


def plan_pool(nbytes: int, layout: SparseModelLayout, block_size: int) -> PoolGeometry:
    """The most blocks that fit ``nbytes`` with the header; ConfigError if not even one."""
    per_block = block_size * layout.host_bytes_per_token
    blocks = max(0, (nbytes - PAGE_SIZE) // (per_block + 8))  # a lower bound; then grow
    while _header_bytes(blocks + 1) + (blocks + 1) * per_block <= nbytes:
        blocks += 1
    if blocks < 1:
        need = _header_bytes(1) + per_block
        raise ConfigError(
            f"host_pool_bytes must hold at least one block of {block_size} tokens "
            f"({need} bytes with the header for this model), got {nbytes}")
    return PoolGeometry(block_size, blocks, _header_bytes(blocks))


def pool_bytes_for(rows: int, layout: SparseModelLayout, block_size: int) -> int:
    """Pool size that holds ``rows`` rows (rounded up to blocks) of every layer."""
    blocks = -(-rows // block_size)
    return _header_bytes(blocks) + blocks * block_size * layout.host_bytes_per_token


class HostKVStore:
    """Views of one host pool laid out for a model; use ``create`` (TP rank 0) or ``attach``."""

    def __init__(self, pool: HostPool, layout: SparseModelLayout,
                 geometry: PoolGeometry, *, rope_apart: bool = False) -> None:
        self.pool = pool
        self.layout = layout
        self.geometry = geometry
        self.rope_apart = rope_apart
        self._meta = pool.view(torch.int64, (_META_SLOTS,))
        self.owners = pool.view(torch.int64, (geometry.total_blocks,), _META_SLOTS * 8)
        self.rows = pool.view(layout.kv_dtype,
                              (layout.num_layers, geometry.total_rows, layout.row_dim),
                              geometry.header_bytes)
        self._flat = self.rows.view(layout.num_layers, geometry.total_rows * layout.row_dim)

    def _expected_meta(self) -> list[int]:
        return [MAGIC, VERSION, self.layout.num_layers, self.layout.row_dim,
                KV_DTYPES.index(self.layout.kv_dtype), self.geometry.block_size,
                self.geometry.total_blocks, int(self.rope_apart)]

    @classmethod
    def create(cls, name: str, nbytes: int, layout: SparseModelLayout,
               block_size: int, *, rope_apart: bool = False) -> HostKVStore:
        plan_pool(nbytes, layout, block_size)  # refuse a too-small size before creating
        pool = HostPool.create(name, nbytes, sized_by=POOL_SIZE_SETTING)
        store = cls(pool, layout, plan_pool(pool.nbytes, layout, block_size),
                    rope_apart=rope_apart)
        store.owners.fill_(NO_OWNER)
        store._meta[:len(META_FIELDS)] = torch.tensor(store._expected_meta())
        return store

    @classmethod
    def attach(cls, name: str, layout: SparseModelLayout, block_size: int, *,
               rope_apart: bool = False) -> HostKVStore:
        pool = HostPool.attach(name)
        geometry = plan_pool(pool.nbytes, layout, block_size)
        store = cls(pool, layout, geometry, rope_apart=rope_apart)
        found = store._meta[:len(META_FIELDS)].tolist()
        expected = store._expected_meta()
        if found != expected:
            diff = {field: (have, want) for field, have, want in
                    zip(META_FIELDS, found, expected, strict=True) if have != want}
            pool.close()
            raise TensorParallelError(
                f"host pool {name!r} was created for another layout: (found, expected) per "
                f"field {diff}; every TP rank must use the same model layout and block size")
        return store

    def layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s rows, ``[total_rows, latent + rope]`` (interleaved layout only)."""
        if self.rope_apart:
            raise ValueError("this pool keeps latent and rope apart (rope_apart=True): use "
                             "latent(layer) and rope(layer)")
        return self.rows[layer]

    def latent(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent parts ``[total_rows, latent]`` (contiguous iff rope_apart)."""
        if not self.rope_apart:
            return self.rows[layer][:, :self.layout.latent_dim]
        size = self.geometry.total_rows * self.layout.latent_dim
        return self._flat[layer, :size].view(self.geometry.total_rows, self.layout.latent_dim)

    def rope(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s rope parts ``[total_rows, rope]`` (contiguous iff rope_apart)."""
        if not self.rope_apart:
            return self.rows[layer][:, self.layout.latent_dim:]
        size = self.geometry.total_rows * self.layout.latent_dim
        return self._flat[layer, size:].view(self.geometry.total_rows, self.layout.rope_dim)

    def close(self) -> None:
        self.pool.close()
