"""The fused pool's row splitter (``kvo_vllm.remote_d2h.fused_pool_split``) over a stand-in
engine that copies local memory: what lands where, what is refused, and that a failed read's
staging slot is not read into again until its quarantine passed. (The real engines, Mooncake
and ZMQ: tests/test_remote_d2h_dsa_pull.py; real vLLM: tests/e2e/test_pd_dsa_fused.py.)"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import pytest
import torch

from kvo_transport.errors import TransferArgumentError, TransferError
from kvo_vllm.remote_d2h.fused_pool_split import (
    RowSplittingEngine,
    StagingArena,
    fused_pool_layers,
)

LATENT, ROPE, ROWS = 8, 4, 16
ROW_BYTES = (LATENT + ROPE) * 4


class CopyEngine:
    """Reads by copying ``remote`` to ``local`` in this process; can fail the next reads."""

    backend = "test"
    protocol = "memcpy"
    session_id = "copy"

    def __init__(self) -> None:
        self.fail_next = 0
        self.reads: list[list[int]] = []

    def register(self, ptr: int, length: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        self.reads.append(list(local_addrs))
        if self.fail_next:
            self.fail_next -= 1
            raise TransferError("failed on purpose")
        for local, remote, length in zip(local_addrs, remote_addrs, lengths, strict=True):
            ctypes.memmove(local, remote, length)

    def write(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        raise AssertionError("not used")

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_region(layers: int = 2) -> torch.Tensor:
    """``layers`` fused layers: each [ROWS, LATENT] latents then [ROWS, ROPE] ropes."""
    return torch.zeros(layers, ROWS * (LATENT + ROPE), dtype=torch.float32)


def parts(region: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer[:ROWS * LATENT].view(ROWS, LATENT), layer[ROWS * LATENT:].view(ROWS, ROPE))
            for layer in region]


def splitter(region: torch.Tensor, *, slots: int = 2, rows: int = 4
             ) -> tuple[RowSplittingEngine, CopyEngine, Clock]:
    inner, clock = CopyEngine(), Clock()
    engine = RowSplittingEngine(inner, fused_pool_layers(parts(region), ROWS),
                                StagingArena(ROW_BYTES, slots=slots, rows=rows),
                                quarantine_s=2.0, clock=clock)
    return engine, inner, clock


def source_rows(count: int, seed: int = 0) -> torch.Tensor:
    return torch.arange(count * (LATENT + ROPE), dtype=torch.float32).view(count, -1) + seed


def test_rows_land_split_in_both_arrays_across_pieces_and_layers() -> None:
    region = pool_region()
    engine, inner, _ = splitter(region, rows=4)
    source = source_rows(6, seed=1000)
    other = torch.zeros(3, dtype=torch.float32)   # e.g. an indexer cache: passes through
    extra = torch.tensor([7.0, 8.0, 9.0])
    layer1 = fused_pool_layers(parts(region), ROWS)[1]
    engine.read("peer", [layer1.base + 2 * ROW_BYTES, other.data_ptr()],
                [source.data_ptr(), extra.data_ptr()], [6 * ROW_BYTES, 12])
    latent, rope = parts(region)[1]
    assert torch.equal(latent[2:8], source[:, :LATENT])
    assert torch.equal(rope[2:8], source[:, LATENT:])
    assert torch.equal(other, extra)
    assert bool((latent[:2] == 0).all()) and bool((latent[8:] == 0).all())
    assert bool((region[0] == 0).all())   # the other layer is untouched
    assert len(inner.reads) == 2          # 6 rows through a 4-row slot: two reads
    assert engine.split_rows == 6


def test_a_descriptor_that_is_not_whole_rows_is_refused_before_reading() -> None:
    region = pool_region()
    engine, inner, _ = splitter(region)
    base = fused_pool_layers(parts(region), ROWS)[0].base
    source = source_rows(2)
    for local, length in ((base + 4, ROW_BYTES), (base, ROW_BYTES + 4),
                          (base + (ROWS - 1) * ROW_BYTES, 2 * ROW_BYTES)):
        with pytest.raises(TransferArgumentError, match="whole rows"):
            engine.read("peer", [local], [source.data_ptr()], [length])
    assert inner.reads == []


def test_a_failed_read_is_not_split_and_its_slot_waits_out_the_quarantine() -> None:
    region = pool_region()
    engine, inner, clock = splitter(region, slots=2)
    base = fused_pool_layers(parts(region), ROWS)[0].base
    source = source_rows(1, seed=5)
    inner.fail_next = 1
    with pytest.raises(TransferError):
        engine.read("peer", [base], [source.data_ptr()], [ROW_BYTES])
    assert bool((region == 0).all())      # nothing of the failed read reached the pool
    first_slot = inner.reads[-1][0]
    engine.read("peer", [base], [source.data_ptr()], [ROW_BYTES])
    second_slot = inner.reads[-1][0]
    assert second_slot != first_slot      # the failed slot is not read into again
    latent, rope = parts(region)[0]
    assert torch.equal(latent[0], source[0, :LATENT]) and torch.equal(rope[0], source[0, LATENT:])
    inner.fail_next = 1
    with pytest.raises(TransferError):
        engine.read("peer", [base], [source.data_ptr()], [ROW_BYTES])
    reads = len(inner.reads)
    with pytest.raises(TransferError, match="quarantined"):   # both slots wait: refused
        engine.read("peer", [base], [source.data_ptr()], [ROW_BYTES])
    assert len(inner.reads) == reads      # refused without reading
    clock.now += 2.0
    engine.read("peer", [base], [source.data_ptr()], [ROW_BYTES])
    assert inner.reads[-1][0] == first_slot   # the oldest quarantine is over first
    assert engine.retired_slots == 2


def test_the_pool_layout_is_checked() -> None:
    region = pool_region()
    (latent, rope), _ = parts(region)
    with pytest.raises(ValueError, match="follow"):
        fused_pool_layers([(latent, torch.zeros(ROWS, ROPE))], ROWS)
    with pytest.raises(ValueError, match="at least"):
        fused_pool_layers([(latent, rope)], ROWS + 1)
