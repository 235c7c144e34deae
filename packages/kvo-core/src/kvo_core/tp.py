"""Tensor-parallel mapping between prefill and decode ranks, and decode control ports.

Prefill may run with more TP ranks than decode (docs/design.md section 7). Every decode rank is fed
by a contribution group of ``ratio = P // D`` consecutive prefill ranks. Main KV is replicated
across the group, so only member 0 sends it; the rank-local indexer is split into disjoint block
ranges, one per member, so the group shares the indexer traffic. The split is rotated by the
chunk's start block: a long prompt arrives in many small chunks, and without rotation member 0
would own the first (often the only) block of every chunk.
"""

from __future__ import annotations

import attrs

from kvo_core.errors import ConfigError

MIN_PORT = 1
MAX_PORT = 65535


def _require_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _require_index(name: str, value: object, size: int, size_name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
        raise ConfigError(
            f"{name} must be an integer in [0, {size}) ({size_name} = {size}), got {value!r}")
    return value


def _check_tp_sizes(instance: TPMapping, attribute: attrs.Attribute[int], value: int) -> None:
    _require_int(attribute.name, value, 1)


@attrs.frozen
class TPMapping:
    """Which prefill ranks feed which decode rank (``P >= D`` and ``P % D == 0``)."""

    prefill_tp: int = attrs.field(validator=_check_tp_sizes)
    decode_tp: int = attrs.field(validator=_check_tp_sizes)

    def __attrs_post_init__(self) -> None:
        if self.prefill_tp < self.decode_tp or self.prefill_tp % self.decode_tp != 0:
            raise ConfigError(
                f"prefill TP size {self.prefill_tp} and decode TP size {self.decode_tp} are "
                f"incompatible: allowed are prefill_tp >= decode_tp and prefill_tp a multiple "
                f"of decode_tp (e.g. {self.decode_tp}, {2 * self.decode_tp}, "
                f"{4 * self.decode_tp})")

    @property
    def ratio(self) -> int:
        """Prefill ranks per decode rank (the size of a contribution group)."""
        return self.prefill_tp // self.decode_tp

    def _prefill_rank(self, p_rank: int) -> int:
        return _require_index("prefill rank", p_rank, self.prefill_tp, "prefill_tp")

    def decode_rank(self, p_rank: int) -> int:
        """The decode rank that prefill rank ``p_rank`` sends to."""
        return self._prefill_rank(p_rank) // self.ratio

    def member(self, p_rank: int) -> int:
        """Position of ``p_rank`` in its contribution group (0 .. ratio-1)."""
        return self._prefill_rank(p_rank) % self.ratio

    def contributors(self, d_rank: int) -> tuple[int, ...]:
        """The prefill ranks that feed decode rank ``d_rank``, ordered by member index."""
        _require_index("decode rank", d_rank, self.decode_tp, "decode_tp")
        first = d_rank * self.ratio
        return tuple(range(first, first + self.ratio))

    def moves_main_kv(self, p_rank: int) -> bool:
        """Only member 0 sends main KV: every member holds the same replicated copy."""
        return self.member(p_rank) == 0

    def indexer_range(self, p_rank: int, start_block: int, num_blocks: int) -> tuple[int, int]:
        """The indexer blocks prefill rank ``p_rank`` sends (see :func:`indexer_block_range`)."""
        return indexer_block_range(start_block, num_blocks, self.ratio, self.member(p_rank))


def indexer_block_range(start_block: int, num_blocks: int, ratio: int,
                        member: int) -> tuple[int, int]:
    """Half-open range ``[begin, end)`` of absolute block ids that ``member`` sends.

    ``[start_block, start_block + num_blocks)`` is cut into ``ratio`` contiguous chunks whose
    sizes differ by at most one (larger chunks first). Chunk ``j`` belongs to member
    ``(start_block + j) % ratio``, so the first chunk's owner rotates with the start block.
    When ``num_blocks < ratio`` some members get an empty range (``begin == end``); they still
    report the layer as ready so the decode side can complete it.
    """
    _require_int("start_block", start_block, 0)
    _require_int("num_blocks", num_blocks, 0)
    _require_int("ratio", ratio, 1)
    _require_index("member", member, ratio, "ratio")
    chunk = (member - start_block) % ratio
    base, extra = divmod(num_blocks, ratio)
    begin = start_block + chunk * base + min(chunk, extra)
    size = base + (1 if chunk < extra else 0)
    return begin, begin + size


def control_port(kv_port: int, dp_rank: int, tp_rank: int, decode_tp_size: int) -> int:
    """The ZMQ control port of decode rank ``(dp_rank, tp_rank)``: ``kv_port + dp*tp_size + tp``."""
    _check_port("kv_port", kv_port)
    _require_int("decode_tp_size", decode_tp_size, 1)
    _require_int("dp_rank", dp_rank, 0)
    _require_index("tp_rank", tp_rank, decode_tp_size, "decode_tp_size")
    port = kv_port + dp_rank * decode_tp_size + tp_rank
    if port > MAX_PORT:
        raise ConfigError(
            f"control port for dp_rank {dp_rank}, tp_rank {tp_rank} is kv_port {kv_port} + "
            f"{dp_rank} * {decode_tp_size} + {tp_rank} = {port}, past the highest port "
            f"{MAX_PORT}; choose kv_port <= {MAX_PORT - dp_rank * decode_tp_size - tp_rank}")
    return port


def control_ports(kv_port: int, dp_size: int, tp_size: int) -> list[int]:
    """Every decode control port of a deployment, ordered by (dp_rank, tp_rank).

    A deployment reserves ``dp_size * tp_size`` consecutive ports starting at ``kv_port``.
    """
    _check_port("kv_port", kv_port)
    _require_int("dp_size", dp_size, 1)
    _require_int("tp_size", tp_size, 1)
    count = dp_size * tp_size
    last = kv_port + count - 1
    if last > MAX_PORT:
        raise ConfigError(
            f"kv_port {kv_port} with dp_size {dp_size} x tp_size {tp_size} needs ports "
            f"{kv_port}..{last}, past the highest port {MAX_PORT}; allowed: kv_port in "
            f"[{MIN_PORT}, {MAX_PORT - count + 1}]")
    return [control_port(kv_port, dp, tp, tp_size)
            for dp in range(dp_size) for tp in range(tp_size)]


def _check_port(name: str, value: object) -> None:
    if (not isinstance(value, int) or isinstance(value, bool)
            or not MIN_PORT <= value <= MAX_PORT):
        raise ConfigError(f"{name} must be an integer in [{MIN_PORT}, {MAX_PORT}], "
                          f"got {value!r}")


def _check_sharers(instance: MainShare, attribute: attrs.Attribute[int], value: int) -> None:
    _require_int(attribute.name, value, 1)


@attrs.frozen
class MainShare:
    """Which main-KV blocks of each chunk one decode TP rank pulls (docs/design.md section 14).

    With its main KV in vLLM's own cache every decode rank keeps a full copy and pulls every
    main block its contribution group sends (``sharers == 1``). With kvo's sparse offload the
    main KV lives in one host pool per DP rank that its ``sharers`` TP ranks share: the
    prompt's main KV must be written into it once, not once per rank, so the ranks pull
    disjoint parts whose union is the whole chunk. The parts are cut as the indexer is cut
    between contribution-group members (:func:`indexer_block_range`, rotated by the chunk's
    start block), so a prompt arriving one block per chunk alternates between the ranks
    instead of landing on rank 0 (the pull traffic is spread over the ranks' engines, as
    vllm-ascend spreads it).
    """

    sharers: int = attrs.field(default=1, validator=_check_sharers)
    rank: int = attrs.field(default=0)

    def __attrs_post_init__(self) -> None:
        _require_index("rank", self.rank, self.sharers, "sharers")

    def block_range(self, start_block: int, num_blocks: int) -> tuple[int, int]:
        """Half-open range ``[begin, end)`` of the chunk's absolute blocks this rank pulls."""
        return indexer_block_range(start_block, num_blocks, self.sharers, self.rank)
