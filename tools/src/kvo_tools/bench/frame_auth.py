"""Cost of authenticating one control frame (kvo_transport.frame_auth), per frame, on this CPU.

Times, for READY frames of three sizes: sealing on the prefill (``seal``), opening on the
decode (``open``: MAC check, session and sequence), and for scale the msgpack encode + strict
decode that every frame pays anyway. Medians of repeated blocks; no sockets, no netns needed.
The end-to-end effect on the READY -> DONE round trip is the ``kvo_pump_auth`` row of
``kvo_tools.bench.transport``. Usage: ``python -m kvo_tools.bench.frame_auth [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvo_transport.frame_auth import AuthCounters, ControlKey, DecodeSessions, PrefillChannel
from kvo_transport.protocol import (
    PROTOCOL_VERSION,
    Fence,
    FrameDecoder,
    ReadReadyBatch,
    ReadyRequest,
    encode,
)

SIZES = {"1 req x 4 blocks": (1, 4), "8 req x 64 blocks": (8, 64),
         "64 req x 256 blocks": (64, 256)}
PEER = b"bench-prefill"


def _batch(requests: int, blocks: int) -> ReadReadyBatch:
    return ReadReadyBatch(
        version=PROTOCOL_VERSION, seq=1, layer_index=3, layer_name="model.layers.3.attn",
        member=0, ratio=1, requests=tuple(
            ReadyRequest(request_id=f"cmpl-{i:032x}", main_start_block=0, num_blocks=blocks,
                         main_block_ids=tuple(range(i * blocks, (i + 1) * blocks)))
            for i in range(requests)),
        fences=tuple(Fence(word=i, epoch=7) for i in range(requests + 1)))


def _median_us(run: Callable[[], Any], n: int, blocks: int = 7) -> float:
    """Median over ``blocks`` blocks of ``n`` calls, in microseconds per call."""
    per_call = []
    for _ in range(blocks):
        started = time.perf_counter()
        for _ in range(n):
            run()
        per_call.append((time.perf_counter() - started) / n * 1e6)
    return statistics.median(per_call)


def _measure_size(key: ControlKey, name: str, requests: int, blocks: int,
                  n: int) -> dict[str, Any]:
    decoder = FrameDecoder()
    decode = DecodeSessions(key)
    channel = PrefillChannel(key, AuthCounters())
    decode.open(PEER, channel.seal_hello(b"meta"))
    channel.open(decode.seal_welcome(PEER, b"ok", accepted=True))
    batch = _batch(requests, blocks)
    payload = encode(batch)
    frames: list[bytes] = []
    seal_us = _median_us(lambda: frames.append(channel.seal(payload)), n)
    feed = iter(frames)
    open_us = _median_us(lambda: decode.open(PEER, next(feed)), n)
    codec_us = _median_us(lambda: decoder.decode(encode(batch)), n)
    return {"frame": name, "payload_bytes": len(payload), "seal_us": seal_us,
            "open_us": open_us, "mac_total_us": seal_us + open_us,
            "encode_decode_us": codec_us, "mac_over_codec": (seal_us + open_us) / codec_us}


def measure(n: int) -> list[dict[str, Any]]:
    key = ControlKey.from_secret("bench control secret (not a real one)")
    return [_measure_size(key, name, requests, blocks, n)
            for name, (requests, blocks) in SIZES.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    rows = measure(300 if args.quick else 3000)
    header = (f"{'frame':<22}{'bytes':>8}{'seal us':>9}{'open us':>9}{'MAC total':>11}"
              f"{'msgpack enc+dec us':>20}{'MAC/codec':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['frame']:<22}{r['payload_bytes']:>8}{r['seal_us']:>9.2f}{r['open_us']:>9.2f}"
              f"{r['mac_total_us']:>11.2f}{r['encode_decode_us']:>20.2f}"
              f"{r['mac_over_codec']:>11.2f}")
    if args.json:
        args.json.write_text(json.dumps({"frame_auth": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
