"""Scheduler half of RemoteD2HConnector: which blocks to send, where to receive, when to free.

What moves: the prompt's *full* blocks that decode's own prefix cache lacks, i.e. blocks
``[skip, stop)`` with ``stop = (prompt_tokens - 1) // block_size`` -- exactly the blocks vLLM
would take from a warm prefix cache. Decode computes the tail (the last partial block, or the
last full one) itself, like any vLLM answering from its prefix cache, so a P/D answer is bit
for bit the answer plain vLLM gives with the prompt cached.

The proxy may post a request to prefill before decode has said which blocks it holds: then
``kvo_stop_block`` is absent and prefill derives ``stop`` from its own prompt (the same rule),
sending from block 0; decode reads only the blocks from its own prefix on.

Prefill (``do_remote_decode`` requests): every step that computes prompt tokens sends the
needed blocks it made full, from the first one not sent yet. A block the step leaves partial
waits for the step that fills it: every block below ``stop`` fills during the prompt, so
sending it early would only make decode read it twice (vLLM's chunks need not end on a block
boundary: seen with a TP 2 prefill, where each 64-token chunk then straddled two blocks). The
step that completes block ``stop - 1`` is the request's last; its blocks stay allocated
(``request_finished`` delays the free) until the worker reports every read answered.

Decode (``do_remote_prefill`` requests): the blocks are an asynchronous external load, so vLLM
allocates them and parks the request in WAITING_FOR_REMOTE_KVS; the worker registers them as
the destination and advertises them. The request runs only after the worker reported it
received (or failed: vLLM's load-failure path then recomputes the invalid blocks or fails the
request, as configured). A prompt with nothing to pull is computed on decode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs

from kvo_vllm.remote_d2h.metadata import RecvTarget, RemoteD2HMetadata, SendChunk
from kvo_vllm.remote_d2h.params import (
    DO_REMOTE_PREFILL,
    TRANSFER_ID,
    DecodePullParams,
    PrefillSendParams,
    TransferParamsError,
)

logger = logging.getLogger(__name__)

SKIPPED_BLOCK = -1
"""Destination entry of a block decode already holds: never a valid block id."""


@attrs.define
class _Send:
    request: Any
    params: PrefillSendParams
    stop_block: int
    """Send blocks below this one: the proxy's, or decode's rule when it gave none."""
    next_block: int
    published: bool = False
    finished_prompt: bool = False


class RemoteD2HScheduler:
    """Answers vLLM's scheduler-side connector calls (both roles; a request picks its side)."""

    def __init__(self, *, block_size: int, block_ids_of: Callable[[str], list[int]]) -> None:
        self._block_size = block_size
        self._block_ids_of = block_ids_of
        self._sends: dict[str, _Send] = {}
        self._abandoned: list[str] = []
        self._new_recvs: list[RecvTarget] = []
        self._pending_recvs: dict[str, str] = {}  # request id -> transfer id
        self._revoked: list[str] = []
        self._declined: list[str] = []

    # -- request arrival ----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = _prefill_params(request)
        if params is None:
            return
        stop = params.stop_block
        if stop is None:
            # Posted with decode at once: send every block decode will pull (its own rule).
            stop = self._pulled_tokens(request) // self._block_size
            if stop <= params.skip_blocks:
                return  # decode computes the whole prompt itself
        self._sends[request.request_id] = _Send(request=request, params=params, stop_block=stop,
                                                next_block=params.skip_blocks)

    # -- decode: the prompt is an asynchronous external load -----------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = _decode_params(request)
        if params is None:
            return 0, False
        count = self._pulled_tokens(request) - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def _pulled_tokens(self, request: Any) -> int:
        """Tokens in the full blocks a warm prefix cache would cover (never the last one)."""
        return int((request.num_prompt_tokens - 1) // self._block_size * self._block_size)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        params = _decode_params(request)
        if params is None:
            return
        # One pull per request: a retry after a failed pull computes locally.
        request.kv_transfer_params[DO_REMOTE_PREFILL] = False
        if num_external_tokens <= 0:
            logger.warning("kvo remote_d2h: request %s (transfer %s) needs no remote KV; it is "
                           "computed on decode", request.request_id, params.transfer_id)
            self._declined.append(params.transfer_id)
            return
        size = self._block_size
        pulled = self._pulled_tokens(request)
        skip = (pulled - num_external_tokens) // size
        blocks = list(self._block_ids_of(request.request_id))[: pulled // size]
        blocks[:skip] = [SKIPPED_BLOCK] * skip
        self._new_recvs.append(RecvTarget(request_id=request.request_id,
                                          transfer_id=params.transfer_id,
                                          block_ids=tuple(blocks), skip_blocks=skip,
                                          notify_url=params.notify_url))
        self._pending_recvs[request.request_id] = params.transfer_id

    def on_connector_output(self, finished_recving: set[str] | None) -> None:
        """The worker reported these pulls over: nothing left to revoke (a revoke still queued
        would make the worker answer a request vLLM frees on this very report)."""
        done = set(finished_recving or ())
        for request_id in done:
            self._pending_recvs.pop(request_id, None)
        if done:
            self._revoked = [r for r in self._revoked if r not in done]

    # -- per-step plan ------------------------------------------------------------------

    def build_metadata(self, scheduler_output: Any) -> RemoteD2HMetadata:
        sends = []
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._sends.get(request_id)
            if state is None:
                continue
            chunk = self._plan_chunk(state.request, state, scheduled)
            if chunk is not None:
                sends.append(chunk)
        # vLLM frees a preempted request's blocks itself (no request_finished): a decode still
        # reading them must fail its fence before this step writes them.
        preempted = tuple(state.params.transfer_id
                          for request_id in sorted(getattr(scheduler_output,
                                                           "preempted_req_ids", None) or ())
                          if (state := self._sends.get(request_id)) is not None
                          and state.published)
        metadata = RemoteD2HMetadata(
            sends=tuple(sends), abandoned_sends=tuple(self._abandoned),
            recvs=tuple(self._new_recvs), revoked_recvs=tuple(self._revoked),
            declined_recvs=tuple(self._declined), preempted_sends=preempted,
            idle=not scheduler_output.num_scheduled_tokens)
        self._abandoned, self._new_recvs, self._revoked, self._declined = [], [], [], []
        return metadata

    def _plan_chunk(self, request: Any, state: _Send, scheduled: int) -> SendChunk | None:
        if state.finished_prompt:
            return None  # everything decode needs was sent
        size = self._block_size
        wanted = state.stop_block
        # Every token below ``end`` is in the layer buffers during this step's forward:
        # computed now, or context (a prefix hit, earlier chunks) loaded for this step.
        end = min(request.num_computed_tokens + scheduled, request.num_prompt_tokens,
                  wanted * size)
        stop = min(end // size, wanted)  # the blocks full after this step
        start = state.next_block
        state.next_block = max(state.next_block, end // size)
        last = end == wanted * size
        if stop <= start:
            return None
        block_ids = self._block_ids_of(request.request_id)[start:stop]
        state.published = True
        state.finished_prompt = state.finished_prompt or last
        return SendChunk(request_id=request.request_id, transfer_id=state.params.transfer_id,
                         decode_endpoints=state.params.decode_endpoints, start_block=start,
                         block_ids=tuple(block_ids), last=last,
                         notify_url=state.params.notify_url)

    # -- request end --------------------------------------------------------------------

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """(delay the free, params for the response) for a finishing request."""
        request_id = request.request_id
        state = self._sends.pop(request_id, None)
        if state is not None:
            if not state.published:
                return False, None
            if not state.finished_prompt:
                self._abandoned.append(request_id)
            # The worker reports the request once every read of its blocks is answered.
            return True, {"kvo_transfer_id": state.params.transfer_id}
        transfer_id = self._pending_recvs.pop(request_id, None)
        if transfer_id is not None:
            # Aborted while its pull may still write the blocks: free them only after the
            # worker has stopped the pull and answered the revocation.
            self._revoked.append(request_id)
            return True, None
        params = request.kv_transfer_params or {}
        if params.get(DO_REMOTE_PREFILL) and isinstance(params.get(TRANSFER_ID), str):
            # Ended before its blocks were allocated: a prefill may already be publishing.
            self._declined.append(params[TRANSFER_ID])
        return False, None


def _decode_params(request: Any) -> DecodePullParams | None:
    try:
        return DecodePullParams.from_params(request.kv_transfer_params)
    except TransferParamsError as error:
        logger.error("kvo remote_d2h: request %s has unusable kv_transfer_params, computing it "
                     "on decode instead: %s", request.request_id, error)
        request.kv_transfer_params[DO_REMOTE_PREFILL] = False
        return None


def _prefill_params(request: Any) -> PrefillSendParams | None:
    try:
        return PrefillSendParams.from_params(request.kv_transfer_params)
    except TransferParamsError as error:
        logger.error("kvo remote_d2h: request %s has unusable kv_transfer_params; its KV is not "
                     "sent to decode: %s", request.request_id, error)
        return None
