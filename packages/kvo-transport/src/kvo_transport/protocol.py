"""Wire messages of the prefill <-> decode control plane (docs/design.md section 9).

Every message is a msgspec Struct encoded as a msgpack map with a ``type`` tag and a protocol
``version``. Frames come from the network, so decoding is defensive: the frame size is checked
before parsing, every list and string has a maximum length that msgspec enforces while it
decodes (an oversized list is refused before its elements are allocated), unknown fields are
refused, and consistency rules run in ``__post_init__``. Anything wrong raises ProtocolError with
a reason; the receiver logs it and keeps serving. Never pickle: a peer must not be able to run
code in our process.

The limits below are the schema's hard maxima; the frame limit is configurable per decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from kvo_transport.errors import ProtocolError

PROTOCOL_VERSION: Final = 2
"""Bumped on any incompatible change; a peer speaking another version is refused.
2: MF_META announces the prefill's epoch words, READY carries fences (kvo_transport.fence)."""

MAX_FRAME_BYTES: Final = 64 << 20
MAX_LAYERS: Final = 1024
MAX_REQUESTS_PER_BATCH: Final = 4096
MAX_BLOCK_IDS_PER_REQUEST: Final = 1 << 20
MAX_TENSORS_PER_GROUP: Final = 16
MAX_BLOCK_SIZE_SCALE: Final = 1024
MAX_TP_SIZE: Final = 4096
MAX_NAME_CHARS: Final = 256
MAX_ID_CHARS: Final = 512
MAX_REASON_CHARS: Final = 4096
MAX_FENCE_WORDS: Final = 1 << 24
MAX_FENCES_PER_BATCH: Final = MAX_REQUESTS_PER_BATCH + 1

_INT64_MAX = (1 << 63) - 1  # msgspec bounds must fit an int64; addresses do (user space)
NO_SEQ: Final = _INT64_MAX
"""The ``seq`` of an answer about the whole session (a reset), not one READY: no publisher
numbers a READY this high, so it matches nothing in flight."""

Address = Annotated[int, Meta(gt=0, le=_INT64_MAX)]
ByteCount = Annotated[int, Meta(gt=0, le=_INT64_MAX)]
BlockId = Annotated[int, Meta(ge=0, le=_INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=_INT64_MAX)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Identifier = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Reason = Annotated[str, Meta(max_length=MAX_REASON_CHARS)]
TpSize = Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)]
TpIndex = Annotated[int, Meta(ge=0, lt=MAX_TP_SIZE)]
LayerIndex = Annotated[int, Meta(ge=0, lt=MAX_LAYERS)]
Version = Annotated[int, Meta(ge=0, le=_INT64_MAX)]
BlockIds = Annotated[tuple[BlockId, ...], Meta(max_length=MAX_BLOCK_IDS_PER_REQUEST)]


class TensorGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Tensors of one kind in one layer (main KV, indexer or int8 scale) that share block ids.

    Tensor ``t`` holds ``num_blocks`` blocks of ``block_bytes[t]`` bytes each from
    ``base_addrs[t]`` (vLLM-Ascend's MLA cache, e.g., is two tensors of different widths).
    """

    base_addrs: Annotated[tuple[Address, ...], Meta(min_length=1, max_length=MAX_TENSORS_PER_GROUP)]
    block_bytes: Annotated[tuple[ByteCount, ...],
                           Meta(min_length=1, max_length=MAX_TENSORS_PER_GROUP)]
    num_blocks: Count

    def __post_init__(self) -> None:
        if len(self.base_addrs) != len(self.block_bytes):
            raise ValueError(f"{len(self.base_addrs)} base_addrs but {len(self.block_bytes)} "
                             f"block_bytes; one block size per tensor is required")

    @property
    def tensor_count(self) -> int:
        return len(self.base_addrs)

    def region_bytes(self, tensor: int) -> int:
        return self.num_blocks * self.block_bytes[tensor]


class LayerMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cache-bearing layer as the prefill exposes it for remote reads.

    ``block_size_scale``: decode blocks per prefill block (a prefill block is that many decode
    blocks laid end to end); 1 when both sides use the same block size.
    """

    index: LayerIndex
    name: Name
    main: TensorGroup
    block_size_scale: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE_SCALE)] = 1
    indexer: TensorGroup | None = None
    indexer_scale: TensorGroup | None = None

    def __post_init__(self) -> None:
        if self.indexer_scale is not None and self.indexer is None:
            raise ValueError(f"layer {self.index}: an int8 indexer scale needs an indexer")
        if self.indexer_scale is not None and self.indexer is not None \
                and self.indexer_scale.num_blocks != self.indexer.num_blocks:
            raise ValueError(f"layer {self.index}: indexer has {self.indexer.num_blocks} blocks "
                             f"but its scale {self.indexer_scale.num_blocks}")

    @property
    def main_tensor_count(self) -> int:
        return self.main.tensor_count


