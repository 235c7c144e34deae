"""Bad arguments fail at the op's entry, with an error naming the argument, and change nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kvo_kernels_cases import copy_sfa_kwargs, manage_call, mla_caches, paged

from kvo_kernels import ops
from kvo_kernels.cache_pool import new_cache_slots_pool
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.limits import MAX_CAPACITY, MAX_QUERY_ROWS

Mutation = Callable[[dict[str, object]], None]


def _manage_kwargs() -> dict[str, object]:
    """A valid steady-state call: two requests (1 and 2 query rows), top-k 3, block 4."""
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(10, 8, generator=g), torch.randn(7, 8, generator=g)]
    cache, table = paged([k[:, None, :] for k in keys], 4, g)
    call = manage_call(torch.randn(3, 2, 8, generator=g), torch.rand(3, 2, generator=g), cache,
                       table, query_rows=[1, 2], key_lengths=[10, 7], stable_lengths=[10, 7],
                       capacities=[5, 6], states=[-2, -2], pool_entries=[1, 0],
                       pool=new_cache_slots_pool(2, 8), top_k=3)
    ops.lightning_indexer_manage(**call.kwargs)
    call.kwargs["request_state"] = torch.tensor([-1, -1], dtype=torch.int32)
    return dict(call.kwargs)


def _set(name: str, value: Callable[[dict[str, object]], object]) -> Mutation:
    def mutate(kwargs: dict[str, object]) -> None:
        kwargs[name] = value(kwargs)
    return mutate


def _meta(*values: int) -> Callable[[dict[str, object]], torch.Tensor]:
    return lambda _: torch.tensor(values, dtype=torch.int32)


MANAGE_CASES: list[tuple[str, Mutation, str]] = [
    ("query rank", _set("query", lambda k: k["query"][0]), "query must have 3 dimensions"),
    ("weights heads", _set("index_weights", lambda k: torch.rand(3, 3)),
     r"index_weights.shape\[1\]"),
    ("key dim", _set("index_key_cache", lambda k: k["index_key_cache"][..., :4]),
     r"index_key_cache.shape\[3\]"),
    ("key dtype", _set("index_key_cache", lambda k: k["index_key_cache"].double()),
     "index_key_cache has dtype float64"),
    ("metadata dtype", _set("actual_seq_lengths_key", lambda k: torch.tensor([10.0, 7.0])),
     "actual_seq_lengths_key has dtype float32"),
    ("batch size", _set("num_cache_tokens", _meta(5)), r"num_cache_tokens.shape\[0\]"),
    ("prefix sum end", _set("actual_seq_lengths_query", _meta(1, 2)),
     "actual_seq_lengths_query ends at 2"),
    ("rows per request", _set("actual_seq_lengths_query", _meta(0, 3)),
     "actual_seq_lengths_query gives request 0 0 query rows"),
    ("key length beyond table", _set("actual_seq_lengths_key", _meta(13, 7)),
     r"actual_seq_lengths_key\[0\] is 13"),
    ("key length below rows", _set("actual_seq_lengths_key", _meta(10, 1)),
     r"actual_seq_lengths_key\[1\] is 1"),
    ("stable length", _set("offload_seq_lengths_key", _meta(11, 7)),
     r"offload_seq_lengths_key\[0\] is 11"),
    ("capacity too small", _set("num_cache_tokens", _meta(2, 6)), r"num_cache_tokens\[0\] is 2"),
    ("capacity beyond pool", _set("num_cache_tokens", _meta(9, 6)), r"num_cache_tokens\[0\] is 9"),
    ("state", _set("request_state", _meta(-1, 0)), r"request_state\[1\] is 0"),
    ("pool entry range", _set("req_pool_entries", _meta(2, 0)), r"req_pool_entries\[0\] is 2"),
    ("pool entry shared", _set("req_pool_entries", _meta(1, 1)), "already used by request 0"),
    ("pool lru", lambda k: k["cache_slots_pool"][1, 1, :5].fill_(0),
     r"cache_slots_pool\[1, 1, :5\]"),
    ("pool token held twice", lambda k: k["cache_slots_pool"][1, 0, :2].fill_(3),
     r"cache_slots_pool entry 1 \(request 0\): slot_tokens .* each at most once"),
    ("pool layout", _set("cache_slots_pool", lambda k: k["cache_slots_pool"][:, 0]),
     "cache_slots_pool must have 3 dimensions"),
    ("block table entry", lambda k: k["index_block_table"].__setitem__((1, 0), 99),
     r"index_block_table\[1, :2\]"),
    ("output width", _set("topk_dst_slots", lambda k: k["topk_dst_slots"][..., :2]),
     "topk_dst_slots shape"),
    ("miss width", lambda k: k.update(miss_src_ids=k["miss_src_ids"][:, :4].contiguous(),
                                      miss_dst_slots=k["miss_dst_slots"][:, :4].contiguous()),
     "miss_src_ids width 4"),
    ("device", _set("topk_miss_counts", lambda k: k["topk_miss_counts"].to("meta")),
     "topk_miss_counts is on meta"),
    ("non-contiguous output",
     _set("miss_counts", lambda k: torch.zeros(2, 2, dtype=torch.int32)[:, 0]),
     "miss_counts must be contiguous"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), MANAGE_CASES,
                         ids=[c[0] for c in MANAGE_CASES])
def test_manage_names_the_bad_argument(case: str, mutate: Mutation, message: str) -> None:
    kwargs = _manage_kwargs()
    mutate(kwargs)
    snapshot = {k: v.clone() for k, v in kwargs.items()
                if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(KernelArgumentError, match=message):
        ops.lightning_indexer_manage(**kwargs)  # type: ignore[arg-type]
    for name, value in snapshot.items():
        assert torch.equal(kwargs[name], value), f"{name} changed by a rejected call"


def test_manage_limits_are_the_production_ones() -> None:
    assert MAX_QUERY_ROWS == 14 and MAX_CAPACITY == 32640
    kwargs = _manage_kwargs()
    rows = MAX_QUERY_ROWS + 1
    kwargs["query"] = torch.randn(rows + 1, 2, 8)
    kwargs["index_weights"] = torch.rand(rows + 1, 2)
    kwargs["query_dequant_scale"] = torch.ones(rows + 1, 2)
    kwargs["actual_seq_lengths_query"] = torch.tensor([1, rows + 1], dtype=torch.int32)
    for name in ("topk_src_ids", "topk_dst_slots"):
        kwargs[name] = torch.zeros(rows + 1, 1, 3, dtype=torch.int32)
    kwargs["topk_miss_counts"] = torch.zeros(rows + 1, dtype=torch.int32)
    with pytest.raises(KernelArgumentError, match=f"request 1 {rows} query rows; allowed: 1..14"):
        ops.lightning_indexer_manage(**kwargs)  # type: ignore[arg-type]


def test_quant_manage_requires_int8_and_fp16_scales() -> None:
    kwargs = _manage_kwargs()
    with pytest.raises(KernelArgumentError, match="query has dtype float32; allowed: int8"):
        ops.quant_lightning_indexer_manage(**kwargs)  # type: ignore[arg-type]
    kwargs["query"] = kwargs["query"].to(torch.int8)  # type: ignore[union-attr]
    kwargs["index_key_cache"] = kwargs["index_key_cache"].to(torch.int8)  # type: ignore[union-attr]
    with pytest.raises(KernelArgumentError, match="query_dequant_scale has dtype float32"):
        ops.quant_lightning_indexer_manage(**kwargs)  # type: ignore[arg-type]


def _copy_sfa_kwargs() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(9, 8, generator=g)
    index_cache, index_table = paged([keys[:, None, :]], 4, g)
    call = manage_call(torch.randn(2, 2, 8, generator=g), torch.rand(2, 2, generator=g),
                       index_cache, index_table, query_rows=[2], key_lengths=[9],
                       stable_lengths=[9], capacities=[7], states=[-2], pool_entries=[0],
                       pool=new_cache_slots_pool(1, 7), top_k=3)
    ops.lightning_indexer_manage(**call.kwargs)
    caches = mla_caches([9], [7], 16, 4, 4, g)
    return copy_sfa_kwargs(call, caches, torch.randn(2, 2, 16, generator=g),
                           torch.randn(2, 2, 4, generator=g), 0.5)


def _entry(name: str, index: tuple[int, ...], value: int) -> Mutation:
    def mutate(kwargs: dict[str, object]) -> None:
        tensor = kwargs[name].clone()  # type: ignore[union-attr]
        tensor[index] = value
        kwargs[name] = tensor
    return mutate


COPY_CASES: list[tuple[str, Mutation, str]] = [
    ("query latent", _set("query", lambda k: k["query"][..., :8]), "hbm_kv_cache.shape"),
    ("rope heads", _set("query_rope", lambda k: k["query_rope"][:, :1]),
     r"query_rope.shape\[1\]"),
    ("float dtype", _set("dram_kv_cache", lambda k: k["dram_kv_cache"].half()),
     "dram_kv_cache has dtype float16"),
    ("dram shape", _set("dram_k_rope", lambda k: k["dram_k_rope"][..., :2]),
     "dram_k_rope has shape"),
    ("out shape", _set("attention_out", lambda k: k["attention_out"][:1]),
     "attention_out has shape"),
    ("scale", _set("scale_value", lambda k: float("inf")), "scale_value must be a finite"),
    ("kv length", _set("actual_seq_lengths_kv", _meta(40)), r"actual_seq_lengths_kv\[0\] is 40"),
    ("not causal", _set("actual_seq_lengths_kv", _meta(3)), "a token its query row cannot see"),
    ("src padding mismatch", _entry("topk_src_ids", (0, 0, 0), -1), "disagree on padding"),
    ("src below -1", _entry("topk_src_ids", (0, 0, 0), -5), "topk_src_ids"),
    ("dst beyond table", _entry("topk_dst_slots", (1, 0, 0), 400), "topk_dst_slots"),
    ("hbm block id", _entry("hbm_block_table", (0, 0), 77), r"hbm_block_table\[0\]"),
    ("dram block id", _entry("dram_block_table", (0, 1), 77), r"dram_block_table\[0, :3\]"),
    ("row miss count", _entry("topk_miss_counts", (0,), 4), "topk_miss_counts of request 0"),
    ("miss count", _set("miss_counts", _meta(99)), r"miss_counts\[0\] is 99"),
    ("miss source", _entry("miss_src_ids", (0, 0), 9), r"miss_src_ids\[0, :"),
    ("miss slot", _entry("miss_dst_slots", (0, 0), -1), r"miss_dst_slots\[0, :"),
    ("metadata device", _set("miss_counts", lambda k: k["miss_counts"].to("meta")),
     "miss_counts is on meta"),
    ("hot cache not contiguous", _set("hbm_kv_cache", lambda k: k["hbm_kv_cache"].transpose(0, 1)),
     "hbm_kv_cache"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), COPY_CASES, ids=[c[0] for c in COPY_CASES])
def test_copy_sfa_names_the_bad_argument(case: str, mutate: Mutation, message: str) -> None:
    kwargs = _copy_sfa_kwargs()
    mutate(kwargs)
    hot = kwargs["hbm_kv_cache"].clone()  # type: ignore[union-attr]
    with pytest.raises(KernelArgumentError, match=message):
        ops.scatter_copy_sparse_flash_attention(**kwargs)  # type: ignore[arg-type]
    assert torch.equal(hot.isnan(), kwargs["hbm_kv_cache"].isnan())  # type: ignore[union-attr]


def test_valid_fixtures_pass() -> None:
    ops.lightning_indexer_manage(**_manage_kwargs())  # type: ignore[arg-type]
    kwargs = _copy_sfa_kwargs()
    ops.scatter_copy_sparse_flash_attention(**kwargs)  # type: ignore[arg-type]
    assert not kwargs["attention_out"].isnan().any()  # type: ignore[union-attr]
