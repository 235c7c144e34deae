"""The fused ops through Triton (interpreter on CPU, a GPU where present) against the reference.

Manage inputs are small integers, so every score is exact in fp32 whatever the summation order:
the Triton op must then give the reference's outputs bit for bit (top-k, slots, misses, pool).
Copy-SFA: the hot buffer must match bit for bit (copies), attention within 1e-4 (fp32).
"""

from __future__ import annotations

import os

import pytest
import torch
from kvo_kernels_cases import copy_sfa_kwargs, manage_call, mla_caches, paged

from kvo_kernels import ops
from kvo_kernels.cache_pool import new_cache_slots_pool

pytest.importorskip("triton", reason="triton is not installed (pip install 'kvo-kernels[triton]')")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 set before triton is imported",
                allow_module_level=True)
pytest.importorskip("kvo_kernels.triton", reason="kvo_kernels.triton (the kernels) is missing")


def _integer_trace(seed: int, rows: list[int], steps: int, quantised: bool):  # type: ignore[no-untyped-def]
    """Per step: manage kwargs on DEVICE built from small-integer queries, keys and weights."""
    g = torch.Generator().manual_seed(seed)
    top_k, heads, dim, block, start = 4, 2, 16, 4, 11
    capacities = [r * top_k + 3 for r in rows]
    max_len = start + steps
    keys = [torch.randint(-3, 4, (max_len, dim), generator=g) for _ in rows]
    cache, table = paged([k[:, None, :].float() for k in keys], block, g)
    key_scale = torch.full(cache.shape[:3], 0.5, dtype=torch.float16)
    if quantised:
        cache = cache.to(torch.int8)
    pools = [new_cache_slots_pool(len(rows), max(capacities)) for _ in range(2)]
    for step in range(steps):
        query = torch.randint(-3, 4, (sum(rows), heads, dim), generator=g).float()
        weights = torch.randint(1, 4, (sum(rows), heads), generator=g).float()
        key_lengths = [start + step + 1] * len(rows)
        calls = []
        for pool in pools:
            call = manage_call(
                query.to(torch.int8) if quantised else query, weights, cache, table,
                query_rows=rows, key_lengths=key_lengths,
                stable_lengths=[n - step % 2 for n in key_lengths], capacities=capacities,
                states=[-2 if step == 0 else -1] * len(rows),
                pool_entries=list(range(len(rows))), pool=pool, top_k=top_k,
                key_scale=key_scale if quantised else None,
                query_scale=torch.full((sum(rows), heads), 2.0, dtype=torch.float16)
                if quantised else None)
            calls.append(call)
        yield calls


@pytest.mark.parametrize("quantised", [False, True], ids=["bf16-abi", "c8"])
def test_manage_triton_equals_reference_bit_for_bit(quantised: bool) -> None:
    op = ops.quant_lightning_indexer_manage if quantised else ops.lightning_indexer_manage
    for reference, triton_call in _integer_trace(3, [2, 1], steps=3, quantised=quantised):
        op(**reference.kwargs, implementation="reference")
        on_device = {k: v.to(DEVICE) for k, v in triton_call.kwargs.items()}
        op(**on_device, implementation="triton")
        for name, value in reference.kwargs.items():
            assert torch.equal(on_device[name].cpu(), value), name
        for name in ("cache_slots_pool",):  # carry the state into the next step
            triton_call.kwargs[name].copy_(on_device[name].cpu())


def test_copy_sfa_triton_matches_reference() -> None:
    g = torch.Generator().manual_seed(5)
    rows, latent, rope, block = [2, 1], 32, 8, 4
    caches = mla_caches([14] * len(rows), [r * 4 + 3 for r in rows], latent, rope, block, g)
    hot_kv, hot_rope = caches.hbm_kv.clone().to(DEVICE), caches.hbm_rope.clone().to(DEVICE)
    for step, (call, _) in enumerate(_integer_trace(4, rows, steps=3, quantised=False)):
        ops.lightning_indexer_manage(**call.kwargs, implementation="reference")
        query = torch.randn(sum(rows), 2, latent, generator=g)
        query_rope = torch.randn(sum(rows), 2, rope, generator=g)
        reference = copy_sfa_kwargs(call, caches, query, query_rope, 0.2)
        on_device = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor)
                         and not k.startswith("dram_") else v) for k, v in reference.items()}
        on_device.update(hbm_kv_cache=hot_kv, hbm_k_rope=hot_rope,
                         attention_out=torch.empty_like(query, device=DEVICE))
        ops.scatter_copy_sparse_flash_attention(**on_device,  # type: ignore[arg-type]
                                                implementation="triton")
        ops.scatter_copy_sparse_flash_attention(**reference,  # type: ignore[arg-type]
                                                implementation="reference")
        assert torch.equal(hot_kv.cpu().nan_to_num(-9.0), caches.hbm_kv.nan_to_num(-9.0)), step
        assert torch.equal(hot_rope.cpu().nan_to_num(-9.0), caches.hbm_rope.nan_to_num(-9.0))
        torch.testing.assert_close(on_device["attention_out"].cpu(),  # type: ignore[union-attr]
                                   reference["attention_out"], rtol=1e-4, atol=1e-4)


