"""The soak's hostile-peer fault against a real decode receiver and prefill publisher (ZMQ,
Mooncake engine): the soak finds the live routing id in the decode's log, claims it from a
second connection, is never answered, and the prefill's own session keeps working."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvo_core.gates import SlotGates
from kvo_tools.pd.hostile import TakeoverCounts, keep_taking_over, live_routing_id
from kvo_transport.decode_side import DecodeReceiver
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_transport.prefill_side import PrefillPublisher
from kvo_transport.protocol import LayerMeta, TensorGroup
from kvo_transport.read_plan import (
    DecodeLayout,
    DestinationGroup,
    DestinationLayer,
    RequestDestination,
)

pytestmark = pytest.mark.needs_loopback_netns

BLOCKS = 4
BLOCK_BYTES = 256
LAYER = "model.layers.0.self_attn.attn"


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    made = create_transfer_engine("mooncake")
    yield made
    made.close()


def test_the_soak_claims_the_logged_routing_id_and_the_decode_never_answers_it(
        engine: TransferEngine, tmp_path: Path) -> None:
    source = ctypes.create_string_buffer(bytes(range(256)) * BLOCKS, BLOCKS * BLOCK_BYTES)
    dest = ctypes.create_string_buffer(BLOCKS * BLOCK_BYTES)
    for memory in (source, dest):
        engine.register(ctypes.addressof(memory), BLOCKS * BLOCK_BYTES)
    destination = RequestDestination(main_block_ids=(0, 1))
    receiver = DecodeReceiver(
        engine=engine, layout=DecodeLayout([DestinationLayer(name=LAYER, main=DestinationGroup(
            base_addrs=[ctypes.addressof(dest)], block_bytes=[BLOCK_BYTES], num_blocks=BLOCKS))]),
        resolve=lambda request_id: destination if request_id == "r" else None)
    log_file = tmp_path / "decode.log"
    handler = logging.FileHandler(log_file)
    decode_log = logging.getLogger("kvo.transport.decode")
    decode_log.addHandler(handler)
    previous_level = decode_log.level
    decode_log.setLevel(logging.INFO)
    gates = SlotGates()
    publisher = PrefillPublisher.for_engine(
        engine, instance_id="soak-prefill", prefill_tp=1, p_rank=0, decode_tp=1,
        layers=[LayerMeta(index=0, name=LAYER, main=TensorGroup(
            base_addrs=(ctypes.addressof(source),), block_bytes=(BLOCK_BYTES,),
            num_blocks=BLOCKS))],
        gates=gates, handshake_timeout_s=10.0, layer_deadline_s=5.0)
    receiver.start()
    try:
        request = publisher.ready_request("r", 0, (2, 3))
        publisher.publish_layer(0, (1,), {receiver.endpoint: [request]})
        gates.wait((1,), 10.0)
        handler.flush()
        identity = live_routing_id(log_file)
        assert identity is not None and identity.startswith(b"soak-prefill rank 0/1/")

        counts, stop = TakeoverCounts(), threading.Event()
        thread = threading.Thread(target=keep_taking_over,
                                  args=(receiver.endpoint, log_file, counts, stop, 0.05))
        thread.start()
        try:
            publisher.publish_layer(0, (2,), {receiver.endpoint: [request]})
            gates.wait((2,), 5.0)  # served on the original connection meanwhile
            while counts.attempts < 3:
                stop.wait(0.05)
        finally:
            stop.set()
            thread.join(10)
        assert counts.answered == 0
        publisher.publish_layer(0, (3,), {receiver.endpoint: [request]})
        gates.wait((3,), 5.0)
        assert publisher.renewed_sessions == 0
        assert dest.raw[:2 * BLOCK_BYTES] == source.raw[2 * BLOCK_BYTES:]
    finally:
        publisher.close()
        receiver.close()
        decode_log.removeHandler(handler)
        decode_log.setLevel(previous_level)
        handler.close()


def test_the_soak_never_fills_a_dev_shm_that_is_not_its_own(monkeypatch) -> None:
    from kvo_tools.pd import private_shm

    monkeypatch.delenv(private_shm.MARK, raising=False)
    with pytest.raises(RuntimeError, match="not the soak's private one"), private_shm.filled(0):
        pass
    assert not (private_shm.SHM / private_shm.FILLER).exists()


FILL_SCRIPT = """
import json, os
from kvo_tools.pd.private_shm import filled, free_bytes
report = {"before": free_bytes()}
try:
    with filled(16384) as left:
        report["left"] = left
        try:
            open("/dev/shm/more", "wb").write(b"x" * 65536)
        except OSError as error:
            report["write"] = error.strerror
        raise KeyError("a batch that failed")
except KeyError:
    pass
report["after"] = free_bytes()
report["files"] = sorted(os.listdir("/dev/shm"))
print(json.dumps(report))
"""


def test_shm_nearly_full_leaves_the_remainder_and_frees_it_again_after_a_failure(
        tmp_path: Path) -> None:
    """In a private tmpfs (as the soak runs): filled up to 16 KiB, a 64 KiB write fails with
    ENOSPC, and the filler is gone again after the batch raised."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from kvo_tools.pd import private_shm

    if private_shm.why_no_private_shm() is not None or shutil.which("unshare") is None:
        pytest.skip(f"no private /dev/shm here: {private_shm.why_no_private_shm()}")
    script = tmp_path / "fill.py"
    script.write_text(FILL_SCRIPT)
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=4m kvo-test-shm /dev/shm && {private_shm.MARK}=4 exec "
         f"{sys.executable} {script}"],
        capture_output=True, text=True, timeout=60, env={**os.environ})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["before"] == 4 << 20
    assert report["left"] == 16384
    assert report["write"] == "No space left on device"
    assert private_shm.FILLER not in report["files"]
    assert report["after"] >= report["before"] - 65536  # only the failed write's partial file
