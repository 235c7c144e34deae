"""Decode-side checks and descriptors, without sockets: the rules a READY must pass."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_core.errors import ConfigError
from kvo_core.tp import MainShare, indexer_block_range
from kvo_transport.protocol import (
    PROTOCOL_VERSION,
    Fence,
    LayerMeta,
    MfMeta,
    ReadReadyBatch,
    ReadyRequest,
    TensorGroup,
)
from kvo_transport.read_plan import (
    DecodeLayout,
    DestinationGroup,
    DestinationLayer,
    ReadRejected,
    RequestDestination,
    check_handshake,
    intended_destination,
    plan_layer_read,
)

SRC_BASE, DST_BASE = 1 << 20, 1 << 30
MAIN, INDEXER = (96, 32), (16,)


def source_layer(num_blocks: int = 16, scale: int = 1, indexer: bool = True,
                 int8_scale: bool = False) -> LayerMeta:
    """Two main tensors and an indexer, each ``num_blocks`` prefill blocks, one after another."""
    main = TensorGroup(base_addrs=(SRC_BASE, SRC_BASE + 100_000),
                       block_bytes=tuple(b * scale for b in MAIN), num_blocks=num_blocks)
    idx = TensorGroup(base_addrs=(SRC_BASE + 200_000,),
                      block_bytes=tuple(b * scale for b in INDEXER), num_blocks=num_blocks)
    sc = TensorGroup(base_addrs=(SRC_BASE + 300_000,), block_bytes=(2 * scale,),
                     num_blocks=num_blocks)
    return LayerMeta(index=0, name="layers.0", main=main, block_size_scale=scale,
                     indexer=idx if indexer else None,
                     indexer_scale=sc if indexer and int8_scale else None)


def dest_layer(num_blocks: int = 40, scale: int = 1, indexer: bool = True,
               int8_scale: bool = False) -> DestinationLayer:
    return DestinationLayer(
        name="layers.0",
        main=DestinationGroup((DST_BASE, DST_BASE + 100_000), MAIN, num_blocks),
        indexer=DestinationGroup((DST_BASE + 200_000,), INDEXER, num_blocks) if indexer else None,
        indexer_scale=(DestinationGroup((DST_BASE + 300_000,), (2,), num_blocks)
                       if indexer and int8_scale else None),
        block_size_scale=scale)


def meta(layers: tuple[LayerMeta, ...], **fields) -> MfMeta:
    values = dict(version=PROTOCOL_VERSION, instance_id="p", engine_session_id="s",
                  backend="mooncake", transfer_protocol="tcp", p_tp_size=1, p_rank=0, member=0,
                  ratio=1, d_rank=0, layers=layers, fence_addr=1 << 20, fence_words=8)
    return MfMeta(**{**values, **fields})


def batch(*requests: ReadyRequest, member: int = 0, ratio: int = 1,
          name: str = "layers.0") -> ReadReadyBatch:
    return ReadReadyBatch(version=PROTOCOL_VERSION, seq=1, layer_index=0, layer_name=name,
                          member=member, ratio=ratio, requests=requests,
                          fences=(Fence(word=0, epoch=0),) if requests else ())


def check(m: MfMeta, layout: DecodeLayout | None = None, **kwargs) -> str | None:
    options = dict(backend="mooncake", transfer_protocol="tcp", decode_tp=1, d_rank=0)
    return check_handshake(m, layout or DecodeLayout([dest_layer()]), **{**options, **kwargs})


# -- handshake ---------------------------------------------------------------------------------

def test_matching_handshake_is_accepted() -> None:
    assert check(meta((source_layer(),))) is None
    assert check(meta((source_layer(scale=2),)), DecodeLayout([dest_layer(scale=2)])) is None
    assert check(meta((source_layer(),), p_tp_size=4, p_rank=3, member=1, ratio=2, d_rank=1),
                 decode_tp=2, d_rank=1) is None


@pytest.mark.parametrize(("m", "layout", "kwargs", "reason"), [
    (meta((source_layer(),), backend="memfabric", transfer_protocol="sdma"), None, {},
     "prefill uses memfabric/sdma, decode uses mooncake/tcp"),
    (meta((source_layer(),), transfer_protocol="rdma"), None, {}, "transfer backend mismatch"),
    (meta((source_layer(),), p_tp_size=3, p_rank=0, d_rank=0), None, {"decode_tp": 2},
     "incompatible tensor parallelism"),
    (meta((source_layer(),), p_tp_size=2, p_rank=1, d_rank=1), None, {"decode_tp": 2},
     "feeds decode rank 1 of 2, but this is decode rank 0"),
    (meta((source_layer(),), p_tp_size=2, p_rank=1, member=0, ratio=1), None, {},
     "claims member 0 of ratio 1; expected member 1 of ratio 2"),
    (meta((source_layer(), LayerMeta(index=1, name="layers.1", main=source_layer().main))),
     None, {},
     "prefill has 2 cache layers, decode has 1"),
    (meta((LayerMeta(index=0, name="layers.9", main=source_layer().main),)), None, {},
     "name mismatch"),
    (meta((source_layer(scale=2),)), None, {}, "block-size scale 2 but decode expects 1"),
    (meta((source_layer(indexer=False),)), None, {}, "prefill has no indexer cache but decode has"),
    (meta((source_layer(),)), DecodeLayout([dest_layer(indexer=False)]), {},
     "prefill has indexer cache but decode has no"),
    (meta((source_layer(int8_scale=True),)), None, {},
     "prefill has int8 indexer scale cache but decode has no"),
    (meta((LayerMeta(index=0, name="layers.0", main=TensorGroup((SRC_BASE,), (96,), 16),
                     indexer=source_layer().indexer),)), None, {},
     "main tensor count mismatch: prefill 1, decode 2"),
    (meta((LayerMeta(index=0, name="layers.0", main=TensorGroup((1, 2), (96, 48), 16),
                     indexer=source_layer().indexer),)), None, {},
     "main tensor 1: prefill block of 48 bytes does not match 1 decode block(s) of 32 bytes"),
])
def test_handshake_mismatches_are_rejected_with_a_reason(m, layout, kwargs, reason) -> None:
    got = check(m, layout, **kwargs)
    assert got is not None and reason in got


def test_a_labelled_group_names_what_each_side_holds() -> None:
    """The decode may label its blocks (kvo-vllm: the indexer key layout, bf16 or C8)."""
    def label(nbytes: int) -> str:
        return {16: "bf16 keys", 8: "C8 keys"}.get(nbytes, "unknown")

    dest = dest_layer()
    labelled = DestinationLayer(
        name=dest.name, main=dest.main, block_size_scale=1,
        indexer=DestinationGroup((DST_BASE + 200_000,), INDEXER, 40, label=label))
    c8 = LayerMeta(index=0, name="layers.0", main=source_layer().main,
                   indexer=TensorGroup((SRC_BASE + 200_000,), (8,), 16))
    got = check(meta((c8,)), DecodeLayout([labelled]))
    assert got is not None and got.endswith(
        "indexer tensor 0: prefill block of 8 bytes does not match 1 decode block(s) of 16 "
        "bytes (prefill: C8 keys; decode: bf16 keys)")
    assert check(meta((source_layer(),)), DecodeLayout([labelled])) is None


# -- READY validation --------------------------------------------------------------------------

def request(rid: str = "r", start: int = 0, main: tuple[int, ...] = (0, 1),
            indexer: tuple[int, ...] | None = None, indexer_start: int | None = None,
            num_blocks: int | None = None) -> ReadyRequest:
    return ReadyRequest(request_id=rid, main_start_block=start,
                        num_blocks=len(main) if num_blocks is None else num_blocks,
                        main_block_ids=main, indexer_start_block=start if indexer_start is None
                        else indexer_start,
                        indexer_block_ids=main if indexer is None else indexer)


def destinations(**table: tuple[int, ...]):
    return lambda rid: RequestDestination(table[rid]) if rid in table else None


@pytest.mark.parametrize(("ready", "table", "source", "reason"), [
    (batch(request("x")), {}, source_layer(), "request 'x' has no destination"),
    (batch(request(main=(0, 1, 2))), {"r": (5, 6)}, source_layer(),
     "need decode logical blocks [0, 3) but the destination has 2"),
    (batch(request(start=2)), {"r": (5, 6, 7)}, source_layer(),
     "need decode logical blocks [2, 4) but the destination has 3"),
    (batch(request(main=(0, 16))), {"r": (5, 6)}, source_layer(),
     "main source block 16 is outside the prefill region of 16 blocks"),
    (batch(request(indexer=(0, 99))), {"r": (5, 6)}, source_layer(),
     "indexer source block 99 is outside"),
    (batch(request()), {"r": (5, 40)}, source_layer(),
     "main destination block 40 is outside the decode region of 40 blocks"),
    (batch(request(num_blocks=3)), {"r": (5, 6, 7)}, source_layer(),
     "member 0 must send all 3 main blocks of the chunk, sent 2"),
    (batch(request(), member=1, ratio=2), {"r": (5, 6)}, source_layer(),
     "member 1 sent 2 main blocks; only member 0 moves main KV"),
    (batch(request(indexer=(0,))), {"r": (5, 6)}, source_layer(),
     "indexer slice [0, 1) is not member 0's share [0, 2)"),
    (batch(request(main=(), indexer=(3,), num_blocks=2, indexer_start=0), member=1, ratio=2),
     {"r": (5, 6)}, source_layer(), "is not member 1's share [1, 2)"),
    (batch(request()), {"r": (5, 6)}, source_layer(indexer=False),
     "sent 2 indexer blocks but layer 0 has no indexer cache"),
    (batch(request(), name="layers.7"), {"r": (5, 6)}, source_layer(),
     "the READY names 'layers.7'"),
])
def test_bad_readies_are_rejected_before_reading(ready, table, source, reason) -> None:
    dest = dest_layer(indexer=source.indexer is not None)
    with pytest.raises(ReadRejected, match=_escape(reason)):
        plan_layer_read(source, dest, ready, destinations(**table))


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_contiguous_runs_coalesce_into_one_descriptor_per_tensor() -> None:
    plan = plan_layer_read(source_layer(), dest_layer(), batch(request(main=(3, 4, 5, 6))),
                           destinations(r=(10, 11, 12, 13)))
    assert plan.lengths == [4 * 96, 4 * 32, 4 * 16]
    assert plan.local_addrs[0] == DST_BASE + 10 * 96
    assert plan.remote_addrs[0] == SRC_BASE + 3 * 96
    assert plan.destinations == {"r": ((10, 11, 12, 13), (10, 11, 12, 13))}


def test_runs_contiguous_on_one_side_only_do_not_coalesce() -> None:
    plan = plan_layer_read(source_layer(indexer=False), dest_layer(indexer=False),
                           batch(request(main=(3, 9), indexer=())), destinations(r=(10, 11)))
    assert plan.lengths == [96, 96, 32, 32]
    plan = plan_layer_read(source_layer(indexer=False), dest_layer(indexer=False),
                           batch(request(main=(3, 4), indexer=())), destinations(r=(11, 10)))
    assert plan.lengths == [96, 96, 32, 32]


def test_empty_member_share_and_empty_batch_plan_nothing() -> None:
    assert plan_layer_read(source_layer(), dest_layer(), batch(), destinations()).lengths == []
    lonely = request(main=(), indexer=(), num_blocks=1, indexer_start=1)
    plan = plan_layer_read(source_layer(), dest_layer(), batch(lonely, member=1, ratio=2),
                           destinations(r=(5,)))
    assert plan.lengths == [] and plan.destinations == {"r": ((), ())}


def test_intended_destination_is_clipped_to_what_exists() -> None:
    dest = dest_layer(scale=2)
    ready = request(start=1, main=(0, 1, 2))
    target = RequestDestination((9, 8, 7, 6, 5), indexer_block_ids=(1, 2, 3))
    assert intended_destination(dest, ready, target) == ((7, 6, 5), (3,))
    assert intended_destination(dest, ready, None) == ((), ())


def test_blocks_below_first_block_are_decodes_own_and_never_written() -> None:
    """A prefill that did not know decode's prefix sends from block 0: decode reads only the
    blocks from its ``first_block`` on (its -1 placeholders below are never looked at)."""
    skipped = RequestDestination((-1, -1, 12, 13), first_block=2)
    plan = plan_layer_read(source_layer(indexer=False), dest_layer(indexer=False),
                           batch(request(main=(3, 4, 5, 6), indexer=())), lambda rid: skipped)
    assert plan.lengths == [2 * 96, 2 * 32]
    assert plan.local_addrs[0] == DST_BASE + 12 * 96
    assert plan.remote_addrs[0] == SRC_BASE + 5 * 96
    assert plan.destinations == {"r": ((12, 13), ())}
    whole_prefix = plan_layer_read(source_layer(indexer=False), dest_layer(indexer=False),
                                   batch(request(main=(3, 4), indexer=())), lambda rid: skipped)
    assert whole_prefix.lengths == [] and whole_prefix.destinations == {"r": ((), ())}
    assert intended_destination(dest_layer(), request(main=(3, 4, 5)), skipped) == \
        ((12,), (12,))


def test_a_declined_request_reads_nothing_but_its_source_is_still_checked() -> None:
    nothing = RequestDestination.nothing()
    plan = plan_layer_read(source_layer(), dest_layer(), batch(request(main=(3, 4))),
                           lambda rid: nothing)
    assert plan.lengths == [] and plan.destinations == {"r": ((), ())}
    with pytest.raises(ReadRejected, match="main source block 16 is outside"):
        plan_layer_read(source_layer(), dest_layer(), batch(request(main=(0, 16))),
                        lambda rid: nothing)


def test_destination_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="2 base_addrs but 1 block_bytes"):
        DestinationGroup((1, 2), (3,), 4)
    with pytest.raises(ConfigError, match="positive integers"):
        DestinationGroup((1,), (0,), 4)
    with pytest.raises(ConfigError, match="needs an indexer"):
        DestinationLayer("l", DestinationGroup((1,), (3,), 4),
                         indexer_scale=DestinationGroup((1,), (3,), 4))
    with pytest.raises(ConfigError, match="block_size_scale"):
        DestinationLayer("l", DestinationGroup((1,), (3,), 4), block_size_scale=0)
    with pytest.raises(ConfigError, match="at least one layer"):
        DecodeLayout([])


# -- descriptors move exactly the right bytes (simulated memory) --------------------------------

@st.composite
def read_cases(draw: st.DrawFn):
    scale = draw(st.integers(1, 3))
    ratio = draw(st.integers(1, 3))
    member = draw(st.integers(0, ratio - 1))
    int8_scale = draw(st.booleans())
    src_blocks, dst_blocks = 12, 12 * scale + 4
    requests, table = [], {}
    free = list(range(dst_blocks))
    for i in range(draw(st.integers(0, 3))):
        n = draw(st.integers(0, 4))
        start = draw(st.integers(0, 2))
        logical = (start + n) * scale
        if logical > len(free):
            break
        if draw(st.booleans()):  # runs of consecutive blocks (coalescing opportunities)
            dst = tuple(free[:logical])
        else:
            dst = draw(st.permutations(free).map(lambda p, k=logical: tuple(p[:k])))
        free = [b for b in free if b not in dst]
        main_src = tuple(draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n)
                              | st.integers(0, src_blocks - n).map(
                                  lambda a, n=n: tuple(range(a, a + n)))))
        idx_src = tuple(draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n)))
        begin, end = indexer_block_range(start, n, ratio, member)
        requests.append(ReadyRequest(
            request_id=f"r{i}", main_start_block=start, num_blocks=n,
            main_block_ids=main_src if member == 0 else (), indexer_start_block=begin,
            indexer_block_ids=idx_src[begin - start:end - start]))
        table[f"r{i}"] = dst
    return scale, ratio, member, int8_scale, src_blocks, dst_blocks, requests, table


SOURCE_MEMORY = bytes(range(251)) * 1600  # 401,600 bytes, no period that aligns with blocks


@settings(max_examples=100, deadline=None)
@given(read_cases())
def test_descriptors_copy_exactly_the_expected_blocks(case) -> None:
    scale, ratio, member, int8_scale, src_blocks, dst_blocks, requests, table = case
    source = source_layer(src_blocks, scale, int8_scale=int8_scale)
    dest = dest_layer(dst_blocks, scale, int8_scale=int8_scale)
    plan = plan_layer_read(source, dest, batch(*requests, member=member, ratio=ratio),
                           destinations(**table))
    src_mem = SOURCE_MEMORY
    got = bytearray(len(src_mem))
    for local, remote, length in zip(plan.local_addrs, plan.remote_addrs, plan.lengths,
                                     strict=True):
        got[local - DST_BASE:local - DST_BASE + length] = \
            src_mem[remote - SRC_BASE:remote - SRC_BASE + length]
    want = bytearray(len(src_mem))
    groups = [("main", source.main, dest.main)]
    groups += [("indexer", source.indexer, dest.indexer)]
    if int8_scale:
        groups += [("scale", source.indexer_scale, dest.indexer_scale)]
    for r in requests:
        dst = table[r.request_id]
        for kind, src_group, dst_group in groups:
            if kind == "main":
                ids, first = r.main_block_ids, r.main_start_block
            else:
                ids, first = r.indexer_block_ids, r.indexer_start_block
            for t in range(src_group.tensor_count):
                size = dst_group.block_bytes[t]
                for j, block in enumerate(ids):  # naive: one decode block at a time
                    for k in range(scale):
                        d = dst[(first + j) * scale + k]
                        at = dst_group.base_addrs[t] - DST_BASE + d * size
                        src_at = (src_group.base_addrs[t] - SRC_BASE
                                  + block * src_group.block_bytes[t] + k * size)
                        want[at:at + size] = src_mem[src_at:src_at + size]
    assert got == want


# -- a main destination shared by decode TP ranks (one host pool per DP rank) ---------------------

def test_ranks_sharing_a_main_destination_read_disjoint_main_blocks() -> None:
    """Decode TP ranks 0 and 1 share one host pool: of a chunk's four main blocks each reads
    two (the union is the chunk, nothing twice), each reads the whole indexer (its own cache)."""
    ready = request(start=4, main=(3, 4, 5, 6))
    plans = [plan_layer_read(source_layer(), dest_layer(), batch(ready),
                             destinations(r=(0, 0, 0, 0, 20, 21, 22, 23)), MainShare(2, rank))
             for rank in (0, 1)]
    assert [plan.destinations["r"] for plan in plans] == [
        ((20, 21), (20, 21, 22, 23)), ((22, 23), (20, 21, 22, 23))]
    main_bytes = [sum(length for local, length in zip(plan.local_addrs, plan.lengths,
                                                      strict=True)
                      if local < DST_BASE + 200_000) for plan in plans]
    assert main_bytes == [2 * sum(MAIN), 2 * sum(MAIN)]
    assert plans[0].remote_addrs[0] == SRC_BASE + 3 * 96
    assert plans[1].remote_addrs[0] == SRC_BASE + 5 * 96
    assert plans[1].local_addrs[0] == DST_BASE + 22 * 96


def test_a_one_block_chunk_is_read_by_one_sharing_rank_only() -> None:
    owners = [rank for rank in (0, 1)
              if plan_layer_read(source_layer(indexer=False), dest_layer(indexer=False),
                                 batch(request(start=3, main=(7,), indexer=())),
                                 destinations(r=(0, 0, 0, 9)), MainShare(2, rank)).lengths]
    assert owners == [1]  # block 3 of the prompt: rank 3 % 2


def test_a_sharing_rank_still_checks_main_sources_it_does_not_read() -> None:
    with pytest.raises(ReadRejected, match="main source block 16 is outside"):
        plan_layer_read(source_layer(), dest_layer(), batch(request(main=(0, 16))),
                        destinations(r=(1, 2)), MainShare(2, 0))