def test_sparse_copy_triton_is_exact() -> None:
    g = torch.Generator().manual_seed(6)
    src = torch.randn(40, 24, generator=g).bfloat16().to(DEVICE)
    dst = torch.zeros(16, 24, dtype=torch.bfloat16, device=DEVICE)
    src_rows = torch.randperm(40, generator=g)[:10].to(DEVICE)
    dst_rows = torch.randperm(16, generator=g)[:10].to(DEVICE)
    ops.sparse_copy(src, dst, src_rows, dst_rows, implementation="triton")
    assert torch.equal(dst[dst_rows], src[src_rows])
    untouched = torch.ones(16, dtype=torch.bool, device=DEVICE)
    untouched[dst_rows] = False
    assert torch.equal(dst[untouched], torch.zeros_like(dst[untouched]))


@pytest.mark.skipif(DEVICE != "cuda", reason="production shapes run only on a CUDA GPU "
                    "(Triton's CPU interpreter would take hours)")
def test_production_shapes_on_gpu() -> None:
    """R=2 x 4 rows, 64 indexer heads, top-k 2048, 8192 slots, 16K tokens, MLA 512+64, bf16."""
    g = torch.Generator().manual_seed(9)
    rows, tokens, capacity, top_k, block = [4, 4], 16384, 8192, 2048, 128
    keys = [torch.randn(tokens, 128, generator=g).bfloat16() for _ in rows]
    cache, table = paged([k[:, None, :] for k in keys], block, g)
    query = torch.randn(sum(rows), 64, 128, generator=g).bfloat16()
    weights = torch.rand(sum(rows), 64, generator=g).bfloat16()
    calls = [manage_call(query, weights, cache, table, query_rows=rows,
                         key_lengths=[tokens] * 2, stable_lengths=[tokens] * 2,
                         capacities=[capacity] * 2, states=[-2, -2], pool_entries=[0, 1],
                         pool=new_cache_slots_pool(2, capacity), top_k=top_k)
             for _ in range(2)]
    ops.lightning_indexer_manage(**calls[0].kwargs, implementation="reference")
    on_device = {k: v.to(DEVICE) for k, v in calls[1].kwargs.items()}
    ops.lightning_indexer_manage(**on_device, implementation="triton")
    for t in range(sum(rows)):  # fp32 sums in another order: compare selections as sets
        ref = set(calls[0]["topk_src_ids"][t, 0].tolist())
        tri = set(on_device["topk_src_ids"][t, 0].cpu().tolist())
        assert len(ref & tri) >= 0.99 * top_k
    caches = mla_caches([tokens] * 2, [capacity] * 2, 512, 64, block, g, torch.bfloat16)
    query_mla = torch.randn(sum(rows), 16, 512, generator=g).bfloat16()
    rope_mla = torch.randn(sum(rows), 16, 64, generator=g).bfloat16()
    reference = copy_sfa_kwargs(calls[0], caches, query_mla, rope_mla, 512 ** -0.5)
    device_kwargs = {k: (v.clone().to(DEVICE) if isinstance(v, torch.Tensor)
                         and not k.startswith("dram_") else v) for k, v in reference.items()}
    ops.scatter_copy_sparse_flash_attention(**device_kwargs,  # type: ignore[arg-type]
                                            implementation="triton")
    ops.scatter_copy_sparse_flash_attention(**reference,  # type: ignore[arg-type]
                                            implementation="reference")
    torch.testing.assert_close(device_kwargs["attention_out"].cpu(),  # type: ignore[union-attr]
                               reference["attention_out"], rtol=2e-2, atol=2e-2)
