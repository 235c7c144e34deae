"""The proxy for vLLM's own Mooncake P/D pair (the benchmark's peer; not part of kvo).

vLLM's ``MooncakeConnector`` is driven by ``kv_transfer_params`` in the request bodies: the
prefill gets the request with ``max_tokens=1`` and ``{do_remote_decode, transfer_id}``, the
decode gets it unchanged but for ``{do_remote_prefill, remote_bootstrap_addr, remote_engine_id,
transfer_id}``, where the bootstrap address is the prefill's bootstrap server (it tells decode
where each prefill worker's Transfer Engine listens) and the engine id is the prefill's
``kv_transfer_config.engine_id``. The one ``transfer_id`` pairs the two requests, so both are
sent at once (the prefill's sender waits for decode's pull request, and decode waits for the
KV): the fastest order this connector allows. A failed prefill aborts the decode.

    python -m kvo_tools.pd.peer_proxy --prefill URL --decode URL --bootstrap http://127.0.0.1:P \\
        --engine-id ID --port N
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import attrs
from aiohttp import web


@attrs.frozen
class PeerConfig:
    prefill_url: str
    decode_url: str
    bootstrap_url: str
    engine_id: str


def prefill_body(body: Mapping[str, Any], transfer_id: str) -> dict[str, Any]:
    """The client's request as the prefill runs it: one token, not streamed, KV kept for decode."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                   "transfer_id": transfer_id})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], transfer_id: str, config: PeerConfig) -> dict[str, Any]:
    """The client's request as decode runs it: its prompt KV pulled from the prefill."""
    return {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_bootstrap_addr": config.bootstrap_url, "remote_engine_id": config.engine_id,
        "transfer_id": transfer_id}}


_CONFIG = web.AppKey("config", PeerConfig)
_SESSION = web.AppKey("session", aiohttp.ClientSession)


def build_app(config: PeerConfig) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_CONFIG] = config

    async def session_context(app: web.Application) -> Any:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            app[_SESSION] = session
            yield

    app.cleanup_ctx.append(session_context)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/health", _health)
    return app


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _route(request, "/v1/completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _route(request, "/v1/chat/completions")


async def _health(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def _prefill(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any]) -> None:
    async with session.post(url, json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"prefill answered {response.status}: {text[:500]}")


async def _route(request: web.Request, path: str) -> web.StreamResponse:
    config, session = request.app[_CONFIG], request.app[_SESSION]
    try:
        body = await request.json()
    except ValueError as error:
        return _error(400, f"the request body is not JSON: {error}")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    transfer_id = uuid.uuid4().hex
    prefill = asyncio.create_task(
        _prefill(session, config.prefill_url + path, prefill_body(body, transfer_id)))
    try:
        return await _relay_decode(request, session, config.decode_url + path,
                                   decode_body(body, transfer_id, config), prefill)
    finally:
        if not prefill.done():  # decode is done, so the prefill's answer is on its way
            await asyncio.wait({prefill}, timeout=30)
        prefill.cancel()
        with contextlib.suppress(BaseException):
            await prefill


async def _relay_decode(request: web.Request, session: aiohttp.ClientSession, url: str,
                        body: Mapping[str, Any], prefill: asyncio.Task[None]
                        ) -> web.StreamResponse:
    """Relay decode's answer to the client (streamed as it comes); a failed prefill ends it."""
    stream: list[web.StreamResponse] = []

    async def relay() -> web.StreamResponse:
        async with session.post(url, json=body) as response:
            if response.status != 200 or not body.get("stream"):
                return web.Response(body=await response.read(), status=response.status,
                                    content_type=response.content_type)
            out = web.StreamResponse(status=200, headers={
                "content-type": response.headers.get("content-type", "text/event-stream")})
            await out.prepare(request)
            stream.append(out)
            async for chunk in response.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    decode = asyncio.create_task(relay())
    await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
    if decode.done() or prefill.exception() is None:
        return await decode
    decode.cancel()  # closing decode's connection aborts its request
    with contextlib.suppress(BaseException):
        await decode
    message = f"prefill failed: {prefill.exception()}"
    if not stream:
        return _error(502, message)
    error_event = json.dumps({"error": {"message": message, "code": 502}})
    with contextlib.suppress(ConnectionError):
        await stream[0].write(f"data: {error_event}\n\n".encode())
        await stream[0].write_eof()
    return stream[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="prefill vLLM base URL")
    parser.add_argument("--decode", required=True, help="decode vLLM base URL")
    parser.add_argument("--bootstrap", required=True,
                        help="the prefill's Mooncake bootstrap server, http://HOST:PORT")
    parser.add_argument("--engine-id", required=True, help="the prefill's engine_id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    config = PeerConfig(prefill_url=args.prefill.rstrip("/"), decode_url=args.decode.rstrip("/"),
                        bootstrap_url=args.bootstrap.rstrip("/"), engine_id=args.engine_id)
    web.run_app(build_app(config), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
