"""The test-only fault injection (kvo_tools.pd.faulty_engine) does what the e2e tests and the soak
rely on."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest

from kvo_tools.pd.faulty_engine import CORRUPT_BYTE, wrap
from kvo_transport.decode_side import DecodeReceiver
from kvo_transport.errors import TransferError
from kvo_transport.protocol import PROTOCOL_VERSION, ReadDone, ReadFailed

BLOCK = 64


class Layer:
    """What the wrapper reads of kvo-vllm's LayerRegion."""

    def __init__(self, base: int, end: int) -> None:
        self.base, self.end = base, end


class FakeEngine:
    backend, protocol, session_id = "mooncake", "tcp", "127.0.0.1:1"

    def __init__(self) -> None:
        self.reads = 0

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        self.reads += 1


def test_faults_follow_the_control_file_and_touch_only_layer_reads(tmp_path: Path) -> None:
    memory = ctypes.create_string_buffer(4 * BLOCK + 8)
    base = ctypes.addressof(memory)
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"fail_reads": 1}))
    fake = FakeEngine()
    faulty = wrap(fake, [Layer(base, base + 4 * BLOCK)],
                  control_file=str(control))
    with pytest.raises(TransferError, match="fault injection"):
        faulty.read("p", [base], [1], [BLOCK])
    faulty.read("p", [base], [1], [BLOCK])
    control.write_text(json.dumps({"corrupt_reads": True}))
    faulty.read("p", [base + BLOCK], [1], [BLOCK])
    assert memory.raw[BLOCK:2 * BLOCK] == bytes([CORRUPT_BYTE]) * BLOCK
    faulty.read("p", [base + 4 * BLOCK], [1], [8])  # not a layer (a fence word): untouched
    assert memory.raw[4 * BLOCK:] == bytes(8)
    assert faulty.snapshot() == {"injected_failures": 1, "corrupted_bytes": BLOCK,
                                 "dropped_acks": 0}
    control.write_text(json.dumps({"fail_reads": 2, "corrupt_reads": False, "extra": 1}))
    faulty.read("p", [base], [1], [BLOCK])  # a bad control file is ignored, faults kept
    assert fake.reads == 4


class PartLayer(Layer):
    def __init__(self, base: int, end: int, part: str) -> None:
        super().__init__(base, end)
        self.part = part


def test_corruption_can_be_limited_to_one_part(tmp_path: Path) -> None:
    memory = ctypes.create_string_buffer(2 * BLOCK)
    base = ctypes.addressof(memory)
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"corrupt_reads": True, "corrupt_part": "idx"}))
    faulty = wrap(FakeEngine(), [PartLayer(base, base + BLOCK, "kv"),
                                 PartLayer(base + BLOCK, base + 2 * BLOCK, "idx")],
                  control_file=str(control))
    faulty.read("p", [base, base + BLOCK], [1, 2], [BLOCK, BLOCK])
    assert memory.raw[:BLOCK] == bytes(BLOCK)
    assert memory.raw[BLOCK:] == bytes([CORRUPT_BYTE]) * BLOCK
    assert faulty.snapshot()["corrupted_bytes"] == BLOCK
    control.write_text(json.dumps({"corrupt_reads": True, "corrupt_part": "scale"}))
    faulty.read("p", [base], [1], [BLOCK])  # refused control file: the old faults stay
    assert memory.raw[:BLOCK] == bytes(BLOCK)


class SealRecorder:
    """The ``_auth`` of a stand-in receiver: records what the real ``_reply`` seals."""

    def __init__(self) -> None:
        self.sealed: list[bytes] = []

    def seal(self, identity: bytes, payload: bytes) -> None:
        self.sealed.append(payload)  # None: "no session", so nothing is sent


class StandInReceiver:
    endpoint = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self._auth = SealRecorder()


def test_read_done_answers_are_dropped_as_the_control_file_says(tmp_path: Path) -> None:
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"drop_acks": 1}))
    wrap(FakeEngine(), [], control_file=str(control))
    faulty = wrap(FakeEngine(), [], control_file=str(control))  # the dropper is installed once
    receiver = StandInReceiver()
    done = ReadDone(version=PROTOCOL_VERSION, seq=3, layer_index=0, bytes_read=64)
    failed = ReadFailed(version=PROTOCOL_VERSION, seq=4, layer_index=1, reason="x")
    reply = DecodeReceiver._reply
    reply(receiver, b"peer", failed)  # type: ignore[arg-type]  # only READ_DONE is dropped
    reply(receiver, b"peer", done)  # type: ignore[arg-type]  # dropped: never sealed
    reply(receiver, b"peer", done)  # type: ignore[arg-type]  # one drop asked: sent
    assert len(receiver._auth.sealed) == 2
    assert faulty.snapshot()["dropped_acks"] == 1
    control.write_text(json.dumps({"drop_acks": 2, "fail_reads": 0}))
    reply(receiver, b"peer", done)  # type: ignore[arg-type]
    assert len(receiver._auth.sealed) == 2 and faulty.snapshot()["dropped_acks"] == 2
