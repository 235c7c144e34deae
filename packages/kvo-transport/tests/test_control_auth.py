"""The authenticated control plane over real ZMQ, with a decode rank (real Mooncake engine) in a
child process: forged, replayed, wrong-session and MAC-less frames are refused and counted,
nothing is read for them, and a good prefill keeps moving bytes afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from _control_harness import (
    DecodeProcess,
    DecodeSpec,
    Geometry,
    ShmBuffer,
    fill_random,
    layer_metas,
    shm_buffers,
)

from kvo_core.errors import ConfigError
from kvo_core.gates import SlotGates
from kvo_transport.decode_side import DecodeReceiver
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_transport.frame_auth import AuthCounters, ControlKey, Kind, PrefillChannel
from kvo_transport.prefill_side import HandshakeRejectedError, PrefillPublisher
from kvo_transport.protocol import (
    PROTOCOL_VERSION,
    Fence,
    FrameDecoder,
    HandshakeAnswer,
    ReadDone,
    ReadReadyBatch,
    encode,
)

pytestmark = pytest.mark.needs_loopback_netns

GEOMETRY = Geometry(layers=2, num_blocks=8, main=(512,))
SECRET = "a control secret for the tests"
WAIT = 10.0
DEST_BLOCKS = (0, 1)
LAYER0 = "model.layers.0.self_attn.attn"
SRC_BLOCKS = (5, 6)


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    made = create_transfer_engine("mooncake")
    yield made
    made.close()


@pytest.fixture(scope="module")
def setup(engine: TransferEngine) -> Iterator[tuple[DecodeProcess, ShmBuffer, ShmBuffer]]:
    with shm_buffers() as make:
        src, dest = make(GEOMETRY.total_bytes), make(GEOMETRY.total_bytes)
        fill_random(src, 11)
        engine.register(src.ptr, src.nbytes)
        decode = DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=GEOMETRY,
                                          destinations={"r1": (DEST_BLOCKS, None)},
                                          control_secret=SECRET))
        try:
            yield decode, src, dest
        finally:
            decode.stop()
            engine.unregister(src.ptr)


def publisher_for(engine: TransferEngine, src: ShmBuffer, secret: str | None,
                  gates: SlotGates) -> PrefillPublisher:
    return PrefillPublisher.for_engine(
        engine, instance_id="prefill-auth", prefill_tp=1, p_rank=0, decode_tp=1,
        layers=layer_metas(GEOMETRY, src.ptr), gates=gates, handshake_timeout_s=WAIT,
        layer_deadline_s=WAIT, control_secret=secret)


def block(buffer: ShmBuffer, layer: int, index: int) -> bytes:
    return buffer.read(GEOMETRY.block_offset(layer, "main", 0, index), GEOMETRY.main[0])


def publish_and_check(publisher: PrefillPublisher, decode: DecodeProcess, src: ShmBuffer,
                      dest: ShmBuffer, gates: SlotGates, slot: int) -> None:
    """One real pull of both layers; the destination must hold the source's bytes."""
    dest.map[:] = bytes(dest.nbytes)
    for layer in range(GEOMETRY.layers):
        request = publisher.ready_request("r1", 0, SRC_BLOCKS)
        publisher.publish_layer(layer, (slot + layer,), {decode.endpoint: [request]})
    for layer in range(GEOMETRY.layers):
        gates.wait((slot + layer,), WAIT)
        for d, s in zip(DEST_BLOCKS, SRC_BLOCKS, strict=True):
            assert block(dest, layer, d) == block(src, layer, s)


