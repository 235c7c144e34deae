"""Layer pulls through kvo's TransferEngine vs raw Mooncake calls vs a local memcpy.

For layer-sized batches (61 layers x 16 blocks of 72 KiB, and 1 MiB blocks) one process pulls
every layer from a peer process, one synchronous batch per layer, three ways, in one run:

- raw:    mooncake.engine.TransferEngine.batch_transfer_sync_read with prepared lists,
- kvo:    kvo_transport's MooncakeTransferEngine.read with the same descriptors (adds argument
          and registered-range checks and error translation),
- samehost: kvo_transport's SameHostEngine.read (process_vm_readv straight from the peer's
          memory, chosen because both processes share this host; Mooncake is its inner engine),
- memcpy: torch copies of the same blocks inside one process (the ceiling on this machine).
- fence:  the decode's fence check alone, once per layer (kvo_transport.fence.FenceReader: a
          one-sided read of 2 epoch words, a slot's and a request's, then the compare), which
          every accepted layer pays after its data read; ``fence_per_layer_us``.

Medians over repetitions; target: kvo >= 90% of raw. Also the control plane's READY -> DONE
round trip for an empty layer (kvo_tools.bench._control_roundtrip), n/a if it is unavailable.
Mooncake listens on all interfaces, so this refuses to run outside a loopback-only network
namespace (``nox -s bench -- transport`` provides one).

    python -m kvo_tools.bench.transport --json PATH [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

TARGET_RATIO = 0.9


@attrs.frozen
class Scenario:
    name: str
    layers: int
    blocks_per_layer: int
    block_bytes: int

    @property
    def layer_bytes(self) -> int:
        return self.blocks_per_layer * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [Scenario("61x16x72KiB", 61, 16, 72 << 10), Scenario("4x16x1MiB", 4, 16, 1 << 20)]
    return [Scenario("61x16x72KiB", 61, 16, 72 << 10), Scenario("16x16x1MiB", 16, 16, 1 << 20)]


def non_loopback_interfaces_up() -> list[str]:
    up = []
    for iface in sorted(Path("/sys/class/net").glob("*")):
        if iface.name == "lo":
            continue
        try:
            if int((iface / "flags").read_text().strip(), 16) & 0x1:
                up.append(iface.name)
        except (OSError, ValueError):
            continue
    return up


def refuse_outside_loopback_namespace() -> None:
    exposed = non_loopback_interfaces_up()
    if os.environ.get("KVO_IN_NETNS") != "1" and exposed:
        sys.exit(
            f"refusing to run: Mooncake would listen on every interface, and {exposed} are up. "
            "Run inside a loopback-only network namespace: nox -s bench -- transport, or\n"
            "  unshare -n sh -c 'ip link set lo up; "
            "KVO_IN_NETNS=1 python -m kvo_tools.bench.transport'"
        )


def serve(conn: Any, nbytes: int) -> None:
    """Peer process: a registered region with known bytes, alive until told to stop."""
    from kvo_transport.engine import create_transfer_engine
    from kvo_transport.samehost_engine import SameHostEngine

    engine = SameHostEngine(create_transfer_engine("mooncake"))
    region = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(3),
                           dtype=torch.uint8)
    engine.register(region.data_ptr(), nbytes)
    conn.send((engine.session_id, region.data_ptr()))
    conn.recv()
    engine.close()


def median_seconds(runs: list[Callable[[], None]], reps: int) -> list[float]:
    """Median time of each run.

    Repetitions interleave the runs, and the order flips every repetition, so that load from
    other processes and any first/second-position effect hit every run alike.
    """
    for run in runs:
        run()  # warm-up: connections, page faults
    samples: list[list[float]] = [[] for _ in runs]
    for rep in range(reps):
        order = list(range(len(runs)))
        if rep % 2:
            order.reverse()
        for i in order:
            started = time.perf_counter()
            runs[i]()
            samples[i].append(time.perf_counter() - started)
    return [statistics.median(times) for times in samples]


def measure(scenario: Scenario, reps: int) -> dict[str, Any]:
    from kvo_transport.engine import create_transfer_engine
    from kvo_transport.samehost_engine import SameHostEngine, split_session_id

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    peer = ctx.Process(target=serve, args=(theirs, scenario.total_bytes), daemon=True)
    peer.start()
    same_host = SameHostEngine(create_transfer_engine("mooncake"))
    engine = same_host.inner
    try:
        if not ours.poll(300):
            raise RuntimeError("the peer process did not start within 300 s")
        full_session, remote_base = ours.recv()
        session = split_session_id(full_session)[0]
        dest = torch.zeros(scenario.total_bytes, dtype=torch.uint8)
        same_host.register(dest.data_ptr(), dest.numel())
        if not same_host.direct_to(full_session):
            raise RuntimeError("the same-host engine does not take the direct path to its peer")
        # Layer i's blocks come from the peer's layer i in reversed order: non-contiguous,
        # as block tables are, and identical descriptors for raw and kvo.
        batches = []
        n, size = scenario.blocks_per_layer, scenario.block_bytes
        for layer in range(scenario.layers):
            base = layer * scenario.layer_bytes
            local = [dest.data_ptr() + base + j * size for j in range(n)]
            remote = [remote_base + base + (n - 1 - j) * size for j in range(n)]
            batches.append((local, remote, [size] * n))
        raw = engine.raw_engine  # type: ignore[attr-defined]

        def pull_raw() -> None:
            for local, remote, lengths in batches:
                if raw.batch_transfer_sync_read(session, local, remote, lengths) != 0:
                    raise RuntimeError("raw Mooncake read failed")

        def pull_kvo() -> None:
            for local, remote, lengths in batches:
                engine.read(session, local, remote, lengths)

        def pull_same_host() -> None:
            for local, remote, lengths in batches:
                same_host.read(full_session, local, remote, lengths)

        src = torch.randint(0, 256, (scenario.total_bytes,), dtype=torch.uint8)
        src_blocks = src.view(-1, scenario.block_bytes)
        dst_blocks = dest.view(-1, scenario.block_bytes)

        def copy_local() -> None:
            for layer in range(scenario.layers):
                first = layer * scenario.blocks_per_layer
                for j in range(scenario.blocks_per_layer):
                    dst_blocks[first + j].copy_(
                        src_blocks[first + scenario.blocks_per_layer - 1 - j])

        from kvo_transport.fence import FenceReader
        from kvo_transport.protocol import Fence

        fence_reader = FenceReader(engine, 2)
        seeded = torch.randint(0, 256, (scenario.total_bytes,),
                               generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
        words = (0, 1)  # the peer's first two 8-byte words stand in for its epoch words
        fences = [Fence(word=w, epoch=int.from_bytes(
            seeded[w * 8:(w + 1) * 8].numpy().tobytes(), "little")) for w in words]

        def fence_only() -> None:
            for _ in batches:
                if fence_reader.stale(session, remote_base, fences) is not None:
                    raise RuntimeError("fence check failed on an unchanged peer")

        def check_only() -> None:
            for local, remote, lengths in batches:
                engine._registry.check_batch(session, local, remote, lengths)  # type: ignore[attr-defined]

        raw_s, kvo_s, same_host_s = median_seconds([pull_raw, pull_kvo, pull_same_host], reps)
        (fence_s,) = median_seconds([fence_only], reps)
        fence_reader.close()
        (check_s,) = median_seconds([check_only], reps)
        expected = torch.randint(0, 256, (scenario.total_bytes,),
                                 generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
        got = dest.view(scenario.layers, scenario.blocks_per_layer, -1)
        want = expected.view(scenario.layers, scenario.blocks_per_layer, -1).flip(1)
        for pull in (pull_kvo, pull_same_host):  # each path alone leaves the peer's bytes
            dest.zero_()
            pull()
            if not torch.equal(got, want):
                raise RuntimeError(f"{scenario.name}: {pull.__name__} pulled bytes that differ "
                                   "from the peer's")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one core copies, as one Mooncake worker does
        try:
            (memcpy_s,) = median_seconds([copy_local], reps)
        finally:
            torch.set_num_threads(threads)
    finally:
        ours.send("stop")
        peer.join(60)
        if peer.is_alive():
            peer.kill()
        same_host.close()
    gb = scenario.total_bytes / 1e9
    return {
        "scenario": scenario.name,
        "layers": scenario.layers,
        "blocks_per_layer": scenario.blocks_per_layer,
        "block_bytes": scenario.block_bytes,
        "total_bytes": scenario.total_bytes,
        "reps": reps,
        "raw_median_s": raw_s,
        "kvo_median_s": kvo_s,
        "memcpy_median_s": memcpy_s,
        "raw_gbps": gb / raw_s,
        "kvo_gbps": gb / kvo_s,
        "memcpy_gbps": gb / memcpy_s,
        "same_host_median_s": same_host_s,
        "same_host_gbps": gb / same_host_s,
        "same_host_vs_kvo": kvo_s / same_host_s,
        "kvo_vs_raw": raw_s / kvo_s,
        "kvo_per_layer_us": kvo_s / scenario.layers * 1e6,
        "kvo_check_per_layer_us": check_s / scenario.layers * 1e6,
        "fence_per_layer_us": fence_s / scenario.layers * 1e6,
        "fence_vs_kvo_read": fence_s / kvo_s,
        "target_kvo_vs_raw": TARGET_RATIO,
        "meets_target": raw_s / kvo_s >= TARGET_RATIO,
    }


def control_roundtrip(quick: bool) -> dict[str, Any] | None:
    """READY -> DONE p50/p99 from the control-plane benchmark, or None when unavailable."""
    try:
        from kvo_tools.bench._control_roundtrip import measure_roundtrip
    except ImportError as exc:
        print(f"READY->DONE round trip: n/a ({exc})")
        return None
    return dict(measure_roundtrip(300 if quick else 3000))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer repetitions")
    args = parser.parse_args(argv)
    refuse_outside_loopback_namespace()
    reps = 5 if args.quick else 11
    rows = [measure(s, reps) for s in scenarios(args.quick)]
    header = (f"{'scenario':<14}{'MiB':>8}{'raw GB/s':>10}{'kvo GB/s':>10}{'memcpy GB/s':>13}"
              f"{'kvo/raw':>9}{'kvo us/layer':>14}{'check us/layer':>16}"
              f"{'same-host GB/s':>16}{'same-host/kvo':>15}"
              f"{'fence us/layer':>16}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['scenario']:<14}{r['total_bytes'] / 2**20:>8.1f}{r['raw_gbps']:>10.2f}"
              f"{r['kvo_gbps']:>10.2f}{r['memcpy_gbps']:>13.2f}{r['kvo_vs_raw']:>9.3f}"
              f"{r['kvo_per_layer_us']:>14.0f}{r['kvo_check_per_layer_us']:>16.1f}"
              f"{r['same_host_gbps']:>16.2f}{r['same_host_vs_kvo']:>14.2f}x"
              f"{r['fence_per_layer_us']:>16.1f}")
    print(f"target: kvo/raw >= {TARGET_RATIO}")
    roundtrip = control_roundtrip(args.quick)
    if roundtrip is not None:
        print("READY->DONE round trip (empty layer; target: kvo p50 < 300 us)")
        print(f"{'mode':<16}{'p50 us':>9}{'p99 us':>9}{'min us':>9}")
        for mode in ("kvo_pump", "kvo_pump_auth", "kvo_io_thread", "raw_zmq"):
            print(f"{mode:<16}{roundtrip[mode + '_p50_us']:>9.0f}"
                  f"{roundtrip[mode + '_p99_us']:>9.0f}{roundtrip[mode + '_min_us']:>9.0f}")
        print(f"kvo_pump / raw_zmq p50: {roundtrip['kvo_pump_over_raw_p50']:.2f}; "
              f"authenticated / plain p50: {roundtrip['auth_over_plain_p50']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"pull": rows, "control_roundtrip": roundtrip}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
