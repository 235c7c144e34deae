"""The P/D proxy's flow against fake engines (its own logic only).

The fake decode advertises its destination to the proxy's notify endpoint and answers once the
fake prefill was asked; the fake prefill records what it got. The real engines are exercised by
tests/e2e/test_pd.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import attrs
from aiohttp import web

from kvo_vllm.proxy.app import ENGINE_KEEPALIVE_S, NOTIFY_PATH, build_app
from kvo_vllm.proxy.flow import Flow, ProxyConfig
from kvo_vllm.proxy.hub import DecodeTopology, NotifyHub
from kvo_vllm.remote_d2h.params import DecodeReady, PrefillFailed

ENDPOINT = "tcp://127.0.0.1:20100"
STREAM = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
          b"data: [DONE]\n\n"]


@attrs.define
class Fakes:
    """Behaviour switches and what the fake engines saw."""

    notify: bool = True
    decode_status: int = 200
    prefill_fails: str | None = None
    prefill_status: int = 200
    decode_bodies: list[dict[str, Any]] = attrs.Factory(list)
    prefill_bodies: list[dict[str, Any]] = attrs.Factory(list)
    decode_cancelled: int = 0
    stream_pause_s: float = 0.0
    """Decode pauses this long between its streamed events."""
    prefilled: asyncio.Event = attrs.Factory(asyncio.Event)
    dp_size: int = 1
    """A decode with vLLM data parallelism: its DP ranks' endpoints differ."""
    honour_pin: bool = True
    """Send a pinned request (X-data-parallel-rank) to that DP rank, as vLLM does."""
    dp_taken: list[int] = attrs.Factory(list)
    """The DP rank that took each decode request; unpinned ones alternate from first_rank."""
    first_rank: int = 1
    dp_headers: list[str | None] = attrs.Factory(list)
    prefill_pause_s: float = 0.0


def dp_endpoint(dp_rank: int) -> str:
    """DP rank r's control endpoint (TP 1): kv_port + r."""
    return f"tcp://127.0.0.1:{20100 + dp_rank}"


def _port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def _serve(app: web.Application, sock: socket.socket) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


def _decode_app(fakes: Fakes) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fakes.decode_bodies.append(body)
        if fakes.decode_status != 200:
            return web.json_response({"error": {"message": "bad request"}},
                                     status=fakes.decode_status)
        params = body["kv_transfer_params"]
        pin = request.headers.get("X-data-parallel-rank")
        fakes.dp_headers.append(pin)
        if pin is not None and fakes.honour_pin:
            dp_rank = int(pin)
        else:
            dp_rank = (len(fakes.dp_taken) + fakes.first_rank) % fakes.dp_size
        fakes.dp_taken.append(dp_rank)
        if fakes.notify:
            ready = DecodeReady(
                transfer_id=params["kvo_transfer_id"], d_rank=0, decode_tp=1,
                endpoint=ENDPOINT if fakes.dp_size == 1 else dp_endpoint(dp_rank),
                skip_blocks=1, num_blocks=4, dp_rank=dp_rank, dp_size=fakes.dp_size)
            async with aiohttp.ClientSession() as session:
                await session.post(params["kvo_notify_url"], json=ready.to_json())
            for _ in range(200):  # until the prefill was asked, or the proxy hung up
                if fakes.prefilled.is_set():
                    break
                if request.transport is None or request.transport.is_closing():
                    fakes.decode_cancelled += 1
                    return web.Response(status=499)
                await asyncio.sleep(0.05)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "ab", "token_ids": [1, 2]}]})
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        for chunk in STREAM:
            await response.write(chunk)
            await asyncio.sleep(fakes.stream_pause_s)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    return app


def _prefill_app(fakes: Fakes) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fakes.prefill_bodies.append(body)
        params = body["kv_transfer_params"]
        if fakes.prefill_fails:
            failed = PrefillFailed(transfer_id=params["kvo_transfer_id"],
                                   error=fakes.prefill_fails)
            async with aiohttp.ClientSession() as session:
                await session.post(params["kvo_notify_url"], json=failed.to_json())
            await asyncio.sleep(5)  # the proxy must not wait for this answer
        await asyncio.sleep(fakes.prefill_pause_s)
        fakes.prefilled.set()
        if fakes.prefill_status != 200:
            return web.json_response({"error": {"message": "prompt too long"}},
                                     status=fakes.prefill_status)
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    return app


