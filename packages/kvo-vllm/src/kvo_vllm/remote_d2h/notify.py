"""POST small JSON notifications to the proxy without blocking vLLM's forward.

The decode advertises a request's destination (``DecodeReady``) and the prefill reports a
request it cannot hand off (``PrefillFailed``) to the proxy's notify endpoint. One background
thread sends them in order; a proxy that does not answer costs a logged warning, never a
stalled engine step. With a control key every POST is signed (notify_auth).

The thread keeps one HTTP/1.1 connection per proxy open: a decode's ``DecodeReady`` lies on
every request's critical path (the proxy starts the prefill only when it arrives), and a new
TCP connection per POST (connect, the proxy's accept) is the larger part of that hop. A kept
connection the proxy closed meanwhile is reopened and the POST sent once more, signed with a
new sequence number (a notification is idempotent at the proxy; a repeated sequence number
would be refused as a replay).
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import queue
import threading
import urllib.parse
from typing import Any

from kvo_transport.frame_auth import ControlKey
from kvo_vllm.remote_d2h.notify_auth import HEADER, sign

logger = logging.getLogger(__name__)

TIMEOUT_S = 5.0
_CLOSED = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
           ConnectionAbortedError)
"""What a kept connection the other side has closed raises on its next use."""


class Notifier:
    """A queue and one daemon thread that POSTs ``(url, body)`` pairs."""

    def __init__(self, name: str = "kvo-notify", key: ControlKey | None = None) -> None:
        self._key = key
        self._sender = os.urandom(8).hex()
        self._seqs = itertools.count(1)
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.sent = 0
        self.failed = 0

    def post(self, url: str | None, body: dict[str, Any]) -> None:
        if url:
            self._queue.put((url, body))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=TIMEOUT_S + 1)

    def _run(self) -> None:
        connections: dict[tuple[str, int], http.client.HTTPConnection] = {}
        while True:
            item = self._queue.get()
            if item is None:
                for connection in connections.values():
                    connection.close()
                return
            url, body = item
            try:
                self._post(connections, url, json.dumps(body).encode())
                self.sent += 1
            except (OSError, http.client.HTTPException, ValueError) as error:
                self.failed += 1
                logger.warning("kvo remote_d2h: notifying %s of %s failed: %s", url,
                               body.get("kind"), error)

    def _post(self, connections: dict[tuple[str, int], http.client.HTTPConnection], url: str,
              data: bytes) -> None:
        """POST ``data`` over the kept connection to ``url``'s host (one retry on a fresh
        connection when the kept one turns out closed); raise on failure or a non-2xx."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the notify URL must be http://HOST:PORT/PATH, got {url!r}")
        where = (parts.hostname, parts.port or 80)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        for attempt in (1, 2):
            connection = connections.get(where)
            fresh = connection is None
            if connection is None:
                connection = connections[where] = http.client.HTTPConnection(
                    where[0], where[1], timeout=TIMEOUT_S)
            headers = {"content-type": "application/json"}
            if self._key is not None:
                headers[HEADER] = sign(self._key, self._sender, next(self._seqs), data)
            try:
                connection.request("POST", path, body=data, headers=headers)
                response = connection.getresponse()
                response.read()
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                del connections[where]
                if fresh or attempt == 2 or not isinstance(error, _CLOSED):
                    raise
                continue  # the proxy closed the kept connection: once more on a new one
            if response.will_close:
                connection.close()
                del connections[where]
            if not 200 <= response.status < 300:
                raise OSError(f"HTTP {response.status} {response.reason}")
            return
