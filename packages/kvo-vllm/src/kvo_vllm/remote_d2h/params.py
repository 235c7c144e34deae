"""What the proxy, the decode and the prefill tell each other about one request.

The decode-first flow (docs/design.md section 10) needs three small agreements, all plain JSON:

- proxy -> decode, in the request's ``kv_transfer_params``: pull this request's prompt KV from
  a prefill (``DecodePullParams``);
- decode -> proxy, POSTed to the proxy's notify endpoint once the destination blocks are
  allocated and registered: where to send it and which leading blocks decode already holds
  (``DecodeReady``); a prefill that cannot hand a request off reports ``PrefillFailed`` there;
- proxy -> prefill, in ``kv_transfer_params``: compute this prompt and publish every layer to
  these decode control endpoints (``PrefillSendParams``).

Everything here comes from the network, so every field is checked and an error names the key,
the value and what is allowed. vLLM's own keys ``do_remote_prefill`` / ``do_remote_decode``
mark the side; kvo's keys start with ``kvo_``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvo_core.errors import KvoError

MAX_ID_CHARS = 200
MAX_ERROR_CHARS = 4000
MAX_DECODE_TP = 4096
MAX_DECODE_DP = 4096
_TRANSFER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
_ENDPOINT = re.compile(r"^tcp://(?P<host>[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")
_URL = re.compile(r"^https?://[^\s/]+(/[^\s]*)?$")

DO_REMOTE_PREFILL = "do_remote_prefill"
DO_REMOTE_DECODE = "do_remote_decode"
TRANSFER_ID = "kvo_transfer_id"
NOTIFY_URL = "kvo_notify_url"
DECODE_ENDPOINTS = "kvo_decode_endpoints"
DECODE_TP = "kvo_decode_tp"
SKIP_BLOCKS = "kvo_skip_blocks"
STOP_BLOCK = "kvo_stop_block"


class TransferParamsError(KvoError, ValueError):
    """kv_transfer_params or a notify message that kvo cannot accept; the message says why."""


def check_transfer_id(value: Any, where: str = TRANSFER_ID) -> str:
    if not isinstance(value, str) or not _TRANSFER_ID.match(value):
        raise TransferParamsError(
            f"{where} must be 1-{MAX_ID_CHARS} characters of letters, digits and '._:-', "
            f"got {value!r}")
    return value


def check_endpoint(value: Any, where: str = "endpoint") -> str:
    """A decode control endpoint: ``tcp://HOST:PORT`` with PORT in [1, 65535]."""
    match = _ENDPOINT.match(value) if isinstance(value, str) else None
    if match is None or not 1 <= int(match.group("port")) <= 65535:
        raise TransferParamsError(
            f"{where} must look like 'tcp://HOST:PORT' with PORT in [1, 65535], got {value!r}")
    return str(value)


