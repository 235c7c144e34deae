"""Late slices of a failed batch never land in memory that was handed back.

Mooncake's batch read returns at its first failed slice while the batch's other slices may still
be landing (up to 267 ms later, measured on loopback TCP). Here a READY's first source block is
outside what the prefill registered, the rest are 1 MiB blocks that are: the read fails at once
while megabytes are still on their way. The decode (a real child process with a real Mooncake
engine) reports the request failed only once the destination settled; the moment it does, the
test hands the blocks to a "new owner" (writes a marker into them) and checks that no byte of
the marker is overwritten afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from _control_harness import (
    DecodeProcess,
    DecodeSpec,
    Geometry,
    fill_random,
    layer_metas,
    shm_buffers,
)

from kvo_core.errors import SlotFailedError
from kvo_core.gates import SlotGates
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_transport.prefill_side import PrefillPublisher

pytestmark = pytest.mark.needs_loopback_netns

BLOCK = 1 << 20
BLOCKS = 12
GEOMETRY = Geometry(layers=1, num_blocks=BLOCKS, main=(BLOCK,))
ROUNDS = 3
MARKER = 0xAB
WAIT = 20.0


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    made = create_transfer_engine("mooncake")
    yield made
    made.close()


def run_rounds(engine: TransferEngine, quarantine_s: float) -> list[tuple[float, int]]:
    """Per round: (seconds from READ_FAILED at the prefill to the decode's failure report,
    marker bytes overwritten after the hand-back)."""
    results = []
    with shm_buffers() as make:
        source, dest = make(GEOMETRY.total_bytes), make(GEOMETRY.total_bytes)
        fill_random(source, 11)
        # The last block is advertised but not registered: its slice fails at once.
        engine.register(source.ptr, (BLOCKS - 1) * BLOCK)
        ids = [f"r{i}" for i in range(ROUNDS)]
        destination = (tuple(range(BLOCKS)), None)
        decode = DecodeProcess(DecodeSpec(
            shm_name=dest.name, geometry=GEOMETRY, read_retries=0,
            destinations=dict.fromkeys(ids, destination), quarantine_s=quarantine_s))
        gates = SlotGates()
        publisher = PrefillPublisher.for_engine(
            engine, instance_id="prefill-late", prefill_tp=1, p_rank=0, decode_tp=1,
            layers=layer_metas(GEOMETRY, source.ptr), gates=gates)
        try:
            for round_, request_id in enumerate(ids):
                dest.map[:] = bytes(dest.nbytes)
                request = publisher.ready_request(
                    request_id, 0, (BLOCKS - 1, *range(BLOCKS - 1)))
                publisher.publish_layer(0, (round_ + 1,), {decode.endpoint: [request]},
                                        last_layer_request_ids=(request_id,))
                with pytest.raises(SlotFailedError, match="failed"):
                    gates.wait((round_ + 1,), WAIT)
                failed_at = time.monotonic()
                handed_back = hand_back_when_reported(decode, request_id)
                dest.map[:] = bytes([MARKER]) * dest.nbytes  # the blocks' new owner
                time.sleep(0.5)
                overwritten = dest.nbytes - dest.map[:].count(MARKER)
                results.append((handed_back - failed_at, overwritten))
        finally:
            publisher.close()
            decode.stop()
            engine.unregister(source.ptr)
    return results


def hand_back_when_reported(decode: DecodeProcess, request_id: str) -> float:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        _, failed, _, _, _ = decode.status()
        if request_id in failed:
            return time.monotonic()
    raise AssertionError(f"{request_id} was never reported failed")


def test_late_slices_never_land_in_memory_handed_back(engine: TransferEngine) -> None:
    results = run_rounds(engine, quarantine_s=2.0)
    assert all(overwritten == 0 for _, overwritten in results), results
    # Held for the quarantine: without it the hand-back follows the failure within
    # milliseconds. Decode starts the quarantine when its read fails, before the prefill's gate
    # hears of it (up to 0.3 s later on a loaded machine), hence half the quarantine as bound.
    assert all(waited >= 1.0 for waited, _ in results), results
