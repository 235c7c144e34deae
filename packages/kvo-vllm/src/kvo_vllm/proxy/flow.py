"""One OpenAI request through the P/D flow (docs/design.md section 10).

1. The request goes to decode with ``do_remote_prefill``: decode allocates the prompt's blocks
   and advertises them (its control endpoints, the prefix it already holds) to the proxy.
2. The proxy sends the request to prefill with ``do_remote_decode`` and ``max_tokens=1``: the
   prefill computes layer by layer and publishes each layer; decode pulls.
3. Decode generates and the proxy relays its answer (streamed or not) to the client.

Step 2 waits for step 1's advertisement only for a decode the proxy has not heard from yet.
Once a decode's control endpoints are known (from its first advertisement), the proxy posts
prefill and decode at once: prefill derives which blocks to send from its own prompt and sends
from block 0, decode reads only what its prefix cache lacks, and a layer that arrives before
decode registered the request waits for it there (kvo_transport.ready_parking; its read is
fenced like any other). That takes decode's scheduling off the path before prefill starts.
A hand-off failure forgets the endpoints: the next request to that decode goes decode-first.

A decode with vLLM data parallelism (one API server, ``--data-parallel-size N``) has one set of
control endpoints per DP rank, and vLLM picks the rank that takes a request. Its advertisement
says which DP rank took it and how many there are; from then on the proxy pins each request to
a DP rank itself (round robin, vLLM's ``X-data-parallel-rank`` header, which vLLM's API server
honours for completions and chat) and keeps known endpoints per (decode URL, DP rank), so a
concurrent post only ever goes to the endpoints of the DP rank the request was pinned to. The
hub still checks the advertisement against them: a decode that ignored the pin fails the
request at once instead of leaving the prefill's layers waiting at a DP rank that never reads
them, and from then on every request to that decode waits for its advertisement (unpinned,
decode-first: correct whichever DP rank takes it).

Failures end cleanly: a decode error is relayed as is; a prefill that cannot hand the KV off
(it names the reason, e.g. a refused handshake) or answers with an error aborts the decode
request and the client gets an error naming what went wrong; a client that goes away aborts
both. A decode that computes the prompt itself (nothing to pull) is simply relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping
from typing import Any

import aiohttp
import attrs
from aiohttp import web

from kvo_vllm.proxy.hub import DecodeTopology, NotifyHub
from kvo_vllm.remote_d2h.params import DecodePullParams, PrefillSendParams

logger = logging.getLogger("kvo.proxy")

PREFILL_DROPPED_KEYS = ("stream_options", "min_tokens")
TRANSFER_ERROR = "kvo_transfer_error"
"""Error type of a request whose KV could not be handed from prefill to decode."""
DP_RANK_HEADER = "X-data-parallel-rank"
"""vLLM's OpenAI server sends a request with this header to that DP rank's engine."""


@attrs.frozen
class ProxyConfig:
    """Where the engines are and how long to wait for them."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    notify_url: str
    ready_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    concurrent_post: bool = True
    """Post prefill with decode at once for a decode whose endpoints are known; False: every
    request waits for decode's advertisement first (``--decode-first``)."""


@attrs.define
class RequestRecord:
    """What the proxy saw of one request (served at /kvo/v1/metadata)."""

    transfer_id: str
    endpoint: str
    stream: bool
    started: float
    ready_s: float | None = None
    prefill_s: float | None = None
    first_byte_s: float | None = None
    total_s: float | None = None
    skip_blocks: int | None = None
    concurrent: bool = False
    """Prefill was posted with decode at once (decode's endpoints were known)."""
    dp_rank: int | None = None
    """The decode DP rank the request was pinned to, or (unpinned) the one that took it."""
    outcome: str = "running"


