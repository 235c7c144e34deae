"""kvo's fused ops as ``torch.library`` custom ops (namespace ``kvo``) and their typed wrappers.

``torch.ops.kvo.<op>`` is what graphs and other packages call; the Python functions below are
the same ops with type hints, keyword names and an optional ``implementation=`` override. The
ops' semantics are the reference modules' docstrings (``kvo_kernels.reference.manage``,
``kvo_kernels.reference.copy_sfa``, ``kvo_kernels.reference.primitives``); ``dispatch`` picks
the implementation per call from the tensors' device.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kvo_kernels import dispatch
from kvo_kernels.copy_sfa_abi import CopySfaArgs, check_copy_sfa_args, check_copy_sfa_static
from kvo_kernels.manage_abi import OUTPUTS as MANAGE_OUTPUTS
from kvo_kernels.manage_abi import ManageArgs, check_manage_static
from kvo_kernels.primitive_set import REFERENCE, Primitives, triton_primitives
from kvo_kernels.reference import copy_sfa as reference_copy_sfa
from kvo_kernels.reference import manage as reference_manage
from kvo_kernels.reference import primitives as reference_primitives

COPY_SFA_OUTPUTS = ("hbm_k_rope", "hbm_kv_cache", "attention_out")

_library = torch.library.Library("kvo", "FRAGMENT")


def _schema(name: str, fields: tuple[attrs.Attribute[Any], ...], mutated: tuple[str, ...]) -> str:
    """A schema string from an args class: tensors, mutated ones annotated ``Tensor(x!)``."""
    params = []
    for i, field in enumerate(fields):
        if field.name == "scale_value":
            params.append(f"float {field.name}")
        elif field.name in mutated:
            params.append(f"Tensor(a{i}!) {field.name}")
        else:
            params.append(f"Tensor {field.name}")
    return f"{name}({', '.join(params)}) -> ()"


def _primitives(implementation: str) -> Primitives:
    return triton_primitives() if implementation == "triton" else REFERENCE


def _manage_impl(op: str, quantised: bool):  # type: ignore[no-untyped-def]
    def impl(*tensors: torch.Tensor) -> None:
        args = ManageArgs(*tensors)
        selection = dispatch.select(op, args.query.device.type)
        if selection.native_op is not None:
            # The native op keeps upstream's pool layout and validates its own arguments.
            selection.native_op(*tensors)
            return
        reference_manage.lightning_indexer_manage(
            args, quantised=quantised, primitives=_primitives(selection.implementation))
    return impl


def _copy_sfa_impl(*values: object) -> None:
    args = CopySfaArgs(*values)  # type: ignore[arg-type]
    selection = dispatch.select("scatter_copy_sparse_flash_attention", args.query.device.type)
    if selection.native_op is not None:
        check_copy_sfa_args(args)  # every index in range before a kernel follows it
        selection.native_op(*values)
        return
    reference_copy_sfa.scatter_copy_sparse_flash_attention(
        args, primitives=_primitives(selection.implementation))


def _sparse_copy_impl(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                      dst_rows: torch.Tensor) -> None:
    selection = dispatch.select("sparse_copy", dst.device.type)
    if selection.native_op is not None:  # kvo's host op: checks its own arguments
        selection.native_op(src, dst, src_rows, dst_rows)
        return
    _primitives(selection.implementation).sparse_copy(src, dst, src_rows, dst_rows)


def _sparse_copy_gather_impl(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                             dst_rows: torch.Tensor, gather_rows: torch.Tensor,
                             out: torch.Tensor) -> None:
    selection = dispatch.select("sparse_copy_gather", dst.device.type)
    if selection.native_op is not None:  # kvo's host op: checks its own arguments
        selection.native_op(src, dst, src_rows, dst_rows, gather_rows, out)
        return
    reference_primitives.sparse_copy_gather(src, dst, src_rows, dst_rows, gather_rows, out)


def _hadamard_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_primitives.hadamard_quant_int8(x)


def _manage_fake(quantised: bool):  # type: ignore[no-untyped-def]
    """Fake/meta kernel: the checks that need no data, so mixed or fake devices still fail."""
    def fake(*tensors: torch.Tensor) -> None:
        check_manage_static(ManageArgs(*tensors), quantised)
    return fake


def _copy_sfa_fake(*values: object) -> None:
    check_copy_sfa_static(CopySfaArgs(*values))  # type: ignore[arg-type]


def _sparse_copy_fake(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                      dst_rows: torch.Tensor) -> None:
    return None


def _sparse_copy_gather_fake(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                             dst_rows: torch.Tensor, gather_rows: torch.Tensor,
                             out: torch.Tensor) -> None:
    return None


def _hadamard_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float16))


def _register() -> None:
    manage_fields = attrs.fields(ManageArgs)
    for op, quantised in (("lightning_indexer_manage", False),
                          ("quant_lightning_indexer_manage", True)):
        _library.define(_schema(op, manage_fields, MANAGE_OUTPUTS))
        _library.impl(op, _manage_impl(op, quantised), "CompositeExplicitAutograd")
        torch.library.register_fake(f"kvo::{op}", _manage_fake(quantised), lib=_library)
    _library.define(_schema("scatter_copy_sparse_flash_attention", attrs.fields(CopySfaArgs),
                            COPY_SFA_OUTPUTS))
    _library.impl("scatter_copy_sparse_flash_attention", _copy_sfa_impl,
                  "CompositeExplicitAutograd")
    torch.library.register_fake("kvo::scatter_copy_sparse_flash_attention", _copy_sfa_fake,
                                lib=_library)
    _library.define(
        "sparse_copy(Tensor src, Tensor(a!) dst, Tensor src_rows, Tensor dst_rows) -> ()")
    _library.impl("sparse_copy", _sparse_copy_impl, "CompositeExplicitAutograd")
    torch.library.register_fake("kvo::sparse_copy", _sparse_copy_fake, lib=_library)
    _library.define("sparse_copy_gather(Tensor src, Tensor(a!) dst, Tensor src_rows, "
                    "Tensor dst_rows, Tensor gather_rows, Tensor(b!) out) -> ()")
    _library.impl("sparse_copy_gather", _sparse_copy_gather_impl, "CompositeExplicitAutograd")
    torch.library.register_fake("kvo::sparse_copy_gather", _sparse_copy_gather_fake,
                                lib=_library)
    _library.define("hadamard_quant_int8(Tensor x) -> (Tensor, Tensor)")
    _library.impl("hadamard_quant_int8", _hadamard_impl, "CompositeExplicitAutograd")
    torch.library.register_fake("kvo::hadamard_quant_int8", _hadamard_fake, lib=_library)


_register()


def lightning_indexer_manage(
        index_weights: torch.Tensor, query_dequant_scale: torch.Tensor, query: torch.Tensor,
        index_key_dequant_scale: torch.Tensor, index_key_cache: torch.Tensor,
        index_block_table: torch.Tensor, actual_seq_lengths_query: torch.Tensor,
        actual_seq_lengths_key: torch.Tensor, offload_seq_lengths_key: torch.Tensor,
        num_cache_tokens: torch.Tensor, request_state: torch.Tensor,
        req_pool_entries: torch.Tensor, cache_slots_pool: torch.Tensor,
        topk_src_ids: torch.Tensor, topk_dst_slots: torch.Tensor,
        topk_miss_counts: torch.Tensor, miss_src_ids: torch.Tensor,
        miss_dst_slots: torch.Tensor, miss_counts: torch.Tensor, *,
        implementation: str | None = None) -> None:
    """BF16/FP16 indexer + top-k + residency; writes the last seven tensors in place.

    Semantics: ``kvo_kernels.reference.manage``; pool layout: ``kvo_kernels.cache_pool``.
    """
    with dispatch.use_implementation(implementation):
        torch.ops.kvo.lightning_indexer_manage(
            index_weights, query_dequant_scale, query, index_key_dequant_scale,
            index_key_cache, index_block_table, actual_seq_lengths_query,
            actual_seq_lengths_key, offload_seq_lengths_key, num_cache_tokens, request_state,
            req_pool_entries, cache_slots_pool, topk_src_ids, topk_dst_slots,
            topk_miss_counts, miss_src_ids, miss_dst_slots, miss_counts)


def quant_lightning_indexer_manage(
        index_weights: torch.Tensor, query_dequant_scale: torch.Tensor, query: torch.Tensor,
        index_key_dequant_scale: torch.Tensor, index_key_cache: torch.Tensor,
        index_block_table: torch.Tensor, actual_seq_lengths_query: torch.Tensor,
        actual_seq_lengths_key: torch.Tensor, offload_seq_lengths_key: torch.Tensor,
        num_cache_tokens: torch.Tensor, request_state: torch.Tensor,
        req_pool_entries: torch.Tensor, cache_slots_pool: torch.Tensor,
        topk_src_ids: torch.Tensor, topk_dst_slots: torch.Tensor,
        topk_miss_counts: torch.Tensor, miss_src_ids: torch.Tensor,
        miss_dst_slots: torch.Tensor, miss_counts: torch.Tensor, *,
        implementation: str | None = None) -> None:
    """C8 variant: int8 query/key (Hadamard-rotated) with fp16 dequant scales; fp8 rejected."""
    with dispatch.use_implementation(implementation):
        torch.ops.kvo.quant_lightning_indexer_manage(
            index_weights, query_dequant_scale, query, index_key_dequant_scale,
            index_key_cache, index_block_table, actual_seq_lengths_query,
            actual_seq_lengths_key, offload_seq_lengths_key, num_cache_tokens, request_state,
            req_pool_entries, cache_slots_pool, topk_src_ids, topk_dst_slots,
            topk_miss_counts, miss_src_ids, miss_dst_slots, miss_counts)


def scatter_copy_sparse_flash_attention(
        query_rope: torch.Tensor, query: torch.Tensor, actual_seq_lengths_query: torch.Tensor,
        actual_seq_lengths_kv: torch.Tensor, num_cache_tokens: torch.Tensor,
        topk_dst_slots: torch.Tensor, topk_src_ids: torch.Tensor,
        topk_miss_counts: torch.Tensor, miss_src_ids: torch.Tensor,
        miss_dst_slots: torch.Tensor, miss_counts: torch.Tensor,
        hbm_block_table: torch.Tensor, dram_block_table: torch.Tensor,
        hbm_k_rope: torch.Tensor, hbm_kv_cache: torch.Tensor, dram_k_rope: torch.Tensor,
        dram_kv_cache: torch.Tensor, scale_value: float, attention_out: torch.Tensor, *,
        implementation: str | None = None) -> None:
    """Copy-SFA: copy the misses into the hot buffer, then sparse MLA attention.

    Writes ``hbm_k_rope``, ``hbm_kv_cache`` and ``attention_out`` in place; semantics:
    ``kvo_kernels.reference.copy_sfa``.
    """
    with dispatch.use_implementation(implementation):
        torch.ops.kvo.scatter_copy_sparse_flash_attention(
            query_rope, query, actual_seq_lengths_query, actual_seq_lengths_kv,
            num_cache_tokens, topk_dst_slots, topk_src_ids, topk_miss_counts, miss_src_ids,
            miss_dst_slots, miss_counts, hbm_block_table, dram_block_table, hbm_k_rope,
            hbm_kv_cache, dram_k_rope, dram_kv_cache, float(scale_value), attention_out)


def sparse_copy(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                dst_rows: torch.Tensor, *, implementation: str | None = None) -> None:
    """``dst[dst_rows] = src[src_rows]`` (rows of any dtype, host <-> device), bounds-checked."""
    with dispatch.use_implementation(implementation):
        torch.ops.kvo.sparse_copy(src, dst, src_rows, dst_rows)


def sparse_copy_gather(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                       dst_rows: torch.Tensor, gather_rows: torch.Tensor, out: torch.Tensor, *,
                       implementation: str | None = None) -> None:
    """``sparse_copy(src, dst, src_rows, dst_rows)``, then ``out[k] = dst[gather_rows[k]]``
    (one device; semantics: ``kvo_kernels.reference.primitives.sparse_copy_gather``)."""
    with dispatch.use_implementation(implementation):
        torch.ops.kvo.sparse_copy_gather(src, dst, src_rows, dst_rows, gather_rows, out)


def hadamard_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hadamard rotation + symmetric per-row int8: (int8 [..., D], fp16 scale [..., 1])."""
    quantised, scale = torch.ops.kvo.hadamard_quant_int8(x)
    return quantised, scale
