"""The P/D control plane stays usable under hostile and broken peers: no permanent cut-offs.

Real ZMQ sockets; decode ranks run in spawned processes with real Mooncake engines, except where
a ROUTER in the test process plays a decode configured the way kvo's used to be (a new
connection may take over a routing id). The bound under test: after any single fault, a
prefill-decode pair is usable again within one layer deadline plus one handshake.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from _control_harness import (
    DecodeProcess,
    DecodeSpec,
    FakeDecode,
    Geometry,
    ShmBuffer,
    done,
    fill_random,
    layer_metas,
    shm_buffers,
)

from kvo_core.errors import SlotFailedError
from kvo_core.gates import SlotGates
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_transport.errors import HandshakeTimeoutError, LayerDeadlineError
from kvo_transport.frame_auth import AuthCounters, ControlKey, Kind, PrefillChannel
from kvo_transport.prefill_side import RENEWAL_WAIT_S, PrefillPublisher
from kvo_transport.protocol import (
    NO_SEQ,
    PROTOCOL_VERSION,
    FrameDecoder,
    HandshakeAnswer,
    MfMeta,
    ReadFailed,
    ReadReadyBatch,
    SendAborted,
    encode,
)

pytestmark = pytest.mark.needs_loopback_netns

GEOMETRY = Geometry(layers=2, num_blocks=8, main=(512,))
DEADLINE_S = 1.0
HANDSHAKE_S = 1.0
"""Generous for a loopback handshake on a loaded 2-core machine (it takes milliseconds)."""
WAIT = 15.0
SECRET = "a control secret for the availability tests"


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    made = create_transfer_engine("mooncake")
    yield made
    made.close()


@pytest.fixture
def buffers() -> Iterator[Callable[[int], ShmBuffer]]:
    with shm_buffers() as make:
        yield make


@pytest.fixture
def source(engine: TransferEngine, buffers: Callable[[int], ShmBuffer]) -> Iterator[ShmBuffer]:
    buffer = buffers(GEOMETRY.total_bytes)
    fill_random(buffer, 36)
    engine.register(buffer.ptr, buffer.nbytes)
    yield buffer
    engine.unregister(buffer.ptr)


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    things: list[Any] = []
    yield lambda thing: things.append(thing) or thing
    for thing in reversed(things):
        (thing.stop if isinstance(thing, DecodeProcess) else thing.close)()


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    made: zmq.Context[Any] = zmq.Context()
    yield made
    made.destroy(linger=0)


def make_publisher(engine: TransferEngine, source: ShmBuffer, gates: SlotGates,
                   secret: str | None = None) -> PrefillPublisher:
    return PrefillPublisher.for_engine(
        engine, instance_id="prefill-avail", prefill_tp=1, p_rank=0, decode_tp=1,
        layers=layer_metas(GEOMETRY, source.ptr), gates=gates, handshake_timeout_s=WAIT,
        layer_deadline_s=DEADLINE_S, control_secret=secret)


def routing_id(publisher: PrefillPublisher, endpoint: str) -> bytes:
    """The ZMQ routing id of the publisher's live connection to ``endpoint``."""
    peer = publisher._peers[endpoint]
    return bytes(peer.connection.socket.getsockopt(zmq.ROUTING_ID))


def block(buffer: ShmBuffer, layer: int, index: int) -> bytes:
    return buffer.read(GEOMETRY.block_offset(layer, "main", 0, index), GEOMETRY.main[0])


def take_over(context: zmq.Context[Any], endpoint: str, identity: bytes,
              handshake: bytes) -> bytes | None:
    """Connect with someone else's routing id, handshake, leave; the answer it got, if any."""
    thief = context.socket(zmq.DEALER)
    thief.setsockopt(zmq.LINGER, 0)
    thief.setsockopt(zmq.ROUTING_ID, identity)
    thief.connect(endpoint)
    try:
        thief.send(handshake)
        return thief.recv() if thief.poll(500) else None
    finally:
        thief.close()
        time.sleep(0.1)  # let the decode see it leave


# -- 1. routing-id takeover ----------------------------------------------------------------------

def test_a_second_connection_cannot_take_over_a_live_prefills_routing_id(
        engine, source, buffers, closing, context) -> None:
    dest = buffers(GEOMETRY.total_bytes)
    decode = closing(DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=GEOMETRY,
                                              destinations={"r": ((0, 1), None)})))
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates))
    request = publisher.ready_request("r", 0, (4, 5))
    publisher.publish_layer(0, (1,), {decode.endpoint: [request]})
    gates.wait((1,), WAIT)

    answer = take_over(context, decode.endpoint, routing_id(publisher, decode.endpoint),
                       encode(publisher.meta))

    started = time.monotonic()
    publisher.publish_layer(1, (2,), {decode.endpoint: [request]},
                            last_layer_request_ids=("r",))
    gates.wait((2,), DEADLINE_S + HANDSHAKE_S)  # the original's next READY is served
    assert time.monotonic() - started < DEADLINE_S + HANDSHAKE_S
    assert block(dest, 1, 0) == block(source, 1, 4) and block(dest, 1, 1) == block(source, 1, 5)
    finished, failed, _, _, _ = decode.wait_terminal(["r"])
    assert finished == ["r"] and failed == {}
    assert answer is None, "the decode answered a connection that claimed a live routing id"


