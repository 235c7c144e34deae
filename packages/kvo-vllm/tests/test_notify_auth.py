"""Signed notifications: the real Notifier against the real proxy app (aiohttp on loopback);
unsigned, forged and replayed POSTs are refused (401) and counted; the CLI refuses a
non-loopback bind without a secret."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from kvo_transport.frame_auth import ControlKey, FrameRejectedError, Rejection
from kvo_vllm.proxy import cli
from kvo_vllm.proxy.app import METADATA_PATH, NOTIFY_PATH, build_app
from kvo_vllm.proxy.flow import ProxyConfig
from kvo_vllm.remote_d2h.notify import Notifier
from kvo_vllm.remote_d2h.notify_auth import HEADER, NotifyVerifier, sign
from kvo_vllm.remote_d2h.params import PrefillFailed

KEY = ControlKey.from_secret("the proxy's secret, 16+ chars")
SENDER = "00112233aabbccdd"


def test_verifier_accepts_each_signed_body_once() -> None:
    verifier = NotifyVerifier(KEY)
    body = b'{"kind": "x"}'
    verifier.verify(sign(KEY, SENDER, 1, body), body)
    verifier.verify(sign(KEY, SENDER, 2, body), body)
    cases = [(sign(KEY, SENDER, 2, body), body, Rejection.REPLAY),
             (sign(KEY, SENDER, 3, body), body + b" ", Rejection.BAD_MAC),
             (sign(ControlKey.from_secret("x" * 16), SENDER, 3, body), body, Rejection.BAD_MAC),
             ("v1 garbage", body, Rejection.BAD_MAC),
             (None, body, Rejection.MISSING_MAC)]
    for header, data, rejection in cases:
        with pytest.raises(FrameRejectedError) as info:
            verifier.verify(header, data)
        assert info.value.rejection is rejection
    assert verifier.counters.total == 5
    verifier.verify(sign(KEY, SENDER, 3, body), body)  # the good sender goes on
    with pytest.raises(FrameRejectedError) as info:
        NotifyVerifier(None).verify(sign(KEY, SENDER, 1, body), body)
    assert info.value.rejection is Rejection.UNEXPECTED_MAC
    NotifyVerifier(None).verify(None, body)


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def test_the_proxy_takes_signed_notifications_and_refuses_the_rest() -> None:
    async def main() -> None:
        sock = _free_socket()
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = ProxyConfig(prefill_urls=("http://127.0.0.1:9",),
                             decode_urls=("http://127.0.0.1:9",), notify_url=base + NOTIFY_PATH)
        runner = web.AppRunner(build_app(config, KEY))
        await runner.setup()
        await web.SockSite(runner, sock).start()
        try:
            # The engines' real Notifier (its own thread, urllib), signing with the key.
            notifier = Notifier("test-notify", KEY)
            for n in range(3):
                notifier.post(base + NOTIFY_PATH, PrefillFailed(f"t{n}", "e").to_json())
            deadline = time.monotonic() + 10
            while notifier.sent + notifier.failed < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            notifier.close()
            assert (notifier.sent, notifier.failed) == (3, 0)

            body = json.dumps(PrefillFailed("t9", "e").to_json()).encode()
            signed = sign(KEY, SENDER, 1, body)
            posts = [({}, 401), ({HEADER: signed}, 200), ({HEADER: signed}, 401),
                     ({HEADER: sign(KEY, SENDER, 2, body)[:-2] + "00"}, 401)]
            async with aiohttp.ClientSession() as session:
                for headers, status in posts:
                    async with session.post(base + NOTIFY_PATH, data=body, headers={
                            "content-type": "application/json", **headers}) as response:
                        assert response.status == status, (headers, await response.text())
                async with session.get(base + METADATA_PATH) as response:
                    meta = await response.json()
            assert meta["unknown_notifications"] == 4  # 3 + 1 accepted, none waited for
            assert meta["refused_notifications"] == {"missing_mac": 1, "bad_mac": 1,
                                                     "replay": 1, "wrong_session": 0,
                                                     "unexpected_mac": 0}
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_cli_refuses_a_non_loopback_bind_without_a_secret(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVO_CONTROL_SECRET", raising=False)
    code = cli.main(["--prefill", "http://10.77.0.1:1", "--decode", "http://10.77.0.2:1",
                     "--host", "0.0.0.0"])
    assert code == 2
    assert "no control secret is set" in capsys.readouterr().err