class MfMeta(msgspec.Struct, tag="MF_META", frozen=True,
                  forbid_unknown_fields=True):
    """P -> D, once per connection: who the prefill rank is and where its layers live."""

    version: Version
    instance_id: Identifier
    """The prefill engine instance; its TP ranks share it (they form contribution groups)."""
    engine_session_id: Identifier
    """What the decode passes to its transfer engine to read this rank's memory."""
    backend: Name
    transfer_protocol: Name
    p_tp_size: TpSize
    p_rank: TpIndex
    member: TpIndex
    ratio: TpSize
    d_rank: TpIndex
    layers: Annotated[tuple[LayerMeta, ...], Meta(min_length=1, max_length=MAX_LAYERS)]
    fence_addr: Address
    """Start of the prefill's epoch words (registered with its engine; kvo_transport.fence)."""
    fence_words: Annotated[int, Meta(ge=1, le=MAX_FENCE_WORDS)]

    def __post_init__(self) -> None:
        if self.p_rank >= self.p_tp_size:
            raise ValueError(f"p_rank {self.p_rank} is not below p_tp_size {self.p_tp_size}")
        if self.member >= self.ratio:
            raise ValueError(f"member {self.member} is not below ratio {self.ratio}")
        indices = [layer.index for layer in self.layers]
        if indices != list(range(len(indices))):
            raise ValueError(f"layer indices must be 0..{len(indices) - 1} in order, "
                             f"got {_preview(indices)}")


class HandshakeAnswer(msgspec.Struct, tag="HANDSHAKE_ANSWER", frozen=True,
                  forbid_unknown_fields=True):
    """D -> P: ACK (``accepted``) or a rejection with the reason."""

    version: Version
    accepted: bool
    reason: Reason = ""
    decode_session_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] = ""
    max_frame_bytes: Annotated[int, Meta(ge=1, le=MAX_FRAME_BYTES)] = MAX_FRAME_BYTES
    """The decode's frame limit: ZMQ drops a larger frame by cutting the connection, so the
    prefill refuses to send one (with an error naming both sizes) instead."""


class ReadyRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request's share of a layer: source block ids on the prefill rank.

    The chunk covers the request's logical (prefill) blocks
    ``[main_start_block, main_start_block + num_blocks)``. Member 0 of a contribution group
    sends every main block (``len(main_block_ids) == num_blocks``), other members none. The
    indexer slice ``[indexer_start_block, indexer_start_block + len(indexer_block_ids))`` is
    this member's part of the same range (kvo_core.tp.indexer_block_range).
    """

    request_id: Identifier
    main_start_block: Count
    num_blocks: Count
    main_block_ids: BlockIds = ()
    indexer_start_block: Count = 0
    indexer_block_ids: BlockIds = ()


class Fence(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One epoch word guarding a READY's source, and the epoch it held when the READY was built.

    The decode accepts the read only if the word still holds ``epoch`` after the data read.
    """

    word: Annotated[int, Meta(ge=0, lt=MAX_FENCE_WORDS)]
    epoch: Count


