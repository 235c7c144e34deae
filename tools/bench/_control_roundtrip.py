"""READY -> DONE round trip of the control plane for an empty layer (no bytes to move).

What prefill waits for per layer when there is nothing to read: publish_layer -> ZMQ -> decode
validates and answers -> the answer opens the slot gate. Measured both ways the answer can reach
the waiter: the waiter pumps the publisher itself (the gate has it attached: ``p50_us``), or
the publisher's I/O thread handles it and wakes the waiter (``io_thread_p50_us``). The
decode rank runs in its own process, as in production. Needs a loopback-only network namespace
(Mooncake engines are started on both sides); ``tools/bench/transport.py`` calls
``measure_roundtrip``; run this file directly for the number alone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BLOCK_BYTES = 4096
NUM_BLOCKS = 4



def _decode_main(ready: Any, stop: Any) -> None:
    from kvo_transport.decode_side import DecodeReceiver
    from kvo_transport.engine import create_transfer_engine
    from kvo_transport.read_plan import DecodeLayout, DestinationGroup, DestinationLayer

    engine = create_transfer_engine("mooncake")
    memory = mmap.mmap(-1, BLOCK_BYTES * NUM_BLOCKS)
    anchor = ctypes.c_char.from_buffer(memory)
    ptr = ctypes.addressof(anchor)
    engine.register(ptr, len(memory))
    layout = DecodeLayout([DestinationLayer(
        name="layers.0", main=DestinationGroup((ptr,), (BLOCK_BYTES,), NUM_BLOCKS))])
    with DecodeReceiver(engine=engine, layout=layout, resolve=lambda rid: None) as receiver:
        ready.put(receiver.endpoint)
        stop.wait(600)


def measure_roundtrip(n: int, warmup: int = 200) -> dict[str, float]:
    """Time ``n`` empty-layer READY -> DONE round trips; latencies in microseconds."""
    from kvo_core.gates import SlotGates
    from kvo_transport.engine import create_transfer_engine
    from kvo_transport.prefill_side import PrefillPublisher
    from kvo_transport.protocol import LayerMeta, TensorGroup

    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    decode = ctx.Process(target=_decode_main, args=(ready, stop), daemon=True)
    decode.start()
    engine = create_transfer_engine("mooncake")
    memory = mmap.mmap(-1, BLOCK_BYTES * NUM_BLOCKS)
    anchor = ctypes.c_char.from_buffer(memory)
    ptr = ctypes.addressof(anchor)
    engine.register(ptr, len(memory))
    gates = SlotGates()
    layer = LayerMeta(index=0, name="layers.0",
                      main=TensorGroup(base_addrs=(ptr,), block_bytes=(BLOCK_BYTES,),
                                       num_blocks=NUM_BLOCKS))
    publisher = PrefillPublisher.for_engine(
        engine, instance_id="bench", prefill_tp=1, p_rank=0, decode_tp=1, layers=[layer],
        gates=gates, handshake_timeout_s=60.0, layer_deadline_s=10.0)
    samples: dict[bool, list[float]] = {False: [], True: []}
    try:
        endpoint = ready.get(timeout=120)
        publisher.connect(endpoint)
        key = (ptr,)
        # Both ways of waiting, alternating in blocks so that load changes hit both alike.
        block = 100
        for i in range(2 * (warmup + n) // block + 1):
            pumped = i % 2 == 1
            gates.attach_pump(publisher if pumped else None)
            for _ in range(block):
                started = time.perf_counter()
                publisher.publish_layer(0, key, {endpoint: []})
                gates.wait(key, 10.0)
                samples[pumped].append((time.perf_counter() - started) * 1e6)
    finally:
        gates.attach_pump(None)
        publisher.close()
        stop.set()
        decode.join(30)
        if decode.is_alive():
            decode.kill()
        engine.close()
    result: dict[str, float] = {"n": n, "target_p50_us": 300.0}
    for pumped, name in ((True, ""), (False, "io_thread_")):
        result.update(_stats(samples[pumped][warmup // 2:], name))
    return result


def _stats(samples: list[float], prefix: str) -> dict[str, float]:
    samples = sorted(samples)
    return {f"{prefix}p50_us": statistics.median(samples),
            f"{prefix}p99_us": samples[min(len(samples) - 1, int(0.99 * len(samples)))],
            f"{prefix}mean_us": statistics.fmean(samples), f"{prefix}min_us": samples[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the result as JSON here")
    parser.add_argument("--quick", action="store_true", help="fewer round trips")
    args = parser.parse_args(argv)
    result = measure_roundtrip(300 if args.quick else 3000)
    print(f"{'metric':<14}{'value':>12}")
    for key, value in result.items():
        print(f"{key:<22}{value:>12.1f}")
    if args.json:
        args.json.write_text(json.dumps({"control_roundtrip": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
