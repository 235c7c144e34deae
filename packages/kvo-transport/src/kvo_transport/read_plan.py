"""Decode-side checks and transfer descriptors: what may be read, and from where to where.

Pure logic, no sockets and no engine, so every rule is unit-testable. The decode receiver calls
``check_handshake`` once per prefill connection and ``plan_layer_read`` for every READY; only a
plan that passed every check reaches the transfer engine. Nothing here trusts the wire: block
ids, ranges and sizes are all compared with what the decode registered and what the prefill
advertised in its handshake, so a bad READY fails before a single byte moves.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvo_core.errors import ConfigError
from kvo_core.tp import MainShare, TPMapping, indexer_block_range
from kvo_transport.protocol import LayerMeta, MfMeta, ReadReadyBatch, ReadyRequest, TensorGroup


class ReadRejected(Exception):
    """A READY cannot be served as sent; the message is the reason sent back in READ_FAILED."""


def _int_tuple(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(operator.index(v) for v in values)


WHOLE_MAIN = MainShare()
"""A decode rank with its own main destination: it pulls every main block it is sent."""


def _positive_ints(instance: object, attribute: attrs.Attribute[tuple[int, ...]],
                   value: tuple[int, ...]) -> None:
    if not value or any(v <= 0 for v in value):
        raise ConfigError(f"{attribute.name} must be a non-empty tuple of positive integers, "
                          f"got {value!r}")


@attrs.frozen
class DestinationGroup:
    """Registered decode memory for one tensor kind of a layer (main, indexer or int8 scale).

    Tensor ``t`` has ``num_blocks`` blocks of ``block_bytes[t]`` bytes from ``base_addrs[t]``.
    """

    base_addrs: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_positive_ints)
    block_bytes: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_positive_ints)
    num_blocks: int = attrs.field(converter=operator.index)
    label: Callable[[int], str] | None = attrs.field(default=None, eq=False, kw_only=True)
    """Optional: names what a block of this many bytes holds, for a mismatch's reason (e.g.
    the indexer key layout, bf16 or C8, that a block size implies)."""

    def __attrs_post_init__(self) -> None:
        if len(self.base_addrs) != len(self.block_bytes):
            raise ConfigError(f"{len(self.base_addrs)} base_addrs but {len(self.block_bytes)} "
                              f"block_bytes: give one block size per tensor")
        if self.num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {self.num_blocks}")

    @property
    def tensor_count(self) -> int:
        return len(self.base_addrs)


@attrs.frozen
class DestinationLayer:
    """Where one layer lands on decode, and the block-size scale decode expects from prefill."""

    name: str
    main: DestinationGroup
    indexer: DestinationGroup | None = None
    indexer_scale: DestinationGroup | None = None
    block_size_scale: int = 1

    def __attrs_post_init__(self) -> None:
        if self.indexer_scale is not None and self.indexer is None:
            raise ConfigError(f"layer {self.name!r}: an indexer_scale destination needs an "
                              f"indexer destination")
        if not isinstance(self.block_size_scale, int) or self.block_size_scale < 1:
            raise ConfigError(f"layer {self.name!r}: block_size_scale must be an integer >= 1, "
                              f"got {self.block_size_scale!r}")


def _layer_tuple(layers: Iterable[DestinationLayer]) -> tuple[DestinationLayer, ...]:
    return tuple(layers)


@attrs.frozen
class DecodeLayout:
    """Every cache-bearing layer of the decode rank, ordered by layer index, and which part
    of each chunk's main KV this rank pulls (all of it, unless its main destination is a host
    pool shared with other TP ranks: :class:`kvo_core.tp.MainShare`)."""

    layers: tuple[DestinationLayer, ...] = attrs.field(converter=_layer_tuple)
    main_share: MainShare = WHOLE_MAIN

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("a decode layout needs at least one layer")


@attrs.frozen
class RequestDestination:
    """One request's destination blocks on decode, indexed by decode-side logical block.

    ``main_block_ids[i]`` is the block of the decode's main destination (its host pool or its
    own KV cache) that holds the request's logical block ``i``; ``indexer_block_ids`` likewise
    for the indexer (defaults to the main ids when both caches share a block table).

    Logical blocks below ``first_block`` are decode's own (its prefix cache already holds
    them): a READY may name them (a prefill that did not know decode's prefix sends from block
    0), but nothing is read into them and their ids are never looked at.
    """

    main_block_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    indexer_block_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_int_tuple))
    first_block: int = attrs.field(default=0, converter=operator.index)

    @classmethod
    def nothing(cls) -> RequestDestination:
        """A request decode computes itself: every block a READY names is skipped."""
        return cls(main_block_ids=(), first_block=NOTHING_WANTED)

    @property
    def indexer_ids(self) -> tuple[int, ...]:
        return self.main_block_ids if self.indexer_block_ids is None else self.indexer_block_ids


NOTHING_WANTED = 1 << 62
"""``first_block`` of :meth:`RequestDestination.nothing`: beyond any logical block."""

Resolver = Callable[[str], "RequestDestination | None"]
"""request id -> its destination blocks, or None when decode does not know the request."""


@attrs.frozen
class LayerReadPlan:
    """A validated layer read: coalesced descriptors and what each request's data lands in."""

    local_addrs: list[int]
    remote_addrs: list[int]
    lengths: list[int]
    destinations: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    """request id -> (main destination blocks, indexer destination blocks) written."""

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths)


