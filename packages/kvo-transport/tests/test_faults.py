"""Control-plane faults: each ends in a clear error, nothing invalid is reported valid, no hang.

Decode ranks run in spawned processes with real Mooncake engines; the "misbehaving decode"
cases use a raw ZMQ ROUTER in the test process that speaks the real protocol but drops or
delays answers. Every wait is bounded.
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvo_core.errors import SlotFailedError
from kvo_core.gates import RequestCompletionTracker, SlotGates
from kvo_transport.decode_side import DEFAULT_DESTINATION_WAIT_S
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_transport.errors import HandshakeTimeoutError, LayerDeadlineError, ProtocolError
from kvo_transport.prefill_side import HandshakeRejectedError, PrefillPublisher
from kvo_transport.protocol import (
    PROTOCOL_VERSION,
    Fence,
    FrameDecoder,
    MfMeta,
    ReadFailed,
    ReadReadyBatch,
    ReadyRequest,
    encode,
)

pytestmark = pytest.mark.needs_loopback_netns

GEOMETRY = Geometry(layers=2, num_blocks=8, main=(512,), indexer=(128,))
WAIT = 10.0  # upper bound of every wait; the deadlines under test are far shorter


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
    fill_random(buffer, 5)
    engine.register(buffer.ptr, buffer.nbytes)
    yield buffer
    engine.unregister(buffer.ptr)


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """Close publishers / stop decode processes at the end of the test, even on failure."""
    things: list[Any] = []
    yield lambda thing: things.append(thing) or thing
    for thing in reversed(things):
        (thing.stop if isinstance(thing, DecodeProcess) else thing.close)()


def make_publisher(engine: TransferEngine, source: ShmBuffer, *, gates: SlotGates | None = None,
                   tracker: RequestCompletionTracker | None = None,
                   handshake_timeout_s: float = 10.0,
                   layer_deadline_s: float = 5.0) -> PrefillPublisher:
    return PrefillPublisher.for_engine(
        engine, instance_id="prefill-f", prefill_tp=1, p_rank=0, decode_tp=1,
        layers=layer_metas(GEOMETRY, source.ptr), gates=gates or SlotGates(), tracker=tracker,
        handshake_timeout_s=handshake_timeout_s, layer_deadline_s=layer_deadline_s)


def wait_failure(gates: SlotGates, key: tuple[int, ...]) -> SlotFailedError:
    with pytest.raises(SlotFailedError) as info:
        gates.wait(key, WAIT)
    return info.value


def pop_until(tracker: RequestCompletionTracker, request_id: str) -> tuple[set[str], dict]:
    deadline = time.monotonic() + WAIT
    finished: set[str] = set()
    failed: dict[str, str] = {}
    while request_id not in finished | set(failed) and time.monotonic() < deadline:
        done, bad = tracker.pop_finished()
        finished |= done
        failed.update(bad)
        time.sleep(0.01)
    return finished, failed


def block_bytes(buffer: ShmBuffer, layer: int, kind: str, block: int) -> bytes:
    size = dict(main=GEOMETRY.main[0], indexer=GEOMETRY.indexer[0])[kind]
    return buffer.read(GEOMETRY.block_offset(layer, kind, 0, block), size)


# -- the tests ---------------------------------------------------------------------------------

def test_ready_that_does_not_fit_the_destination_fails_and_invalidates(
        engine, source, buffers, closing) -> None:
    dest = buffers(GEOMETRY.total_bytes)
    # "short" has destination blocks for 2 logical blocks but the chunk brings 4.
    decode = closing(DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=GEOMETRY,
        destinations={"short": ((3, 4), None), "fine": ((5, 6), None)})))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = closing(make_publisher(engine, source, gates=gates, tracker=tracker))
    for layer in range(GEOMETRY.layers):
        key = (layer + 1,)
        requests = [publisher.ready_request("short", 0, (0, 1, 2, 3), (0, 1, 2, 3)),
                    publisher.ready_request("fine", 0, (4, 5), (4, 5))]
        publisher.publish_layer(layer, key, {decode.endpoint: requests},
                                last_layer_request_ids=("short", "fine")
                                if layer == GEOMETRY.layers - 1 else ())
        error = wait_failure(gates, key)
        assert "'short'" in str(error) and "destination has 2" in str(error)
    finished, failed = pop_until(tracker, "short")
    assert set(failed) == {"short", "fine"} and not finished  # the whole layer failed
    finished, failed, invalid, _, _ = decode.wait_terminal(["short", "fine"])
    assert finished == [] and set(failed) == {"short", "fine"}
    assert "destination has 2" in failed["short"]
    assert invalid["short"] == ([3, 4], [3, 4])  # what it was meant to fill, clipped
    assert invalid["fine"] == ([5, 6], [5, 6])
    for layer in range(GEOMETRY.layers):  # validation failed before reading: nothing moved
        for block in (3, 4, 5, 6):
            assert block_bytes(dest, layer, "main", block) == bytes(GEOMETRY.main[0])


def test_layout_mismatch_is_rejected_at_handshake(engine, source, buffers, closing) -> None:
    narrow = Geometry(layers=2, num_blocks=8, main=(256,), indexer=(128,))
    dest = buffers(narrow.total_bytes)
    decode = closing(DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=narrow,
                                              destinations={})))
    publisher = closing(make_publisher(engine, source))
    with pytest.raises(HandshakeRejectedError, match="main tensor 0: prefill block of 512 bytes"):
        publisher.connect(decode.endpoint)
    assert not publisher.is_connected(decode.endpoint)


def test_peer_that_never_answers_the_handshake_times_out(engine, source, closing) -> None:
    silent = closing(FakeDecode(lambda batch: [], answer_handshake=False))
    publisher = closing(make_publisher(engine, source, handshake_timeout_s=0.5))
    started = time.monotonic()
    with pytest.raises(HandshakeTimeoutError, match=silent.endpoint):
        publisher.publish_layer(0, (1,), {silent.endpoint: []})
    assert time.monotonic() - started < WAIT
    assert isinstance(silent.seen[0], MfMeta)  # it did get the MF_META


@pytest.mark.parametrize("pumped", [False, True], ids=["io-thread", "waiter-pumps"])
def test_lost_acknowledgement_fails_the_slot_at_the_deadline(engine, source, closing,
                                                             pumped) -> None:
    held: list[ReadReadyBatch] = []

    def drop_first(batch: ReadReadyBatch) -> list[Any]:
        if not held:
            held.append(batch)
            return []  # lost
        return [done(held[0]), done(batch)]  # a late answer for the first, then the second

    fake = closing(FakeDecode(drop_first))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = closing(make_publisher(engine, source, gates=gates, tracker=tracker))
    if pumped:
        gates.attach_pump(publisher)
    key = (7,)
    request = publisher.ready_request("r", 0, (0, 1), (0, 1))
    publisher.publish_layer(0, key, {fake.endpoint: [request]}, deadline_s=0.5)
    error = wait_failure(gates, key)
    assert isinstance(error.__cause__, LayerDeadlineError)
    assert fake.endpoint in str(error) and "layer 0" in str(error)
    # The slot can be used again; the late answer for the first round must not open it early.
    publisher.publish_layer(1, key, {fake.endpoint: [request]}, last_layer_request_ids=("r",))
    gates.wait(key, WAIT)
    finished, failed = pop_until(tracker, "r")
    assert "r" in failed and "LayerDeadlineError" in failed["r"] and not finished
    gates.attach_pump(None)


def test_a_silent_decode_fails_every_layer_in_flight_at_the_first_deadline(
        engine, source, closing) -> None:
    fake = closing(FakeDecode(lambda batch: []))  # alive, but never answers a READY
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates=gates))
    request = publisher.ready_request("r", 0, (0, 1), (0, 1))
    publisher.publish_layer(0, (1,), {fake.endpoint: [request]}, deadline_s=0.3)
    # Queued behind layer 0 with deadlines far past WAIT: only the first deadline can end them.
    for layer, key in ((1, (2,)), (0, (3,))):
        publisher.publish_layer(layer, key, {fake.endpoint: [request]}, deadline_s=60.0)
    first = wait_failure(gates, (1,))
    assert "layer 0" in str(first) and "within 0.3 s" in str(first)
    for key in ((2,), (3,)):
        error = wait_failure(gates, key)
        assert isinstance(error.__cause__, LayerDeadlineError)
        assert "queued behind it" in str(error) and "seq" in str(error)


def test_a_ready_over_the_decodes_frame_limit_fails_at_the_caller(engine, source,
                                                                  closing) -> None:
    fake = closing(FakeDecode(lambda batch: [done(batch)], max_frame_bytes=1024))
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates=gates))
    small = [publisher.ready_request("r", 0, (0, 1), (0, 1))]
    publisher.publish_layer(0, (1,), {fake.endpoint: small})
    gates.wait((1,), WAIT)
    big = [publisher.ready_request(f"r{i}", 0, (0, 1), (0, 1)) for i in range(64)]
    with pytest.raises(ProtocolError, match=r"over the frame limit of 1024 .*the decode: 1024"):
        publisher.publish_layer(1, (2,), {fake.endpoint: big})
    assert gates.is_open((2,))  # nothing was closed, nothing sent
    assert sum(isinstance(m, ReadReadyBatch) for m in fake.seen) == 1


def test_decode_killed_mid_transfer_fails_the_slot_within_the_deadline(
        engine, source, buffers, closing) -> None:
    dest = buffers(GEOMETRY.total_bytes)
    decode = closing(DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=GEOMETRY, destinations={"r": ((0, 1), None)},
        stall_request="r")))
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates=gates, layer_deadline_s=1.0))
    publisher.publish_layer(0, (9,), {decode.endpoint: [
        publisher.ready_request("r", 0, (0, 1), (0, 1))]})
    assert decode.next_event(WAIT) == ("stalled", "r")
    decode.kill()
    error = wait_failure(gates, (9,))
    assert isinstance(error.__cause__, LayerDeadlineError)


def test_transient_pull_failure_succeeds_on_retry(engine, source, buffers, closing) -> None:
    dest = buffers(GEOMETRY.total_bytes)
    decode = closing(DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=GEOMETRY, destinations={"r": ((6, 2), None)},
        read_retries=2, fail_first_reads=1)))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = closing(make_publisher(engine, source, gates=gates, tracker=tracker))
    for layer in range(GEOMETRY.layers):
        publisher.publish_layer(layer, (layer + 1,), {decode.endpoint: [
            publisher.ready_request("r", 0, (4, 5), (1, 0))]},
            last_layer_request_ids=("r",) if layer else ())
        gates.wait((layer + 1,), WAIT)
    assert pop_until(tracker, "r") == ({"r"}, {})
    finished, failed, invalid, _, reads = decode.wait_terminal(["r"])
    assert finished == ["r"] and failed == {} and invalid["r"] == ([], [])
    # One failed attempt, then per layer the data read and its fence read.
    assert reads == 2 * GEOMETRY.layers + 1
    for layer in range(GEOMETRY.layers):
        for src, dst in ((4, 6), (5, 2)):
            assert block_bytes(dest, layer, "main", dst) == block_bytes(source, layer, "main", src)
        for src, dst in ((1, 6), (0, 2)):
            assert block_bytes(dest, layer, "indexer", dst) == \
                block_bytes(source, layer, "indexer", src)


def test_pull_failing_past_its_retries_reports_read_failed(engine, source, buffers,
                                                           closing) -> None:
    dest = buffers(GEOMETRY.total_bytes)
    decode = closing(DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=GEOMETRY, destinations={"r": ((6, 2), None)},
        read_retries=1, fail_first_reads=2)))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = closing(make_publisher(engine, source, gates=gates, tracker=tracker))
    publisher.publish_layer(0, (1,), {decode.endpoint: [
        publisher.ready_request("r", 0, (4, 5), (1, 0))]})
    error = wait_failure(gates, (1,))
    assert "failed after 2 attempt(s)" in str(error) and "injected transient failure" in str(error)
    publisher.publish_layer(1, (2,), {decode.endpoint: [
        publisher.ready_request("r", 0, (4, 5), (1, 0))]}, last_layer_request_ids=("r",))
    gates.wait((2,), WAIT)  # the next layer reads fine
    finished, failed = pop_until(tracker, "r")
    assert "r" in failed and not finished
    finished, failed, invalid, _, reads = decode.wait_terminal(["r"])
    assert finished == [] and "layer 0" in failed["r"]
    # Layer 0: two failed attempts; layer 1: its data read and its fence read.
    assert invalid["r"] == ([2, 6], [2, 6]) and reads == 4


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(frames=st.lists(st.one_of(
    st.binary(max_size=300),
    st.dictionaries(st.sampled_from(["type", "version", "seq", "layer_index", "requests",
                                     "layers", "reason", "x"]),
                    st.one_of(st.integers(-2, 2**64 - 1), st.text(max_size=20),
                              st.sampled_from(["MF_META", "READ_READY_BATCH", "READ_DONE"]),
                              st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5)),
                    max_size=6).map(msgspec.msgpack.encode),
), min_size=1, max_size=6))
def test_garbage_frames_never_stop_the_decode_from_serving(
        frames, decode_for_garbage) -> None:
    decode, publisher, gates, raw = decode_for_garbage
    for frame in frames:
        raw.send(frame)
    raw.send_multipart([b"two", b"parts"])
    # A valid peer is still served: an empty layer makes the full READY -> DONE round trip.
    publisher.publish_layer(0, (3,), {decode.endpoint: []})
    gates.wait((3,), WAIT)


@pytest.fixture(scope="module")
def decode_for_garbage(engine) -> Iterator[tuple[DecodeProcess, PrefillPublisher, SlotGates,
                                                 zmq.Socket]]:
    with shm_buffers() as make:
        src, dest = make(GEOMETRY.total_bytes), make(GEOMETRY.total_bytes)
        engine.register(src.ptr, src.nbytes)
        decode = DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=GEOMETRY,
                                          destinations={}, max_frame_bytes=64 << 10))
        gates = SlotGates()
        publisher = make_publisher(engine, src, gates=gates)
        context = zmq.Context()
        raw = context.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(decode.endpoint)
        fresh = context.socket(zmq.DEALER)
        fresh.setsockopt(zmq.LINGER, 0)
        try:
            yield decode, publisher, gates, raw
            # Oversized frames and a READY without handshake, then a valid peer once more.
            closed_before = decode.closed_connections()
            raw.send(b"\x00" * (65 << 10))  # over the limit: zmq drops that connection
            fresh.connect(decode.endpoint)
            fresh.send(encode(ReadReadyBatch(version=PROTOCOL_VERSION, seq=5, layer_index=0,
                                           layer_name="x", member=0, ratio=1, requests=(
                                               ReadyRequest("q", 0, 1, (0,)),),
                                           fences=(Fence(word=0, epoch=0),))))
            # Refused at once, not parked until a destination for "q" could have appeared
            # (DEFAULT_DESTINATION_WAIT_S): the prefill must handshake before anything is read.
            reply = fresh.poll(int(DEFAULT_DESTINATION_WAIT_S * 1000 / 2))
            assert reply, "a READY without handshake was not refused at once"
            answer = FrameDecoder().decode(fresh.recv())
            assert isinstance(answer, ReadFailed) and answer.needs_handshake and answer.seq == 5
            publisher.publish_layer(1, (4,), {decode.endpoint: []})
            gates.wait((4,), WAIT)
            _, _, _, rejected, _ = decode.status()
            assert rejected > 0
            assert decode.closed_connections() > closed_before  # seen and logged, not silent
        finally:
            raw.close()
            fresh.close()
            context.term()
            publisher.close()
            decode.stop()
            engine.unregister(src.ptr)


def test_forgotten_requests_and_invalidation_callbacks(engine, source,
                                                                       closing) -> None:
    from _control_harness import decode_layout

    from kvo_transport.decode_side import DecodeReceiver
    from kvo_transport.read_plan import RequestDestination

    live = {"gone": RequestDestination((0, 1)), "kept": RequestDestination((2, 3)),
            "short": RequestDestination((5,))}
    invalidated: list[tuple] = []
    # No READY here passes validation with blocks to move: the decode answers but never
    # reads, so one engine can serve both sides in this process.
    receiver = closing(DecodeReceiver(
        engine=engine, layout=decode_layout(GEOMETRY, source.ptr), resolve=live.get,
        on_invalid=lambda *args: invalidated.append(args)).start())
    gates = SlotGates()
    publisher = closing(make_publisher(engine, source, gates=gates))
    empty = [publisher.ready_request(rid, 0, ()) for rid in ("gone", "kept")]
    publisher.publish_layer(0, (1,), {receiver.endpoint: empty})
    gates.wait((1,), WAIT)
    receiver.forget("gone")
    del live["gone"]  # released: the resolver no longer knows it
    publisher.publish_layer(1, (2,), {receiver.endpoint: empty[1:]},
                            last_layer_request_ids=("kept",))
    gates.wait((2,), WAIT)
    deadline = time.monotonic() + WAIT
    finished: set[str] = set()
    while "kept" not in finished and time.monotonic() < deadline:
        done, failed = receiver.pop_finished()
        finished |= done
        assert failed == {}  # "gone" is never reported
        time.sleep(0.01)
    assert finished == {"kept"}
    publisher.publish_layer(1, (3,), {receiver.endpoint: empty[:1]})
    assert "'gone' has no destination" in str(wait_failure(gates, (3,)))
    assert invalidated == []  # an unknown request has no blocks to invalidate
    publisher.publish_layer(0, (4,), {receiver.endpoint: [
        publisher.ready_request("short", 0, (0, 1), (0, 1))]})
    wait_failure(gates, (4,))
    assert [args[:4] for args in invalidated] == [("short", 0, (5,), (5,))]
    assert "destination has 1" in invalidated[0][4]
    assert receiver.invalid_blocks("short").main == {5}


def test_reads_joined_into_the_owners_round_open_it_only_with_the_save(
        engine, source, buffers, closing) -> None:
    """The publisher reports into a round someone else closes (the layerwise pipeline's:
    store save + remote reads): the READ_DONE may come before the round exists, and a
    READ_FAILED fails the owner's round."""
    dest = buffers(GEOMETRY.total_bytes)
    decode = closing(DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=GEOMETRY,
        destinations={"r": ((6, 2), None), "q": ((3, 1), None)},
        read_retries=0, fail_first_reads=1)))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = closing(make_publisher(engine, source, gates=gates, tracker=tracker))
    for layer, (key, request) in enumerate((((1,), "r"), ((2,), "q"))):
        gates.announce(key, f"remote:{layer}")
        publisher.publish_layer(layer, key, {decode.endpoint: [
            publisher.ready_request(request, 0, (4, 5), (1, 0))]},
            last_layer_request_ids=(request,), slot_part=f"remote:{layer}")
    finished, failed = pop_until(tracker, "r")
    if "q" not in finished:
        finished |= pop_until(tracker, "q")[0]
    assert "r" in failed and finished == {"q"}  # layer 0's read failed, layer 1's was done...
    assert gates.is_open((1,)) and gates.is_open((2,))  # ...held: no round closed yet
    for layer, key in enumerate(((1,), (2,))):
        gates.close(key, [f"store:{layer}", f"remote:{layer}"])
        assert gates.pending(key) == {f"store:{layer}"}  # the early answer was applied
        gates.mark_done(key, f"store:{layer}")
    error = wait_failure(gates, (1,))
    assert "remote:0" in str(error) and "injected transient failure" in str(error)
    gates.wait((2,), WAIT)  # layer 1 was read fine: its slot opens with its save
    with pytest.raises(ValueError, match="belong to the round's owner"):
        publisher.publish_layer(0, (3,), {}, extra_parts=["store"], slot_part="remote:x")
