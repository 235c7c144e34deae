"""POST small JSON notifications to the proxy without blocking vLLM's forward.

The decode advertises a request's destination (``DecodeReady``) and the prefill reports a
request it cannot hand off (``PrefillFailed``) to the proxy's notify endpoint. One background
thread sends them in order; a proxy that does not answer costs a logged warning, never a
stalled engine step. With a control key every POST is signed (notify_auth).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import urllib.error
import urllib.request
from typing import Any

from kvo_transport.frame_auth import ControlKey
from kvo_vllm.remote_d2h.notify_auth import HEADER, sign

logger = logging.getLogger(__name__)

TIMEOUT_S = 5.0


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
        while True:
            item = self._queue.get()
            if item is None:
                return
            url, body = item
            data = json.dumps(body).encode()
            headers = {"content-type": "application/json"}
            if self._key is not None:
                headers[HEADER] = sign(self._key, self._sender, next(self._seqs), data)
            request = urllib.request.Request(url, data=data, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                    response.read()
                self.sent += 1
            except (urllib.error.URLError, OSError, ValueError) as error:
                self.failed += 1
                logger.warning("kvo remote_d2h: notifying %s of %s failed: %s", url,
                               body.get("kind"), error)