class _Descriptors:
    """Collects (local, remote, length) triples, merging runs contiguous on both sides."""

    def __init__(self) -> None:
        self.local: list[int] = []
        self.remote: list[int] = []
        self.lengths: list[int] = []
        self._local_end = -1
        self._remote_end = -1

    def add(self, local: int, remote: int, length: int) -> None:
        if local == self._local_end and remote == self._remote_end:
            self.lengths[-1] += length
        else:
            self.local.append(local)
            self.remote.append(remote)
            self.lengths.append(length)
        self._local_end = local + length
        self._remote_end = remote + length


def check_handshake(meta: MfMeta, layout: DecodeLayout, *, backend: str, transfer_protocol: str,
                    decode_tp: int, d_rank: int) -> str | None:
    """The reason to reject ``meta`` on this decode rank, or None to accept it."""
    if (meta.backend, meta.transfer_protocol) != (backend, transfer_protocol):
        return (f"transfer backend mismatch: prefill uses {meta.backend}/"
                f"{meta.transfer_protocol}, decode uses {backend}/{transfer_protocol}; "
                f"both sides must configure the same transfer_backend and protocol")
    try:
        mapping = TPMapping(meta.p_tp_size, decode_tp)
        expected_d_rank = mapping.decode_rank(meta.p_rank)
        member = mapping.member(meta.p_rank)
    except ConfigError as exc:
        return f"incompatible tensor parallelism: {exc}"
    if (meta.d_rank, expected_d_rank) != (d_rank, d_rank):
        return (f"prefill rank {meta.p_rank} of {meta.p_tp_size} (claims decode rank "
                f"{meta.d_rank}) feeds decode rank {expected_d_rank} of {decode_tp}, but this "
                f"is decode rank {d_rank}")
    if (meta.member, meta.ratio) != (member, mapping.ratio):
        return (f"prefill rank {meta.p_rank} claims member {meta.member} of ratio {meta.ratio}; "
                f"expected member {member} of ratio {mapping.ratio}")
    if len(meta.layers) != len(layout.layers):
        return (f"layer count mismatch: prefill has {len(meta.layers)} cache layers, decode "
                f"has {len(layout.layers)}")
    for source, dest in zip(meta.layers, layout.layers, strict=True):
        reason = _check_layer(source, dest)
        if reason is not None:
            return f"layer {source.index} ({source.name!r}): {reason}"
    return None