class ReadReadyBatch(msgspec.Struct, tag="READ_READY_BATCH", frozen=True,
                  forbid_unknown_fields=True):
    """P -> D, per layer and decode rank: these blocks may be read now."""

    version: Version
    seq: Count
    """Per-connection sequence number; the answer echoes it so late answers match nothing."""
    layer_index: LayerIndex
    layer_name: Name
    member: TpIndex
    ratio: TpSize
    requests: Annotated[tuple[ReadyRequest, ...], Meta(max_length=MAX_REQUESTS_PER_BATCH)] = ()
    last_layer_request_ids: Annotated[tuple[Identifier, ...],
                                      Meta(max_length=MAX_REQUESTS_PER_BATCH)] = ()
    fences: Annotated[tuple[Fence, ...], Meta(max_length=MAX_FENCES_PER_BATCH)] = ()
    """Every epoch word guarding this batch's source (the slot's, each request's)."""

    def __post_init__(self) -> None:
        if self.member >= self.ratio:
            raise ValueError(f"member {self.member} is not below ratio {self.ratio}")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate request ids in one batch: {_preview(sorted(ids))}")
        unknown = set(self.last_layer_request_ids) - set(ids)
        if unknown:
            raise ValueError(f"last_layer_request_ids {_preview(sorted(unknown))} are not "
                             f"requests of this batch")
        if self.requests and not self.fences:
            raise ValueError("a READY with requests carries no fence: its read could not be "
                             "checked against reuse of the source")


class _ReadyNumber(msgspec.Struct):
    """What identifies a READY, read leniently (other fields skipped unchecked)."""

    type: Annotated[str, Meta(max_length=64)]
    seq: Annotated[int, Meta(ge=0, lt=NO_SEQ)]


class _ReadyLayer(msgspec.Struct):
    layer_index: LayerIndex = 0


class _RequestId(msgspec.Struct):
    request_id: Identifier


class _ReadyRequestIds(msgspec.Struct):
    requests: Annotated[tuple[_RequestId, ...], Meta(max_length=MAX_REQUESTS_PER_BATCH)] = ()


class UnreadableReady(msgspec.Struct, frozen=True):
    """What could be read of a READY that failed to decode: enough to answer it."""

    seq: int
    layer_index: int
    """0 when the frame's own layer index is missing or out of range."""
    request_ids: tuple[str, ...]
    """Empty when the frame's requests cannot be read."""


_ready_number = msgspec.msgpack.Decoder(_ReadyNumber)
_ready_layer = msgspec.msgpack.Decoder(_ReadyLayer)
_ready_request_ids = msgspec.msgpack.Decoder(_ReadyRequestIds)


def unreadable_ready(frame: bytes | bytearray | memoryview) -> UnreadableReady | None:
    """For a frame that did not decode: its READY's sequence number, layer and request ids if
    it is a READY whose ``seq`` can be read (whatever else is wrong with it), else None.

    Lets the decode answer a malformed READY with READ_FAILED instead of leaving the prefill to
    wait for its deadline. The frame has passed the size limit already.
    """
    try:
        number = _ready_number.decode(frame)
    except msgspec.MsgspecError:
        return None
    if number.type != ReadReadyBatch.__struct_config__.tag:
        return None
    try:
        layer = _ready_layer.decode(frame).layer_index
    except msgspec.MsgspecError:
        layer = 0
    try:
        ids = tuple(dict.fromkeys(r.request_id for r in _ready_request_ids.decode(frame).requests))
    except msgspec.MsgspecError:
        ids = ()
    return UnreadableReady(seq=number.seq, layer_index=layer, request_ids=ids)


class ReadDone(msgspec.Struct, tag="READ_DONE", frozen=True,
                  forbid_unknown_fields=True):
    """D -> P: every block of the batch was read; the prefill may reuse the buffer."""

    version: Version
    seq: Count
    layer_index: LayerIndex
    bytes_read: Count = 0


