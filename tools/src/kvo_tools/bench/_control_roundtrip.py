"""READY -> DONE round trip of the control plane for an empty layer (no bytes to move).

What prefill waits for per layer when there is nothing to read: publish_layer -> ZMQ -> decode
validates and answers -> the answer opens the slot gate. Measured both ways the answer can reach
the waiter (``measure_roundtrip``), next to a bare pyzmq ping-pong between the same two
processes, so the table says what kvo adds to what ZMQ costs on this host at this moment;
``kvo_pump_auth`` is the pumped round trip with a control secret (every frame MACed, see
kvo_transport.frame_auth). The
decode rank runs in its own process, as in production. Needs a loopback-only network namespace
(Mooncake engines are started on both sides); ``kvo_tools.bench.transport`` calls
``measure_roundtrip``; run this file directly for the number alone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing
import selectors
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

BLOCK_BYTES = 4096
NUM_BLOCKS = 4
BENCH_SECRET = "bench control secret (not a real one)"


def _decode_main(ready: Any, stop: Any) -> None:
    """The decode rank: kvo's DecodeReceiver, plus a bare ROUTER thread for the baseline."""
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
    context = zmq.Context()
    echo = context.socket(zmq.ROUTER)
    echo.setsockopt(zmq.LINGER, 0)
    echo_port = echo.bind_to_random_port("tcp://127.0.0.1")
    thread = threading.Thread(target=_echo, args=(echo, stop), daemon=True)
    thread.start()
    with DecodeReceiver(engine=engine, layout=layout, resolve=lambda rid: None) as receiver, \
            DecodeReceiver(engine=engine, layout=layout, resolve=lambda rid: None,
                           control_secret=BENCH_SECRET) as authenticated:
        ready.put((receiver.endpoint, f"tcp://127.0.0.1:{echo_port}", authenticated.endpoint))
        stop.wait(600)
    thread.join(5)
    echo.close()
    context.term()


def _echo(socket: zmq.Socket[bytes], stop: Any) -> None:
    """Baseline decode: answer every frame at once, from a Python thread, as kvo's does."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            while _int_option(socket, zmq.EVENTS) & zmq.POLLIN:
                socket.send_multipart(socket.recv_multipart())


def _int_option(socket: zmq.Socket[bytes], option: int) -> int:
    """An integer socket option (EVENTS, FD); pyzmq types every option's value as a union."""
    value = socket.getsockopt(option)
    if not isinstance(value, int):
        raise TypeError(f"socket option {option} is {value!r}, not an integer")
    return value


class _RawPeer:
    """Baseline prefill: DEALER send, then sleep on the socket's FD until the answer is in."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.selector = selectors.DefaultSelector()
        self.selector.register(_int_option(self.socket, zmq.FD), selectors.EVENT_READ)
        self.frame = b"x" * 64

    def round_trip(self) -> None:
        self.socket.send(self.frame)
        while not _int_option(self.socket, zmq.EVENTS) & zmq.POLLIN:
            self.selector.select(10.0)
        self.socket.recv()

    def close(self) -> None:
        self.selector.close()
        self.socket.close()
        self.context.term()


MODES = ("kvo_pump", "kvo_pump_auth", "kvo_io_thread", "raw_zmq")


def measure_roundtrip(n: int, warmup: int = 200) -> dict[str, float]:
    """Time ``n`` empty-layer READY -> DONE round trips per mode; latencies in microseconds.

    Modes: kvo with the waiter pumping (``kvo_pump``, how kvo's layer pipeline waits), kvo
    with the I/O thread handing answers over (``kvo_io_thread``), kvo pumped with every frame
    authenticated (``kvo_pump_auth``), and the bare pyzmq
    DEALER/ROUTER ping-pong between the same two processes (``raw_zmq``: the floor).
    """
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
    auth_gates = SlotGates()
    auth_publisher = PrefillPublisher.for_engine(
        engine, instance_id="bench-auth", prefill_tp=1, p_rank=0, decode_tp=1, layers=[layer],
        gates=auth_gates, handshake_timeout_s=60.0, layer_deadline_s=10.0,
        control_secret=BENCH_SECRET)
    auth_gates.attach_pump(auth_publisher)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    raw: _RawPeer | None = None
    try:
        endpoint, echo_endpoint, auth_endpoint = ready.get(timeout=120)
        publisher.connect(endpoint)
        auth_publisher.connect(auth_endpoint)
        raw = _RawPeer(echo_endpoint)
        key = (ptr,)

        def kvo_round_trip() -> None:
            publisher.publish_layer(0, key, {endpoint: []})
            gates.wait(key, 10.0)

        def kvo_auth_round_trip() -> None:
            auth_publisher.publish_layer(0, key, {auth_endpoint: []})
            auth_gates.wait(key, 10.0)

        # The modes alternate in blocks, so that load changes hit all of them alike.
        block = 100
        for i in range(len(MODES) * ((warmup + n) // block + 1)):
            mode = MODES[i % len(MODES)]
            gates.attach_pump(publisher if mode == "kvo_pump" else None)
            run = {"raw_zmq": raw.round_trip,
                   "kvo_pump_auth": kvo_auth_round_trip}.get(mode, kvo_round_trip)
            for _ in range(block):
                started = time.perf_counter()
                run()
                samples[mode].append((time.perf_counter() - started) * 1e6)
    finally:
        gates.attach_pump(None)
        auth_gates.attach_pump(None)
        publisher.close()
        auth_publisher.close()
        if raw is not None:
            raw.close()
        stop.set()
        decode.join(30)
        if decode.is_alive():
            decode.kill()
        engine.close()
    result: dict[str, float] = {"n": n, "target_p50_us": 300.0}
    for mode in MODES:
        result.update(_stats(samples[mode][warmup:], mode))
    result["kvo_pump_over_raw_p50"] = result["kvo_pump_p50_us"] / result["raw_zmq_p50_us"]
    result["auth_over_plain_p50"] = result["kvo_pump_auth_p50_us"] / result["kvo_pump_p50_us"]
    return result


def _stats(samples: list[float], mode: str) -> dict[str, float]:
    samples = sorted(samples)
    return {f"{mode}_p50_us": statistics.median(samples),
            f"{mode}_p99_us": samples[min(len(samples) - 1, int(0.99 * len(samples)))],
            f"{mode}_min_us": samples[0]}


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
