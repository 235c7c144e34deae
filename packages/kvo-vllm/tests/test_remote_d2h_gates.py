"""Buffer-reuse gates joined across the store save and the remote reads; decode's read guard."""

from __future__ import annotations

import ctypes
import threading

import pytest

from kvo_core.errors import SlotFailedError
from kvo_vllm.remote_d2h.gates import JoinedSlotGates, ReadPartsForwarder
from kvo_vllm.remote_d2h.guarded_engine import GuardedEngine, LayerRegion

KEY = (0x1000,)


def test_a_read_answered_before_the_round_closes_still_counts() -> None:
    gates = JoinedSlotGates()
    forwarder = ReadPartsForwarder(gates)
    gates.announce(KEY, "remote:1:0")
    forwarder.target_next(KEY, "remote:1:0")
    forwarder.close(KEY, ["read:a#1", "read:b#2"])  # the publisher's per-endpoint parts
    forwarder.mark_done(KEY, "read:a#1")
    forwarder.mark_done(KEY, "read:b#2")  # early: the layerwise round is not closed yet
    assert gates.is_open(KEY)
    gates.close(KEY, ["store:1:0", "remote:1:0"])
    assert gates.pending(KEY) == {"store:1:0"}  # the early remote answer was applied
    gates.mark_done(KEY, "store:1:0")
    gates.wait(KEY, timeout=0)


def test_the_buffer_opens_only_after_the_save_and_every_read() -> None:
    gates = JoinedSlotGates()
    forwarder = ReadPartsForwarder(gates)
    gates.announce(KEY, "remote:2:0")
    forwarder.target_next(KEY, "remote:2:0")
    forwarder.close(KEY, ["read:a#3", "read:b#4"])
    gates.close(KEY, ["store:2:0", "remote:2:0"])
    gates.mark_done(KEY, "store:2:0")
    forwarder.mark_done(KEY, "read:a#3")
    assert not gates.is_open(KEY)  # decode b still reads the buffer
    opened = threading.Event()
    waiter = threading.Thread(target=lambda: (gates.wait(KEY, 10), opened.set()))
    waiter.start()
    assert not opened.wait(0.1)
    forwarder.mark_done(KEY, "read:b#4")
    waiter.join(5)
    assert opened.is_set()


def test_a_failed_read_fails_the_round_once() -> None:
    gates = JoinedSlotGates()
    forwarder = ReadPartsForwarder(gates)
    gates.announce(KEY, "remote:3:0")
    forwarder.target_next(KEY, "remote:3:0")
    forwarder.close(KEY, ["read:a#5", "read:b#6"])
    gates.close(KEY, ["remote:3:0"])
    forwarder.mark_failed(KEY, "read:a#5", "decode lost")
    assert forwarder.mark_done(KEY, "read:b#6")  # a late success changes nothing
    with pytest.raises(SlotFailedError, match="decode lost"):
        gates.wait(KEY, timeout=0)
    assert forwarder.in_flight() == 0
    assert not forwarder.mark_done(KEY, "read:b#6")  # unknown now: ignored


def test_forwarder_without_target_only_tracks() -> None:
    forwarder = ReadPartsForwarder(None)
    forwarder.close(KEY, ["read:x#1"])
    assert forwarder.in_flight() == 1
    forwarder.mark_done(KEY, "read:x#1")
    assert forwarder.in_flight() == 0


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
