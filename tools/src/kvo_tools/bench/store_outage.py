"""How long store calls take once the Mooncake master is dead: kvo's store (circuit breaker)
next to the bare Mooncake client, per call kind, and how long close takes.

Each variant starts its own master and client, puts a key, kills the master (SIGKILL) and times
``get``, ``put``, ``exists``, ``remove`` (3 rounds, medians) and ``close``. Variants: ``bare``
(MooncakeDistributedStore directly: what kvo did before the breaker), ``kvo_probe`` (kvo's
store, calls start 0.5 s after the kill, when the health probe had time to notice),
``kvo_no_probe`` (probe off: the first failing call must find out). Mooncake binds every
interface: run in a loopback-only netns (``nox -s bench -- store_outage`` does).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = 4096
ROUNDS = 3
KINDS = ("get", "put", "exists", "remove")


def _timed(call: Callable[[], Any]) -> float:
    started = time.monotonic()
    try:
        call()
    except Exception:  # every call is expected to fail; only its duration matters here
        pass
    return time.monotonic() - started


def _run(variant: str) -> dict[str, Any]:
    from kvo_transport.mooncake_master import MooncakeMaster
    from kvo_transport.mooncake_store import import_mooncake_store_class
    from kvo_transport.store import create_kv_store

    region = mmap.mmap(-1, 1 << 20)
    anchor = ctypes.c_char.from_buffer(region)
    ptr = ctypes.addressof(anchor)
    master = MooncakeMaster().start()
    if variant == "bare":
        store = import_mooncake_store_class()()
        store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master.address)
        store.register_buffer(ptr, 1 << 20)
        store.batch_upsert_from(["k"], [ptr], [BLOCK])
        calls = {"get": lambda: store.batch_get_into(["k"], [ptr + BLOCK], [BLOCK]),
                 "put": lambda: store.batch_upsert_from(["k2"], [ptr], [BLOCK]),
                 "exists": lambda: store.batch_is_exist(["k"]),
                 "remove": lambda: store.batch_remove(["k"])}

        def close() -> None:
            store.unregister_buffer(ptr)
            store.close()
    else:
        interval = 0.25 if variant == "kvo_probe" else 0
        kvo = create_kv_store("mooncake", master_address=master.address,
                              health_probe_interval_s=interval)
        kvo.register(ptr, 1 << 20)
        kvo.put_from(["k"], [ptr], [BLOCK])
        calls = {"get": lambda: kvo.get_into(["k"], [ptr + BLOCK], [BLOCK]),
                 "put": lambda: kvo.put_from(["k2"], [ptr], [BLOCK]),
                 "exists": lambda: kvo.exists(["k"]),
                 "remove": lambda: kvo.remove(["k"])}
        close = kvo.close
    assert master._process is not None
    master._process.send_signal(signal.SIGKILL)
    master._process.wait()
    master._cleanup()
    if variant == "kvo_probe":
        time.sleep(0.5)
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(ROUNDS):
        for kind in KINDS:
            samples[kind].append(_timed(calls[kind]))
    row: dict[str, Any] = {"variant": variant}
    row.update({f"{kind}_s": statistics.median(samples[kind]) for kind in KINDS})
    row["first_call_s"] = samples["get"][0]
    row["close_s"] = _timed(close)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry; no effect")
    args = parser.parse_args(argv)
    rows = [_run(variant) for variant in ("bare", "kvo_probe", "kvo_no_probe")]
    header = (f"{'variant':<14}{'first get s':>12}" + "".join(f"{k + ' s':>10}" for k in KINDS)
              + f"{'close s':>10}")
    print("store calls after the Mooncake master was killed (medians of 3; target: < 1 s)")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['variant']:<14}{r['first_call_s']:>12.3f}"
              + "".join(f"{r[k + '_s']:>10.3f}" for k in KINDS) + f"{r['close_s']:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps({"store_outage": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
