"""Fenced reads: a slow decode never accepts bytes the prefill reused while they were read.

Real processes: the decode rank is a spawned child with a real Mooncake engine and ZMQ socket
(``_control_harness``); its engine pauses half-way through data reads of chosen layers, so a
read is torn when the source changes during the pause. The prefill side runs here and really
reuses its memory the way a prefill does: a physical slot shared by two logical layers is
overwritten by the next layer once its round ended (failed at the deadline or not), or a
request's blocks get a new occupant once the request was reported failed. Both shapes of the
defect (one read stalled past the deadline; slow but progressing reads over 4 layers) end with
the request failed on decode, never finished with reused bytes; a property test drives random
stall / deadline / reuse timings and checks every byte of every finished request.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
from _control_harness import (
    DecodeProcess,
    DecodeSpec,
    Geometry,
    ShmBuffer,
    layer_name,
    shm_buffers,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvo_core.errors import SlotFailedError, SlotTimeoutError
from kvo_core.gates import RequestCompletionTracker, SlotGates
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_transport.prefill_side import PrefillPublisher
from kvo_transport.protocol import LayerMeta, TensorGroup

pytestmark = pytest.mark.needs_loopback_netns

BLOCK = 256
LAYERS = 4
SRC = Geometry(layers=LAYERS, num_blocks=4, main=(BLOCK,))
CASES = 128
DST = Geometry(layers=LAYERS, num_blocks=3 * CASES, main=(BLOCK,))
SRC_BLOCKS = (0, 1, 2)
WAIT = 20.0


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    made = create_transfer_engine("mooncake")
    yield made
    made.close()


@pytest.fixture(scope="module")
def memory(engine: TransferEngine) -> Iterator[tuple[ShmBuffer, ShmBuffer]]:
    with shm_buffers() as make:
        source, dest = make(SRC.total_bytes), make(DST.total_bytes)
        engine.register(source.ptr, source.nbytes)
        yield source, dest
        engine.unregister(source.ptr)


@pytest.fixture(scope="module")
def decode(memory: tuple[ShmBuffer, ShmBuffer]) -> Iterator[DecodeProcess]:
    _, dest = memory
    destinations = {f"c{i}": (tuple(range(3 * i, 3 * i + 3)), None) for i in range(CASES)}
    process = DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=DST,
                                       destinations=destinations, read_retries=0))
    yield process
    process.stop()


_case_numbers = iter(range(CASES))


def content(case: str, layer: int, generation: int) -> bytes:
    """What occupies a layer's source region: one value per (request, layer, occupant)."""
    return random.Random(f"{case}/{layer}/{generation}").randbytes(SRC.num_blocks * BLOCK)


def metas(source: ShmBuffer, slots: int) -> list[LayerMeta]:
    """Logical layer ``i`` lives in physical region ``i % slots`` (aliased like a reused
    layer buffer when ``slots`` < LAYERS)."""
    out = []
    for layer in range(LAYERS):
        base, size = SRC.tensors(source.ptr, layer % slots)["main"][0]
        out.append(LayerMeta(index=layer, name=layer_name(layer), main=TensorGroup(
            base_addrs=(base,), block_bytes=(size,), num_blocks=SRC.num_blocks)))
    return out


def write_region(source: ShmBuffer, region: int, data: bytes) -> None:
    offset = SRC.block_offset(region, "main", 0, 0)
    source.map[offset:offset + len(data)] = data


def received(dest: ShmBuffer, case_index: int, layer: int) -> bytes:
    first = DST.block_offset(layer, "main", 0, 3 * case_index)
    return dest.read(first, len(SRC_BLOCKS) * BLOCK)


def published(case: str, layer: int) -> bytes:
    data = content(case, layer, 0)
    return b"".join(data[b * BLOCK:(b + 1) * BLOCK] for b in SRC_BLOCKS)


def run_case(engine: TransferEngine, memory: tuple[ShmBuffer, ShmBuffer],
             decode: DecodeProcess, *, stalls: dict[int, float], deadline_s: float,
             slot_reuse: bool) -> tuple[str, int, bool]:
    """One request through 4 layers while the prefill reuses memory like a real one.

    ``slot_reuse``: 2 physical slots for 4 layers; a layer waits for its slot's round, then
    overwrites it (whether the round succeeded, failed or timed out, as the pipeline does).
    Otherwise 4 slots and the request's blocks get a new occupant as soon as the prefill
    reports the request failed (its blocks would go back to the allocator then).
    Returns (request id, case index, finished on decode).
    """
    source, _ = memory
    index = next(_case_numbers)
    case = f"c{index}"
    decode.set_stalls(stalls)
    slots = 2 if slot_reuse else LAYERS
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = PrefillPublisher.for_engine(
        engine, instance_id=f"prefill-{case}", prefill_tp=1, p_rank=0, decode_tp=1,
        layers=metas(source, slots), gates=gates, tracker=tracker,
        layer_deadline_s=deadline_s)
    try:
        return _publish_case(publisher, gates, tracker, source, decode, case, index, slots,
                             slot_reuse, deadline_s)
    finally:
        publisher.close()


