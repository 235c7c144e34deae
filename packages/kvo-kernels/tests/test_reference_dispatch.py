"""Implementation selection (device, forcing, native lookup) and forwarding to native ops."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from kvo_kernels_cases import copy_sfa_kwargs, manage_call, mla_caches, paged

from kvo_kernels import dispatch, ops
from kvo_kernels.cache_pool import new_cache_slots_pool
from kvo_kernels.errors import KernelArgumentError, KernelUnsupportedError

MANAGE = "lightning_indexer_manage"


def registered(*names: str):  # type: ignore[no-untyped-def]
    """A native lookup that knows exactly ``names`` (what a vllm-ascend build would register)."""
    def op(*args: object) -> None:
        return None

    return lambda name: op if name in names else None


NONE = registered()
ALL = registered(*dispatch.NATIVE_OPS.values())


@pytest.fixture(autouse=True)
def auto_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


@pytest.mark.parametrize(("op", "device", "lookup", "has_triton", "expected"), [
    (MANAGE, "cpu", ALL, True, "reference"),
    (MANAGE, "cuda", NONE, True, "triton"),
    (MANAGE, "cuda", NONE, False, "reference"),
    (MANAGE, "cuda", ALL, True, "triton"),             # native ops are NPU-only
    (MANAGE, "npu", ALL, True, "native"),
    ("quant_lightning_indexer_manage", "npu", registered(
        "npu_fused_lightning_indexer_manage"), True, "triton"),   # only the BF16 one is built
    ("scatter_copy_sparse_flash_attention", "npu", ALL, False, "native"),
    (MANAGE, "npu", NONE, True, "triton"),
    (MANAGE, "npu", NONE, False, "reference"),
    ("sparse_copy", "npu", ALL, True, "triton"),       # no native sparse_copy upstream
    ("hadamard_quant_int8", "cuda", ALL, True, "reference"),
])
def test_automatic_selection(op: str, device: str, lookup, has_triton: bool,  # type: ignore[no-untyped-def]
                             expected: str) -> None:
    selection = dispatch.select(op, device, native_lookup=lookup, triton_importable=has_triton)
    assert selection.implementation == expected, selection.reason
    assert (selection.native_op is not None) == (expected == "native")


def test_forced_choices() -> None:
    assert dispatch.select(MANAGE, "npu", choice="reference",
                           native_lookup=ALL).implementation == "reference"
    with pytest.raises(KernelUnsupportedError, match="npu_fused_lightning_indexer_manage"):
        dispatch.select(MANAGE, "npu", choice="native", native_lookup=NONE)
    with pytest.raises(KernelUnsupportedError, match="NPU tensors only"):
        dispatch.select(MANAGE, "cpu", choice="native", native_lookup=ALL)
    with pytest.raises(KernelUnsupportedError, match="pip install 'kvo-kernels\\[triton\\]'"):
        dispatch.select(MANAGE, "cuda", choice="triton", triton_importable=False)
    assert dispatch.select("hadamard_quant_int8", "cpu", choice="triton").implementation == \
        "reference"
    with pytest.raises(KernelArgumentError, match="implementation is 'fast'"):
        dispatch.select(MANAGE, "cpu", choice="fast")
    with pytest.raises(KernelArgumentError, match="unknown op 'attention'"):
        dispatch.select("attention", "cpu")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.select(MANAGE, "cpu", choice="triton",
                           triton_importable=True).implementation == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelUnsupportedError, match="TRITON_INTERPRET=1"):
        dispatch.select(MANAGE, "cpu", choice="triton", triton_importable=True)


def test_environment_and_context_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.select(MANAGE, "cuda", triton_importable=True).implementation == "reference"
    with dispatch.use_implementation("auto"):  # the context beats the environment
        assert dispatch.select(MANAGE, "cuda", triton_importable=True).implementation == "triton"
    with dispatch.use_implementation(None):   # None leaves the current choice
        assert dispatch.forced_choice() == "reference"
    monkeypatch.setenv(dispatch.ENV_VAR, "gpu")
    with pytest.raises(KernelArgumentError, match="KVO_KERNELS_IMPL is 'gpu'"):
        dispatch.select(MANAGE, "cuda")


def test_native_lookup_is_injectable_and_defaults_to_torch_ops() -> None:
    previous = dispatch.set_native_lookup(ALL)
    try:
        assert dispatch.select(MANAGE, "npu").implementation == "native"
    finally:
        dispatch.set_native_lookup(previous)
    assert previous is dispatch.torch_ops_native_lookup
    if importlib.util.find_spec("torch_npu") is None:
        assert dispatch.torch_ops_native_lookup("npu_fused_lightning_indexer_manage") is None


def _manage_kwargs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(9, 8, generator=g)
    cache, table = paged([keys[:, None, :]], 4, g)
    call = manage_call(torch.randn(1, 2, 8, generator=g), torch.rand(1, 2, generator=g), cache,
                       table, query_rows=[1], key_lengths=[9], stable_lengths=[9],
                       capacities=[4], states=[-2], pool_entries=[0],
                       pool=new_cache_slots_pool(1, 4), top_k=3)
    return call.kwargs


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def __call__(self, *args: object) -> None:
        self.calls.append(args)


def test_manage_forwards_the_19_arguments_to_the_native_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    native = Recorder()
    monkeypatch.setattr(dispatch, "select", lambda op, device: dispatch.Selection(
        "native", "test", native))
    kwargs = _manage_kwargs()
    before = {k: v.clone() for k, v in kwargs.items()}
    ops.lightning_indexer_manage(**kwargs)
    (args,) = native.calls
    assert len(args) == 19
    assert all(a is b for a, b in zip(args, kwargs.values(), strict=True))  # ABI order
    for name, value in before.items():  # the reference did not run
        assert torch.equal(kwargs[name], value)


def test_copy_sfa_checks_indices_before_a_native_op_follows_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manage = _manage_kwargs()
    ops.lightning_indexer_manage(**manage, implementation="reference")
    native = Recorder()
    monkeypatch.setattr(dispatch, "select", lambda op, device: dispatch.Selection(
        "native", "test", native))
    from kvo_kernels_cases import ManageCall
    g = torch.Generator().manual_seed(1)
    kwargs = copy_sfa_kwargs(ManageCall(kwargs=manage, query_rows=[1]),
                             mla_caches([9], [4], 16, 4, 4, g), torch.randn(1, 2, 16),
                             torch.randn(1, 2, 4), 0.5)
    ops.scatter_copy_sparse_flash_attention(**kwargs)  # type: ignore[arg-type]
    assert len(native.calls) == 1 and len(native.calls[0]) == 19
    kwargs["dram_block_table"] = kwargs["dram_block_table"].clone()  # type: ignore[union-attr]
    kwargs["dram_block_table"][0, 0] = 1000  # type: ignore[index]
    with pytest.raises(KernelArgumentError, match="dram_block_table"):
        ops.scatter_copy_sparse_flash_attention(**kwargs)  # type: ignore[arg-type]
    assert len(native.calls) == 1


def test_wrapper_argument_forces_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, "native")
    kwargs = _manage_kwargs()
    with pytest.raises(KernelUnsupportedError, match="not registered"):
        ops.lightning_indexer_manage(**kwargs)
    ops.lightning_indexer_manage(**kwargs, implementation="reference")
    assert int(kwargs["miss_counts"][0]) == 3


def test_native_ops_on_npu_match_the_reference() -> None:
    """On an Ascend machine with vllm-ascend's fused ops: Copy-SFA native == reference."""
    pytest.importorskip("torch_npu", reason="torch_npu (Ascend CANN) is not installed here: "
                        "the native _C_ascend ops can only run on an Ascend NPU")
    name = dispatch.NATIVE_OPS["scatter_copy_sparse_flash_attention"]
    if dispatch.torch_ops_native_lookup(name) is None:
        pytest.skip(f"torch.ops._C_ascend.{name} is not registered (vllm-ascend without the "
                    "fused offload ops)")
    g = torch.Generator().manual_seed(0)
    tokens, capacity, top_k, block = 4096, 2048, 2048, 128
    keys = torch.randn(tokens, 128, generator=g).bfloat16()
    cache, table = paged([keys[:, None, :]], block, g)
    call = manage_call(torch.randn(1, 64, 128, generator=g).bfloat16(),
                       torch.rand(1, 64, generator=g).bfloat16(), cache, table,
                       query_rows=[1], key_lengths=[tokens], stable_lengths=[tokens],
                       capacities=[capacity], states=[-2], pool_entries=[0],
                       pool=new_cache_slots_pool(1, capacity), top_k=top_k, miss_width=32768)
    ops.lightning_indexer_manage(**call.kwargs, implementation="reference")
    caches = mla_caches([tokens], [capacity], 512, 64, block, g, torch.bfloat16)
    kwargs = copy_sfa_kwargs(call, caches, torch.randn(1, 16, 512, generator=g).bfloat16(),
                             torch.randn(1, 16, 64, generator=g).bfloat16(), 0.04)
    reference = dict(kwargs, hbm_kv_cache=caches.hbm_kv.clone(),
                     hbm_k_rope=caches.hbm_rope.clone(),
                     attention_out=kwargs["attention_out"].clone())  # type: ignore[union-attr]
    ops.scatter_copy_sparse_flash_attention(**reference, implementation="reference")  # type: ignore[arg-type]
    npu = {k: (v.to("npu") if isinstance(v, torch.Tensor) and not k.startswith("dram_") else v)
           for k, v in kwargs.items()}
    ops.scatter_copy_sparse_flash_attention(**npu, implementation="native")  # type: ignore[arg-type]
    torch.testing.assert_close(npu["attention_out"].cpu(), reference["attention_out"],  # type: ignore[union-attr]
                               rtol=2e-2, atol=2e-2)
