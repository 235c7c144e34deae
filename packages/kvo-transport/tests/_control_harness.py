"""Shared helpers for the control-plane tests: memory, layouts, and a decode rank in a process.

The decode rank runs in a spawned child process with a real Mooncake transfer engine and a real
ZMQ socket; the prefill side runs in the test process. Buffers are files in /dev/shm mapped by
both processes, so the test can compare source and destination bytes directly. Children import
no torch (it takes seconds on a loaded 2-core machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import multiprocessing
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import zmq

from kvo_core.gates import RequestCompletionTracker, SlotGates
from kvo_transport.engine import DelegatingEngine, TransferEngine, create_transfer_engine
from kvo_transport.errors import TransferError
from kvo_transport.protocol import (
    PROTOCOL_VERSION,
    FrameDecoder,
    HandshakeAnswer,
    LayerMeta,
    MfMeta,
    ReadDone,
    ReadReadyBatch,
    TensorGroup,
    encode,
)
from kvo_transport.read_plan import (
    DecodeLayout,
    DestinationGroup,
    DestinationLayer,
    RequestDestination,
)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "kvo-ctltest-"

# -- memory ------------------------------------------------------------------------------------

class ShmBuffer:
    """A /dev/shm file mapped into this process; the creator unlinks it on close."""

    def __init__(self, name: str, nbytes: int, *, create: bool) -> None:
        self.name, self.nbytes, self.creator = name, nbytes, create
        self.path = SHM_DIR / f"{SHM_PREFIX}{name}"
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._anchor: Any = ctypes.c_char.from_buffer(self.map)
        self.ptr = ctypes.addressof(self._anchor)

    def read(self, offset: int, length: int) -> bytes:
        return self.map[offset:offset + length]

    def close(self) -> None:
        if self._anchor is None:
            return
        self._anchor = None
        self.map.close()
        if self.creator:
            self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def shm_buffers() -> Iterator[Callable[[int], ShmBuffer]]:
    """Create buffers on demand; all are unmapped and unlinked at the end."""
    made: list[ShmBuffer] = []

    def make(nbytes: int) -> ShmBuffer:
        buffer = ShmBuffer(f"{os.getpid()}-{len(made)}-{random.getrandbits(32):x}", nbytes,
                           create=True)
        made.append(buffer)
        return buffer

    try:
        yield make
    finally:
        for buffer in made:
            buffer.close()
    left = [str(b.path) for b in made if b.path.exists()]
    assert not left, f"shared-memory files left behind: {left}"


# -- layouts -----------------------------------------------------------------------------------

@attrs.frozen
class Geometry:
    """Per layer: main tensors, then indexer tensors, then scale tensors, each ``num_blocks``
    blocks; layers follow each other. One geometry per side (the block counts may differ)."""

    layers: int
    num_blocks: int
    main: tuple[int, ...]
    indexer: tuple[int, ...] = ()
    scale: tuple[int, ...] = ()

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * sum((*self.main, *self.indexer, *self.scale))

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def tensors(self, base: int, layer: int) -> dict[str, list[tuple[int, int]]]:
        """kind -> [(base address, block bytes)] for one layer."""
        offset = base + layer * self.layer_bytes
        out: dict[str, list[tuple[int, int]]] = {}
        for kind, sizes in (("main", self.main), ("indexer", self.indexer),
                            ("scale", self.scale)):
            out[kind] = []
            for size in sizes:
                out[kind].append((offset, size))
                offset += size * self.num_blocks
        return out

    def block_offset(self, layer: int, kind: str, tensor: int, block: int) -> int:
        """Byte offset (from the buffer start) of one block."""
        address, size = self.tensors(0, layer)[kind][tensor]
        return address + block * size


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def _group(kind_tensors: list[tuple[int, int]], num_blocks: int) -> TensorGroup | None:
    if not kind_tensors:
        return None
    return TensorGroup(base_addrs=tuple(a for a, _ in kind_tensors),
                       block_bytes=tuple(s for _, s in kind_tensors), num_blocks=num_blocks)


def layer_metas(geometry: Geometry, base: int) -> list[LayerMeta]:
    metas = []
    for layer in range(geometry.layers):
        t = geometry.tensors(base, layer)
        main = _group(t["main"], geometry.num_blocks)
        assert main is not None
        metas.append(LayerMeta(index=layer, name=layer_name(layer), main=main,
                               indexer=_group(t["indexer"], geometry.num_blocks),
                               indexer_scale=_group(t["scale"], geometry.num_blocks)))
    return metas


def _dest(kind_tensors: list[tuple[int, int]], num_blocks: int) -> DestinationGroup | None:
    if not kind_tensors:
        return None
    return DestinationGroup(base_addrs=[a for a, _ in kind_tensors],
                            block_bytes=[s for _, s in kind_tensors], num_blocks=num_blocks)


def decode_layout(geometry: Geometry, base: int) -> DecodeLayout:
    layers = []
    for layer in range(geometry.layers):
        t = geometry.tensors(base, layer)
        main = _dest(t["main"], geometry.num_blocks)
        assert main is not None
        layers.append(DestinationLayer(name=layer_name(layer), main=main,
                                       indexer=_dest(t["indexer"], geometry.num_blocks),
                                       indexer_scale=_dest(t["scale"], geometry.num_blocks)))
    return DecodeLayout(layers)


# -- a decode rank in a child process ----------------------------------------------------------

@attrs.frozen
class DecodeSpec:
    shm_name: str
    geometry: Geometry
    destinations: Mapping[str, tuple[tuple[int, ...], tuple[int, ...] | None]]
    decode_tp: int = 1
    d_rank: int = 0
    read_retries: int = 2
    retry_backoff_s: float = 0.01
    fail_first_reads: int = 0
    stall_request: str | None = None
    max_frame_bytes: int = 1 << 20
    control_secret: str | None = None
    stalls: Mapping[int, float] = attrs.Factory(dict)
    """layer -> seconds a data read into that destination layer pauses half-way (torn)."""
    quarantine_s: float = 2.0
    first_blocks: Mapping[str, int] = attrs.Factory(dict)
    """request id -> its RequestDestination.first_block (decode's own prefix below it)."""
    registered_after: Mapping[str, float] = attrs.Factory(dict)
    """request id -> seconds after start before its destination is registered."""
    declined: tuple[str, ...] = ()
    """Requests decode computes itself (``DecodeReceiver.decline``)."""
    destination_wait_s: float | None = None
    """How long a READY waits for its destination (None: the receiver's default)."""


class FlakyEngine(DelegatingEngine):
    """Delegates to a real engine but fails its first ``failures`` reads (transient faults),
    and pauses half-way through data reads into a stalled layer (``stalls``): the first half
    of the bytes is read, then the pause, then the rest: a slow decode whose read is torn if
    the source changes meanwhile."""

    def __init__(self, engine: TransferEngine, failures: int, geometry: Geometry | None = None,
                 dest_base: int = 0, stalls: Mapping[int, float] | None = None) -> None:
        super().__init__(engine)
        self._failures = failures
        self._geometry = geometry
        self._dest_base = dest_base
        self.stalls: dict[int, float] = dict(stalls or {})
        self.reads = 0

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        self.reads += 1
        if self.reads <= self._failures:
            raise TransferError(f"injected transient failure {self.reads} of {self._failures}")
        stall = self._stall_of(local_addrs[0]) if local_addrs else 0.0
        if stall <= 0:
            self._engine.read(peer, local_addrs, remote_addrs, lengths)
            return
        spans = [(local, remote, length)
                 for local, remote, length in zip(local_addrs, remote_addrs, lengths, strict=True)]
        if len(spans) == 1 and spans[0][2] > 1:
            local, remote, length = spans[0]
            half = length // 2
            spans = [(local, remote, half), (local + half, remote + half, length - half)]
        cut = len(spans) // 2
        for i, part in enumerate((spans[:cut], spans[cut:])):
            if i:
                time.sleep(stall)
            if part:
                self._engine.read(peer, [s[0] for s in part], [s[1] for s in part],
                                  [s[2] for s in part])

    def _stall_of(self, local: int) -> float:
        geometry = self._geometry
        if geometry is None or not self.stalls:
            return 0.0
        offset = local - self._dest_base
        if not 0 <= offset < geometry.total_bytes:
            return 0.0  # not a data read (the fence words land elsewhere)
        return self.stalls.get(offset // geometry.layer_bytes, 0.0)


def decode_main(spec: DecodeSpec, events: Any, commands: Any) -> None:
    """Child process: serve one decode rank until told to stop."""
    from kvo_transport.decode_side import DecodeReceiver

    logging.basicConfig(level=logging.WARNING, format="decode-child %(name)s: %(message)s")
    buffer = ShmBuffer(spec.shm_name, spec.geometry.total_bytes, create=False)
    engine = FlakyEngine(create_transfer_engine("mooncake"), spec.fail_first_reads,
                         spec.geometry, buffer.ptr, spec.stalls)
    engine.register(buffer.ptr, buffer.nbytes)
    table = {rid: RequestDestination(main, indexer, first_block=spec.first_blocks.get(rid, 0))
             for rid, (main, indexer) in spec.destinations.items()}
    started = time.monotonic()

    def resolve(request_id: str) -> RequestDestination | None:
        if request_id == spec.stall_request:
            events.put(("stalled", request_id))
            time.sleep(60)
        if time.monotonic() - started < spec.registered_after.get(request_id, 0.0):
            return None
        return table.get(request_id)

    receiver = DecodeReceiver(engine=engine, layout=decode_layout(spec.geometry, buffer.ptr),
                              resolve=resolve, decode_tp=spec.decode_tp, d_rank=spec.d_rank,
                              read_retries=spec.read_retries,
                              retry_backoff_s=spec.retry_backoff_s,
                              max_frame_bytes=spec.max_frame_bytes,
                              quarantine_s=spec.quarantine_s,
                              control_secret=spec.control_secret,
                              **({} if spec.destination_wait_s is None else
                                 {"destination_wait_s": spec.destination_wait_s}))
    for request_id in spec.declined:
        receiver.decline(request_id)
    receiver.start()
    events.put(("ready", receiver.endpoint, engine.session_id))
    finished: set[str] = set()
    failed: dict[str, str] = {}
    while True:
        command = commands.get(timeout=120)
        done, bad = receiver.pop_finished()
        finished |= done
        for request_id, reason in bad.items():  # the first failure says what went wrong
            failed.setdefault(request_id, reason)
        if isinstance(command, tuple) and command[0] == "stalls":
            engine.stalls = dict(command[1])
            events.put(("stalls",))
        elif command == "status":
            invalid = {rid: (sorted(receiver.invalid_blocks(rid).main),
                             sorted(receiver.invalid_blocks(rid).indexer))
                       for rid in spec.destinations}
            events.put(("status", sorted(finished), dict(failed), invalid,
                        receiver.rejected_frames, engine.reads))
        elif command == "parking":
            events.put(("parking", receiver.parked_readies, receiver.expired_readies,
                        receiver.waiting_readies))
        elif isinstance(command, tuple) and command[0] == "aborted":
            events.put(("aborted", {rid: receiver.aborted(rid) for rid in command[1]},
                        receiver.aborted_requests))
        elif command == "closed_connections":
            events.put(("closed_connections", receiver.closed_connections))
        elif command == "auth_rejections":
            events.put(("auth_rejections", receiver.auth_rejections.as_dict()))
        elif command == "stop":
            receiver.close()
            buffer.close()
            events.put(("stopped",))
            return


class DecodeProcess:
    """Parent-side handle of a decode child."""

    def __init__(self, spec: DecodeSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.spec = spec
        self.events = ctx.Queue()
        self.commands = ctx.Queue()
        self.process = ctx.Process(target=decode_main, args=(spec, self.events, self.commands),
                                   daemon=True)
        self.process.start()
        kind, self.endpoint, self.session_id = self.next_event(60)
        assert kind == "ready"

    def next_event(self, timeout: float) -> tuple[Any, ...]:
        try:
            event: tuple[Any, ...] = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"decode child sent nothing within {timeout} s "
                                 f"(alive: {self.process.is_alive()})") from None
        return event

    def status(self) -> tuple[list[str], dict[str, str], dict[str, Any], int, int]:
        self.commands.put("status")
        event = self.next_event(30)
        assert event[0] == "status", event
        return event[1], event[2], event[3], event[4], event[5]

    def set_stalls(self, stalls: Mapping[int, float]) -> None:
        """From now on, data reads into these destination layers pause half-way this long."""
        self.commands.put(("stalls", dict(stalls)))
        assert self.next_event(30) == ("stalls",)

    def parking(self) -> tuple[int, int, int]:
        """(READYs that waited for their destination, READYs whose wait expired, READYs
        waiting now)."""
        self.commands.put("parking")
        event = self.next_event(30)
        assert event[0] == "parking", event
        return int(event[1]), int(event[2]), int(event[3])

    def aborted(self, request_ids: Sequence[str]) -> tuple[dict[str, str | None], int]:
        """(request id -> why its prefill gave it up, or None; aborts received in all)."""
        self.commands.put(("aborted", tuple(request_ids)))
        event = self.next_event(30)
        assert event[0] == "aborted", event
        return dict(event[1]), int(event[2])

    def closed_connections(self) -> int:
        self.commands.put("closed_connections")
        event = self.next_event(30)
        assert event[0] == "closed_connections", event
        return int(event[1])

    def auth_rejections(self) -> dict[str, int]:
        self.commands.put("auth_rejections")
        event = self.next_event(30)
        assert event[0] == "auth_rejections", event
        return dict(event[1])

    def wait_terminal(self, request_ids: Sequence[str], timeout: float = 20.0
                      ) -> tuple[list[str], dict[str, str], dict[str, Any], int, int]:
        """Poll until every request finished or failed on this rank."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if set(request_ids) <= set(status[0]) | set(status[1]):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"requests not terminal on decode after {timeout} s: "
                                     f"finished {status[0]}, failed {status[1]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put("stop")
            self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        assert not self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)


# -- a misbehaving decode in the test process --------------------------------------------------

class FakeDecode:
    """A ROUTER that accepts handshakes and answers READYs per ``policy(batch) -> answer``.

    ``policy`` returns a list of frames to send back (possibly none: a lost acknowledgement).
    ``handover``: let a new connection take over a connected peer's routing id (ZMQ's
    ROUTER_HANDOVER; the old connection is then never read again).
    """

    def __init__(self, policy: Callable[[ReadReadyBatch], list[Any]],
                 answer_handshake: bool = True, max_frame_bytes: int | None = None,
                 handover: bool = False) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, int(handover))
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.policy = policy
        self.answer_handshake = answer_handshake
        self.limit = {} if max_frame_bytes is None else {"max_frame_bytes": max_frame_bytes}
        self.seen: list[Any] = []
        self.handshakes_from: list[bytes] = []
        """The routing id of every handshake, in arrival order."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = FrameDecoder()
        while not self._stop.is_set():
            if not self.socket.poll(20):
                continue
            identity, frame = self.socket.recv_multipart()
            message = decoder.decode(frame)
            self.seen.append(message)
            if isinstance(message, MfMeta):
                self.handshakes_from.append(identity)
                if self.answer_handshake:
                    self.socket.send_multipart([identity, encode(HandshakeAnswer(
                        version=PROTOCOL_VERSION, accepted=True, **self.limit))])
            elif isinstance(message, ReadReadyBatch):  # SEND_ABORTED is only recorded
                for answer in self.policy(message):
                    self.socket.send_multipart([identity, encode(answer)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close()
        self.context.term()


def done(batch: ReadReadyBatch) -> ReadDone:
    return ReadDone(version=PROTOCOL_VERSION, seq=batch.seq, layer_index=batch.layer_index)

# -- the prefill side in the test process ------------------------------------------------------

@attrs.frozen
class Chunk:
    """One request's chunk as a prefill rank sees it."""

    request_id: str
    start_block: int
    main_src: tuple[int, ...]
    indexer_src: tuple[int, ...] = ()


@attrs.define
class PrefillOutcome:
    slot_errors: list[BaseException] = attrs.Factory(list)
    finished: set[str] = attrs.Factory(set)
    failed: dict[str, str] = attrs.Factory(dict)


def run_prefill_rank(publisher: Any, endpoint: str, chunks: Sequence[Chunk], layers: int,
                     slot_base: int, *, shared_slots: int = 2, wait_timeout: float = 10.0,
                     gates: SlotGates, tracker: RequestCompletionTracker,
                     final: bool = True) -> PrefillOutcome:
    """Publish every layer of ``chunks`` like a layer pipeline with ``shared_slots`` buffers.

    ``final``: these chunks end their requests (the last layer carries the last-layer mark, and
    the requests' completion is awaited).
    """
    from kvo_core.errors import SlotFailedError, SlotTimeoutError

    outcome = PrefillOutcome()
    ids = [c.request_id for c in chunks]

    def key(layer: int) -> tuple[int, ...]:
        return (slot_base + layer % shared_slots,)

    def wait(slot: tuple[int, ...]) -> None:
        try:
            gates.wait(slot, wait_timeout)
        except (SlotFailedError, SlotTimeoutError) as exc:
            outcome.slot_errors.append(exc)

    for layer in range(layers):
        wait(key(layer))  # the previous layer in this slot must be read before reuse
        requests = [publisher.ready_request(c.request_id, c.start_block, c.main_src,
                                            c.indexer_src) for c in chunks]
        publisher.publish_layer(layer, key(layer), {endpoint: requests},
                                last_layer_request_ids=ids if final and layer == layers - 1
                                else ())
    for slot in sorted({key(layer) for layer in range(layers)}):
        wait(slot)
    deadline = time.monotonic() + wait_timeout
    while (final and set(ids) - outcome.finished - set(outcome.failed)
           and time.monotonic() < deadline):
        done, bad = tracker.pop_finished()
        outcome.finished |= done
        outcome.failed.update(bad)
        time.sleep(0.01)
    return outcome


def fill_random(buffer: ShmBuffer, seed: int) -> None:
    rng = random.Random(seed)
    buffer.map[:] = rng.randbytes(buffer.nbytes)


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` in a thread; its result (or exception) lands in the returned list."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(target())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result