def _publish_case(publisher: PrefillPublisher, gates: SlotGates,
                  tracker: RequestCompletionTracker, source: ShmBuffer, decode: DecodeProcess,
                  case: str, index: int, slots: int, slot_reuse: bool,
                  deadline_s: float) -> tuple[str, int, bool]:
    request = publisher.ready_request(case, 0, SRC_BLOCKS)
    for layer in range(LAYERS):
        key = (1 + layer % slots,)
        try:
            gates.wait(key, 2 * deadline_s + 5.0)
        except SlotFailedError:
            pass  # the round is over: the pipeline overwrites the slot now
        except SlotTimeoutError as error:
            for part in gates.pending(key):
                gates.mark_failed(key, part, error)
        write_region(source, layer % slots, content(case, layer, 0))
        publisher.publish_layer(layer, key, {decode.endpoint: [request]},
                                last_layer_request_ids=(case,) if layer == LAYERS - 1 else ())
    outcome: dict[str, str] | set[str] = set()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        done, failed = tracker.pop_finished()
        if failed and not slot_reuse:  # a new occupant takes the request's blocks at once
            for layer in range(LAYERS):
                write_region(source, layer, content(case, layer, 1))
        if done or failed:
            outcome = done or failed
            break
        time.sleep(0.005)
    assert outcome, f"{case}: the prefill never settled the request"
    finished, failed, _, _, _ = decode.wait_terminal([case], timeout=WAIT)
    return case, index, case in finished


def check_accepted_bytes(memory: tuple[ShmBuffer, ShmBuffer], case: str, index: int) -> None:
    _, dest = memory
    for layer in range(LAYERS):
        assert received(dest, index, layer) == published(case, layer), \
            f"{case} finished on decode with layer {layer} holding bytes it was not sent"


def test_a_read_stalled_past_the_deadline_is_refused_after_slot_reuse(
        engine, memory, decode) -> None:
    # Layer 0's read pauses 1.5 s half-way; its deadline is 0.5 s, after which layer 2 is
    # written into the same physical slot. Without the fence the decode finished the request.
    case, index, finished = run_case(engine, memory, decode, stalls={0: 1.5}, deadline_s=0.5,
                                     slot_reuse=True)
    assert not finished
    _, failed, invalid, _, _ = decode.status()
    assert "fence: the prefill reused the source" in failed[case]
    assert invalid[case][0] == [3 * index, 3 * index + 1, 3 * index + 2]


def test_slow_but_progressing_reads_are_refused_once_blocks_are_reused(
        engine, memory, decode) -> None:
    # Every read takes 0.4 s, the deadline is 1.0 s: layers 0-1 arrive in time, layer 2 is
    # still being read when the prefill fails the request and its blocks get a new occupant.
    case, _, finished = run_case(engine, memory, decode,
                                 stalls=dict.fromkeys(range(LAYERS), 0.4), deadline_s=1.0,
                                 slot_reuse=False)
    assert not finished
    _, failed, _, _, _ = decode.status()
    assert "fence" in failed[case]


def test_unhurried_reads_still_arrive(engine, memory, decode) -> None:
    for slot_reuse in (True, False):
        case, index, finished = run_case(engine, memory, decode, stalls={}, deadline_s=5.0,
                                         slot_reuse=slot_reuse)
        assert finished
        check_accepted_bytes(memory, case, index)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(stalls=st.dictionaries(st.integers(0, LAYERS - 1),
                              st.sampled_from([0.0, 0.02, 0.08, 0.15, 0.3])),
       deadline_s=st.sampled_from([0.05, 0.1, 0.2, 0.4]), slot_reuse=st.booleans())
def test_every_accepted_byte_is_what_the_prefill_published(
        engine, memory, decode, stalls, deadline_s, slot_reuse) -> None:
    case, index, finished = run_case(engine, memory, decode, stalls=stalls,
                                     deadline_s=deadline_s, slot_reuse=slot_reuse)
    if finished:
        check_accepted_bytes(memory, case, index)