def test_a_session_that_missed_its_deadline_is_rebuilt_on_a_new_connection(
        engine, source, closing, context) -> None:
    """Against a decode whose ROUTER lets a newcomer take a routing id over (kvo's decode did),
    the original connection is dead for good: the publisher notices by the missed deadline,
    drops that connection and handshakes again on a new one with a new routing id."""
    fake = closing(FakeDecode(lambda batch: [done(batch)], handover=True))
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates))
    request = publisher.ready_request("r", 0, (4, 5))
    publisher.publish_layer(0, (1,), {fake.endpoint: [request]})
    gates.wait((1,), WAIT)
    first_id = routing_id(publisher, fake.endpoint)

    assert take_over(context, fake.endpoint, first_id, encode(publisher.meta)) is not None
    fault = time.monotonic()
    publisher.publish_layer(1, (2,), {fake.endpoint: [request]})
    with pytest.raises(SlotFailedError) as info:
        gates.wait((2,), WAIT)
    assert isinstance(info.value.__cause__, LayerDeadlineError)  # the fault costs one deadline

    publisher.publish_layer(0, (3,), {fake.endpoint: [request]})
    gates.wait((3,), WAIT)
    recovered = time.monotonic() - fault
    assert recovered < DEADLINE_S + HANDSHAKE_S, recovered
    assert routing_id(publisher, fake.endpoint) != first_id
    assert fake.handshakes_from[0] == fake.handshakes_from[1] == first_id  # the thief's, too
    assert len(fake.handshakes_from) == 3 and fake.handshakes_from[2] != first_id


def test_a_decode_that_stops_answering_costs_one_bounded_wait_then_requests_fail_at_once(
        engine, source, closing) -> None:
    """After a missed deadline the renewed session's handshake may go unanswered (a frozen or
    dead decode): the first new request to that endpoint waits for it a bounded time (a layer
    deadline, at least RENEWAL_WAIT_S), later ones fail at once, each naming why the previous
    session ended, instead of stalling the prefill's steps for the whole handshake timeout
    (WAIT here) per request."""
    answering = [True]
    fake = closing(FakeDecode(lambda batch: [done(batch)] if answering[0] else []))
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates))
    request = publisher.ready_request("r", 0, (4, 5))
    publisher.publish_layer(0, (1,), {fake.endpoint: [request]})
    gates.wait((1,), WAIT)

    answering[0] = False
    fake.answer_handshake = False
    publisher.publish_layer(1, (2,), {fake.endpoint: [request]})
    with pytest.raises(SlotFailedError):
        gates.wait((2,), WAIT)
    started = time.monotonic()
    with pytest.raises(HandshakeTimeoutError, match="previous session ended"):
        publisher.connect(fake.endpoint)
    assert time.monotonic() - started < max(DEADLINE_S, RENEWAL_WAIT_S) + HANDSHAKE_S < WAIT
    for _ in range(2):  # the pending handshake is kept; later requests fail at once
        started = time.monotonic()
        with pytest.raises(HandshakeTimeoutError, match="previous session ended"):
            publisher.connect(fake.endpoint)
        assert time.monotonic() - started < HANDSHAKE_S


def test_a_session_the_decode_resets_fails_everything_in_flight_at_once_and_is_rebuilt(
        engine, source, closing) -> None:
    """A decode that no longer knows the session answers READ_FAILED asking for a handshake: the
    READYs queued behind it there will never be answered on that connection either."""
    first: list[ReadReadyBatch] = []

    def reset_first(batch: ReadReadyBatch) -> list[Any]:
        if first:
            return [done(batch)]
        first.append(batch)
        return [ReadFailed(version=PROTOCOL_VERSION, seq=NO_SEQ, layer_index=0,
                           reason="no session for this peer (decode restarted)",
                           needs_handshake=True)]

    fake = closing(FakeDecode(reset_first))
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates))
    publisher.layer_deadline_s = 30.0  # far past WAIT: only the reset can end these READYs
    request = publisher.ready_request("r", 0, (4, 5))
    started = time.monotonic()
    publisher.publish_layer(0, (1,), {fake.endpoint: [request]})
    publisher.publish_layer(1, (2,), {fake.endpoint: [request]})
    for key in ((1,), (2,)):
        with pytest.raises(SlotFailedError, match="reset the control session: no session"):
            gates.wait(key, WAIT)
    publisher.publish_layer(0, (3,), {fake.endpoint: [request]})
    gates.wait((3,), WAIT)
    assert time.monotonic() - started < HANDSHAKE_S
    assert publisher.renewed_sessions == 1 and len(fake.handshakes_from) == 2


