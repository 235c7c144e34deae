"""RemoteD2H's scheduler half with fake requests: what moves, when blocks may be freed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_vllm.remote_d2h.params import DecodePullParams, PrefillSendParams
from kvo_vllm.remote_d2h.scheduler_side import SKIPPED_BLOCK, RemoteD2HScheduler

BS = 4
ENDPOINT = ("tcp://127.0.0.1:20100",)


class FakeRequest:
    def __init__(self, request_id: str, prompt: int, params: dict[str, Any] | None) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = 0
        self.kv_transfer_params = params


def _scheduler(blocks: dict[str, list[int]]) -> RemoteD2HScheduler:
    return RemoteD2HScheduler(block_size=BS, block_ids_of=lambda rid: blocks[rid])


def _step(scheduler: RemoteD2HScheduler, scheduled: dict[str, int]) -> Any:
    return scheduler.build_metadata(SimpleNamespace(num_scheduled_tokens=scheduled))


# -- decode ------------------------------------------------------------------------------------

def test_decode_pulls_the_full_blocks_a_warm_cache_would_cover() -> None:
    params = DecodePullParams(transfer_id="t1", notify_url=None).to_params()
    request = FakeRequest("r1", 17, params)  # (17 - 1) // 4 = 4 full blocks, 16 tokens
    blocks = {"r1": [10, 11, 12, 13, 14]}
    scheduler = _scheduler(blocks)
    assert scheduler.num_new_matched_tokens(request, 0) == (16, True)
    assert scheduler.num_new_matched_tokens(request, 8) == (8, True)  # local hit: 2 blocks
    scheduler.update_state_after_alloc(request, 8)
    assert request.kv_transfer_params["do_remote_prefill"] is False  # one pull per request
    assert scheduler.num_new_matched_tokens(request, 0) == (0, False)
    recv = _step(scheduler, {}).recvs[0]
    assert recv.transfer_id == "t1" and recv.skip_blocks == 2
    assert recv.block_ids == (SKIPPED_BLOCK, SKIPPED_BLOCK, 12, 13)
    assert _step(scheduler, {}).recvs == ()


def test_a_step_that_schedules_no_tokens_is_marked_idle() -> None:
    """The decode worker may sleep for a pull on such a step (decode_worker.IDLE_WAIT_S)."""
    scheduler = _scheduler({"r": [1, 2]})
    assert _step(scheduler, {}).idle is True
    assert _step(scheduler, {"r": 3}).idle is False


def test_decode_computes_prompts_without_a_full_block_itself() -> None:
    params = DecodePullParams(transfer_id="t2").to_params()
    scheduler = _scheduler({})
    assert scheduler.num_new_matched_tokens(FakeRequest("r", BS, params), 0) == (0, False)
    plain = FakeRequest("p", 40, None)
    assert scheduler.num_new_matched_tokens(plain, 0) == (0, False)


def test_decode_abort_while_pulling_is_revoked_and_delays_the_free() -> None:
    scheduler = _scheduler({"a": [1, 2], "b": [3, 4]})
    for rid in ("a", "b"):
        request = FakeRequest(rid, 9, DecodePullParams(transfer_id=f"t-{rid}").to_params())
        scheduler.update_state_after_alloc(request, 8)
    _step(scheduler, {})
    scheduler.on_connector_output({"b"})  # b arrived, a is still being pulled
    assert scheduler.request_finished(FakeRequest("a", 9, {})) == (True, None)
    assert scheduler.request_finished(FakeRequest("b", 9, {})) == (False, None)
    assert _step(scheduler, {}).revoked_recvs == ("a",)


def test_a_report_crossing_an_abort_cancels_the_queued_revoke() -> None:
    """vLLM aborted the request before it processed the output reporting its pull: that report
    frees it, so no revoke may follow (the worker's answer would name a request vLLM forgot)."""
    scheduler = _scheduler({"a": [1, 2]})
    request = FakeRequest("a", 9, DecodePullParams(transfer_id="t-a").to_params())
    scheduler.update_state_after_alloc(request, 8)
    _step(scheduler, {})
    assert scheduler.request_finished(FakeRequest("a", 9, {})) == (True, None)
    scheduler.on_connector_output({"a"})
    assert _step(scheduler, {}).revoked_recvs == ()


def test_a_pull_decode_will_not_make_is_declined_to_the_worker() -> None:
    """Prefill may already be publishing (posted at once with decode): the worker must answer
    those READYs with nothing read, for a prompt decode holds whole or a request that ended
    before its blocks were allocated."""
    scheduler = _scheduler({"r": [1, 2, 3]})
    cached = FakeRequest("r", 9, DecodePullParams(transfer_id="t-cached").to_params())
    scheduler.update_state_after_alloc(cached, 0)
    gone = FakeRequest("g", 9, DecodePullParams(transfer_id="t-gone").to_params())
    assert scheduler.request_finished(gone) == (False, None)
    metadata = _step(scheduler, {})
    assert metadata.declined_recvs == ("t-cached", "t-gone") and metadata.recvs == ()
    assert _step(scheduler, {}).declined_recvs == ()


def test_bad_params_fall_back_to_local_compute() -> None:
    request = FakeRequest("r", 40, {"do_remote_prefill": True, "kvo_transfer_id": "no spaces!"})
    assert _scheduler({}).num_new_matched_tokens(request, 0) == (0, False)
    assert request.kv_transfer_params["do_remote_prefill"] is False


# -- prefill -----------------------------------------------------------------------------------

def _prefill_request(rid: str, prompt: int, stop: int, skip: int = 0) -> FakeRequest:
    params = PrefillSendParams(transfer_id=f"t-{rid}", decode_endpoints=ENDPOINT,
                               stop_block=stop, skip_blocks=skip).to_params()
    return FakeRequest(rid, prompt, params)


def test_prefill_chunks_send_each_block_once_when_full_and_stop_at_the_wanted_block() -> None:
    blocks = {"r": list(range(100, 106))}  # 22 tokens -> 6 blocks; decode wants 5
    scheduler = _scheduler(blocks)
    request = _prefill_request("r", 22, stop=5, skip=1)
    scheduler.on_new_request(request)
    first = _step(scheduler, {"r": 10}).sends[0]  # tokens [0, 10): block 1 (2 is partial)
    assert (first.start_block, first.block_ids, first.last) == (1, (101,), False)
    request.num_computed_tokens = 10
    assert _step(scheduler, {"r": 1}).sends == ()  # token 10: block 2 still partial
    request.num_computed_tokens = 11
    second = _step(scheduler, {"r": 11}).sends[0]  # tokens [11, 22): blocks 2 .. 4
    assert (second.start_block, second.block_ids, second.last) == (2, (102, 103, 104), True)
    request.num_computed_tokens = 22
    assert _step(scheduler, {"r": 1}).sends == ()  # decoding: nothing more to send
    assert scheduler.request_finished(request) == (True, {"kvo_transfer_id": "t-r"})


def test_prefill_prefix_hit_sends_its_context_in_the_first_step() -> None:
    scheduler = _scheduler({"r": list(range(6))})
    request = _prefill_request("r", 22, stop=5)
    scheduler.on_new_request(request)
    request.num_computed_tokens = 20  # a prefix hit beyond decode's last wanted block
    chunk = _step(scheduler, {"r": 2}).sends[0]
    assert (chunk.start_block, chunk.block_ids, chunk.last) == (0, (0, 1, 2, 3, 4), True)


def test_prefill_posted_with_decode_derives_the_wanted_blocks_itself() -> None:
    """No kvo_stop_block: the proxy did not wait for decode; prefill sends from block 0 up to
    the block a warm prefix cache would cover, (prompt - 1) // block_size."""
    scheduler = _scheduler({"r": list(range(100, 106)), "s": [7]})
    params = PrefillSendParams(transfer_id="t-r", decode_endpoints=ENDPOINT,
                               stop_block=None).to_params()
    request = FakeRequest("r", 22, params)
    scheduler.on_new_request(request)
    chunk = _step(scheduler, {"r": 22}).sends[0]
    assert (chunk.start_block, chunk.block_ids, chunk.last) == (0, (100, 101, 102, 103, 104),
                                                                True)
    short = FakeRequest("s", BS, PrefillSendParams(transfer_id="t-s", decode_endpoints=ENDPOINT,
                                                   stop_block=None).to_params())
    scheduler.on_new_request(short)  # one partial block: decode computes it all
    assert _step(scheduler, {"s": BS}).sends == ()
    assert scheduler.request_finished(short) == (False, None)


def test_prefill_abort_before_the_last_chunk_is_abandoned() -> None:
    scheduler = _scheduler({"r": list(range(6)), "q": [7, 8]})
    request = _prefill_request("r", 22, stop=5)
    untouched = _prefill_request("q", 8, stop=1)
    scheduler.on_new_request(request)
    scheduler.on_new_request(untouched)
    _step(scheduler, {"r": 6})
    assert scheduler.request_finished(request)[0] is True
    assert scheduler.request_finished(untouched) == (False, None)  # never published
    assert _step(scheduler, {}).abandoned_sends == ("r",)


def test_prefill_preemption_of_a_published_send_is_told_to_the_worker() -> None:
    """vLLM frees a preempted request's blocks without asking the connector: the worker must
    advance the request's epoch word before the step that may overwrite them."""
    scheduler = _scheduler({"r": list(range(6)), "q": [7, 8]})
    request = _prefill_request("r", 22, stop=5)
    quiet = _prefill_request("q", 8, stop=1)
    scheduler.on_new_request(request)
    scheduler.on_new_request(quiet)
    _step(scheduler, {"r": 6})
    metadata = scheduler.build_metadata(SimpleNamespace(num_scheduled_tokens={},
                                                        preempted_req_ids={"r", "q", "x"}))
    assert metadata.preempted_sends == ("t-r",)  # q never published, x is not a send
    assert metadata.has_sends  # so start_load_kv runs before the forward
    assert _step(scheduler, {}).preempted_sends == ()


@settings(max_examples=150, deadline=None)
@given(prompt=st.integers(min_value=BS + 1, max_value=60), data=st.data())
def test_prefill_sends_every_wanted_block_complete(prompt: int, data: Any) -> None:
    """Whatever the chunking, each block in [skip, stop) is sent, its last send after it was
    complete, and the last chunk is flagged exactly once, when nothing is missing."""
    stop = (prompt - 1) // BS
    skip = data.draw(st.integers(min_value=0, max_value=stop - 1))
    scheduler = _scheduler({"r": list(range(1000, 1000 + -(-prompt // BS)))})
    request = _prefill_request("r", prompt, stop=stop, skip=skip)
    scheduler.on_new_request(request)
    request.num_computed_tokens = data.draw(st.integers(min_value=0, max_value=prompt - 1))
    final_send: dict[int, int] = {}  # block -> tokens computed when it was last sent
    lasts = 0
    while request.num_computed_tokens < prompt:
        left = prompt - request.num_computed_tokens
        scheduled = data.draw(st.integers(min_value=1, max_value=left))
        for chunk in _step(scheduler, {"r": scheduled}).sends:
            lasts += chunk.last
            for offset, block_id in enumerate(chunk.block_ids):
                position = chunk.start_block + offset
                assert block_id == 1000 + position
                final_send[position] = request.num_computed_tokens + scheduled
            if chunk.last:
                assert set(final_send) == set(range(skip, stop))
        request.num_computed_tokens += scheduled
    assert lasts == 1
    assert set(final_send) == set(range(skip, stop))
    for position, computed in final_send.items():
        assert computed >= (position + 1) * BS  # the block was full when last sent
