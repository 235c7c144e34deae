"""End to end: LayerwiseStoreConnector in a real vLLM (CPU) engine with a real Mooncake store.

One plain engine (no kvo) gives the reference answers; one engine with the connector (8 layers
in 3 physical buffers) must give exactly the same tokens and logprobs, with its buffers aliased
in the live KV cache, its prefix hits loaded from the store, and its output visibly changed when
a loaded block is corrupted. Prefills are chunked, so which tokens a step computes depends on
the prefix hit, and CPU matmuls round differently for different chunks (by ~1e-5 in a
logprob): a cold run is compared with plain vLLM's cold run, a store hit with plain vLLM's
local prefix-cache hit. Both engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``, ``uni`` executor), each started once per module.

Mooncake listens on every interface, so this runs inside a loopback-only network namespace:
``nox -s e2e`` does that; by hand::

    unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 HF_HUB_OFFLINE=1 \\
      VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 \\
      python -m pytest -q tests/e2e/test_layerwise.py'
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _engines as e2e
import pytest

pytestmark = e2e.NEEDS_NETNS

NUM_LAYERS = 8
SHARED_BUFFERS = 2
PHYSICAL_BUFFERS = 1 + SHARED_BUFFERS  # layer 0 independent, layers 1..7 round robin in 2
BLOCK_SIZE = 32  # several full blocks and a partial one per prompt
STEP_TOKENS = 96  # chunked prefills mixed with decodes: later chunks reload earlier ones
MAX_TOKENS = 6
# Different lengths: whole blocks, partial tails, one prompt a prefix of another.
PROMPTS = [
    "The layerwise offload keeps few buffers on the device. " * 3,
    "A store holds every layer; prefix hits load through it, block by block. " * 4,
    "The layerwise offload keeps few buffers on the device. " * 3 + "Then decode continues.",
]


engine_env = e2e.engine_env_fixture(clear_sparse_config=False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvo_tools.models.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_layers=NUM_LAYERS)


def _engine(model: Path, **extra: Any) -> Any:
    return e2e.start_engine(model, max_model_len=1024, block_size=BLOCK_SIZE,
                            max_num_batched_tokens=STEP_TOKENS, **extra)


def _stop(llm: Any) -> None:
    if not getattr(llm, "_kvo_stopped", False):  # a test may stop a module's engine early
        llm.llm_engine.engine_core.shutdown()
        llm._kvo_stopped = True


def _generate(llm: Any, prompts: list[str] = PROMPTS) -> e2e.Answers:
    return e2e.greedy_answers(llm, prompts, MAX_TOKENS)


@dataclass(frozen=True)
class Reference:
    """Plain vLLM's answers: computed from scratch, and again with its prefix cache warm."""

    cold: e2e.Answers
    prefix_hit: e2e.Answers


@pytest.fixture(scope="module")
def reference(engine_env: None, tiny_model: Path) -> Reference:
    llm = _engine(tiny_model)
    try:
        return Reference(cold=_generate(llm), prefix_hit=_generate(llm))
    finally:
        _stop(llm)


master = e2e.mooncake_master_fixture()


@pytest.fixture(scope="module")
def kvo(engine_env: None, tiny_model: Path, master: Any,
        reference: Reference) -> Iterator[e2e.KvoEngine]:
    transfer = e2e.layerwise_transfer(master.address, shared_buffers=SHARED_BUFFERS)
    llm = _engine(tiny_model, kv_transfer_config=transfer)
    try:
        yield e2e.KvoEngine(llm=llm, cold=_generate(llm))
    finally:
        _stop(llm)


def _live_kv_caches(worker: Any) -> dict[str, tuple[int, int]]:
    """Per attention layer the cache vLLM's layers actually use: (data_ptr, bytes)."""
    context = worker.vllm_config.compilation_config.static_forward_context
    caches = {}
    for name, module in context.items():
        cache = getattr(module, "kv_cache", None)
        if name.endswith(".attn") and cache is not None and cache.numel():
            caches[name] = (cache.data_ptr(), cache.numel() * cache.element_size())
    return caches


def test_same_tokens_and_logprobs_as_plain_vllm(kvo: e2e.KvoEngine, reference: Reference) -> None:
    assert kvo.cold == reference.cold
    stats = e2e.layerwise_worker_connector().stats
    assert stats.saved_blocks > 0
    # Later chunks and decode steps refill the shared buffers from the store.
    assert stats.loaded_blocks > 0
    assert stats.failed_loads == 0 and stats.failed_saves == 0


