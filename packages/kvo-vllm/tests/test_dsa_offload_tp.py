"""One DP rank's host pool shared by its TP ranks: rank 0 creates and writes, rank 1 attaches
and reads after rank 0's write notice; start-up failures reach every rank with their reasons.

Two threads play the two TP ranks (each with its own :class:`OffloadManager`, as two vLLM
workers would); their group is a small in-process :class:`TPGroup` (a barrier and shared
lists). The real pool, FIFOs and managers are used; vLLM's gloo group is exercised end to end in
``tests/e2e/test_dsa_offload_tp2.py``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvo_transport.host_pool import leaked_segments
from kvo_vllm.dsa import offload_tp
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.sparse.errors import TensorParallelError
from kvo_vllm.sparse.host_store import HostKVStore
from kvo_vllm.sparse.layout import SparseModelLayout

BS = 4
NUM_BLOCKS = 8


class ThreadGroup:
    """A :class:`~kvo_vllm.dsa.offload_tp.TPGroup` of threads (one instance per rank)."""

    def __init__(self, shared: dict[str, Any], rank: int, size: int) -> None:
        self.shared, self._rank, self._size = shared, rank, size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _collective(self, values: list[int], combine: Callable[[list[list[int]]], list[int]]
                    ) -> list[int]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self._rank] = values
        barrier.wait()
        result = combine(list(slots))
        barrier.wait()
        return result

    def broadcast_from_first(self, values: list[int]) -> list[int]:
        return self._collective(values, lambda all_values: list(all_values[0]))

    def sum_over_ranks(self, values: list[int]) -> list[int]:
        return self._collective(
            values, lambda all_values: [sum(v) for v in zip(*all_values, strict=True)])


def _run_ranks(size: int, body: Callable[[ThreadGroup], Any]) -> list[Any]:
    """``body(group)`` on ``size`` threads; each rank's result or raised exception."""
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size, timeout=20)}
    results: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = body(ThreadGroup(shared, rank, size))
        except BaseException as error:  # handed to the test
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def _layout() -> SparseModelLayout:
    return SparseModelLayout(num_layers=2, latent_dim=8, rope_dim=4, index_dim=4,
                             softmax_scale=1.0, kv_dtype=torch.float32)


def _manager(group: ThreadGroup) -> OffloadManager:
    return OffloadManager(_layout(), num_blocks=NUM_BLOCKS, block_size=BS, max_rows=2,
                          max_blocks_per_row=4, top_k=4, capacity=8, decode_query_rows=1,
                          pool_name="unused-at-tp2", tp_group=group)


def test_rank_1_attaches_to_rank_0s_pool_and_reads_after_the_notice() -> None:
    started = threading.Barrier(2, timeout=20)
    seen: dict[int, Any] = {}

    def body(group: ThreadGroup) -> Any:
        manager = _manager(group)
        try:
            rows = torch.arange(12, dtype=torch.float32).view(1, 12) + 100
            slots = torch.tensor([BS * 3])   # block 3's first row
            started.wait()
            if group.rank == 1:
                manager.write(0, torch.zeros(1, 12), slots)   # returns after rank 0's notice
            else:
                threading.Event().wait(0.2)   # rank 1 is already waiting for the notice
                manager.write(0, rows, slots)
            seen[group.rank] = (manager.pool_layer(0)[BS * 3].clone(),
                                manager.store.pool.name, manager.store.pool.is_creator,
                                int(manager.layers.identity[0].state.versions[3]),
                                manager.pool_region[1])
            started.wait()
        finally:
            manager.close()

    results = _run_ranks(2, body)
    assert results == [None, None]
    assert seen[0][1] == seen[1][1] and (seen[0][2], seen[1][2]) == (True, False)
    assert torch.equal(seen[1][0], torch.arange(12, dtype=torch.float32) + 100)  # rank 0's row
    assert seen[0][3] == seen[1][3] == 1          # both recorded the block's new version
    assert seen[0][4] == seen[1][4]
    assert f"kvo-hostpool-{seen[0][1]}" not in leaked_segments()   # the creator unlinked it


def test_a_diverged_write_count_fails_the_reader() -> None:
    def body(group: ThreadGroup) -> Any:
        manager = _manager(group)
        try:
            assert manager.notices is not None
            if group.rank == 0:
                manager.notices.published()
                manager.notices.published()
            else:
                manager.notices.sequence = 1   # as if it had missed a write call
                with pytest.raises(TensorParallelError, match="expected 2"):
                    manager.notices.wait_published()
        finally:
            group.sum_over_ranks([0])
            manager.close()

    assert _run_ranks(2, body) == [None, None]


def test_rank_0_gone_fails_the_reader_at_once() -> None:
    def body(group: ThreadGroup) -> Any:
        manager = _manager(group)
        try:
            assert manager.notices is not None
            if group.rank == 0:
                manager.close()   # closes its write end, as a dead process's would be
            group.sum_over_ranks([0])
            if group.rank == 1:
                with pytest.raises(TensorParallelError, match="closed its write notices"):
                    manager.write(0, torch.zeros(1, 12), torch.tensor([0]))
        finally:
            manager.close()

    assert _run_ranks(2, body) == [None, None]


def test_a_rank_that_cannot_attach_fails_every_rank_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real_attach = HostKVStore.attach

    def attach(name: str, *args: Any, **kwargs: Any) -> HostKVStore:
        if threading.current_thread().name.endswith("rank-2"):
            raise OSError("no such mapping")
        return real_attach(name, *args, **kwargs)

    monkeypatch.setattr(HostKVStore, "attach", staticmethod(attach))

    def body(group: ThreadGroup) -> Any:
        threading.current_thread().name = f"rank-{group.rank}"
        return _manager(group)

    results = _run_ranks(3, body)
    assert all(isinstance(r, TensorParallelError) for r in results), results
    for rank, error in enumerate(results):
        assert f"TP rank {rank} of 3: the DP rank's shared host pool 'dsa-" in str(error)
        assert "TP rank 2 could not attach to it: no such mapping" in str(error)
        assert "TP rank 1 could not" not in str(error)
    ours = f"dsa-{os.getpid()}-tp"
    assert not [name for name in leaked_segments() if ours in name]   # rank 0 removed it
    assert not list(offload_tp.FIFO_DIR.glob(f"{offload_tp.FIFO_PREFIX}{ours}*"))


def test_a_pool_rank_0_cannot_create_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    def create(*args: Any, **kwargs: Any) -> HostKVStore:
        raise OSError("no room in /dev/shm")

    monkeypatch.setattr(HostKVStore, "create", staticmethod(create))
    results = _run_ranks(2, _manager)
    assert all(isinstance(r, TensorParallelError) for r in results), results
    assert all("TP rank 0 could not create it: no room in /dev/shm" in str(r) for r in results)
