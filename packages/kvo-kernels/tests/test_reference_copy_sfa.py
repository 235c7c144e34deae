"""Copy-SFA (reference): the hot buffer gets exactly the misses, and attention over it equals
dense attention over the selected tokens of the full, never-offloaded cache."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvo_kernels_cases import (
    MlaCaches,
    copy_sfa_kwargs,
    manage_call,
    mla_caches,
    paged,
)

from kvo_kernels import ops
from kvo_kernels.cache_pool import new_cache_slots_pool
from kvo_kernels.copy_sfa_abi import CopySfaArgs, check_copy_sfa_args
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.reference.copy_sfa import request_copies
from kvo_kernels.reference.primitives import sparse_mla_attention

FIRST_OFFLOAD, STEADY = -2, -1
LATENT, ROPE, HEADS, BLOCK = 16, 4, 2, 4


def rewrite_host_rows(caches: MlaCaches, b: int, positions: range,
                      generator: torch.Generator) -> None:
    """A speculative suffix was rejected: its host rows now hold different K/V."""
    for t in positions:
        block, row = int(caches.dram_table[b, t // BLOCK]), t % BLOCK
        kv = torch.randn(LATENT, generator=generator)
        rope = torch.randn(ROPE, generator=generator)
        caches.dram_kv[block, row], caches.dram_rope[block, row] = kv, rope
        caches.tokens_kv[b][t], caches.tokens_rope[b][t] = kv, rope


def dense_reference(caches: MlaCaches, rows: list[int], kwargs: dict[str, object],
                    scale: float) -> torch.Tensor:
    """Attention of every query row over its selected tokens, read from the full cache."""
    query, query_rope = kwargs["query"], kwargs["query_rope"]
    out = torch.empty_like(query)  # type: ignore[arg-type]
    start = 0
    for b, count in enumerate(rows):
        own = slice(start, start + count)
        tokens = kwargs["topk_src_ids"][own, 0].to(torch.int64)  # type: ignore[index]
        out[own] = sparse_mla_attention(query[own], query_rope[own],  # type: ignore[index]
                                        caches.tokens_kv[b], caches.tokens_rope[b], tokens,
                                        scale)
        start += count
    return out


def pairs(copies: tuple[torch.Tensor, torch.Tensor]) -> set[tuple[int, int]]:
    return set(zip(copies[0].tolist(), copies[1].tolist(), strict=True))


def run_trace(rows: list[int], steps: int, start: int, spec: list[int], seed: int,
              top_k: int = 3, dtype: torch.dtype = torch.float32, spare_slots: int = 2) -> int:
    """Drive manage + Copy-SFA over a trace; check every step; return the first-fill count."""
    g = torch.Generator().manual_seed(seed)
    capacities = [r * top_k + spare_slots for r in rows]
    max_len = start + steps
    caches = mla_caches([max_len] * len(rows), capacities, LATENT, ROPE, BLOCK, g, dtype)
    index_keys = [torch.randn(max_len, 8, generator=g) for _ in rows]
    index_cache, index_table = paged([k[:, None, :] for k in index_keys], BLOCK, g)
    pool = new_cache_slots_pool(len(rows), max(capacities))
    scale = 0.25
    first_fills = 0
    for step in range(steps):
        key_lengths = [start + step + 1] * len(rows)
        stable = [n - spec[step] for n in key_lengths]
        if step:
            for b in range(len(rows)):
                rewrite_host_rows(caches, b, range(stable[b], key_lengths[b]), g)
        call = manage_call(
            torch.randn(sum(rows), 2, 8, generator=g), torch.rand(sum(rows), 2, generator=g),
            index_cache, index_table, query_rows=rows, key_lengths=key_lengths,
            stable_lengths=stable, capacities=capacities,
            states=[FIRST_OFFLOAD if step == 0 else STEADY] * len(rows),
            pool_entries=list(range(len(rows))), pool=pool, top_k=top_k)
        ops.lightning_indexer_manage(**call.kwargs)
        query = torch.randn(sum(rows), HEADS, LATENT, generator=g).to(dtype)
        query_rope = torch.randn(sum(rows), HEADS, ROPE, generator=g).to(dtype)
        kwargs = copy_sfa_kwargs(call, caches, query, query_rope, scale)
        layout = check_copy_sfa_args(CopySfaArgs(**kwargs))  # type: ignore[arg-type]
        first_fills += sum(r.first_fill for r in layout.requests)
        args = CopySfaArgs(**kwargs)  # type: ignore[arg-type]
        for req in layout.requests:  # both copy paths name the same (token, slot) pairs
            union = request_copies(args, attrs.evolve(req, cache_tokens=0))
            prefixes = request_copies(args, attrs.evolve(req, cache_tokens=1 << 30))
            assert pairs(union) == pairs(prefixes)
        ops.scatter_copy_sparse_flash_attention(**kwargs)  # type: ignore[arg-type]
        want = dense_reference(caches, rows, kwargs, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(kwargs["attention_out"], want, rtol=tol, atol=tol)
        # every selected slot holds its token's current host row, bit for bit
        for b in range(len(rows)):
            own = call.row_slice(b)
            for src, dst in zip(call["topk_src_ids"][own, 0].flatten().tolist(),
                                call["topk_dst_slots"][own, 0].flatten().tolist(), strict=True):
                if src < 0:
                    continue
                hot = int(caches.hbm_table[b, dst // BLOCK]), dst % BLOCK
                assert torch.equal(caches.hbm_kv[hot[0], hot[1], 0], caches.tokens_kv[b][src])
                assert torch.equal(caches.hbm_rope[hot[0], hot[1], 0],
                                   caches.tokens_rope[b][src])
    return first_fills


def test_single_request_steady_trace() -> None:
    run_trace([1], steps=4, start=9, spec=[0, 0, 0, 0], seed=1)


def test_mtp_rows_two_requests_and_rejected_speculation() -> None:
    run_trace([3, 2], steps=5, start=7, spec=[2, 1, 2, 0, 1], seed=2, top_k=5)


def test_bf16_caches() -> None:
    run_trace([2], steps=3, start=8, spec=[0, 1, 0], seed=3, dtype=torch.bfloat16)


def test_request_that_fits_entirely_takes_the_first_fill_path() -> None:
    # 5 tokens, top-k 5, 5 slots: the first offload misses every slot of the hot buffer
    assert run_trace([1], steps=3, start=4, spec=[0, 0, 0], seed=4, top_k=5,
                     spare_slots=0) == 1


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(1, 4),
       st.integers(3, 12), st.lists(st.integers(0, 2), min_size=4, max_size=4),
       st.integers(0, 2**31 - 1))
def test_copy_sfa_equals_dense_attention_on_random_traces(
        rows: list[int], steps: int, start: int, spec: list[int], seed: int) -> None:
    run_trace(rows, steps, max(start, max(rows) + 2), spec, seed)


def _first_offload_case(top_k: int, key_length: int, capacity: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(7)
    caches = mla_caches([key_length], [capacity], LATENT, ROPE, BLOCK, g)
    keys = torch.randn(key_length, 8, generator=g)
    index_cache, index_table = paged([keys[:, None, :]], BLOCK, g)
    call = manage_call(torch.randn(1, 2, 8, generator=g), torch.rand(1, 2, generator=g),
                       index_cache, index_table, query_rows=[1], key_lengths=[key_length],
                       stable_lengths=[key_length], capacities=[capacity],
                       states=[FIRST_OFFLOAD], pool_entries=[0],
                       pool=new_cache_slots_pool(1, capacity), top_k=top_k)
    ops.lightning_indexer_manage(**call.kwargs)
    kwargs = copy_sfa_kwargs(call, caches, torch.randn(1, HEADS, LATENT, generator=g),
                             torch.randn(1, HEADS, ROPE, generator=g), 0.5)
    return caches, call, kwargs


def test_first_fill_path_copies_the_request_union() -> None:
    caches, call, kwargs = _first_offload_case(top_k=6, key_length=6, capacity=6)
    layout = check_copy_sfa_args(CopySfaArgs(**kwargs))
    assert layout.requests[0].first_fill
    kwargs["topk_miss_counts"] = torch.zeros_like(call["topk_miss_counts"])  # unused here
    ops.scatter_copy_sparse_flash_attention(**kwargs)
    torch.testing.assert_close(kwargs["attention_out"],
                               dense_reference(caches, [1], kwargs, 0.5), rtol=1e-5, atol=1e-5)


def test_steady_path_copies_each_rows_miss_prefix() -> None:
    caches, call, kwargs = _first_offload_case(top_k=3, key_length=9, capacity=5)
    layout = check_copy_sfa_args(CopySfaArgs(**kwargs))
    assert not layout.requests[0].first_fill
    kwargs["miss_counts"] = torch.zeros_like(call["miss_counts"])  # unused on this path
    ops.scatter_copy_sparse_flash_attention(**kwargs)
    torch.testing.assert_close(kwargs["attention_out"],
                               dense_reference(caches, [1], kwargs, 0.5), rtol=1e-5, atol=1e-5)


def test_one_slot_named_for_two_tokens_is_an_error() -> None:
    caches, call, kwargs = _first_offload_case(top_k=3, key_length=9, capacity=5)
    dst = call["topk_dst_slots"].clone()
    dst[0, 0, 1] = dst[0, 0, 0]
    kwargs["topk_dst_slots"] = dst
    before = caches.hbm_kv.clone()
    with pytest.raises(KernelArgumentError, match="one hot-buffer row for two different"):
        ops.scatter_copy_sparse_flash_attention(**kwargs)
    assert torch.equal(before.isnan(), caches.hbm_kv.isnan())  # nothing copied
