"""TP mapping, indexer block-range split and decode control ports (docs/design.md section 7)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_core.errors import ConfigError
from kvo_core.tp import MainShare, TPMapping, control_port, control_ports, indexer_block_range

SETTINGS = settings(max_examples=150, deadline=None)


# -- mapping ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("prefill", "decode"), [(2, 4), (6, 4), (3, 2), (1, 2)])
def test_incompatible_sizes_name_both_values(prefill: int, decode: int) -> None:
    with pytest.raises(ConfigError) as info:
        TPMapping(prefill, decode)
    message = str(info.value)
    assert f"prefill TP size {prefill}" in message
    assert f"decode TP size {decode}" in message
    assert "multiple" in message


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "2"])
def test_sizes_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ConfigError, match="prefill_tp must be an integer >= 1"):
        TPMapping(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="decode_tp must be an integer >= 1"):
        TPMapping(4, bad)  # type: ignore[arg-type]


def test_example_mapping() -> None:
    mapping = TPMapping(8, 2)
    assert mapping.ratio == 4
    assert [mapping.decode_rank(p) for p in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [mapping.member(p) for p in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert mapping.contributors(1) == (4, 5, 6, 7)
    assert [p for p in range(8) if mapping.moves_main_kv(p)] == [0, 4]


@SETTINGS
@given(decode=st.integers(1, 8), ratio=st.integers(1, 8))
def test_contribution_groups_partition_prefill_ranks(decode: int, ratio: int) -> None:
    mapping = TPMapping(decode * ratio, decode)
    assert mapping.ratio == ratio
    seen: list[int] = []
    for d_rank in range(decode):
        group = mapping.contributors(d_rank)
        assert len(group) == ratio
        assert [mapping.member(p) for p in group] == list(range(ratio))
        assert all(mapping.decode_rank(p) == d_rank for p in group)
        # exactly one member (member 0) moves this decode rank's main KV
        movers = [p for p in group if mapping.moves_main_kv(p)]
        assert movers == [group[0]]
        assert mapping.member(movers[0]) == 0
        seen.extend(group)
    assert seen == list(range(decode * ratio))


def test_rank_out_of_range() -> None:
    mapping = TPMapping(4, 2)
    with pytest.raises(ConfigError, match=r"prefill rank must be an integer in \[0, 4\).*got 4"):
        mapping.decode_rank(4)
    with pytest.raises(ConfigError, match="prefill rank"):
        mapping.member(-1)
    with pytest.raises(ConfigError, match=r"decode rank must be an integer in \[0, 2\).*got 2"):
        mapping.contributors(2)


# -- indexer block ranges ----------------------------------------------------------------------

@SETTINGS
@given(start=st.integers(0, 10**6), num=st.integers(0, 600), ratio=st.integers(1, 16))
def test_ranges_are_disjoint_and_cover(start: int, num: int, ratio: int) -> None:
    ranges = [indexer_block_range(start, num, ratio, m) for m in range(ratio)]
    covered: list[int] = []
    for begin, end in ranges:
        assert start <= begin <= end <= start + num
        covered.extend(range(begin, end))
    assert sorted(covered) == list(range(start, start + num))  # disjoint and complete
    sizes = sorted(end - begin for begin, end in ranges)
    assert sizes[-1] - sizes[0] <= 1  # balanced
    empty = sum(1 for size in sizes if size == 0)
    assert empty == max(ratio - num, 0)  # members without blocks when the chunk is small
    if num > 0:
        first_owner = next(m for m, (begin, end) in enumerate(ranges) if begin == start < end)
        assert first_owner == start % ratio  # rotation by start block


def test_rotation_spreads_single_block_chunks() -> None:
    # A prompt arriving one block per chunk: without rotation member 0 would send every block.
    owners = []
    for start in range(8):
        ranges = [indexer_block_range(start, 1, 4, m) for m in range(4)]
        sends = [m for m, (begin, end) in enumerate(ranges) if end > begin]
        assert len(sends) == 1
        assert ranges[sends[0]] == (start, start + 1)
        owners.append(sends[0])
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]


def test_example_split_with_rotation() -> None:
    # 10 blocks from block 5 over 4 members: chunks 3,3,2,2; chunk 0 goes to member 5 % 4 = 1.
    assert [indexer_block_range(5, 10, 4, m) for m in range(4)] == [
        (13, 15), (5, 8), (8, 11), (11, 13)]
    # an empty range is a valid, empty half-open interval
    begin, end = indexer_block_range(0, 1, 2, 1)
    assert begin == end


def test_mapping_range_uses_member() -> None:
    mapping = TPMapping(4, 2)
    assert mapping.indexer_range(3, 0, 4) == indexer_block_range(0, 4, 2, 1)


@pytest.mark.parametrize(("args", "fragment"), [
    ((-1, 4, 2, 0), "start_block must be an integer >= 0, got -1"),
    ((0, -4, 2, 0), "num_blocks must be an integer >= 0, got -4"),
    ((0, 4, 0, 0), "ratio must be an integer >= 1, got 0"),
    ((0, 4, 2, 2), r"member must be an integer in \[0, 2\)"),
])
def test_range_bad_arguments(args: tuple[int, int, int, int], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        indexer_block_range(*args)


# -- ports ---------------------------------------------------------------------------------------

@SETTINGS
@given(kv_port=st.integers(1, 60000), dp=st.integers(1, 8), tp=st.integers(1, 8))
def test_ports_distinct_and_consecutive(kv_port: int, dp: int, tp: int) -> None:
    ports = control_ports(kv_port, dp, tp)
    assert len(set(ports)) == dp * tp
    assert ports == list(range(kv_port, kv_port + dp * tp))
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            port = control_port(kv_port, dp_rank, tp_rank, tp)
            assert port == kv_port + dp_rank * tp + tp_rank
            assert ports[dp_rank * tp + tp_rank] == port


def test_highest_port_is_allowed() -> None:
    assert control_ports(65534, 1, 2) == [65534, 65535]
    assert control_port(65535, 0, 0, 1) == 65535


@pytest.mark.parametrize(("call", "fragment"), [
    (lambda: control_port(0, 0, 0, 1), r"kv_port must be an integer in \[1, 65535\], got 0"),
    (lambda: control_port(65536, 0, 0, 1), "got 65536"),
    (lambda: control_port(65535, 0, 1, 2), "past the highest port 65535"),
    (lambda: control_port(60000, 1, 2, 2), r"tp_rank must be an integer in \[0, 2\)"),
    (lambda: control_port(60000, -1, 0, 2), "dp_rank must be an integer >= 0"),
    (lambda: control_port(60000, 0, 0, 0), "decode_tp_size must be an integer >= 1"),
    (lambda: control_ports(65535, 1, 2), r"needs ports 65535\.\.65536.*kv_port in \[1, 65534\]"),
    (lambda: control_ports(65000, 40, 16), r"kv_port in \[1, 64896\]"),
    (lambda: control_ports(30000, 0, 2), "dp_size must be an integer >= 1"),
    (lambda: control_ports(30000, 2, 0), "tp_size must be an integer >= 1"),
])
def test_port_range_errors(call: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        call()  # type: ignore[operator]


# -- main share of a decode DP rank's shared host pool -----------------------------------------

@given(start=st.integers(0, 500), count=st.integers(0, 64), sharers=st.integers(1, 8))
@SETTINGS
def test_main_shares_cover_each_chunk_once(start: int, count: int, sharers: int) -> None:
    """The ranks sharing one pool pull disjoint block ranges whose union is the chunk: the
    prompt's main KV is written into the pool exactly once."""
    covered: list[int] = []
    for rank in range(sharers):
        begin, end = MainShare(sharers, rank).block_range(start, count)
        assert start <= begin <= end <= start + count
        covered.extend(range(begin, end))
    assert sorted(covered) == list(range(start, start + count))


def test_one_block_chunks_alternate_between_two_ranks() -> None:
    """A prompt sent one block per chunk: block i lands on rank i % 2, not all on rank 0."""
    owners = [rank for block in range(6) for rank in (0, 1)
              if MainShare(2, rank).block_range(block, 1) == (block, block + 1)]
    assert owners == [0, 1, 0, 1, 0, 1]


def test_a_lone_rank_pulls_every_main_block() -> None:
    assert MainShare().block_range(3, 5) == (3, 8)


@pytest.mark.parametrize(("sharers", "rank", "match"), [
    (0, 0, "sharers must be an integer >= 1"),
    (2, 2, r"rank must be an integer in \[0, 2\) \(sharers = 2\), got 2"),
    (2, -1, "rank must be an integer in"),
])
def test_bad_main_share_is_refused(sharers: int, rank: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MainShare(sharers, rank)