def _run(fakes: Fakes, scenario: Callable[[str, aiohttp.ClientSession], Awaitable[None]],
         concurrent_post: bool = True) -> None:
    async def main() -> None:
        socks = [_port() for _ in range(3)]
        urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
        config = ProxyConfig(prefill_urls=(urls[1],), decode_urls=(urls[2],),
                             notify_url=urls[0] + NOTIFY_PATH, ready_timeout_s=5,
                             concurrent_post=concurrent_post)
        runners = [await _serve(build_app(config), socks[0]),
                   await _serve(_prefill_app(fakes), socks[1]),
                   await _serve(_decode_app(fakes), socks[2])]
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.wait_for(scenario(urls[0], session), 30)
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())


BODY = {"model": "m", "prompt": "hello", "max_tokens": 5, "min_tokens": 2, "temperature": 0}


def test_decode_first_then_prefill_then_the_decode_answer() -> None:
    fakes = Fakes()

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        async with session.post(proxy + "/v1/completions", json=BODY) as response:
            assert response.status == 200
            assert (await response.json())["choices"][0]["token_ids"] == [1, 2]
        async with session.get(proxy + "/kvo/v1/metadata") as response:
            metadata = await response.json()
        assert metadata["decode_endpoints"] == {"0/0": ENDPOINT}
        assert metadata["requests"][0]["outcome"] == "ok"
        assert metadata["requests"][0]["skip_blocks"] == 1

    _run(fakes, scenario)
    decode_params = fakes.decode_bodies[0]["kv_transfer_params"]
    prefill = fakes.prefill_bodies[0]
    assert decode_params["do_remote_prefill"] is True
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "min_tokens" not in prefill
    params = prefill["kv_transfer_params"]
    assert params["do_remote_decode"] is True
    assert params["kvo_transfer_id"] == decode_params["kvo_transfer_id"]
    assert params["kvo_decode_endpoints"] == [ENDPOINT]
    assert (params["kvo_skip_blocks"], params["kvo_stop_block"]) == (1, 4)


def test_a_known_decode_gets_prefill_at_once_until_a_hand_off_fails() -> None:
    """After a decode's first advertisement the proxy posts prefill without waiting for the
    next one (no stop block: prefill derives it; from block 0: decode skips what it holds);
    a failed hand-off forgets the endpoints, so the next request goes decode-first again."""
    fakes = Fakes()

    async def ask(proxy: str, session: aiohttp.ClientSession, status: int) -> None:
        async with session.post(proxy + "/v1/completions", json=BODY) as response:
            assert response.status == status

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        await ask(proxy, session, 200)
        await ask(proxy, session, 200)
        fakes.prefill_fails, fakes.prefilled = "decode refused the READY", asyncio.Event()
        await ask(proxy, session, 502)
        fakes.prefill_fails = None
        await ask(proxy, session, 200)
        async with session.get(proxy + "/kvo/v1/metadata") as response:
            records = (await response.json())["requests"]
        assert [r["concurrent"] for r in records] == [False, True, True, False]
        assert [r["outcome"] for r in records][:2] == ["ok", "ok"]

    _run(fakes, scenario)
    params = [body["kv_transfer_params"] for body in fakes.prefill_bodies]
    assert (params[0]["kvo_skip_blocks"], params[0]["kvo_stop_block"]) == (1, 4)
    for at_once in params[1:3]:
        assert "kvo_stop_block" not in at_once and at_once["kvo_skip_blocks"] == 0
        assert at_once["kvo_decode_endpoints"] == [ENDPOINT]
    assert params[3]["kvo_stop_block"] == 4


def test_decode_first_switch_waits_for_every_advertisement() -> None:
    fakes = Fakes()

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        for _ in range(3):
            async with session.post(proxy + "/v1/completions", json=BODY) as response:
                assert response.status == 200
        async with session.get(proxy + "/kvo/v1/metadata") as response:
            records = (await response.json())["requests"]
        assert [(r["concurrent"], r["outcome"]) for r in records] == [(False, "ok")] * 3

    _run(fakes, scenario, concurrent_post=False)
    for body in fakes.prefill_bodies:  # each one told decode's stop block and prefix
        params = body["kv_transfer_params"]
        assert (params["kvo_skip_blocks"], params["kvo_stop_block"]) == (1, 4)