def _check_layer(source: LayerMeta, dest: DestinationLayer) -> str | None:
    if source.name != dest.name:
        return f"name mismatch: decode's layer {source.index} is {dest.name!r}"
    if source.block_size_scale != dest.block_size_scale:
        return (f"block-size scale {source.block_size_scale} but decode expects "
                f"{dest.block_size_scale}")
    scale = dest.block_size_scale
    parts: tuple[tuple[str, TensorGroup | None, DestinationGroup | None], ...] = (
        ("main", source.main, dest.main),
        ("indexer", source.indexer, dest.indexer),
        ("int8 indexer scale", source.indexer_scale, dest.indexer_scale))
    for what, src, dst in parts:
        if (src is None) != (dst is None):
            have = "has" if src is not None else "has no"
            want = "has" if dst is not None else "has no"
            return f"prefill {have} {what} cache but decode {want}"
        if src is None or dst is None:
            continue
        if src.tensor_count != dst.tensor_count:
            return (f"{what} tensor count mismatch: prefill {src.tensor_count}, decode "
                    f"{dst.tensor_count}")
        for t, (sb, db) in enumerate(zip(src.block_bytes, dst.block_bytes, strict=True)):
            if sb != db * scale:
                named = ("" if dst.label is None else
                         f" (prefill: {dst.label(sb // scale)}; decode: {dst.label(db)})")
                return (f"{what} tensor {t}: prefill block of {sb} bytes does not match "
                        f"{scale} decode block(s) of {db} bytes{named}")
    return None


def plan_layer_read(source: LayerMeta, dest: DestinationLayer, batch: ReadReadyBatch,
                    resolve: Resolver, main_share: MainShare = WHOLE_MAIN) -> LayerReadPlan:
    """Validate every request of ``batch`` and build the layer's descriptors.

    Member 0 must name every main block of the chunk; this rank reads ``main_share`` of them
    (the other ranks sharing its main destination read the rest).
    Raises ReadRejected naming the first problem; nothing is read unless all requests pass.
    """
    if batch.layer_name != source.name:
        raise ReadRejected(f"layer {batch.layer_index} is {source.name!r} in the handshake, "
                           f"the READY names {batch.layer_name!r}")
    out = _Descriptors()
    destinations: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for request in batch.requests:
        target = resolve(request.request_id)
        if target is None:
            raise ReadRejected(f"request {request.request_id!r} has no destination on this "
                               f"decode rank (unknown or already released)")
        try:
            destinations[request.request_id] = _plan_request(
                source, dest, batch, request, target, out, main_share)
        except ReadRejected as exc:
            raise ReadRejected(f"request {request.request_id!r}: {exc}") from None
    return LayerReadPlan(out.local, out.remote, out.lengths, destinations)


