"""Wire protocol: every message round-trips; anything else is a ProtocolError, never a crash."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_transport.errors import ProtocolError
from kvo_transport.protocol import (
    MAX_BLOCK_IDS_PER_REQUEST,
    MAX_FENCE_WORDS,
    MAX_LAYERS,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_REQUESTS_PER_BATCH,
    MAX_TENSORS_PER_GROUP,
    PROTOCOL_VERSION,
    Fence,
    FrameDecoder,
    HandshakeAnswer,
    LayerMeta,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadyRequest,
    SendAborted,
    TensorGroup,
    clip_reason,
    decode,
    encode,
)

V = PROTOCOL_VERSION
SETTINGS = settings(max_examples=75, deadline=None)

ids = st.text(min_size=1, max_size=40)
names = st.text(max_size=40)
counts = st.integers(0, 2**40)
block_ids = st.lists(st.integers(0, 2**40), max_size=20).map(tuple)


@st.composite
def tensor_groups(draw: st.DrawFn) -> TensorGroup:
    n = draw(st.integers(1, 4))
    return TensorGroup(base_addrs=tuple(draw(st.lists(st.integers(1, 2**62), min_size=n,
                                                      max_size=n))),
                       block_bytes=tuple(draw(st.lists(st.integers(1, 2**30), min_size=n,
                                                       max_size=n))),
                       num_blocks=draw(counts))


@st.composite
def layer_metas(draw: st.DrawFn, index: int) -> LayerMeta:
    indexer = draw(st.none() | tensor_groups())
    scale = None
    if indexer is not None and draw(st.booleans()):
        group = draw(tensor_groups())
        scale = TensorGroup(group.base_addrs, group.block_bytes, indexer.num_blocks)
    return LayerMeta(index=index, name=draw(names), main=draw(tensor_groups()),
                     block_size_scale=draw(st.integers(1, 8)), indexer=indexer,
                     indexer_scale=scale)


@st.composite
def mf_metas(draw: st.DrawFn) -> MfMeta:
    ratio = draw(st.integers(1, 4))
    p_tp = ratio * draw(st.integers(1, 4))
    p_rank = draw(st.integers(0, p_tp - 1))
    layers = tuple(draw(layer_metas(i)) for i in range(draw(st.integers(1, 5))))
    return MfMeta(version=V, instance_id=draw(ids), engine_session_id=draw(ids),
                  backend=draw(names), transfer_protocol=draw(names), p_tp_size=p_tp,
                  p_rank=p_rank, member=p_rank % ratio, ratio=ratio, d_rank=p_rank // ratio,
                  layers=layers, fence_addr=draw(st.integers(1, 1 << 62)),
                  fence_words=draw(st.integers(1, 1 << 20)))


@st.composite
def ready_batches(draw: st.DrawFn) -> ReadReadyBatch:
    request_ids = draw(st.lists(ids, max_size=6, unique=True))
    requests = tuple(ReadyRequest(request_id=r, main_start_block=draw(counts),
                                  num_blocks=draw(counts), main_block_ids=draw(block_ids),
                                  indexer_start_block=draw(counts),
                                  indexer_block_ids=draw(block_ids)) for r in request_ids)
    ratio = draw(st.integers(1, 8))
    last = tuple(r for r in request_ids if draw(st.booleans()))
    fences = tuple(Fence(word=draw(st.integers(0, 1 << 20)), epoch=draw(counts))
                   for _ in range(len(requests) + 1))
    return ReadReadyBatch(version=V, seq=draw(counts), layer_index=draw(st.integers(0, 1023)),
                          layer_name=draw(names), member=draw(st.integers(0, ratio - 1)),
                          ratio=ratio, requests=requests, last_layer_request_ids=last,
                          fences=fences)


messages = st.one_of(
    mf_metas(),
    st.builds(HandshakeAnswer, version=st.just(V), accepted=st.booleans(), reason=names,
              decode_session_id=names),
    ready_batches(),
    st.builds(ReadDone, version=st.just(V), seq=counts, layer_index=st.integers(0, 1023),
              bytes_read=counts),
    st.builds(ReadFailed, version=st.just(V), seq=counts, layer_index=st.integers(0, 1023),
              reason=names, needs_handshake=st.booleans()),
    st.builds(SendAborted, version=st.just(V),
              request_ids=st.lists(ids, min_size=1, max_size=6).map(tuple), reason=names),
)


@SETTINGS
@given(messages)
def test_every_message_round_trips(message) -> None:
    assert decode(encode(message)) == message


@SETTINGS
@given(st.binary(max_size=2048))
def test_random_bytes_never_crash_the_decoder(frame: bytes) -> None:
    try:
        decode(frame)
    except ProtocolError:
        pass


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=10) | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["type", "version", "seq", "layer_index", "requests",
                                        "layers", "reason", "accepted", "member", "ratio"]),
                       msgpack_values, max_size=8),
       st.sampled_from(["MF_META", "READ_READY_BATCH", "READ_DONE", "READ_FAILED",
                        "HANDSHAKE_ANSWER", "SEND_ABORTED", "OTHER"]))
def test_random_maps_decode_only_into_their_own_type(fields: dict, tag: str) -> None:
    fields = {**fields, "type": tag, "version": V}
    try:
        message = decode(msgspec.msgpack.encode(fields))
    except ProtocolError:
        return
    assert TAGS[type(message)] == tag  # e.g. {"accepted": true} is a valid HANDSHAKE_ANSWER
    assert encode(message) and decode(encode(message)) == message


TAGS = {MfMeta: "MF_META", HandshakeAnswer: "HANDSHAKE_ANSWER", ReadReadyBatch: "READ_READY_BATCH",
        ReadDone: "READ_DONE", ReadFailed: "READ_FAILED"}


@SETTINGS
@given(messages, st.data())
def test_corrupted_frames_decode_or_raise_protocol_error(message, data) -> None:
    frame = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        decode(bytes(frame[:cut]))
    except ProtocolError:
        pass


@SETTINGS
@given(messages, st.integers(0, 2**62).filter(lambda v: v != V))
def test_unknown_version_is_rejected_naming_both_versions(message, version: int) -> None:
    frame = encode(msgspec.structs.replace(message, version=version))
    with pytest.raises(ProtocolError, match=f"version {version}; this side speaks {V}"):
        decode(frame)


def test_frame_over_the_limit_is_refused_before_parsing() -> None:
    decoder = FrameDecoder(max_frame_bytes=1000)
    frame = encode(ReadFailed(version=V, seq=1, layer_index=0, reason="x" * 2000))
    with pytest.raises(ProtocolError, match=r"frame of \d+ bytes exceeds the limit of 1000"):
        decoder.decode(frame)
    assert decode(frame).reason == "x" * 2000
    with pytest.raises(ValueError, match="max_frame_bytes"):
        FrameDecoder(max_frame_bytes=0)


def _raw(**fields) -> bytes:
    return msgspec.msgpack.encode({"version": V, **fields})


def _batch(**fields) -> dict:
    return {"type": "READ_READY_BATCH", "seq": 0, "layer_index": 0, "layer_name": "l",
            "member": 0, "ratio": 1, **fields}


def _request(rid: str = "r", **fields) -> dict:
    return {"request_id": rid, "main_start_block": 0, "num_blocks": 0, **fields}


def _group(n: int = 1) -> dict:
    return {"base_addrs": [4096] * n, "block_bytes": [64] * n, "num_blocks": 4}


def _meta(**fields) -> dict:
    return {"type": "MF_META", "instance_id": "i", "engine_session_id": "s", "backend": "b",
            "transfer_protocol": "t", "p_tp_size": 1, "p_rank": 0, "member": 0, "ratio": 1,
            "d_rank": 0, "layers": [{"index": 0, "name": "l", "main": _group()}],
            "fence_addr": 4096, "fence_words": 8, **fields}


BAD_FRAMES = [
    (_raw(**_batch(requests=[_request(str(i)) for i in range(MAX_REQUESTS_PER_BATCH + 1)])),
     f"length <= {MAX_REQUESTS_PER_BATCH}"),
    (_raw(**_batch(requests=[_request(main_block_ids=[0] * (MAX_BLOCK_IDS_PER_REQUEST + 1))])),
     f"length <= {MAX_BLOCK_IDS_PER_REQUEST}"),
    (_raw(**_meta(layers=[{"index": i, "name": "l", "main": _group()}
                          for i in range(MAX_LAYERS + 1)])), f"length <= {MAX_LAYERS}"),
    (_raw(**_meta(layers=[{"index": 0, "name": "l", "main": _group(MAX_TENSORS_PER_GROUP + 1)}])),
     f"length <= {MAX_TENSORS_PER_GROUP}"),
    (_raw(**_batch(layer_name="n" * (MAX_NAME_CHARS + 1))), f"length <= {MAX_NAME_CHARS}"),
    (_raw(type="READ_FAILED", seq=0, layer_index=0, reason="r" * (MAX_REASON_CHARS + 1)),
     f"length <= {MAX_REASON_CHARS}"),
    (_raw(**_batch(requests=[_request(main_block_ids=[-1])])), ">= 0"),
    (_raw(**_batch(layer_index=MAX_LAYERS)), f"<= {MAX_LAYERS - 1}"),
    (_raw(**_batch(extra=1)), "unknown field `extra`"),
    (_raw(**_batch(requests=[_request("a"), _request("a")])), "duplicate request ids"),
    (_raw(**_batch(requests=[_request("a")], last_layer_request_ids=["b"])),
     "not requests of this batch"),
    (_raw(**_batch(member=2, ratio=2)), "member 2 is not below ratio 2"),
    (_raw(**_batch(requests=[_request("a")])), "carries no fence"),
    (_raw(**_batch(requests=[_request("a")], fences=[[MAX_FENCE_WORDS, 0]])),
     f"<= {MAX_FENCE_WORDS - 1}"),
    (_raw(**_meta(fence_words=0)), ">= 1"),
    (_raw(**{k: v for k, v in _meta().items() if k != "fence_addr"}),
     "missing required field `fence_addr`"),
    (_raw(**_batch(seq="1")), "Expected `int`, got `str`"),
    (_raw(**_meta(p_rank=1)), "p_rank 1 is not below p_tp_size 1"),
    (_raw(**_meta(layers=[{"index": 1, "name": "l", "main": _group()}])), "layer indices"),
    (_raw(**_meta(layers=[{"index": 0, "name": "l", "main": {
        "base_addrs": [4096, 8192], "block_bytes": [64], "num_blocks": 1}}])),
     "2 base_addrs but 1 block_bytes"),
    (_raw(**_meta(layers=[{"index": 0, "name": "l", "main": _group(),
                           "indexer_scale": _group()}])), "int8 indexer scale needs an indexer"),
    (_raw(**_meta(layers=[{"index": 0, "name": "l", "main": {**_group(), "base_addrs": [0]}}])),
     ">= 1"),
    (_raw(type="READ_DONE", seq=0), "missing required field `layer_index`"),
    (_raw(type="SEND_ABORTED", request_ids=[], reason="r"), "length >= 1"),
    (_raw(type="SEND_ABORTED", request_ids=[""], reason="r"), "length >= 1"),
    (_raw(type="SEND_ABORTED", request_ids=["r"] * (MAX_REQUESTS_PER_BATCH + 1), reason="r"),
     f"length <= {MAX_REQUESTS_PER_BATCH}"),
    (_raw(type="NOPE"), "Invalid value 'NOPE'"),
    (msgspec.msgpack.encode([1, 2, 3]), "not a control-plane message"),
    (b"\xc1", "not a control-plane message"),
    (b"", "not a control-plane message"),
]


@pytest.mark.parametrize(("frame", "reason"), BAD_FRAMES, ids=[r for _, r in BAD_FRAMES])
def test_limits_and_schema_rules_are_enforced(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=_escape(reason)):
        decode(frame)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_encode_refuses_anything_but_a_message() -> None:
    with pytest.raises(TypeError, match="not a control-plane message: dict"):
        encode({"type": "READ_DONE"})  # type: ignore[arg-type]


def test_long_reasons_are_clipped_to_what_the_schema_accepts() -> None:
    reason = clip_reason("z" * (MAX_REASON_CHARS * 2))
    assert len(reason) == MAX_REASON_CHARS and reason.endswith("...")
    assert clip_reason("short") == "short"
    frame = encode(ReadFailed(version=V, seq=0, layer_index=0, reason=reason))
    assert decode(frame).reason == reason
