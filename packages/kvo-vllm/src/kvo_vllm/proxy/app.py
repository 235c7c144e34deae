"""The proxy's HTTP surface (aiohttp, which vLLM already depends on).

Client-facing: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not),
``GET /v1/models`` (from a decode), ``GET /health``. Engine-facing: ``POST /kvo/v1/notify``
(decode readiness, prefill hand-off failures) and ``GET /kvo/v1/metadata`` (the topology the
decodes advertised and what happened to recent requests). With a control key, a notification
must carry a valid signature (remote_d2h.notify_auth); a refused one is answered 401, counted
and logged, and changes nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import attrs
from aiohttp import web

from kvo_transport.frame_auth import ControlKey, FrameRejectedError
from kvo_vllm.proxy.flow import Flow, ProxyConfig, ProxyError
from kvo_vllm.proxy.hub import NotifyHub
from kvo_vllm.remote_d2h.notify_auth import HEADER, NotifyVerifier
from kvo_vllm.remote_d2h.params import TransferParamsError, parse_notification

logger = logging.getLogger("kvo.proxy")

NOTIFY_PATH = "/kvo/v1/notify"
METADATA_PATH = "/kvo/v1/metadata"
MAX_NOTIFY_BYTES = 64 * 1024
ENGINE_KEEPALIVE_S = 2.0
"""How long an idle connection to an engine is kept for reuse. vLLM's API server closes idle
ones after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request sent on a pooled connection just as
the server closes it fails with "Server disconnected" (seen in the e2e bench, requests ~5 s
apart), so the proxy drops them well before."""

_FLOW = web.AppKey("flow", Flow)
_HUB = web.AppKey("hub", NotifyHub)
_CONFIG = web.AppKey("config", ProxyConfig)
_VERIFIER = web.AppKey("verifier", NotifyVerifier)


def build_app(config: ProxyConfig, control_key: ControlKey | None = None) -> web.Application:
    """An aiohttp application serving the proxy; the client session lives with the app.

    ``control_key``: notifications must be signed with it (None: unsigned ones are accepted;
    the caller must then bind loopback only, see cli.py).
    """
    app = web.Application(client_max_size=64 * 1024 * 1024)
    hub = NotifyHub()
    app[_HUB] = hub
    app[_CONFIG] = config
    app[_VERIFIER] = NotifyVerifier(control_key)

    async def session_context(app: web.Application) -> Any:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=ENGINE_KEEPALIVE_S)
        async with aiohttp.ClientSession(connector=connector) as session:
            app[_FLOW] = Flow(config, hub, session)
            yield

    app.cleanup_ctx.append(session_context)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_post(NOTIFY_PATH, _notify)
    app.router.add_get(METADATA_PATH, _metadata)
    return app


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[_FLOW].handle(request, "/v1/completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await request.app[_FLOW].handle(request, "/v1/chat/completions")


async def _models(request: web.Request) -> web.StreamResponse:
    flow = request.app[_FLOW]
    url = flow.config.decode_urls[0] + "/v1/models"
    try:
        async with flow.session.get(url) as response:
            return web.Response(body=await response.read(), status=response.status,
                                content_type=response.content_type)
    except aiohttp.ClientError as error:
        return ProxyError(502, f"decode at {url} failed: {error}").response()


async def _health(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok", "waiting": len(request.app[_HUB])})


async def _notify(request: web.Request) -> web.StreamResponse:
    if request.content_length is not None and request.content_length > MAX_NOTIFY_BYTES:
        return ProxyError(413, f"a notification is at most {MAX_NOTIFY_BYTES} bytes").response()
    raw = await request.read()
    verifier = request.app[_VERIFIER]
    try:
        verifier.verify(request.headers.get(HEADER), raw)
    except FrameRejectedError as error:
        logger.warning("refused a notification from %s (%d refused so far: %s): %s",
                       request.remote, verifier.counters.total, verifier.counters.as_dict(),
                       error)
        return ProxyError(401, f"notification refused: {error}").response()
    try:
        body = json.loads(raw)
        note = parse_notification(body)
    except (json.JSONDecodeError, UnicodeDecodeError, TransferParamsError) as error:
        logger.warning("rejected a notification: %s", error)
        return ProxyError(400, f"bad notification: {error}").response()
    known = request.app[_HUB].deliver(note)
    if not known:
        logger.info("notification %s for unknown transfer %s (request over or timed out)",
                    type(note).__name__, note.transfer_id)
    return web.json_response({"known": known})


async def _metadata(request: web.Request) -> web.StreamResponse:
    hub = request.app[_HUB]
    flow = request.app[_FLOW]
    config = request.app[_CONFIG]
    return web.json_response({
        "prefill_urls": list(config.prefill_urls),
        "decode_urls": list(config.decode_urls),
        "decode_tp": hub.decode_tp,
        "decode_endpoints": {_rank_label(dp, tp): ep
                             for (dp, tp), ep in sorted(hub.endpoints_seen.items())},
        "waiting": len(hub),
        "unknown_notifications": hub.unknown_notifications,
        "refused_notifications": request.app[_VERIFIER].counters.as_dict(),
        "requests": [attrs.asdict(record) for record in flow.records],
    })


def _rank_label(dp_rank: int, tp_rank: int) -> str:
    """A decode rank in /kvo/v1/metadata: ``"DP/TP"`` (``"0/1"``: DP rank 0, TP rank 1)."""
    return f"{dp_rank}/{tp_rank}"