def intended_destination(dest: DestinationLayer, request: ReadyRequest,
                         target: RequestDestination | None
                         ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The destination blocks a READY entry was meant to fill, clipped to what exists.

    Used to invalidate after a failure, including one found before reading: the request then
    lacks this layer's data, so those blocks must not be taken as valid.
    """
    if target is None:
        return (), ()
    scale, first = dest.block_size_scale, target.first_block
    main = _clipped(target.main_block_ids, max(first, request.main_start_block * scale),
                    (request.main_start_block + len(request.main_block_ids)) * scale)
    indexer: tuple[int, ...] = ()
    if dest.indexer is not None:
        indexer = _clipped(target.indexer_ids, max(first, request.indexer_start_block * scale),
                           (request.indexer_start_block + len(request.indexer_block_ids)) * scale)
    return main, indexer


def _clipped(ids: tuple[int, ...], begin: int, end: int) -> tuple[int, ...]:
    return ids[min(begin, len(ids)):min(end, len(ids))]


def _plan_request(source: LayerMeta, dest: DestinationLayer, batch: ReadReadyBatch,
                  request: ReadyRequest, target: RequestDestination, out: _Descriptors,
                  main_share: MainShare) -> tuple[tuple[int, ...], tuple[int, ...]]:
    scale = dest.block_size_scale
    start, count = request.main_start_block, request.num_blocks
    main_written: tuple[int, ...] = ()
    if batch.member == 0:
        if len(request.main_block_ids) != count:
            raise ReadRejected(f"member 0 must send all {count} main blocks of the chunk, "
                               f"sent {len(request.main_block_ids)}")
        _check_sources("main", source.main, request.main_block_ids)  # every one, read or not
        begin, end = main_share.block_range(start, count)
        if begin < end:
            main_written = _add_group(out, "main", source.main, dest.main,
                                      request.main_block_ids[begin - start:end - start],
                                      target.main_block_ids, begin, scale, target.first_block)
    elif request.main_block_ids:
        raise ReadRejected(f"member {batch.member} sent {len(request.main_block_ids)} main "
                           f"blocks; only member 0 moves main KV")

    indexer_written: tuple[int, ...] = ()
    ids = request.indexer_block_ids
    if source.indexer is None or dest.indexer is None:
        if ids:
            raise ReadRejected(f"sent {len(ids)} indexer blocks but layer {source.index} has "
                               f"no indexer cache")
        return main_written, indexer_written
    begin, end = indexer_block_range(start, count, batch.ratio, batch.member)
    got_begin = request.indexer_start_block
    if len(ids) != end - begin or (ids and got_begin != begin):
        raise ReadRejected(
            f"indexer slice [{got_begin}, {got_begin + len(ids)}) is not member "
            f"{batch.member}'s share [{begin}, {end}) of blocks [{start}, {start + count}) "
            f"split {batch.ratio} ways")
    if ids:
        indexer_written = _add_group(out, "indexer", source.indexer, dest.indexer, ids,
                                     target.indexer_ids, begin, scale, target.first_block)
        if source.indexer_scale is not None and dest.indexer_scale is not None:
            _add_group(out, "int8 indexer scale", source.indexer_scale, dest.indexer_scale,
                       ids, target.indexer_ids, begin, scale, target.first_block)
    return main_written, indexer_written


def _add_group(out: _Descriptors, what: str, src: TensorGroup, dst: DestinationGroup,
               src_ids: tuple[int, ...], dst_ids: tuple[int, ...], start: int,
               scale: int, first_block: int = 0) -> tuple[int, ...]:
    """Descriptors moving source blocks ``src_ids`` (logical ``start``...) into ``dst_ids``.

    Source block ``j`` is ``scale`` decode blocks laid end to end; they land in the decode
    blocks of logical positions ``(start + j) * scale + k``, except positions below
    ``first_block`` (decode's own prefix: skipped).
    """
    first, last = start * scale, (start + len(src_ids)) * scale
    wanted = max(first, first_block)
    _check_sources(what, src, src_ids)
    if wanted >= last:
        return ()
    if last > len(dst_ids):
        raise ReadRejected(f"{what} blocks [{start}, {start + len(src_ids)}) need decode "
                           f"logical blocks [{wanted}, {last}) but the destination has "
                           f"{len(dst_ids)}")
    written = dst_ids[wanted:last]
    for block in written:
        if not 0 <= block < dst.num_blocks:
            raise ReadRejected(f"{what} destination block {block} is outside the decode region "
                               f"of {dst.num_blocks} blocks")
    for t in range(src.tensor_count):
        src_base, src_bytes = src.base_addrs[t], src.block_bytes[t]
        dst_base, dst_bytes = dst.base_addrs[t], dst.block_bytes[t]
        position = first
        for block in src_ids:
            remote = src_base + block * src_bytes
            for k in range(scale):
                if position >= wanted:
                    out.add(dst_base + dst_ids[position] * dst_bytes, remote + k * dst_bytes,
                            dst_bytes)
                position += 1
    return written


def _check_sources(what: str, src: TensorGroup, src_ids: tuple[int, ...]) -> None:
    for block in src_ids:
        if block >= src.num_blocks:
            raise ReadRejected(f"{what} source block {block} is outside the prefill region of "
                               f"{src.num_blocks} blocks")