class ProxyError(Exception):
    """Ends a request with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "kvo_proxy_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": str(self), "type": self.kind,
                                            "code": self.status}}, status=self.status)


class Flow:
    """The decode-first orchestration shared by every proxied request."""

    def __init__(self, config: ProxyConfig, hub: NotifyHub, session: aiohttp.ClientSession
                 ) -> None:
        self.config = config
        self.hub = hub
        self.session = session
        self._next_prefill = 0
        self._next_decode = 0
        self.records: deque[RequestRecord] = deque(maxlen=1000)
        self._background: set[asyncio.Future[Any]] = set()
        self._endpoints: dict[tuple[str, int], tuple[str, ...]] = {}
        """(decode URL, DP rank) -> that DP rank's control endpoints, from its latest
        advertisement."""
        self._dp_size: dict[str, int] = {}
        """decode URL -> its DP size, from its latest advertisement."""
        self._next_dp: dict[str, int] = {}
        self._ignores_pin: set[str] = set()
        """Decode URLs seen giving a pinned request to another DP rank: decode-first only."""

    def _pick(self) -> tuple[str, str]:
        prefill = self.config.prefill_urls[self._next_prefill % len(self.config.prefill_urls)]
        decode = self.config.decode_urls[self._next_decode % len(self.config.decode_urls)]
        self._next_prefill += 1
        self._next_decode += 1
        return prefill, decode

    def _pin(self, decode_url: str) -> int | None:
        """The DP rank this request goes to (round robin), or None: the decode's DP size is
        not known yet or is 1 (vLLM then picks, and the advertisement says which)."""
        dp_size = self._dp_size.get(decode_url, 1)
        if dp_size == 1 or decode_url in self._ignores_pin:
            return None
        turn = self._next_dp.get(decode_url, 0)
        self._next_dp[decode_url] = turn + 1
        return turn % dp_size

    async def handle(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return ProxyError(400, f"the request body is not JSON: {error}").response()
        if not isinstance(body, dict):
            return ProxyError(400, "the request body must be a JSON object").response()
        if body.get("n", 1) != 1 or body.get("best_of", 1) not in (None, 1):
            return ProxyError(400, "the P/D proxy serves one choice per request (n = 1); got "
                                   f"n={body.get('n')!r}").response()
        if "kv_transfer_params" in body:
            return ProxyError(400, "kv_transfer_params is set by the P/D proxy and must not be "
                                   "given by the client").response()
        record = RequestRecord(transfer_id=f"kvo-{uuid.uuid4().hex}", endpoint=path,
                               stream=bool(body.get("stream")), started=time.monotonic())
        self.records.append(record)
        try:
            response = await self._run(request, path, body, record)
            if record.outcome == "running":
                record.outcome = "ok" if response.status < 400 else f"http {response.status}"
            return response
        except ProxyError as error:
            record.outcome = f"error: {error}"
            logger.warning("request %s failed: %s", record.transfer_id, error)
            return error.response()
        except (ClientGoneError, ConnectionResetError) as error:
            record.outcome = "client went away"
            logger.info("request %s: the client closed the connection before the answer ended",
                        record.transfer_id)
            if isinstance(error.__cause__, ConnectionResetError):
                raise error.__cause__ from None  # what aiohttp expects of a gone client
            raise
        finally:
            record.total_s = time.monotonic() - record.started
            self.hub.forget(record.transfer_id)

    async def _run(self, request: web.Request, path: str, body: dict[str, Any],
                   record: RequestRecord) -> web.StreamResponse:
        prefill_url, decode_url = self._pick()
        tid = record.transfer_id
        pinned = self._pin(decode_url)
        record.dp_rank = pinned
        endpoints_key = (decode_url, 0 if pinned is None else pinned)
        known = (self._endpoints.get(endpoints_key)
                 if self.config.concurrent_post and decode_url not in self._ignores_pin
                 else None)
        ready, failed = self.hub.expect(tid, sent_to=known)
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = DecodePullParams(
            transfer_id=tid, notify_url=self.config.notify_url).to_params()
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        headers = {"X-Request-Id": tid}
        if pinned is not None:
            headers[DP_RANK_HEADER] = str(pinned)
        decode_call = asyncio.ensure_future(self.session.post(
            decode_url + path, json=decode_body, timeout=timeout, headers=headers))
        ready.add_done_callback(lambda done: self._on_ready(decode_url, record, done))
        try:
            if known is not None:
                record.concurrent = True
                first = await self._prefill(prefill_url, path, body, known, None, 0, failed,
                                            decode_call, decode_url, record)
            else:
                topology, first = await self._wait_ready(ready, decode_call, decode_url, record)
                if topology is not None:
                    first = await self._prefill(
                        prefill_url, path, body, topology.endpoints, topology.num_blocks,
                        topology.skip_blocks, failed, decode_call, decode_url, record)
            try:
                decode = await decode_call
            except aiohttp.ClientError as error:
                raise ProxyError(502, f"decode at {decode_url} failed: {error}") from error
            return await self._relay(request, decode, record, first)
        except ProxyError as error:
            if error.kind == TRANSFER_ERROR:  # next time: wait for decode's word
                ready.cancel()
                self._endpoints.pop(endpoints_key, None)
            raise
        finally:
            await _abort(decode_call)

    def _on_ready(self, decode_url: str, record: RequestRecord,
                  ready: asyncio.Future[DecodeTopology]) -> None:
        """Decode advertised the request's destination: note when, and keep the endpoints of
        the DP rank that took it (and the decode's DP size) for the decode's next requests."""
        if ready.cancelled() or ready.exception() is not None:
            return
        topology = ready.result()
        record.ready_s = time.monotonic() - record.started
        record.skip_blocks = topology.skip_blocks
        if record.dp_rank is not None and record.dp_rank != topology.dp_rank:
            logger.warning("request %s was pinned to DP rank %d of decode %s but DP rank %d "
                           "took it: the decode does not honour %s; every later request to "
                           "it waits for its advertisement (decode-first)", record.transfer_id,
                           record.dp_rank, decode_url, topology.dp_rank, DP_RANK_HEADER)
            self._ignores_pin.add(decode_url)
        record.dp_rank = topology.dp_rank
        if self._dp_size.get(decode_url) != topology.dp_size:
            # A decode seen for the first time, or restarted with another shape.
            for key in [key for key in self._endpoints if key[0] == decode_url]:
                del self._endpoints[key]
            self._dp_size[decode_url] = topology.dp_size
        self._endpoints[(decode_url, topology.dp_rank)] = topology.endpoints

    async def _wait_ready(self, ready: asyncio.Future[DecodeTopology],
                          decode_call: asyncio.Future[aiohttp.ClientResponse], decode_url: str,
                          record: RequestRecord) -> tuple[DecodeTopology | None, bytes]:
        """(where to send the KV, b"") once decode is ready, or (None, bytes already read)
        when decode answers without needing the prefill (an error, or it computed locally)."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending: set[asyncio.Future[Any]] = {ready, decode_call}
        first_chunk: asyncio.Future[bytes] | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProxyError(504, f"decode at {decode_url} did not allocate the request's "
                                      f"KV destination within {self.config.ready_timeout_s:g} s")
            done, _ = await asyncio.wait(pending, timeout=remaining,
                                         return_when=asyncio.FIRST_COMPLETED)
            if first_chunk is not None and first_chunk.done():
                # A token before readiness: decode computes the prompt itself.
                return None, first_chunk.result()
            if ready in done:
                if first_chunk is not None:
                    first_chunk.cancel()
                return ready.result(), b""
            if decode_call in done:
                pending.discard(decode_call)
                try:
                    decode = decode_call.result()
                except aiohttp.ClientError as error:
                    raise ProxyError(502, f"decode at {decode_url} failed: {error}") from error
                if decode.status != 200 or not record.stream:
                    return None, b""  # an error, or a complete local answer
                # Streaming headers come at once; wait for readiness or a first token.
                first_chunk = asyncio.ensure_future(decode.content.readany())
                pending.add(first_chunk)

    async def _prefill(self, prefill_url: str, path: str, body: Mapping[str, Any],
                       endpoints: tuple[str, ...], stop_block: int | None, skip_blocks: int,
                       failed: asyncio.Future[str],
                       decode_call: asyncio.Future[aiohttp.ClientResponse], decode_url: str,
                       record: RequestRecord) -> bytes:
        """Run the prefill half; the decode bytes that already arrived (b"" if none).

        Returns as soon as the prefill answered or the decode started answering (then the
        hand-off worked and the prefill's own answer no longer matters). Raises when the
        prefill refuses the request or reports a failed hand-off, or when decode fails first.
        """
        prefill_body = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_KEYS}
        prefill_body["stream"] = False
        prefill_body["max_tokens"] = 1
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["kv_transfer_params"] = PrefillSendParams(
            transfer_id=record.transfer_id, decode_endpoints=endpoints, stop_block=stop_block,
            skip_blocks=skip_blocks, notify_url=self.config.notify_url).to_params()
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        call = asyncio.ensure_future(self._post_json(prefill_url + path, prefill_body, timeout,
                                                     record.transfer_id))
        probe: asyncio.Future[bytes] | None = None
        waiting: set[asyncio.Future[Any]] = {call, failed, decode_call}
        try:
            while True:
                if decode_call.done():
                    waiting.discard(decode_call)
                    if decode_call.exception() is not None:
                        raise ProxyError(502, f"decode at {decode_url} failed while the "
                                              f"prefill ran: {decode_call.exception()}")
                    if not _streaming(decode_call):
                        # A complete (or refused) decode answer: nothing waits for the KV.
                        if decode_call.result().status == 200:
                            self._detach(call)
                        else:
                            call.cancel()
                        return b""
                    if probe is None:
                        probe = asyncio.ensure_future(decode_call.result().content.readany())
                        waiting.add(probe)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if failed in done:
                    raise ProxyError(502, f"prefill could not hand the KV to decode: "
                                          f"{failed.result()}", kind=TRANSFER_ERROR)
                if probe is not None and probe in done:
                    return self._early_decode_bytes(probe, decode_url, call)
                if call in done:
                    break
        except BaseException:
            call.cancel()
            raise
        finally:
            if probe is not None and not probe.done():
                probe.cancel()
        status, answer = call.result()
        record.prefill_s = time.monotonic() - started
        if status != 200:
            message = _error_message(answer)
            raise ProxyError(status if status >= 400 else 502,
                             f"prefill at {prefill_url} refused the request: {message}")
        # A hand-off failure can be reported just after the prefill answered.
        await asyncio.sleep(0)
        if failed.done() and not failed.cancelled():
            raise ProxyError(502, f"prefill could not hand the KV to decode: {failed.result()}",
                             kind=TRANSFER_ERROR)
        return b""

    def _early_decode_bytes(self, probe: asyncio.Future[bytes], decode_url: str,
                            call: asyncio.Future[Any]) -> bytes:
        try:
            data = probe.result()
        except aiohttp.ClientError as error:
            raise ProxyError(502, f"decode at {decode_url} failed while the prefill ran: "
                                  f"{error}") from error
        if not data:
            raise ProxyError(502, f"decode at {decode_url} closed its answer before the "
                                  f"prefill handed the KV over")
        self._detach(call)
        return data

    def _detach(self, call: asyncio.Future[Any]) -> None:
        """Let the prefill call finish on its own; its outcome is only logged."""
        def finished(task: asyncio.Future[Any]) -> None:
            self._background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.info("prefill call ended with %s after decode answered",
                            task.exception())

        self._background.add(call)
        call.add_done_callback(finished)

    async def _post_json(self, url: str, body: Mapping[str, Any], timeout: aiohttp.ClientTimeout,
                         request_id: str) -> tuple[int, Any]:
        try:
            async with self.session.post(url, json=body, timeout=timeout,
                                         headers={"X-Request-Id": request_id}) as response:
                text = await response.text()
                try:
                    return response.status, json.loads(text)
                except json.JSONDecodeError:
                    return response.status, text
        except aiohttp.ClientError as error:
            raise ProxyError(502, f"prefill at {url} failed: {error}") from error

    async def _relay(self, request: web.Request, decode: aiohttp.ClientResponse,
                     record: RequestRecord, first: bytes) -> web.StreamResponse:
        if not record.stream or decode.status != 200:
            payload = first + await decode.read()
            record.first_byte_s = time.monotonic() - record.started
            return web.Response(body=payload, status=decode.status,
                                content_type=decode.content_type or "application/json")
        response = web.StreamResponse(status=decode.status)
        response.content_type = decode.content_type or "text/event-stream"
        await response.prepare(request)
        if first:
            record.first_byte_s = time.monotonic() - record.started
            await response.write(first)
        try:
            async for chunk in decode.content.iter_any():
                if record.first_byte_s is None:
                    record.first_byte_s = time.monotonic() - record.started
                try:
                    await response.write(chunk)
                except ConnectionResetError as gone:  # aiohttp's is a ClientError too
                    raise ClientGoneError from gone
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            # The status line is out already: end the stream with an error event, so the
            # client sees a failure instead of a silently short answer.
            record.outcome = f"error: decode stream broke: {error}"
            logger.warning("request %s: decode stream broke: %s", record.transfer_id, error)
            event = {"error": {"message": f"decode stream broke: {error}",
                               "type": "kvo_proxy_error", "code": 502}}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        try:
            await response.write_eof()
        except ConnectionResetError:
            # Every event was written; the client stopped reading at the last one ([DONE]).
            logger.debug("request %s: the client closed before the stream's end marker",
                         record.transfer_id)
        return response


class ClientGoneError(Exception):
    """The client closed its connection while the proxy still wrote the answer to it."""


def _streaming(call: asyncio.Future[aiohttp.ClientResponse]) -> bool:
    """A decode call that returned a 200 event stream (its tokens come later)."""
    if not call.done() or call.cancelled() or call.exception() is not None:
        return False
    response = call.result()
    return response.status == 200 and response.content_type == "text/event-stream"


async def _abort(call: asyncio.Future[aiohttp.ClientResponse]) -> None:
    """Close the decode call: a no-op after a complete relay, an abort on decode otherwise."""
    if not call.done():
        call.cancel()
        with contextlib.suppress(BaseException):
            await call
        return
    if not call.cancelled() and call.exception() is None:
        call.result().close()


def _error_message(answer: Any) -> str:
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in answer:
            return str(answer["message"])
    return str(answer)[:500]