def test_a_dp_decode_is_pinned_per_rank_and_each_prefill_goes_to_the_rank_that_took_it(
        ) -> None:
    """A decode with 2 DP ranks: the first request is unpinned (vLLM picks rank 1) and goes
    decode-first; its advertisement tells the DP size, and from then on requests are pinned
    round robin. A rank whose endpoints are not known yet goes decode-first, a known one gets
    its prefill at once, to that rank's own endpoints; never another rank's."""
    fakes = Fakes(dp_size=2)

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        for _ in range(6):
            async with session.post(proxy + "/v1/completions", json=BODY) as response:
                assert response.status == 200, await response.text()
        async with session.get(proxy + "/kvo/v1/metadata") as response:
            metadata = await response.json()
        records = metadata["requests"]
        assert [r["concurrent"] for r in records] == [False, False, True, True, True, True]
        assert [r["dp_rank"] for r in records] == [1, 0, 1, 0, 1, 0]
        assert metadata["decode_endpoints"] == {"0/0": dp_endpoint(0), "1/0": dp_endpoint(1)}

    _run(fakes, scenario)
    assert fakes.dp_headers == [None, "0", "1", "0", "1", "0"]
    assert fakes.dp_taken == [1, 0, 1, 0, 1, 0]
    sent_to = [body["kv_transfer_params"]["kvo_decode_endpoints"]
               for body in fakes.prefill_bodies]
    assert sent_to == [[dp_endpoint(rank)] for rank in fakes.dp_taken]


def test_a_decode_that_ignores_the_pin_fails_the_request_at_once_then_goes_decode_first(
        ) -> None:
    """The prefill of a concurrent post went to DP rank 0's endpoints but rank 1 took the
    request: the hub sees it in rank 1's advertisement and the request fails naming both,
    without waiting for the prefill; later requests to that decode are not pinned and wait for
    its word (each prefill then goes to the rank that took the request)."""
    fakes = Fakes(dp_size=2, honour_pin=False, first_rank=0, prefill_pause_s=1.0)

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        statuses, errors = [], []
        for _ in range(4):
            async with session.post(proxy + "/v1/completions", json=BODY) as response:
                statuses.append(response.status)
                if response.status != 200:
                    errors.append((await response.json())["error"])
        assert statuses == [200, 502, 200, 200], statuses
        assert errors[0]["type"] == "kvo_transfer_error"
        assert (f"decode DP rank 1 took the request and advertised ['{dp_endpoint(1)}'], but "
                f"the prefill was already sent to ['{dp_endpoint(0)}']") in errors[0]["message"]
        async with session.get(proxy + "/kvo/v1/metadata") as response:
            records = (await response.json())["requests"]
        assert [r["concurrent"] for r in records] == [False, True, False, False]
        assert records[1]["total_s"] < 1.0  # not after the prefill's answer

    _run(fakes, scenario)
    # Unpinned -> rank 0 (learnt); pinned 0 but rank 1 took it: failed; then unpinned,
    # decode-first, each prefill to the rank that took the request.
    assert fakes.dp_taken == [0, 1, 0, 1]
    assert fakes.dp_headers == [None, "0", None, None]
    sent_to = [body["kv_transfer_params"]["kvo_decode_endpoints"]
               for body in fakes.prefill_bodies]
    assert sent_to == [[dp_endpoint(0)], [dp_endpoint(0)], [dp_endpoint(0)], [dp_endpoint(1)]]


def test_two_dp_ranks_advertising_one_transfer_fail_it() -> None:
    async def main() -> None:
        hub = NotifyHub()
        ready, failed = hub.expect("t1")
        for dp_rank in (0, 1):
            hub.deliver(DecodeReady(transfer_id="t1", d_rank=dp_rank, decode_tp=2,
                                    endpoint=dp_endpoint(dp_rank), skip_blocks=0,
                                    num_blocks=2, dp_rank=dp_rank, dp_size=2))
        assert failed.done() and "decode DP ranks [0] and 1 both advertised" in failed.result()
        assert ready.exception() is not None

    asyncio.run(main())


def test_every_tp_rank_of_the_dp_rank_must_advertise_before_ready() -> None:
    async def main() -> None:
        hub = NotifyHub()
        ready, _ = hub.expect("t1")
        endpoints = ("tcp://127.0.0.1:20102", "tcp://127.0.0.1:20103")  # DP rank 1 of TP 2
        for tp_rank in (1, 0):
            assert not ready.done()
            hub.deliver(DecodeReady(transfer_id="t1", d_rank=tp_rank, decode_tp=2,
                                    endpoint=endpoints[tp_rank], skip_blocks=0, num_blocks=2,
                                    dp_rank=1, dp_size=2))
        assert ready.result() == DecodeTopology(endpoints=endpoints, skip_blocks=0,
                                                num_blocks=2, dp_rank=1, dp_size=2)

    asyncio.run(main())


def test_streams_are_relayed_chunk_by_chunk() -> None:
    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        async with session.post(proxy + "/v1/chat/completions",
                                json={**BODY, "stream": True}) as response:
            assert response.status == 200
            assert await response.read() == b"".join(STREAM)

    _run(Fakes(), scenario)


