"""How a P/D pull can fill the fused decode's host pool: strided descriptors vs split on arrival.

The prefill's MLA cache keeps a token's main KV as one row of latent + rope values; the fused
decode's pool keeps every layer's latents in one array and its ropes in another (the Copy-SFA
ABI takes them as two contiguous tensors). One process pulls a layer's blocks from a peer
process, one synchronous batch per layer, through kvo's engines (SameHostEngine's direct path,
and Mooncake over loopback TCP), three ways:

- blocks:  one descriptor per block into one interleaved array (what a non-fused decode
           pulls; the lower bound);
- strided: two descriptors per row, latent and rope straight into the two arrays;
- staged:  one descriptor per block into a staging area, then the rows split into the two
           arrays as the decode does (``fused_pool_split.split_rows``).

Medians over repetitions, per layer. Mooncake listens on all interfaces: run inside a
loopback-only network namespace (``/work/bin/kvo-py`` or ``nox -s bench`` provide one).

    python -m kvo_tools.bench._fused_pull [--blocks 16] [--block-size 64] [--reps 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvo_tools.bench.transport import serve

LATENT_BYTES = 512 * 2   # bf16
ROPE_BYTES = 64 * 2
ROW_BYTES = LATENT_BYTES + ROPE_BYTES


def _median(run: Callable[[], None], reps: int) -> float:
    run()   # warm-up: connections, page faults
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure(blocks: int, block_size: int, reps: int) -> dict[str, Any]:
    from kvo_transport.engine import create_transfer_engine
    from kvo_transport.samehost_engine import SameHostEngine, split_session_id
    from kvo_vllm.remote_d2h.fused_pool_split import SplitLayer, split_rows

    rows = blocks * block_size
    block_bytes = block_size * ROW_BYTES
    nbytes = rows * ROW_BYTES
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    peer = ctx.Process(target=serve, args=(theirs, nbytes), daemon=True)
    peer.start()
    same_host = SameHostEngine(create_transfer_engine("mooncake"))
    try:
        if not ours.poll(300):
            raise RuntimeError("the peer process did not start within 300 s")
        full_session, remote_base = ours.recv()
        session = split_session_id(full_session)[0]
        staging = torch.zeros(nbytes, dtype=torch.uint8)
        latent = torch.zeros(rows, LATENT_BYTES, dtype=torch.uint8)
        rope = torch.zeros(rows, ROPE_BYTES, dtype=torch.uint8)
        for t in (staging, latent, rope):
            same_host.register(t.data_ptr(), t.numel())
        # source blocks in reversed order: non-contiguous, as block tables are
        src = [remote_base + (blocks - 1 - j) * block_bytes for j in range(blocks)]
        whole = ([staging.data_ptr() + j * block_bytes for j in range(blocks)], src,
                 [block_bytes] * blocks)
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for j in range(blocks):
            for i in range(block_size):
                row = j * block_size + i
                at = src[j] + i * ROW_BYTES
                local += [latent.data_ptr() + row * LATENT_BYTES,
                          rope.data_ptr() + row * ROPE_BYTES]
                remote += [at, at + LATENT_BYTES]
                lengths += [LATENT_BYTES, ROPE_BYTES]
        strided = (local, remote, lengths)
        staged_rows = staging.view(rows, ROW_BYTES)
        target = SplitLayer(base=latent.data_ptr(), rows=rows, latent=latent, rope=rope)

        def split() -> None:   # what the decode does on arrival
            split_rows(staged_rows, target, 0)

        out: dict[str, Any] = {"blocks": blocks, "block_size": block_size,
                               "layer_bytes": nbytes, "descriptors": {
                                   "blocks": blocks, "strided": len(local)}}
        split_s = _median(split, reps)
        out["split_us"] = split_s * 1e6
        for name, engine, peer_id in (("samehost", same_host, full_session),
                                      ("mooncake_tcp", same_host.inner, session)):
            def read(batch: tuple[list[int], list[int], list[int]],
                     engine: Any = engine, peer_id: str = peer_id) -> None:
                engine.read(peer_id, *batch)

            blocks_s = _median(lambda: read(whole), reps)
            strided_s = _median(lambda: read(strided), reps)
            out[name] = {"blocks_us": blocks_s * 1e6, "strided_us": strided_s * 1e6,
                         "staged_us": (blocks_s + split_s) * 1e6}
        expected = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(3),
                                 dtype=torch.uint8).view(blocks, block_size, ROW_BYTES)
        expected = expected.flip(0).reshape(rows, ROW_BYTES)
        if not (torch.equal(latent, expected[:, :LATENT_BYTES])
                and torch.equal(rope, expected[:, LATENT_BYTES:])):
            raise RuntimeError("the pulled rows differ from the peer's")
        return out
    finally:
        ours.send("stop")
        peer.join(30)
        same_host.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=16, help="blocks per layer (default 16)")
    parser.add_argument("--block-size", type=int, default=64, help="rows per block (default 64)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args(argv)
    result = measure(args.blocks, args.block_size, args.reps)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
