"""Decode's guarded engine: bytes and seconds counted per layer and per part.

(The slot-gate join of store save and remote reads is tested in kvo-core's test_gates.py.)
"""

from __future__ import annotations

import ctypes

import pytest

from kvo_vllm.remote_d2h.guarded_engine import GuardedEngine, LayerRegion

# -- the decode-side guard ---------------------------------------------------------------------

class FakeEngine:
    backend, protocol, session_id = "mooncake", "tcp", "127.0.0.1:1"

    def __init__(self) -> None:
        self.reads: list[tuple[list[int], list[int]]] = []

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        self.reads.append((list(local), list(lengths)))

    def close(self) -> None:
        pass


BLOCK = 64


@pytest.fixture
def memory() -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(2 * 4 * BLOCK)  # two layers of four blocks


def _guard(memory: ctypes.Array[ctypes.c_char]) -> tuple[GuardedEngine, FakeEngine, int]:
    base = ctypes.addressof(memory)
    layers = [LayerRegion(index=i, base=base + i * 4 * BLOCK, block_bytes=BLOCK, num_blocks=4)
              for i in range(2)]
    fake = FakeEngine()
    return GuardedEngine(fake, layers), fake, base  # type: ignore[arg-type]


def test_reads_are_counted_per_layer_and_other_reads_are_not(
        memory: ctypes.Array[ctypes.c_char]) -> None:
    guard, fake, base = _guard(memory)
    layer1 = base + 4 * BLOCK
    guard.read("p", [layer1 + BLOCK], [1], [2 * BLOCK])  # blocks 1-2 of layer 1
    guard.read("p", [base], [1], [BLOCK])
    guard.read("p", [layer1 + 2 * BLOCK], [1], [BLOCK])
    guard.read("p", [base + 2 * 4 * BLOCK + 64], [1], [8])  # e.g. a fence read: elsewhere
    assert len(fake.reads) == 4 and sorted(guard.per_layer) == [0, 1]
    assert guard.per_layer[1].reads == 2 and guard.per_layer[1].bytes == 3 * BLOCK
