"""A small OpenAI client for the demo, the tests and the benchmark (stdlib only).

``complete`` sends one greedy request and returns what a comparison needs: the generated token
ids with their logprobs, and the client-side timing (time to first token, decode tokens/s).
Streaming requests are read as server-sent events, so the first token's arrival is measured.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from kvo_tools.pd.cluster import SERVED_MODEL


@attrs.frozen
class Answer:
    """One request's outcome."""

    status: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    text: str = ""
    error: str | None = None
    ttft_s: float | None = None
    total_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first one per second of the time after the first one."""
        if self.ttft_s is None or len(self.token_ids) < 2 or self.total_s <= self.ttft_s:
            return None
        return (len(self.token_ids) - 1) / (self.total_s - self.ttft_s)

    def same_output(self, other: Answer) -> bool:
        return self.token_ids == other.token_ids and self.logprobs == other.logprobs


def completion_body(prompt: str | Sequence[int], max_tokens: int, stream: bool,
                    chat: bool = False) -> dict[str, Any]:
    """Greedy, logprobs of the sampled token, token ids returned, no early stop."""
    body: dict[str, Any] = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["logprobs"] = True
        body["top_logprobs"] = 0
    else:
        body["prompt"] = prompt
        body["logprobs"] = 0
    return body


def complete(base_url: str, body: Mapping[str, Any], timeout_s: float = 600.0) -> Answer:
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                     method="POST", headers={"content-type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if body.get("stream"):
                return _read_stream(response, chat, started)
            payload = json.loads(response.read())
            ids, logprobs, text = _choice(payload, chat)
            elapsed = time.monotonic() - started
            return Answer(status=response.status, token_ids=ids, logprobs=logprobs, text=text,
                          ttft_s=None, total_s=elapsed)
    except urllib.error.HTTPError as error:
        raw = error.read().decode("utf-8", "replace")
        try:
            message = json.loads(raw).get("error", {}).get("message", raw)
        except (ValueError, AttributeError):
            message = raw
        return Answer(status=error.code, error=str(message),
                      total_s=time.monotonic() - started)
    except (urllib.error.URLError, OSError) as error:
        return Answer(status=0, error=f"{type(error).__name__}: {error}",
                      total_s=time.monotonic() - started)


def _choice(payload: Mapping[str, Any], chat: bool) -> tuple[tuple[int, ...], tuple[float, ...],
                                                             str]:
    choices = payload.get("choices") or [{}]
    choice = choices[0]
    ids = tuple(choice.get("token_ids") or ())
    logprobs: tuple[float, ...] = ()
    info = choice.get("logprobs") or {}
    if chat:
        logprobs = tuple(entry["logprob"] for entry in info.get("content") or ())
        text = (choice.get("message") or choice.get("delta") or {}).get("content") or ""
    else:
        logprobs = tuple(info.get("token_logprobs") or ())
        text = choice.get("text") or ""
    return ids, logprobs, text


def _read_stream(response: Any, chat: bool, started: float) -> Answer:
    ids: list[int] = []
    logprobs: list[float] = []
    text: list[str] = []
    first: float | None = None
    error: str | None = None
    done = False
    try:
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                error = str(event["error"])
                break
            chunk_ids, chunk_logprobs, chunk_text = _choice(event, chat)
            if chunk_ids and first is None:
                first = time.monotonic() - started
            ids.extend(chunk_ids)
            logprobs.extend(chunk_logprobs)
            text.append(chunk_text)
    except (OSError, http.client.HTTPException) as broken:
        error = f"the stream broke: {type(broken).__name__}: {broken}"
    if not done and error is None:
        error = "the stream ended without [DONE]"
    return Answer(status=response.status, token_ids=tuple(ids), logprobs=tuple(logprobs),
                  text="".join(text), error=error, ttft_s=first,
                  total_s=time.monotonic() - started)


def complete_all(base_url: str, bodies: Sequence[Mapping[str, Any]], concurrency: int,
                 timeout_s: float = 600.0) -> list[Answer]:
    """Send ``bodies`` with at most ``concurrency`` in flight; answers in request order."""
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(lambda body: complete(base_url, body, timeout_s), bodies))