def test_a_client_that_stops_reading_is_recorded_not_left_running() -> None:
    """A client that closes at [DONE] (before the stream's end marker) got its whole answer:
    the record says ok; one that closes mid-stream is recorded as gone, not "running"."""
    fakes = Fakes(stream_pause_s=0.3)

    async def records(proxy: str, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        async with session.get(proxy + "/kvo/v1/metadata") as response:
            return list((await response.json())["requests"])

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        async with aiohttp.ClientSession() as reader:
            response = await reader.post(proxy + "/v1/completions",
                                         json={**BODY, "stream": True})
            assert await response.content.readuntil(b"\n\n") == STREAM[0]
            response.close()  # gone before the second event
        async with aiohttp.ClientSession() as reader:
            response = await reader.post(proxy + "/v1/completions",
                                         json={**BODY, "stream": True})
            while await response.content.readuntil(b"\n\n") != STREAM[-1]:
                pass
            response.close()  # stops at [DONE]
        for _ in range(40):
            outcomes = [r["outcome"] for r in await records(proxy, session)]
            if "running" not in outcomes:
                break
            await asyncio.sleep(0.1)
        assert outcomes == ["client went away", "ok"]

    _run(fakes, scenario)


def test_a_refused_hand_off_aborts_decode_with_a_clear_error() -> None:
    fakes = Fakes(prefill_fails="decode rejected the handshake: block size mismatch")

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        async with session.post(proxy + "/v1/completions", json=BODY) as response:
            assert response.status == 502
            error = (await response.json())["error"]
        assert error["type"] == "kvo_transfer_error"
        assert "block size mismatch" in error["message"]
        await asyncio.sleep(0.5)
        assert fakes.decode_cancelled == 1  # the decode request was dropped, not left waiting

    _run(fakes, scenario)


def test_engine_errors_are_relayed() -> None:
    decode_error = Fakes(decode_status=400)

    async def refused(proxy: str, session: aiohttp.ClientSession) -> None:
        async with session.post(proxy + "/v1/completions", json=BODY) as response:
            assert response.status == 400
            assert (await response.json())["error"]["message"] == "bad request"

    _run(decode_error, refused)
    assert decode_error.prefill_bodies == []

    prefill_error = Fakes(prefill_status=400)

    async def too_long(proxy: str, session: aiohttp.ClientSession) -> None:
        async with session.post(proxy + "/v1/completions", json=BODY) as response:
            assert response.status == 400
            assert "prompt too long" in (await response.json())["error"]["message"]

    _run(prefill_error, too_long)


def test_a_decode_that_computes_locally_is_relayed_without_prefill() -> None:
    fakes = Fakes(notify=False)

    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        async with session.post(proxy + "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status == 200 and await r.read() == b"".join(STREAM)

    _run(fakes, scenario)
    assert fakes.prefill_bodies == []


def test_bad_client_requests_are_refused_at_the_door() -> None:
    async def scenario(proxy: str, session: aiohttp.ClientSession) -> None:
        for body, word in (({**BODY, "n": 2}, "n = 1"),
                           ({**BODY, "kv_transfer_params": {}}, "kv_transfer_params")):
            async with session.post(proxy + "/v1/completions", json=body) as response:
                assert response.status == 400
                assert word in (await response.json())["error"]["message"]
        async with session.post(proxy + "/v1/completions", data=b"{not json") as response:
            assert response.status == 400
        async with session.post(proxy + NOTIFY_PATH, data=json.dumps({"kind": "x"})) as r:
            assert r.status == 400

    _run(Fakes(), scenario)


def test_pooled_engine_connections_are_dropped_before_vllm_closes_them() -> None:
    """A request sent on a connection the engine is closing fails ("Server disconnected"):
    the proxy must let idle ones go before vLLM's API server does."""
    import vllm.envs

    assert ENGINE_KEEPALIVE_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE

    async def main() -> None:
        app = build_app(ProxyConfig(prefill_urls=("http://127.0.0.1:9",),
                                    decode_urls=("http://127.0.0.1:9",),
                                    notify_url="http://127.0.0.1:9" + NOTIFY_PATH))
        runner = web.AppRunner(app)
        await runner.setup()  # runs the cleanup context that opens the engine session
        try:
            flows = [v for v in app.values() if isinstance(v, Flow)]
            assert len(flows) == 1
            connector = flows[0].session.connector
            assert connector is not None
            assert connector._keepalive_timeout == ENGINE_KEEPALIVE_S
        finally:
            await runner.cleanup()

    asyncio.run(main())

