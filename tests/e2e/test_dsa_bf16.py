"""The tiny DeepSeek-V3.2-architecture model served in bfloat16 (DeepSeek-V3.2's main-KV dtype):
kvo's offload mode gives the same tokens and logprobs as its resident mode, with the host pool's
rows in bfloat16; a packed main-KV cache (vLLM's ``kv_cache_dtype="fp8"``) is refused at start.

Two real in-process vLLM engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one after the other,
with the same prompts and scheduling: a prompt longer than the hot row (residency, misses copied
from the pool), chunked prefill, two requests running together, and a short prompt.

By hand: ``HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m pytest -q
tests/e2e/test_dsa_bf16.py`` (``nox -s e2e`` sets these).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _engines as e2e
import attrs
import pytest
import torch

NUM_LAYERS = 2
INDEX_TOPK = 32
STEP_TOKENS = 128
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 4,   # > hot row (64)
    "Hello, sparse world",
]
MAX_TOKENS = [10, 8]
LATENT_ROPE = 512 + 64


engine_env = e2e.engine_env_fixture()
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32-bf16", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


def _engine(model: Path, mode: str, **extra: Any) -> Any:
    return e2e.start_engine(model, dtype="bfloat16", max_model_len=512, max_num_seqs=2,
                            max_num_batched_tokens=STEP_TOKENS,
                            additional_config={"kvo_sparse": {"mode": mode}}, **extra)


def _generate(llm: Any) -> e2e.Answers:
    return e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)


@attrs.frozen
class Runs:
    resident: e2e.Answers
    offload: e2e.Answers
    pool_dtype: torch.dtype
    pool_row_bytes: int
    misses: int
    hits: int


@pytest.fixture(scope="module")
def runs(engine_env: None, dsv32_model: Path) -> Iterator[Runs]:
    from kvo_vllm.dsa.offload_main_kv import offload_workers

    llm = _engine(dsv32_model, "resident")
    resident = _generate(llm)
    e2e.stop_engine(llm)
    del llm
    earlier = {id(w) for w in offload_workers()}
    llm = _engine(dsv32_model, "offload")
    offload = _generate(llm)
    worker = next(w for w in offload_workers() if id(w) not in earlier
                  and w.manager is not None)
    manager = worker.manager
    yield Runs(resident=resident, offload=offload, pool_dtype=manager.layout.kv_dtype,
               pool_row_bytes=manager.row_bytes, misses=worker.stats.totals.misses,
               hits=worker.stats.totals.hits)
    e2e.stop_engine(llm)


def test_bf16_offload_equals_resident_tokens_and_logprobs(runs: Runs) -> None:
    assert [len(tokens) for tokens, _ in runs.offload] == MAX_TOKENS
    assert runs.offload == runs.resident


def test_bf16_host_pool_holds_bf16_rows_and_is_read(runs: Runs) -> None:
    assert runs.pool_dtype == torch.bfloat16
    assert runs.pool_row_bytes == LATENT_ROPE * 2
    assert runs.misses > 0 and runs.hits > 0   # the long prompt went through residency


@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_packed_main_kv_cache_is_refused_at_start(engine_env: None, dsv32_model: Path,
                                                  mode: str) -> None:
    # vLLM's config validation re-raises kvo's ConfigError as a pydantic ValueError.
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is a packed main-KV cache.*"
                                         r"allowed: 'auto', 'bfloat16', 'float16'"):
        _engine(dsv32_model, mode, kv_cache_dtype="fp8")