def _optional_url(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 2000 or not _URL.match(value):
        raise TransferParamsError(f"{where} must be an http(s) URL or absent, got {value!r}")
    return value


def _int_in(value: Any, where: str, minimum: int, maximum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise TransferParamsError(
            f"{where} must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def _mapping(params: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(params, Mapping):
        raise TransferParamsError(f"{what} must be a JSON object, got {type(params).__name__}")
    return params


@attrs.frozen
class DecodePullParams:
    """Decode side: pull the prompt's KV of transfer ``transfer_id`` instead of computing it."""

    transfer_id: str
    notify_url: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> DecodePullParams | None:
        """None when the request is not a remote-prefill request (or already started)."""
        if not params or not params.get(DO_REMOTE_PREFILL):
            return None
        params = _mapping(params, "kv_transfer_params")
        return cls(transfer_id=check_transfer_id(params.get(TRANSFER_ID)),
                   notify_url=_optional_url(params.get(NOTIFY_URL), NOTIFY_URL))

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {DO_REMOTE_PREFILL: True, TRANSFER_ID: self.transfer_id}
        if self.notify_url is not None:
            params[NOTIFY_URL] = self.notify_url
        return params


@attrs.frozen
class PrefillSendParams:
    """Prefill side: publish this request's layers to the decode ranks at ``decode_endpoints``.

    ``decode_endpoints[d]`` is decode TP rank ``d``'s control endpoint (``len == decode_tp``).
    The blocks ``[skip_blocks, stop_block)`` are sent: the leading ones are already on decode
    (its own prefix cache), and decode computes the prompt's tail after ``stop_block`` itself.
    ``stop_block`` None: the proxy posted prefill and decode at once, not knowing what decode
    holds; prefill derives it from the prompt (the rule decode uses) and decode skips what it
    holds.
    """

    transfer_id: str
    decode_endpoints: tuple[str, ...]
    stop_block: int | None
    skip_blocks: int = 0
    notify_url: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.stop_block is not None and not self.skip_blocks < self.stop_block:
            raise TransferParamsError(
                f"{SKIP_BLOCKS} ({self.skip_blocks}) must be below {STOP_BLOCK} "
                f"({self.stop_block}): there must be something to send")

    @property
    def decode_tp(self) -> int:
        return len(self.decode_endpoints)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> PrefillSendParams | None:
        """None when the request is not a remote-decode request."""
        if not params or not params.get(DO_REMOTE_DECODE):
            return None
        params = _mapping(params, "kv_transfer_params")
        endpoints = params.get(DECODE_ENDPOINTS)
        if (not isinstance(endpoints, list | tuple) or not endpoints
                or len(endpoints) > MAX_DECODE_TP):
            raise TransferParamsError(
                f"{DECODE_ENDPOINTS} must be a non-empty list of decode control endpoints "
                f"(one per decode TP rank), got {endpoints!r}")
        checked = tuple(check_endpoint(e, f"{DECODE_ENDPOINTS}[{i}]")
                        for i, e in enumerate(endpoints))
        decode_tp = params.get(DECODE_TP, len(checked))
        _int_in(decode_tp, DECODE_TP, 1, MAX_DECODE_TP)
        if decode_tp != len(checked):
            raise TransferParamsError(
                f"{DECODE_TP} is {decode_tp} but {len(checked)} decode endpoints were given")
        return cls(transfer_id=check_transfer_id(params.get(TRANSFER_ID)),
                   decode_endpoints=checked,
                   stop_block=(None if params.get(STOP_BLOCK) is None else
                               _int_in(params.get(STOP_BLOCK), STOP_BLOCK, 1, 1 << 40)),
                   skip_blocks=_int_in(params.get(SKIP_BLOCKS, 0), SKIP_BLOCKS, 0, 1 << 40),
                   notify_url=_optional_url(params.get(NOTIFY_URL), NOTIFY_URL))

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            DO_REMOTE_DECODE: True, TRANSFER_ID: self.transfer_id,
            DECODE_ENDPOINTS: list(self.decode_endpoints), DECODE_TP: self.decode_tp,
            SKIP_BLOCKS: self.skip_blocks}
        if self.stop_block is not None:
            params[STOP_BLOCK] = self.stop_block
        if self.notify_url is not None:
            params[NOTIFY_URL] = self.notify_url
        return params


@attrs.frozen
class DecodeReady:
    """Decode -> proxy: TP rank ``d_rank`` of ``decode_tp`` in DP rank ``dp_rank`` of
    ``dp_size`` holds destinations for the transfer (the DP rank that took the request)."""

    transfer_id: str
    d_rank: int
    decode_tp: int
    endpoint: str
    skip_blocks: int
    num_blocks: int
    """Blocks to receive: the destination covers ``[skip_blocks, num_blocks)``."""
    dp_rank: int = 0
    dp_size: int = 1

    KIND = "decode_ready"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> DecodeReady:
        decode_tp = _int_in(body.get("decode_tp"), "decode_tp", 1, MAX_DECODE_TP)
        num_blocks = _int_in(body.get("num_blocks"), "num_blocks", 1, 1 << 40)
        dp_size = _int_in(body.get("dp_size", 1), "dp_size", 1, MAX_DECODE_DP)
        return cls(transfer_id=check_transfer_id(body.get("transfer_id"), "transfer_id"),
                   d_rank=_int_in(body.get("d_rank"), "d_rank", 0, decode_tp - 1),
                   decode_tp=decode_tp,
                   endpoint=check_endpoint(body.get("endpoint")),
                   skip_blocks=_int_in(body.get("skip_blocks"), "skip_blocks", 0,
                                       max(0, num_blocks - 1)),
                   num_blocks=num_blocks,
                   dp_rank=_int_in(body.get("dp_rank", 0), "dp_rank", 0, dp_size - 1),
                   dp_size=dp_size)


@attrs.frozen
class PrefillFailed:
    """Prefill -> proxy: the request's KV cannot reach decode (e.g. the handshake was refused)."""

    transfer_id: str
    error: str

    KIND = "prefill_failed"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "transfer_id": self.transfer_id,
                "error": self.error[:MAX_ERROR_CHARS]}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PrefillFailed:
        error = body.get("error")
        if not isinstance(error, str) or not error:
            raise TransferParamsError(f"error must be a non-empty string, got {error!r}")
        return cls(transfer_id=check_transfer_id(body.get("transfer_id"), "transfer_id"),
                   error=error[:MAX_ERROR_CHARS])


def parse_notification(body: Any) -> DecodeReady | PrefillFailed:
    """Decode one POST to the proxy's notify endpoint."""
    body = _mapping(body, "a notification")
    kind = body.get("kind")
    if kind == DecodeReady.KIND:
        return DecodeReady.from_json(body)
    if kind == PrefillFailed.KIND:
        return PrefillFailed.from_json(body)
    raise TransferParamsError(
        f"kind must be {DecodeReady.KIND!r} or {PrefillFailed.KIND!r}, got {kind!r}")