def test_requests_a_renewal_failed_are_given_up_on_the_decode_right_after_the_new_handshake(
        engine, source, closing) -> None:
    """A READY that misses its deadline ends the session; its requests, and those of every READY
    failed with it, get no more layers from this prefill. The decode hears so (SEND_ABORTED) on
    the new session as soon as its handshake is accepted, instead of waiting its own deadline
    for layers that will not come (a decode that restarted showed that: 20 s in the soak)."""
    answering = [False]
    fake = closing(FakeDecode(lambda batch: [done(batch)] if answering[0] else []))
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates))
    first = publisher.ready_request("r1", 0, (4, 5))
    second = publisher.ready_request("r2", 2, (6,))
    publisher.publish_layer(0, (1,), {fake.endpoint: [first]})
    publisher.publish_layer(0, (2,), {fake.endpoint: [second]})
    started = time.monotonic()
    for key in ((1,), (2,)):
        with pytest.raises(SlotFailedError):
            gates.wait(key, WAIT)

    while time.monotonic() - started < HANDSHAKE_S + 2.0 and not any(
            isinstance(m, SendAborted) for m in fake.seen):
        time.sleep(0.02)
    aborts = [m for m in fake.seen if isinstance(m, SendAborted)]
    assert len(aborts) == 1, fake.seen
    assert aborts[0].request_ids == ("r1", "r2")
    assert "control session ended (no answer to layer 0 seq" in aborts[0].reason
    handshakes = [i for i, m in enumerate(fake.seen) if isinstance(m, MfMeta)]
    assert len(handshakes) == 2 and fake.seen.index(aborts[0]) > handshakes[1]  # new session
    answering[0] = True
    publisher.publish_layer(0, (3,), {fake.endpoint: [first]})
    gates.wait((3,), WAIT)  # the new session serves


# -- 3. malformed READYs are answered ------------------------------------------------------------

class RawPrefill:
    """A DEALER that handshakes with a real publisher's MF_META, then sends frames by hand."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, meta: MfMeta,
                 secret: str | None) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.channel = PrefillChannel(None if secret is None else ControlKey.from_secret(secret),
                                      AuthCounters())
        self.socket.send(self.channel.seal_hello(encode(meta)))
        answer = self.answer(WAIT)
        assert isinstance(answer, HandshakeAnswer) and answer.accepted, answer

    def send(self, message: bytes) -> None:
        self.socket.send(self.channel.seal(message))

    def answer(self, timeout_s: float) -> Any:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        kind, payload = self.channel.open(self.socket.recv())
        assert kind in (Kind.WELCOME, Kind.TO_PREFILL), kind
        return FrameDecoder().decode(payload)


def ready_without_fences(seq: int) -> bytes:
    """A READY a real publisher never sends: requests, but no fence words."""
    return msgspec.msgpack.encode({
        "type": "READ_READY_BATCH", "version": PROTOCOL_VERSION, "seq": seq, "layer_index": 1,
        "layer_name": "model.layers.1.self_attn.attn", "member": 0, "ratio": 1,
        "requests": [{"request_id": "r", "main_start_block": 0, "num_blocks": 2,
                      "main_block_ids": [4, 5]}]})


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "authenticated"])
def test_a_malformed_ready_is_answered_read_failed_with_the_reason(
        engine, source, buffers, closing, context, secret) -> None:
    dest = buffers(GEOMETRY.total_bytes)
    decode = closing(DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=GEOMETRY,
                                              destinations={"r": ((0, 1), None)},
                                              control_secret=secret)))
    publisher = closing(make_publisher(engine, source, SlotGates(), secret))
    peer = RawPrefill(context, decode.endpoint, publisher.meta, secret)

    started = time.monotonic()
    peer.send(ready_without_fences(seq=41))
    answer = peer.answer(1.0)
    assert isinstance(answer, ReadFailed), answer
    assert time.monotonic() - started < 1.0
    assert answer.seq == 41 and answer.layer_index == 1 and not answer.needs_handshake
    assert "fence" in answer.reason and "malformed READY" in answer.reason
    # Nothing was read, and the request it named failed on decode with the reason.
    assert block(dest, 1, 0) == bytes(GEOMETRY.main[0])
    _, failed, _, _, _ = decode.wait_terminal(["r"])
    assert "fence" in failed["r"]

    # A frame in the session that is no message at all resets the session, saying why.
    peer.send(b"\x93not a control message")
    reset = peer.answer(1.0)
    assert isinstance(reset, ReadFailed) and reset.needs_handshake, reset
    assert "not a control-plane message" in reset.reason