class RawPeer:
    """A DEALER speaking the envelope by hand, to send what a real publisher never would."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, key: ControlKey | None) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.channel = PrefillChannel(key, AuthCounters())

    def answer(self, timeout_s: float) -> bytes | None:
        return self.socket.recv() if self.socket.poll(int(timeout_s * 1000)) else None


def test_bad_frames_are_refused_and_a_good_prefill_keeps_working(engine, setup) -> None:
    decode, src, dest = setup
    gates = SlotGates()
    publisher = publisher_for(engine, src, SECRET, gates)
    context: zmq.Context[Any] = zmq.Context()
    try:
        publish_and_check(publisher, decode, src, dest, gates, slot=0)

        # An attacker's own, correctly keyed session: its READYs work, replays do not.
        key = ControlKey.from_secret(SECRET)
        peer = RawPeer(context, decode.endpoint, key)
        peer.socket.send(peer.channel.seal_hello(encode(publisher.meta)))
        welcome = peer.answer(WAIT)
        assert welcome is not None
        kind, payload = peer.channel.open(welcome)
        answer = FrameDecoder().decode(payload)
        assert kind is Kind.WELCOME and isinstance(answer, HandshakeAnswer) and answer.accepted
        dest.map[:] = bytes(dest.nbytes)
        ready = peer.channel.seal(encode(ReadReadyBatch(
            version=PROTOCOL_VERSION, seq=900, layer_index=0, layer_name=LAYER0, member=0,
            ratio=1, requests=(publisher.ready_request("r1", 0, SRC_BLOCKS),),
            fences=(Fence(word=0, epoch=publisher.fences.epoch(0)),))))
        peer.socket.send(ready)
        done = peer.answer(WAIT)
        assert done is not None
        assert isinstance(FrameDecoder().decode(peer.channel.open(done)[1]), ReadDone)
        assert block(dest, 0, DEST_BLOCKS[0]) == block(src, 0, SRC_BLOCKS[0])

        dest.map[:] = bytes(dest.nbytes)
        peer.socket.send(ready)  # replay
        forged = bytearray(ready)
        forged[-3] ^= 0x40
        peer.socket.send(bytes(forged))  # forged (altered after sealing)
        plain = encode(ReadReadyBatch(
            version=PROTOCOL_VERSION, seq=901, layer_index=0, layer_name=LAYER0, member=0,
            ratio=1, requests=(publisher.ready_request("r1", 0, SRC_BLOCKS),),
            fences=(Fence(word=0, epoch=publisher.fences.epoch(0)),)))
        peer.socket.send(plain)  # no MAC at all
        wrong_key = RawPeer(context, decode.endpoint, ControlKey.from_secret("not the secret!!"))
        wrong_key.socket.send(wrong_key.channel.seal_hello(encode(publisher.meta)))
        # Another session's READY on this connection: the decode answers only RESET.
        other = RawPeer(context, decode.endpoint, key)
        other.socket.send(other.channel.seal_hello(encode(publisher.meta)))
        assert other.answer(WAIT) is not None
        stolen = peer.channel.seal(plain)
        other.socket.send(stolen)
        reset = other.answer(WAIT)
        assert reset is not None and reset[4] == Kind.RESET

        assert peer.answer(1.0) is None  # replay, forgery, MAC-less: silently dropped
        assert wrong_key.answer(0.2) is None
        rejections = decode.auth_rejections()
        assert rejections == {"missing_mac": 1, "bad_mac": 2, "replay": 1, "wrong_session": 1,
                              "unexpected_mac": 0}
        # Nothing was read for them: the destination is still zero.
        assert block(dest, 0, DEST_BLOCKS[0]) == bytes(GEOMETRY.main[0])

        # The good prefill is unaffected.
        publish_and_check(publisher, decode, src, dest, gates, slot=10)
        assert publisher.auth_rejections.total == 0
    finally:
        publisher.close()
        context.destroy(linger=0)


def test_a_prefill_without_the_secret_is_refused_with_the_reason(engine, setup) -> None:
    decode, src, _ = setup
    publisher = publisher_for(engine, src, None, SlotGates())
    try:
        with pytest.raises(HandshakeRejectedError, match="set the same control secret"):
            publisher.connect(decode.endpoint)
    finally:
        publisher.close()


def test_a_prefill_with_another_secret_times_out_naming_the_secret(engine, setup) -> None:
    decode, src, _ = setup
    publisher = publisher_for(engine, src, "a different secret, same length", SlotGates())
    try:
        with pytest.raises(Exception, match="same control secret"):
            publisher.connect(decode.endpoint, timeout_s=1.0)
    finally:
        publisher.close()


def test_non_loopback_without_a_secret_is_refused_at_start(engine, setup,
                                                           monkeypatch) -> None:
    monkeypatch.delenv("KVO_CONTROL_SECRET", raising=False)
    _, src, _ = setup
    with pytest.raises(ConfigError, match=r"'10\.77\.0\.1' is not a loopback address"):
        DecodeReceiver(engine=engine, layout=None, resolve=lambda r: None,  # type: ignore[arg-type]
                       host="10.77.0.1")
    publisher = publisher_for(engine, src, None, SlotGates())
    try:
        with pytest.raises(ConfigError, match="not a loopback address"):
            publisher.connect("tcp://10.77.0.2:5555")
    finally:
        publisher.close()
