"""Code that runs in the second process of the backend tests (started with multiprocessing spawn).

Kept in its own module so the child imports only this, not the test module.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

import torch


def worker_context() -> BaseContext:
    """A forkserver context that preloads torch and this module.

    Children start from a fresh single-threaded server (safe next to Mooncake's threads, unlike
    fork) without paying torch's import again for every child (unlike spawn).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "_backend_workers"])
    return ctx


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes, so both processes know what should arrive."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=generator, dtype=torch.uint8)


def serve_region(conn: Connection, nbytes: int, seed: int, same_host: bool = False) -> None:
    """Own a registered region filled with pattern(seed) and answer commands until "stop"."""
    from kvo_transport.engine import create_transfer_engine
    from kvo_transport.samehost_engine import SameHostEngine

    engine = create_transfer_engine("mooncake")
    if same_host:
        engine = SameHostEngine(engine)
    region = pattern(seed, nbytes)
    engine.register(region.data_ptr(), nbytes)
    conn.send((engine.session_id, region.data_ptr(), nbytes))
    while True:
        command = conn.recv()
        if command[0] == "bytes":
            offset, length = command[1], command[2]
            conn.send(region[offset : offset + length].numpy().tobytes())
        elif command[0] == "refill":
            region.copy_(pattern(seed, nbytes))
            conn.send("ok")
        elif command[0] == "stop":
            break
    engine.close()
    conn.send("closed")


def put_into_store(conn: Connection, master_address: str, keys: list[str], seed: int) -> None:
    """Another Mooncake Store client: put one 64 KiB pattern block per key, then report."""
    from kvo_transport.store import create_kv_store

    block = 64 << 10
    store = create_kv_store("mooncake", master_address=master_address)
    data = pattern(seed, block * len(keys))
    store.register(data.data_ptr(), data.numel())
    store.put_from(keys, [data.data_ptr() + i * block for i in range(len(keys))],
                   [block] * len(keys))
    conn.send("stored")
    conn.recv()  # keep the client (which holds the stored segment) alive until told to stop
    store.close()


def write_pool(conn: Connection, name: str, offset: int, seed: int, nbytes: int) -> None:
    """Attach to a host pool by name, check what the creator wrote, write our own pattern."""
    from kvo_transport.host_pool import HostPool

    pool = HostPool.attach(name)
    seen = pool.view(torch.uint8, (nbytes,), 0).clone()
    pool.view(torch.uint8, (nbytes,), offset).copy_(pattern(seed, nbytes))
    conn.send((pool.nbytes, seen.numpy().tobytes()))
    pool.close()


def create_pool_and_exit(conn: Connection, name: str, close: bool) -> None:
    """Create a pool and exit normally, with or without close(): it must not outlive us."""
    from kvo_transport.host_pool import HostPool

    pool = HostPool.create(name, 1 << 16)
    pool.view(torch.uint8, (16,)).fill_(7)
    conn.send(str(pool.path))
    if close:
        pool.close()


def hold_pool(conn: Connection, name: str, create: bool) -> None:
    """Create (or attach to) a pool, say its path, and keep it until killed."""
    import time

    from kvo_transport.host_pool import HostPool

    pool = HostPool.create(name, 1 << 16) if create else HostPool.attach(name)
    pool.view(torch.uint8, (16,)).fill_(9)
    conn.send(str(pool.path))
    time.sleep(600)
