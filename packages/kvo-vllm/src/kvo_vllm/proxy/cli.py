"""``kvo-proxy``: run the P/D proxy in front of prefill and decode vLLM API servers.

Example (one prefill, one decode, the proxy on port 8000)::

    kvo-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

The engines POST notifications back to ``--notify-url`` (default: this proxy's own address),
so the proxy must be reachable from them there. With ``KVO_CONTROL_SECRET`` set (the same
secret as the engines' ``control_secret``), only signed notifications are accepted; without
it, binding anything but a loopback address is refused.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

from aiohttp import web

from kvo_core.errors import ConfigError
from kvo_transport.frame_auth import control_key, require_secret_beyond_loopback
from kvo_vllm.proxy.app import NOTIFY_PATH, build_app
from kvo_vllm.proxy.flow import ProxyConfig

_URL = re.compile(r"^https?://[^\s/]+$")


def _base_url(value: str) -> str:
    value = value.rstrip("/")
    if not _URL.match(value):
        raise argparse.ArgumentTypeError(
            f"expected a base URL like http://127.0.0.1:8100 (no path), got {value!r}")
    return value


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return number


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvo-proxy", description=__doc__.splitlines()[0])
    p.add_argument("--prefill", action="append", type=_base_url, required=True,
                   help="prefill API server base URL (repeat for several, round robin)")
    p.add_argument("--decode", action="append", type=_base_url, required=True,
                   help="decode API server base URL (repeat for several, round robin)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--notify-url", type=_base_url, default=None,
                   help="base URL the engines use to reach this proxy (default http://HOST:PORT)")
    p.add_argument("--ready-timeout", type=_positive, default=120.0,
                   help="seconds to wait for decode to allocate a request's KV (default 120)")
    p.add_argument("--request-timeout", type=_positive, default=600.0,
                   help="seconds a whole request may take (default 600)")
    p.add_argument("--decode-first", action="store_true",
                   help="always wait for decode to advertise a request's destination before "
                        "posting prefill (default: once a decode's control endpoints are known, "
                        "post prefill and decode at once)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not 1 <= args.port <= 65535:
        print(f"kvo-proxy: --port must be in [1, 65535], got {args.port}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        key = control_key()
        require_secret_beyond_loopback(key, args.host, "kvo-proxy's notify endpoint")
    except ConfigError as error:
        print(f"kvo-proxy: {error}", file=sys.stderr)
        return 2
    base = args.notify_url or f"http://{args.host}:{args.port}"
    config = ProxyConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
                         notify_url=base + NOTIFY_PATH, ready_timeout_s=args.ready_timeout,
                         request_timeout_s=args.request_timeout,
                         concurrent_post=not args.decode_first)
    web.run_app(build_app(config, key), host=args.host, port=args.port, print=None,
                access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
