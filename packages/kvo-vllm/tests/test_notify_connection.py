"""The Notifier keeps one connection to the proxy open (a DecodeReady lies on every request's
critical path) and, when the proxy closed it meanwhile, sends the notification once more on a
new connection with a new sequence number, so a signed one is still accepted."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from kvo_transport.frame_auth import ControlKey
from kvo_vllm.remote_d2h.notify import Notifier
from kvo_vllm.remote_d2h.notify_auth import HEADER, NotifyVerifier

KEY = ControlKey.from_secret("the proxy's secret, 16+ chars")


class _Proxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.verifier = NotifyVerifier(KEY)
        self.bodies: list[bytes] = []
        self.connections = 0
        self.drop_after_next = False
        """Close the connection, without saying so, after answering the next POST."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/kvo/v1/notify"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Proxy

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.verifier.verify(self.headers.get(HEADER), body)  # raises on a replay
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
        if self.server.drop_after_next:
            self.server.drop_after_next = False
            self.close_connection = True  # no "Connection: close": the client finds out later

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[_Proxy]:
    server = _Proxy()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _wait_for(notifier: Notifier, count: int) -> None:
    limit = time.monotonic() + 10
    while notifier.sent + notifier.failed < count and time.monotonic() < limit:
        time.sleep(0.01)


def test_notifications_share_one_connection(proxy: _Proxy) -> None:
    notifier = Notifier(key=KEY)
    try:
        for i in range(5):
            notifier.post(proxy.url, {"kind": "test", "i": i})
        _wait_for(notifier, 5)
    finally:
        notifier.close()
    assert (notifier.sent, notifier.failed) == (5, 0)
    assert [b'"i": %d' % i in body for i, body in enumerate(proxy.bodies)] == [True] * 5
    assert proxy.connections == 1


def test_a_connection_the_proxy_closed_is_reopened_and_the_post_signed_anew(proxy: _Proxy
                                                                            ) -> None:
    notifier = Notifier(key=KEY)
    try:
        proxy.drop_after_next = True
        notifier.post(proxy.url, {"kind": "test", "i": 0})
        _wait_for(notifier, 1)
        time.sleep(0.2)  # the proxy's side of the connection is closed by now
        notifier.post(proxy.url, {"kind": "test", "i": 1})
        _wait_for(notifier, 2)
    finally:
        notifier.close()
    assert (notifier.sent, notifier.failed) == (2, 0)
    assert len(proxy.bodies) == 2 and b'"i": 1' in proxy.bodies[1]
    assert proxy.connections == 2
    assert proxy.verifier.counters.total == 0  # nothing refused: no sequence number reused


def test_a_refusing_proxy_counts_a_failure_and_the_next_post_still_goes(proxy: _Proxy) -> None:
    notifier = Notifier(key=ControlKey.from_secret("another secret, 16+ chars"))
    try:
        notifier.post(proxy.url, {"kind": "test"})  # bad MAC: the handler raises, no answer
        _wait_for(notifier, 1)
        notifier.post("ftp://127.0.0.1:1/x", {"kind": "test"})
        _wait_for(notifier, 2)
    finally:
        notifier.close()
    assert (notifier.sent, notifier.failed) == (0, 2)
    assert proxy.bodies == []