class ReadFailed(msgspec.Struct, tag="READ_FAILED", frozen=True,
                  forbid_unknown_fields=True):
    """D -> P: the batch was not (completely) read; its destination was invalidated."""

    version: Version
    seq: Count
    layer_index: LayerIndex
    reason: Reason
    needs_handshake: bool = False
    """The decode has no session for this connection (it restarted): handshake again."""


class SendAborted(msgspec.Struct, tag="SEND_ABORTED", frozen=True,
                  forbid_unknown_fields=True):
    """P -> D: the prefill gave these requests up (its KV of them is wrong or will not all
    come: a failed store load, the request ended before its prompt was sent). The decode fails
    their pulls now instead of waiting for layers until its deadline. Sent after the READYs
    of the same connection, so it never overtakes one of them."""

    version: Version
    request_ids: Annotated[tuple[Identifier, ...],
                           Meta(min_length=1, max_length=MAX_REQUESTS_PER_BATCH)]
    reason: Reason


Message = MfMeta | HandshakeAnswer | ReadReadyBatch | ReadDone | ReadFailed | SendAborted
MESSAGE_TYPES: Final = (MfMeta, HandshakeAnswer, ReadReadyBatch, ReadDone, ReadFailed,
                        SendAborted)


class _Header(msgspec.Struct):
    """Read first, ignoring everything else, so a peer on another version gets a clear reason."""

    type: Annotated[str, Meta(max_length=64)]
    version: Version


_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    """Serialise one message (the caller sets ``version``; use PROTOCOL_VERSION)."""
    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"not a control-plane message: {type(message).__name__}")
    return _encoder.encode(message)


def clip_reason(reason: str) -> str:
    """Reasons are for humans; cut them to what the schema accepts instead of failing to send."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    return reason[: MAX_REASON_CHARS - 3] + "..."


class FrameDecoder:
    """Decode untrusted frames into messages, or raise ProtocolError saying why not."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if not isinstance(max_frame_bytes, int) or not 0 < max_frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"max_frame_bytes must be in [1, {MAX_FRAME_BYTES}], "
                             f"got {max_frame_bytes!r}")
        self.max_frame_bytes = max_frame_bytes
        self._header = msgspec.msgpack.Decoder(_Header)
        self._message = msgspec.msgpack.Decoder(Message)

    def decode(self, frame: bytes | bytearray | memoryview) -> Message:
        size = len(frame)
        if size > self.max_frame_bytes:
            raise ProtocolError(f"frame of {size} bytes exceeds the limit of "
                                f"{self.max_frame_bytes} bytes")
        try:  # one strict decode on the hot path; the header only to explain a failure
            message: Message = self._message.decode(frame)
        except msgspec.MsgspecError as exc:
            raise self._explain(frame, exc) from None
        if message.version != PROTOCOL_VERSION:
            raise _version_error(type(message).__struct_config__.tag, message.version)
        return message

    def _explain(self, frame: bytes | bytearray | memoryview,
                 error: msgspec.MsgspecError) -> ProtocolError:
        """Why a frame did not decode: not ours at all, another version, or a broken field."""
        size = len(frame)
        try:
            header = self._header.decode(frame)
        except msgspec.MsgspecError as exc:
            return ProtocolError(f"frame of {size} bytes is not a control-plane message: {exc}")
        if header.version != PROTOCOL_VERSION:
            return _version_error(header.type, header.version)
        return ProtocolError(f"invalid {header.type[:64]!r} frame ({size} bytes): {error}")


def _version_error(kind: object, version: int) -> ProtocolError:
    return ProtocolError(f"{str(kind)[:64]!r} frame speaks protocol version {version}; "
                         f"this side speaks {PROTOCOL_VERSION}")


_default_decoder = FrameDecoder()


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Decode with the default (largest) frame limit."""
    return _default_decoder.decode(frame)


def _preview(values: Sequence[object], limit: int = 8) -> str:
    shown = ", ".join(map(repr, values[:limit]))
    return f"[{shown}{', ...' if len(values) > limit else ''}]"
