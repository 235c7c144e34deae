"""The prefill publisher's own rules, checked before anything touches the network."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvo_core.errors import ConfigError
from kvo_core.gates import SlotGates
from kvo_transport.fence import FenceWords
from kvo_transport.prefill_side import PrefillPublisher, PublisherClosedError
from kvo_transport.protocol import MAX_REQUESTS_PER_BATCH, LayerMeta, ReadyRequest, TensorGroup

LAYERS = [LayerMeta(index=i, name=f"layers.{i}",
                    main=TensorGroup(base_addrs=(4096 * (i + 1),), block_bytes=(64,),
                                     num_blocks=8)) for i in range(2)]


def publisher(**overrides) -> PrefillPublisher:
    options = dict(engine_session_id="127.0.0.1:1", backend="mooncake", transfer_protocol="tcp",
                   instance_id="p", prefill_tp=4, p_rank=1, decode_tp=2, layers=LAYERS,
                   gates=SlotGates(), fences=FenceWords(64))
    return PrefillPublisher(**{**options, **overrides})


@pytest.fixture
def member_one() -> Iterator[PrefillPublisher]:
    made = publisher()
    yield made
    made.close()


def test_topology_is_derived_from_the_tp_mapping(member_one: PrefillPublisher) -> None:
    meta = member_one.meta
    assert (meta.member, meta.ratio, meta.d_rank) == (1, 2, 0)


def test_ready_request_gives_each_member_its_share(member_one: PrefillPublisher) -> None:
    # blocks [3, 8) split 2 ways, rotated by the start block: member 1 owns the first chunk.
    request = member_one.ready_request("r", 3, (10, 11, 12, 13, 14), (20, 21, 22, 23, 24))
    assert request.main_block_ids == ()  # only member 0 moves main KV
    assert (request.indexer_start_block, request.indexer_block_ids) == (3, (20, 21, 22))
    assert request.num_blocks == 5 and request.main_start_block == 3
    lead = publisher(p_rank=0)
    try:
        other = lead.ready_request("r", 3, (10, 11, 12, 13, 14), (20, 21, 22, 23, 24))
        assert other.main_block_ids == (10, 11, 12, 13, 14)
        assert (other.indexer_start_block, other.indexer_block_ids) == (6, (23, 24))
    finally:
        lead.close()
    with pytest.raises(ValueError, match="2 indexer block ids for a chunk of 3 blocks"):
        member_one.ready_request("r", 0, (1, 2, 3), (1, 2))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(layer_index=2), ValueError, "layer_index 2 is out of range: this rank exposes 2"),
    (dict(last_layer_request_ids=("x",)), ValueError, r"\['x'\] are not published"),
    (dict(requests=[ReadyRequest("r", 0, 1, (-1,))]), ValueError, "negative main block id -1"),
    (dict(requests=[ReadyRequest(str(i), 0, 0) for i in range(MAX_REQUESTS_PER_BATCH + 1)]),
     ValueError, "at most 4096 are allowed"),
    (dict(deadline_s=0), ValueError, "deadline_s must be > 0"),
])
def test_bad_publish_arguments_fail_at_the_caller(member_one, kwargs, error, match) -> None:
    gates = SlotGates()
    member_one._gates = gates
    requests = kwargs.pop("requests", [ReadyRequest("r", 0, 0)])
    arguments = dict(layer_index=0, slot_key=(1,),
                     requests_by_endpoint={"tcp://127.0.0.1:9": requests})
    with pytest.raises(error, match=match):
        member_one.publish_layer(**{**arguments, **kwargs})
    assert gates.is_open((1,))  # nothing was closed


def test_invalid_layer_description_is_a_config_error() -> None:
    long_name = [LayerMeta(index=0, name="n" * 300, main=LAYERS[0].main)]
    with pytest.raises(ConfigError, match=r"MF_META is not valid.*length <= 256"):
        publisher(layers=long_name)
    with pytest.raises(ConfigError, match="incompatible"):
        publisher(prefill_tp=3, p_rank=0)
    with pytest.raises(ValueError, match="handshake_timeout_s must be > 0"):
        publisher(handshake_timeout_s=0)


def test_closed_publisher_refuses_work() -> None:
    made = publisher()
    made.close()
    made.close()  # idempotent
    with pytest.raises(PublisherClosedError, match="is closed"):
        made.connect("tcp://127.0.0.1:9")


def test_a_late_failure_never_advances_a_word_now_leased_to_another_request() -> None:
    """A READY of request t1 fails after t1 released its word and t2 took it: t1's readers
    already fail (the release advanced the word); advancing it again would fail t2's reads."""
    fences = FenceWords(4)
    word = fences.lease("t1")
    fences.release("t1")
    assert fences.lease("t2") == word  # the free list hands the word straight out again
    epoch = fences.epoch(word)
    fences.advance_leases([("t1", word)])  # the late failure of t1's READY
    assert fences.epoch(word) == epoch
    fences.advance_leases([("t2", word)])  # a failure of t2's own READY
    assert fences.epoch(word) == epoch + 1
    fences.close()
