"""Prefill and decode in different processes: handshake -> READY -> pull -> DONE, bytes checked.

Real ZMQ sockets, real Mooncake transfer engines (tcp on loopback), decode ranks in spawned
processes. Every source byte that should move is compared with its destination, and every
destination block that should not have been written is checked to still be zero.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
from _control_harness import (
    Chunk,
    DecodeProcess,
    DecodeSpec,
    Geometry,
    ShmBuffer,
    fill_random,
    in_thread,
    layer_metas,
    run_prefill_rank,
    shm_buffers,
)

from kvo_core.gates import RequestCompletionTracker, SlotGates
from kvo_core.tp import indexer_block_range
from kvo_transport.engine import TransferEngine, create_transfer_engine
from kvo_transport.prefill_side import PrefillPublisher

pytestmark = pytest.mark.needs_loopback_netns

PREFILL = Geometry(layers=4, num_blocks=24, main=(1024, 256), indexer=(512,), scale=(64,))
DECODE = Geometry(layers=4, num_blocks=40, main=(1024, 256), indexer=(512,), scale=(64,))
KINDS = (("main", PREFILL.main), ("indexer", PREFILL.indexer), ("scale", PREFILL.scale))


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    made = [create_transfer_engine("mooncake") for _ in range(4)]
    yield made
    for engine in made:
        engine.close()


@pytest.fixture
def buffers() -> Iterator[object]:
    with shm_buffers() as make:
        yield make


def publisher_for(engine: TransferEngine, buffer: ShmBuffer, *, prefill_tp: int = 1,
                  p_rank: int = 0, decode_tp: int = 1, gates: SlotGates,
                  tracker: RequestCompletionTracker) -> PrefillPublisher:
    engine.register(buffer.ptr, buffer.nbytes)
    return PrefillPublisher.for_engine(
        engine, instance_id="prefill-0", prefill_tp=prefill_tp, p_rank=p_rank,
        decode_tp=decode_tp, layers=layer_metas(PREFILL, buffer.ptr), gates=gates,
        tracker=tracker, handshake_timeout_s=30.0, layer_deadline_s=10.0)


def block(buffer: ShmBuffer, geometry: Geometry, layer: int, kind: str, tensor: int,
          block_id: int) -> bytes:
    size = dict(KINDS)[kind][tensor]
    return buffer.read(geometry.block_offset(layer, kind, tensor, block_id), size)


def check_untouched_blocks_are_zero(buffer: ShmBuffer,
                                    written: set[tuple[int, str, int, int]]) -> None:
    for layer in range(DECODE.layers):
        for kind, sizes in KINDS:
            for tensor, size in enumerate(sizes):
                for block_id in range(DECODE.num_blocks):
                    if (layer, kind, tensor, block_id) in written:
                        continue
                    assert block(buffer, DECODE, layer, kind, tensor, block_id) == bytes(size), \
                        f"stray write: layer {layer} {kind}[{tensor}] block {block_id}"


class ReportThreads(SlotGates):
    """SlotGates that remember which thread reported each part."""

    def __init__(self) -> None:
        super().__init__()
        self.reporters: list[int] = []

    def mark_done(self, key, part) -> bool:
        self.reporters.append(threading.get_ident())
        return super().mark_done(key, part)


@pytest.mark.parametrize("pumped", [False, True], ids=["io-thread", "waiter-pumps"])
def test_layers_and_chunked_requests_arrive_byte_identical(engines, buffers, pumped) -> None:
    rng = random.Random(7)
    source = buffers(PREFILL.total_bytes)
    fill_random(source, 1)
    dest = buffers(DECODE.total_bytes)
    # Request sizes in blocks; r-chunked arrives in two chunks (chunked prefill).
    sizes = {"r-contig": 5, "r-scatter": 3, "r-chunked": 7}
    src_pool = rng.sample(range(1, PREFILL.num_blocks), sum(sizes.values()))
    src_pool[:5] = [0, 1, 2, 3, 4]  # a contiguous run: descriptors coalesce on both sides
    dst_pool = rng.sample([b for b in range(DECODE.num_blocks) if not 20 <= b < 25],
                          2 * sum(sizes.values()))
    main_src, indexer_src, main_dst, indexer_dst = {}, {}, {}, {}
    offset = 0
    for rid, n in sizes.items():
        main_src[rid] = tuple(src_pool[offset:offset + n])
        indexer_src[rid] = tuple(rng.sample(range(PREFILL.num_blocks), n))
        main_dst[rid] = tuple(dst_pool[offset:offset + n])
        offset += n
    main_dst["r-contig"] = (20, 21, 22, 23, 24)
    indexer_dst["r-scatter"] = tuple(dst_pool[offset:offset + 3])  # own indexer block table
    destinations = {rid: (main_dst[rid], indexer_dst.get(rid)) for rid in sizes}
    decode = DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=DECODE,
                                      destinations=destinations))
    gates, tracker = ReportThreads(), RequestCompletionTracker()
    publisher = publisher_for(engines[0], source, gates=gates, tracker=tracker)
    if pumped:
        gates.attach_pump(publisher)
    try:
        first = [Chunk("r-chunked", 0, main_src["r-chunked"][:4], indexer_src["r-chunked"][:4])]
        early = run_prefill_rank(publisher, decode.endpoint, first, PREFILL.layers, 1000,
                                 gates=gates, tracker=tracker, final=False)
        assert early.slot_errors == []
        chunks = [Chunk(rid, 0, main_src[rid], indexer_src[rid])
                  for rid in ("r-contig", "r-scatter")]
        chunks.append(Chunk("r-chunked", 4, main_src["r-chunked"][4:],
                            indexer_src["r-chunked"][4:]))
        outcome = run_prefill_rank(publisher, decode.endpoint, chunks, PREFILL.layers, 1000,
                                   gates=gates, tracker=tracker)
        assert outcome.slot_errors == []
        assert outcome.failed == {}
        assert outcome.finished == set(sizes)
        finished, failed, invalid, rejected, _ = decode.wait_terminal(list(sizes))
        assert set(finished) == set(sizes) and failed == {} and rejected == 0
        assert all(invalid[rid] == ([], []) for rid in sizes)
        # Who opened the gates: the waiting (this) thread when it pumps, else the I/O thread.
        here = threading.get_ident()
        assert len(gates.reporters) == 2 * PREFILL.layers
        if pumped:
            assert here in gates.reporters  # (an answer that beats the wait goes to I/O)
        else:
            assert here not in gates.reporters
    finally:
        gates.attach_pump(None)
        publisher.close()
        engines[0].unregister(source.ptr)
        decode.stop()

    written: set[tuple[int, str, int, int]] = set()
    for layer in range(PREFILL.layers):
        for rid in sizes:
            for kind, tensors in KINDS:
                src_ids = main_src[rid] if kind == "main" else indexer_src[rid]
                dst_ids = main_dst[rid] if kind == "main" else indexer_dst.get(rid, main_dst[rid])
                for tensor in range(len(tensors)):
                    for src_id, dst_id in zip(src_ids, dst_ids, strict=True):
                        assert block(dest, DECODE, layer, kind, tensor, dst_id) == \
                            block(source, PREFILL, layer, kind, tensor, src_id), \
                            f"{rid} layer {layer} {kind}[{tensor}] block {src_id}->{dst_id}"
                        written.add((layer, kind, tensor, dst_id))
    check_untouched_blocks_are_zero(dest, written)


def test_readies_wait_for_a_late_destination_and_skip_what_decode_holds(engines,
                                                                        buffers) -> None:
    """Prefill and decode posted at once: prefill publishes from block 0 before decode has
    registered "late" (it appears 0.4 s in), decode already holds the first two blocks of
    "prefix", and computes "declined" itself. Every layer of "late" waits and then arrives
    byte-identical; "prefix" gets only its blocks 2 and 3; "declined" reads nothing; every
    READY is answered READ_DONE, so prefill finishes all three."""
    source = buffers(PREFILL.total_bytes)
    fill_random(source, 3)
    dest = buffers(DECODE.total_bytes)
    src = {"late": (1, 2, 3), "prefix": (4, 5, 6, 7), "declined": (8, 9)}
    dst = {"late": (10, 11, 12), "prefix": (-1, -1, 14, 15)}
    decode = DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=DECODE,
        destinations={rid: (ids, None) for rid, ids in dst.items()},
        first_blocks={"prefix": 2}, registered_after={"late": 0.4}, declined=("declined",)))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = publisher_for(engines[0], source, gates=gates, tracker=tracker)
    try:
        chunks = [Chunk(rid, 0, ids, ids) for rid, ids in src.items()]
        outcome = run_prefill_rank(publisher, decode.endpoint, chunks, PREFILL.layers, 2000,
                                   gates=gates, tracker=tracker)
        assert outcome.slot_errors == [] and outcome.failed == {}
        assert outcome.finished == set(src)
        finished, failed, invalid, rejected, _ = decode.wait_terminal(["late", "prefix"])
        assert {"late", "prefix"} <= set(finished) and failed == {} and rejected == 0
        assert invalid == {"late": ([], []), "prefix": ([], [])}
        parked, expired, waiting = decode.parking()
        assert parked >= 1 and expired == 0 and waiting == 0
    finally:
        publisher.close()
        engines[0].unregister(source.ptr)
        decode.stop()

    written: set[tuple[int, str, int, int]] = set()
    moved = {"late": list(zip(src["late"], dst["late"], strict=True)),
             "prefix": list(zip(src["prefix"][2:], dst["prefix"][2:], strict=True))}
    for layer in range(PREFILL.layers):
        for pairs in moved.values():
            for kind, tensors in KINDS:
                for tensor in range(len(tensors)):
                    for src_id, dst_id in pairs:
                        assert block(dest, DECODE, layer, kind, tensor, dst_id) == \
                            block(source, PREFILL, layer, kind, tensor, src_id)
                        written.add((layer, kind, tensor, dst_id))
    check_untouched_blocks_are_zero(dest, written)


def test_a_ready_refused_before_registration_fails_the_request_not_its_later_chunks(
        engines, buffers) -> None:
    """Prefill and decode posted at once, decode slow to register "late" (1.5 s) and READYs
    wait at most 0.3 s: chunk 1's layers are refused (no destination). Once "late" is
    registered, chunk 2 arrives whole, every layer. The request must fail (block 10 was never
    written), not finish: finishing would hand vLLM a block of garbage as computed KV. The
    rank remembers why, for a registration that comes after the refusal (``aborted``)."""
    source = buffers(PREFILL.total_bytes)
    fill_random(source, 7)
    dest = buffers(DECODE.total_bytes)
    decode = DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=DECODE, destinations={"late": ((10, 11), None)},
        registered_after={"late": 1.5}, destination_wait_s=0.3))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = publisher_for(engines[0], source, gates=gates, tracker=tracker)
    try:
        started = time.monotonic()
        first = run_prefill_rank(publisher, decode.endpoint, [Chunk("late", 0, (1,), (1,))],
                                 PREFILL.layers, 4000, gates=gates, tracker=tracker,
                                 final=False)
        assert first.slot_errors  # chunk 1's READs failed
        reasons, _ = decode.aborted(["late"])
        assert "refused before its destination was registered" in str(reasons["late"])
        time.sleep(max(0.0, 1.7 - (time.monotonic() - started)))
        run_prefill_rank(publisher, decode.endpoint, [Chunk("late", 1, (2,), (2,))],
                         PREFILL.layers, 4100, gates=gates, tracker=tracker)
        finished, failed, _, _, _ = decode.wait_terminal(["late"])
        assert "late" not in finished
        assert "refused before its destination was registered" in failed["late"]
    finally:
        publisher.close()
        engines[0].unregister(source.ptr)
        decode.stop()


def test_a_request_the_prefill_gives_up_fails_on_decode_at_once(engines, buffers) -> None:
    """Prefill publishes two of four layers of "given-up", then gives it up (say its store
    load failed) and tells decode (SEND_ABORTED): decode fails that pull now instead of
    waiting for the missing layers, and remembers "early" (aborted before its destination
    appeared) for whoever registers it. The connection keeps serving: "kept" arrives whole."""
    source = buffers(PREFILL.total_bytes)
    fill_random(source, 5)
    dest = buffers(DECODE.total_bytes)
    src = {"given-up": (1, 2), "kept": (3, 4)}
    decode = DecodeProcess(DecodeSpec(
        shm_name=dest.name, geometry=DECODE,
        destinations={"given-up": ((10, 11), None), "kept": ((12, 13), None),
                      "early": ((14,), None)},
        registered_after={"early": 60.0}))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = publisher_for(engines[0], source, gates=gates, tracker=tracker)
    try:
        partial = run_prefill_rank(publisher, decode.endpoint,
                                   [Chunk("given-up", 0, src["given-up"], src["given-up"])],
                                   2, 3000, gates=gates, tracker=tracker, final=False)
        assert partial.slot_errors == []
        assert publisher.abort(decode.endpoint, ["given-up", "early"],
                               "store load of layer 2 failed")
        assert not publisher.abort("tcp://127.0.0.1:1", ["given-up"], "no session there")
        _, failed, _, rejected, _ = decode.wait_terminal(["given-up"])
        assert "gave the request up: store load of layer 2 failed" in failed["given-up"]
        assert rejected == 0
        reasons, count = decode.aborted(["given-up", "early", "kept"])
        assert count == 2 and reasons["kept"] is None
        assert reasons["early"] is not None and "store load of layer 2" in reasons["early"]
        outcome = run_prefill_rank(publisher, decode.endpoint,
                                   [Chunk("kept", 0, src["kept"], src["kept"])],
                                   PREFILL.layers, 3100, gates=gates, tracker=tracker)
        assert outcome.failed == {} and outcome.finished == {"kept"}
        finished, failed, _, _, _ = decode.wait_terminal(["kept"])
        assert "kept" in finished and set(failed) == {"given-up"}
    finally:
        publisher.close()
        engines[0].unregister(source.ptr)
        decode.stop()
    for layer in range(PREFILL.layers):
        for src_id, dst_id in zip(src["kept"], (12, 13), strict=True):
            assert block(dest, DECODE, layer, "main", 0, dst_id) == \
                block(source, PREFILL, layer, "main", 0, src_id)


def test_an_abort_of_many_long_ids_is_split_under_the_decodes_frame_limit(engines,
                                                                          buffers) -> None:
    """5000 ids of 500 characters (2.5 MB) to a decode whose frame limit is 1 MiB: the abort
    goes out in several frames, every id arrives, and the connection stays up (ZMQ would
    have cut it over a frame past the limit)."""
    source = buffers(PREFILL.total_bytes)
    dest = buffers(DECODE.total_bytes)
    decode = DecodeProcess(DecodeSpec(shm_name=dest.name, geometry=DECODE, destinations={},
                                      max_frame_bytes=1 << 20))
    gates, tracker = SlotGates(), RequestCompletionTracker()
    publisher = publisher_for(engines[0], source, gates=gates, tracker=tracker)
    ids = [f"{i:05d}-" + "x" * 494 for i in range(5000)]
    try:
        publisher.connect(decode.endpoint)
        assert publisher.abort(decode.endpoint, ids, "bulk give-up")
        deadline = time.monotonic() + 20
        while decode.aborted(ids[-1:])[1] < len(ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        reasons, count = decode.aborted([ids[0], ids[-1]])
        assert count == len(ids) and all(r is not None for r in reasons.values())
        assert decode.closed_connections() == 0
    finally:
        publisher.close()
        engines[0].unregister(source.ptr)
        decode.stop()


def test_four_prefill_ranks_feed_two_decode_ranks_with_split_indexer(engines, buffers) -> None:
    prefill_tp, decode_tp, ratio = 4, 2, 2
    sources = [buffers(PREFILL.total_bytes) for _ in range(prefill_tp)]
    for p_rank, source in enumerate(sources):
        fill_random(source, 100 + p_rank)  # distinct per rank: shows who sent each block
    # (request, first logical block, blocks): rotation by start block, and a 1-block chunk
    # where one member of each group has nothing to send but must still report.
    chunks = {"a": (0, 5), "b": (3, 4), "c": (2, 1)}
    rng = random.Random(11)
    src_ids = {rid: tuple(rng.sample(range(PREFILL.num_blocks), n))
               for rid, (_, n) in chunks.items()}
    idx_src_ids = {rid: tuple(rng.sample(range(PREFILL.num_blocks), n))
                   for rid, (_, n) in chunks.items()}
    dsts = [buffers(DECODE.total_bytes) for _ in range(decode_tp)]
    pool = rng.sample(range(DECODE.num_blocks), sum(start + n for start, n in chunks.values()))
    dst_ids = {}
    for rid, (start, n) in chunks.items():
        dst_ids[rid], pool = tuple(pool[:start + n]), pool[start + n:]
    decodes = [DecodeProcess(DecodeSpec(
        shm_name=dsts[d].name, geometry=DECODE, decode_tp=decode_tp, d_rank=d,
        destinations={rid: (ids, None) for rid, ids in dst_ids.items()}))
        for d in range(decode_tp)]
    publishers: list[PrefillPublisher] = []
    trackers = [RequestCompletionTracker() for _ in range(prefill_tp)]
    try:
        threads = []
        for p_rank in range(prefill_tp):
            gates = SlotGates()
            publisher = publisher_for(engines[p_rank], sources[p_rank], prefill_tp=prefill_tp,
                                      p_rank=p_rank, decode_tp=decode_tp, gates=gates,
                                      tracker=trackers[p_rank])
            publishers.append(publisher)
            rank_chunks = [Chunk(rid, start, src_ids[rid], idx_src_ids[rid])
                           for rid, (start, _) in chunks.items()]
            endpoint = decodes[p_rank // ratio].endpoint
            threads.append(in_thread(
                lambda pub=publisher, ep=endpoint, cs=rank_chunks, g=gates, t=trackers[p_rank]:
                run_prefill_rank(pub, ep, cs, PREFILL.layers, 2000, gates=g, tracker=t)))
        for thread, result in threads:
            thread.join(60)
            assert not thread.is_alive()
            outcome = result[0]
            assert not isinstance(outcome, BaseException), outcome
            assert outcome.slot_errors == [] and outcome.failed == {}
            assert outcome.finished == set(chunks)
        for decode in decodes:
            finished, failed, _, rejected, _ = decode.wait_terminal(list(chunks))
            assert set(finished) == set(chunks) and failed == {} and rejected == 0
    finally:
        for publisher in publishers:
            publisher.close()
        for p_rank, source in enumerate(sources):
            engines[p_rank].unregister(source.ptr)
        for decode in decodes:
            decode.stop()

    for d_rank, dest in enumerate(dsts):
        written: set[tuple[int, str, int, int]] = set()
        group = [d_rank * ratio + m for m in range(ratio)]
        for layer in range(PREFILL.layers):
            for rid, (start, n) in chunks.items():
                owners = {}
                for member, p_rank in enumerate(group):
                    begin, end = indexer_block_range(start, n, ratio, member)
                    owners.update({i: p_rank for i in range(begin, end)})
                assert sorted(owners) == list(range(start, start + n))
                for kind, tensors in KINDS:
                    for tensor in range(len(tensors)):
                        for i in range(start, start + n):
                            sender = group[0] if kind == "main" else owners[i]
                            src = (src_ids if kind == "main" else idx_src_ids)[rid][i - start]
                            dst = dst_ids[rid][i]
                            assert block(dest, DECODE, layer, kind, tensor, dst) == \
                                block(sources[sender], PREFILL, layer, kind, tensor, src), \
                                f"decode {d_rank} {rid} layer {layer} {kind}[{tensor}] block {i}"
                            written.add((layer, kind, tensor, dst))
        check_untouched_blocks_are_zero(dest, written)