def test_buffer_reuse_is_active_in_the_live_kv_cache(kvo: e2e.KvoEngine) -> None:
    caches = kvo.llm.collective_rpc(_live_kv_caches)[0]
    assert len(caches) == NUM_LAYERS
    pointers = {pointer for pointer, _ in caches.values()}
    assert len(pointers) == PHYSICAL_BUFFERS < NUM_LAYERS
    by_pointer: dict[int, list[int]] = {}
    for name, (pointer, _) in caches.items():
        by_pointer.setdefault(pointer, []).append(int(name.split(".")[2]))
    assert sorted(sorted(layers) for layers in by_pointer.values()) == [
        [0], [1, 3, 5, 7], [2, 4, 6]]
    layout = e2e.layerwise_worker_connector().layout
    per_layer = {size for _, size in caches.values()}
    assert per_layer == {layout.layer_region_bytes}
    assert layout.physical_bytes * NUM_LAYERS == layout.logical_bytes * PHYSICAL_BUFFERS


def test_prefix_hit_after_reset_loads_through_the_store(kvo: e2e.KvoEngine,
                                                         reference: Reference) -> None:
    worker, scheduler = e2e.layerwise_worker_connector(), e2e.scheduler_connector(kvo.llm)
    assert kvo.llm.reset_prefix_cache()  # vLLM's own cache is empty; the store is not
    layer0_before = worker.stats.loaded_blocks_by_layer.get(0, 0)
    hits_before = scheduler.scheduler_stats.hit_tokens

    assert _generate(kvo.llm) == reference.prefix_hit

    hit_tokens = scheduler.scheduler_stats.hit_tokens - hits_before
    # At least every whole block of the longest prompt but its last token came from the store
    # (the others may hit blocks the first prompt loaded in the same step, locally).
    longest = max(len(kvo.llm.get_tokenizer()(p).input_ids) for p in PROMPTS)
    assert hit_tokens >= (longest - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    # Layer 0 owns its buffer; it only loads blocks the scheduler took from the store.
    assert worker.stats.loaded_blocks_by_layer.get(0, 0) - layer0_before == (
        hit_tokens // BLOCK_SIZE)


def test_corrupted_loaded_block_changes_the_output(kvo: e2e.KvoEngine,
                                                   reference: Reference) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    corrupted: list[str] = []

    def corrupt(layer_name: str, cache: torch.Tensor, block_ids: list[int]) -> None:
        block = cache[block_ids[0]]
        block.copy_(torch.randn(block.shape, generator=generator, dtype=block.dtype))
        corrupted.append(layer_name)

    with e2e.corrupting_loads(corrupt):
        assert kvo.llm.reset_prefix_cache()
        damaged = _generate(kvo.llm)
    assert corrupted
    assert damaged != reference.prefix_hit
    # The damage stayed on the device: the store still holds the right blocks.
    assert kvo.llm.reset_prefix_cache()
    assert _generate(kvo.llm) == reference.prefix_hit


class FailingGets:
    """Makes the worker's next ``count`` store gets raise, as Mooncake does on LEASE_EXPIRED."""

    def __init__(self, count: int) -> None:
        from kvo_vllm.layerwise.loader import LOAD_ATTEMPTS

        self.worker = e2e.layerwise_worker_connector().worker
        self.left = count * LOAD_ATTEMPTS  # every retry of ``count`` loads fails too
        self._get = self.worker.store.get_into

    def __enter__(self) -> FailingGets:
        def get_into(*args: Any) -> Any:
            if self.left > 0:
                self.left -= 1
                raise RuntimeError("injected store failure")
            return self._get(*args)

        self.worker.store.get_into = get_into
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.store.get_into = self._get


def test_failed_load_fails_the_request_never_answers_wrong(kvo: e2e.KvoEngine,
                                                          reference: Reference) -> None:
    """Default policy ("fail"): a request whose KV did not load ends without tokens."""
    failed_before = e2e.layerwise_worker_connector().stats.failed_loads
    assert kvo.llm.reset_prefix_cache()
    with FailingGets(1) as failing:
        answers = _generate(kvo.llm)
    assert failing.left == 0 and e2e.layerwise_worker_connector().stats.failed_loads > failed_before
    assert any(not tokens for tokens, _ in answers)  # some request was failed...
    for (tokens, _), (want, _) in zip(answers, reference.prefix_hit, strict=True):
        assert not tokens or tokens == want  # ...and none answered from broken KV
    assert kvo.llm.reset_prefix_cache()
    assert _generate(kvo.llm) == reference.prefix_hit  # nothing bad was left in the store


def test_a_late_removal_of_a_poisoned_block_never_fails_a_later_request(
        kvo: e2e.KvoEngine, reference: Reference) -> None:
    """Issue 13 §6: a store failure poisons the blocks the failed requests computed; their
    removal from the store runs in the background, and on a loaded machine (or behind a read
    lease) it can come after the next generation computed and saved the same blocks again.
    It must not delete those: the next decode step reloads them, and a missing block fails
    a request that did nothing wrong (seen: 4 of 6 tokens, then the end)."""
    worker = e2e.layerwise_worker_connector().worker
    assert kvo.llm.reset_prefix_cache()
    with HeldRemovals(worker) as held:
        with FailingGets(1):
            failed = _generate(kvo.llm)
        assert any(not tokens for tokens, _ in failed)
        assert kvo.llm.reset_prefix_cache()
        held.watch_resaves = True
        answers = _generate(kvo.llm)
    assert held.resaved_poisoned  # the follow-up saved poisoned blocks again...
    assert answers == reference.prefix_hit  # ...and every request got all its tokens
    assert kvo.llm.reset_prefix_cache()
    assert _generate(kvo.llm) == reference.prefix_hit  # and the store kept them


def test_a_poisoned_block_is_gone_from_the_store_before_the_next_lookup(
        kvo: e2e.KvoEngine) -> None:
    """The other way a failure could reach a later request: the failed requests' blocks are
    poisoned (this worker never loads them), but while their removal is still under way the
    scheduler's store lookup finds them and promises them to the next request with the same
    prefix, whose load then fails. A step that poisoned keys ends only once they are removed."""
    longer = PROMPTS[1] + "It goes on for another sentence or two."
    worker = e2e.layerwise_worker_connector().worker
    assert kvo.llm.reset_prefix_cache()
    with HeldRemovals(worker):
        with FailingGets(1):
            failed = _generate(kvo.llm)
        assert any(not tokens for tokens, _ in failed)
        poisoned = worker.stats.poisoned_keys
        # No reset: vLLM evicted the failed blocks; the rest of the prefix is cached locally.
        (tokens, _), = _generate(kvo.llm, [longer])
    assert worker.stats.poisoned_keys == poisoned  # nothing failed this time
    assert len(tokens) == MAX_TOKENS
    assert kvo.llm.reset_prefix_cache()
    (again, _), = _generate(kvo.llm, [longer])
    assert again == tokens


def test_failed_load_is_recomputed_to_the_same_answer(engine_env: None, tiny_model: Path,
                                                      master: Any, kvo: e2e.KvoEngine,
                                                      reference: Reference) -> None:
    """kv_load_failure_policy="recompute": vLLM recomputes what did not load; same answers."""
    _stop(kvo.llm)  # one engine at a time in this process (vLLM's global connector state)
    transfer = e2e.layerwise_transfer(master.address, shared_buffers=SHARED_BUFFERS,
                                      kv_load_failure_policy="recompute")
    llm = _engine(tiny_model, kv_transfer_config=transfer)
    try:
        assert _generate(llm) == reference.cold
        for _ in range(2):
            assert llm.reset_prefix_cache()
            with FailingGets(1) as failing:
                answers = _generate(llm)
            assert failing.left == 0
            # Same tokens; the recompute runs in other chunks than either reference, and CPU
            # matmuls round per chunk (module docstring): logprobs agree to ~1e-5.
            for (tokens, logprobs), (want, want_logprobs) in zip(
                    answers, reference.prefix_hit, strict=True):
                assert tokens == want
                assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    finally:
        _stop(llm)


def test_refuses_to_run_without_eager_mode(tiny_model: Path, master: Any) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvo_vllm.layerwise import EagerModeRequiredError, LayerwiseStoreConnector

    transfer = KVTransferConfig(
        kv_connector="LayerwiseStoreConnector", kv_connector_module_path="kvo_vllm.connectors",
        kv_role="kv_both", kv_connector_extra_config={"store_master_address": master.address})
    config = EngineArgs(model=str(tiny_model), enforce_eager=False, kv_transfer_config=transfer,
                        distributed_executor_backend="uni").create_engine_config()
    with pytest.raises(EagerModeRequiredError, match=r"requires eager mode.*enforce_eager=True"):
        LayerwiseStoreConnector(config, KVConnectorRole.SCHEDULER, None)


class HeldRemovals:
    """Holds each store removal until the next put has completed (at most ``HOLD_S``), as a
    loaded machine or a read lease delays it: a removal asked for before a save of the same
    key then reaches the store after that save, unless the connector keeps them in order."""

    HOLD_S = 1.0

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.store = worker.store
        self._remove, self._put = self.store.remove, self.store.put_from
        self._puts = 0
        self._put_done = threading.Condition()
        self.watch_resaves = False
        self.resaved_poisoned: set[str] = set()
        """Keys saved while poisoned, once ``watch_resaves`` is set."""

    def __enter__(self) -> HeldRemovals:
        def remove(keys: list[str]) -> None:
            with self._put_done:
                seen = self._puts
                self._put_done.wait_for(lambda: self._puts > seen, timeout=self.HOLD_S)
            self._remove(keys)

        def put_from(keys: list[str], *args: Any, **kwargs: Any) -> None:
            if self.watch_resaves:
                self.resaved_poisoned |= self.worker.poisoned.poisoned_among(keys)
            try:
                self._put(keys, *args, **kwargs)
            finally:
                with self._put_done:
                    self._puts += 1
                    self._put_done.notify_all()

        self.store.remove, self.store.put_from = remove, put_from
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.remove, self.store.put_from = self._remove, self._put
        self.worker.poisoned.settle()
