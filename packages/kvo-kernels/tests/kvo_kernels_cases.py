"""Builders for kvo-kernels tests: paged caches, manage calls with chosen scores, Copy-SFA calls.

``scored_inputs`` makes the indexer pick exactly what a test wants: with one head, weight 1,
key s = the unit vector e_s and query = the wanted score row, ``score[t, s] = relu(q[t, s])``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kvo_kernels.cache_pool import new_cache_slots_pool


def paged(rows_per_request: Sequence[torch.Tensor], block_size: int, generator: torch.Generator,
          spare_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter each request's rows [S_b, ...] into shuffled blocks; returns (cache, table).

    cache: [blocks, block_size, ...]; table: [B, max_blocks] int32 (unused entries -1).
    """
    tail = rows_per_request[0].shape[1:]
    counts = [-(-r.shape[0] // block_size) for r in rows_per_request]
    total = sum(counts) + spare_blocks
    order = torch.randperm(total, generator=generator)
    cache = torch.zeros((total, block_size, *tail), dtype=rows_per_request[0].dtype)
    table = torch.full((len(rows_per_request), max(counts)), -1, dtype=torch.int32)
    used = 0
    for b, rows in enumerate(rows_per_request):
        for j in range(counts[b]):
            block = int(order[used])
            used += 1
            table[b, j] = block
            chunk = rows[j * block_size:(j + 1) * block_size]
            cache[block, :chunk.shape[0]] = chunk
    return cache, table


def prefix_sums(rows: Sequence[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(rows, dtype=torch.int32), 0).to(torch.int32)


@attrs.define
class ManageCall:
    """The 19 manage arguments as a dict, plus what the test needs to read them back."""

    kwargs: dict[str, torch.Tensor]
    query_rows: list[int]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.kwargs[name]

    def row_slice(self, b: int) -> slice:
        start = sum(self.query_rows[:b])
        return slice(start, start + self.query_rows[b])

    def row_topk(self, t: int) -> tuple[list[int], list[int], int]:
        """(src ids, dst slots, miss count) of query row t, padding dropped."""
        src = self.kwargs["topk_src_ids"][t, 0].tolist()
        dst = self.kwargs["topk_dst_slots"][t, 0].tolist()
        n = sum(1 for s in src if s >= 0)
        return src[:n], dst[:n], int(self.kwargs["topk_miss_counts"][t])

    def request_misses(self, b: int) -> tuple[list[int], list[int]]:
        n = int(self.kwargs["miss_counts"][b])
        return (self.kwargs["miss_src_ids"][b, :n].tolist(),
                self.kwargs["miss_dst_slots"][b, :n].tolist())


def scored_inputs(scores: torch.Tensor, key_tokens: Sequence[int], query_rows: Sequence[int],
                  block_size: int, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query [T,1,D], weights [T,1], index_key_cache, index_block_table) with those scores.

    scores: [T, D] with D >= every request's key count; key s of every request is e_s.
    """
    dim = scores.shape[1]
    eye = torch.eye(dim)
    keys = [eye[:n] for n in key_tokens]
    cache, table = paged([k[:, None, :] for k in keys], block_size, generator)
    assert sum(query_rows) == scores.shape[0]
    return scores[:, None, :].clone(), torch.ones(scores.shape[0], 1), cache, table


def manage_call(query: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                block_table: torch.Tensor, *, query_rows: Sequence[int],
                key_lengths: Sequence[int], stable_lengths: Sequence[int],
                capacities: Sequence[int], states: Sequence[int], pool_entries: Sequence[int],
                pool: torch.Tensor, top_k: int, miss_width: int | None = None,
                key_scale: torch.Tensor | None = None,
                query_scale: torch.Tensor | None = None) -> ManageCall:
    """Allocate outputs (filled with a sentinel, so unwritten entries show) and pack args."""
    rows, heads, _ = query.shape
    batch = len(query_rows)
    width = miss_width if miss_width is not None else max(query_rows) * top_k

    def meta(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32)

    kwargs = {
        "index_weights": weights,
        "query_dequant_scale": query_scale if query_scale is not None
        else torch.ones(rows, heads),
        "query": query,
        "index_key_dequant_scale": key_scale if key_scale is not None
        else torch.ones(key_cache.shape[:3]),
        "index_key_cache": key_cache,
        "index_block_table": block_table,
        "actual_seq_lengths_query": prefix_sums(query_rows),
        "actual_seq_lengths_key": meta(key_lengths),
        "offload_seq_lengths_key": meta(stable_lengths),
        "num_cache_tokens": meta(capacities),
        "request_state": meta(states),
        "req_pool_entries": meta(pool_entries),
        "cache_slots_pool": pool,
        "topk_src_ids": torch.full((rows, 1, top_k), -7, dtype=torch.int32),
        "topk_dst_slots": torch.full((rows, 1, top_k), -7, dtype=torch.int32),
        "topk_miss_counts": torch.full((rows,), -7, dtype=torch.int32),
        "miss_src_ids": torch.full((batch, width), -7, dtype=torch.int32),
        "miss_dst_slots": torch.full((batch, width), -7, dtype=torch.int32),
        "miss_counts": torch.full((batch,), -7, dtype=torch.int32),
    }
    return ManageCall(kwargs=kwargs, query_rows=list(query_rows))


@attrs.define
class MlaCaches:
    """A host (DRAM) cache holding every token and an empty paged hot (HBM) buffer."""

    dram_kv: torch.Tensor       # [dram_blocks, block, Dl]
    dram_rope: torch.Tensor     # [dram_blocks, block, Dr]
    dram_table: torch.Tensor    # [B, max_blocks]
    hbm_kv: torch.Tensor        # [hbm_blocks, block, 1, Dl]
    hbm_rope: torch.Tensor      # [hbm_blocks, block, 1, Dr]
    hbm_table: torch.Tensor     # [B, hbm_max_blocks]
    tokens_kv: list[torch.Tensor]    # per request [S_b, Dl], the un-offloaded truth
    tokens_rope: list[torch.Tensor]  # per request [S_b, Dr]


def mla_caches(token_counts: Sequence[int], hot_slots: Sequence[int], latent: int, rope: int,
               block_size: int, generator: torch.Generator,
               dtype: torch.dtype = torch.float32) -> MlaCaches:
    tokens_kv = [torch.randn(n, latent, generator=generator).to(dtype) for n in token_counts]
    tokens_rope = [torch.randn(n, rope, generator=generator).to(dtype) for n in token_counts]
    both = [torch.cat([k, r], 1) for k, r in zip(tokens_kv, tokens_rope, strict=True)]
    dram, dram_table = paged(both, block_size, generator)
    hot_blocks = [-(-c // block_size) for c in hot_slots]
    hbm_total = sum(hot_blocks) + 1
    order = torch.randperm(hbm_total, generator=generator)
    hbm_table = torch.full((len(hot_slots), max(hot_blocks)), -1, dtype=torch.int32)
    used = 0
    for b, count in enumerate(hot_blocks):
        hbm_table[b, :count] = order[used:used + count].to(torch.int32)
        used += count
    return MlaCaches(
        dram_kv=dram[..., :latent].contiguous(), dram_rope=dram[..., latent:].contiguous(),
        dram_table=dram_table,
        hbm_kv=torch.full((hbm_total, block_size, 1, latent), float("nan"), dtype=dtype),
        hbm_rope=torch.full((hbm_total, block_size, 1, rope), float("nan"), dtype=dtype),
        hbm_table=hbm_table, tokens_kv=tokens_kv, tokens_rope=tokens_rope)


def copy_sfa_kwargs(manage: ManageCall, caches: MlaCaches, query: torch.Tensor,
                    query_rope: torch.Tensor, scale: float) -> dict[str, object]:
    """Copy-SFA arguments continuing a manage call (its outputs feed the copy)."""
    return {
        "query_rope": query_rope, "query": query,
        "actual_seq_lengths_query": manage["actual_seq_lengths_query"],
        "actual_seq_lengths_kv": manage["actual_seq_lengths_key"],
        "num_cache_tokens": manage["num_cache_tokens"],
        "topk_dst_slots": manage["topk_dst_slots"], "topk_src_ids": manage["topk_src_ids"],
        "topk_miss_counts": manage["topk_miss_counts"], "miss_src_ids": manage["miss_src_ids"],
        "miss_dst_slots": manage["miss_dst_slots"], "miss_counts": manage["miss_counts"],
        "hbm_block_table": caches.hbm_table, "dram_block_table": caches.dram_table,
        "hbm_k_rope": caches.hbm_rope, "hbm_kv_cache": caches.hbm_kv,
        "dram_k_rope": caches.dram_rope, "dram_kv_cache": caches.dram_kv,
        "scale_value": scale,
        "attention_out": torch.full_like(query, float("nan")),
    }


__all__ = ["ManageCall", "MlaCaches", "copy_sfa_kwargs", "manage_call", "mla_caches",
           "new_cache_slots_pool", "paged", "prefix_sums", "scored_inputs"]
