"""One decode DP rank's host pool, shared by its TP ranks (docs/design.md sections 6 and 14).

The main-KV rows are replicated across TP ranks (MLA's latent and rope come from replicated
projections), so a DP rank keeps one copy: TP rank 0 creates the pool, the other TP ranks
attach to the same pages by name (no copy, no second pool), and only TP rank 0 writes rows.
Each rank keeps its own hot buffers, residency tables and (in vLLM's device cache) the indexer
data its own attention needs; the residency state evolves identically on every rank because
every rank sees the same top-k and the same scheduler steps.

Start-up (:func:`open_shared_store`), at the first layer call every rank makes (they make the
same calls): rank 0 creates the pool and one write-notice FIFO per other rank, then broadcasts
its outcome and the pool's name (pid and counter, three int64s) over the TP group's CPU
group; the other ranks attach and open their FIFO; then every rank adds its failure reason (or
nothing) to a sum over the group, so a rank that could not attach fails every rank at the same
call, each naming the ranks that failed and why (no rank serves alone, no wrong answer).

Write order (what makes another rank's read of a row come after rank 0's write of it): every
rank counts the layer calls that write rows (``OffloadManager.write``; all ranks make the same
calls). Rank 0 writes its rows into the pool, then writes that call's sequence number into
each other rank's FIFO (:class:`WriteNotices`); each other rank, in the same write call and
so before any read of the pool in that layer call, blocks reading its FIFO until that number
arrives (it also checks the number: ranks whose calls diverged fail). A pipe's write and read
go through the kernel's pipe lock, which orders rank 0's earlier stores to the pool before the
reader's later loads on every architecture (no sleep, no timeout as a fence). If rank 0 dies,
the kernel closes its end and the reader's read returns end-of-file at once: the call fails.

The other direction (rank 0 overwriting a slot another rank still reads) needs nothing new:
rank 0 rewrites a slot only in a later write call of that layer, which comes after that
layer's output all-reduce (``o_proj``, a row-parallel linear: every TP rank enters it after
its attention, which is where it reads the pool).
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvo_vllm.sparse.errors import TensorParallelError
from kvo_vllm.sparse.host_store import HostKVStore

log = logging.getLogger("kvo.vllm.dsa.offload_tp")

FIFO_DIR = Path("/dev/shm")
FIFO_PREFIX = "kvo-tp-write-order-"
NOTICE_TIMEOUT_S = 600.0
"""How long a reader waits for rank 0's notice before failing the call: failure detection for a
rank 0 that hangs (a dead one is seen at once); the order itself never depends on it."""
REASON_BYTES = 400
"""How much of a rank's start-up failure the other ranks are told (their own logs have all)."""
_NOTICE = struct.Struct("<q")
_pool_counter = itertools.count()


class TPGroup(Protocol):
    """The TP ranks of one DP rank, as the pool's start-up needs them."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def broadcast_from_first(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (same length everywhere)."""
        ...

    def sum_over_ranks(self, values: list[int]) -> list[int]:
        """The element-wise sum of every rank's ``values``, on every rank."""
        ...


class VllmTPGroup:
    """:class:`TPGroup` over vLLM's TP group: int64 tensors on its CPU (gloo) process group."""

    def __init__(self, group: object) -> None:
        self._group = group

    @property
    def rank(self) -> int:
        return int(self._group.rank_in_group)  # type: ignore[attr-defined]

    @property
    def size(self) -> int:
        return int(self._group.world_size)  # type: ignore[attr-defined]

    def broadcast_from_first(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(tensor, src=self._group.ranks[0],  # type: ignore[attr-defined]
                       group=self._group.cpu_group)  # type: ignore[attr-defined]
        return [int(v) for v in tensor.tolist()]

    def sum_over_ranks(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, group=self._group.cpu_group)  # type: ignore[attr-defined]
        return [int(v) for v in tensor.tolist()]


def vllm_tp_group() -> VllmTPGroup | None:
    """This worker's TP group when it has more than one rank, else None."""
    from vllm.distributed import get_tp_group
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():  # type: ignore[no-untyped-call]
        return None
    group = get_tp_group()
    return VllmTPGroup(group) if group.world_size > 1 else None


def fifo_path(pool_name: str, rank: int) -> Path:
    return FIFO_DIR / f"{FIFO_PREFIX}{pool_name}-{rank}"


class WriteNotices:
    """The write-order channel of one rank (module docstring): rank 0 holds one FIFO write end
    per other rank, every other rank the read end of its own."""

    def __init__(self, rank: int, fds: list[int], pool_name: str) -> None:
        self.rank = rank
        self.pool_name = pool_name
        self._fds = fds
        self.sequence = 0   # write calls made so far (the same count on every rank)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def published(self) -> None:
        """Rank 0, after a write call's rows are in the pool: tell every other rank."""
        self.sequence += 1
        message = _NOTICE.pack(self.sequence)
        for fd in self._fds:
            os.write(fd, message)

    def wait_published(self) -> None:
        """Another rank, in the same write call: return once rank 0 has published it."""
        self.sequence += 1
        expected = self.sequence
        (fd,) = self._fds
        data = b""
        while len(data) < _NOTICE.size:
            ready, _, _ = select.select([fd], [], [], NOTICE_TIMEOUT_S)
            if not ready:
                raise TensorParallelError(
                    f"TP rank {self.rank}: TP rank 0 did not publish write {expected} to host "
                    f"pool {self.pool_name!r} within {NOTICE_TIMEOUT_S:g} s; failing this "
                    f"call rather than reading rows it may not have written")
            chunk = os.read(fd, _NOTICE.size - len(data))
            if not chunk:
                raise TensorParallelError(
                    f"TP rank {self.rank}: TP rank 0 closed its write notices for host pool "
                    f"{self.pool_name!r} before write {expected} (it stopped or died); "
                    f"failing this call")
            data += chunk
        (got,) = _NOTICE.unpack(data)
        if got != expected:
            raise TensorParallelError(
                f"TP rank {self.rank}: TP rank 0 published write {got} of host pool "
                f"{self.pool_name!r} where this rank expected {expected}: the ranks' layer "
                f"calls diverged")

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _make_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)   # a name from a dead run with the same pid (never ours)
    os.mkfifo(path, 0o600)
    if not stat.S_ISFIFO(os.stat(path).st_mode):
        raise TensorParallelError(f"{path} is not a FIFO")


def _open_reader(path: Path) -> int:
    # Non-blocking open: the read end opens before rank 0 opens its write end.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    return fd


def _exchange_failures(group: TPGroup, reason: str | None) -> dict[int, str]:
    """Every rank's failure reason (UTF-8, at most REASON_BYTES), on every rank: each rank
    fills its own row of a zero matrix and the group sums them (no pickle, fixed size)."""
    size = group.size
    rows = [0] * (size * (REASON_BYTES + 1))
    if reason is not None:
        encoded = reason.encode()[:REASON_BYTES]
        start = group.rank * (REASON_BYTES + 1)
        rows[start] = 1
        rows[start + 1:start + 1 + len(encoded)] = list(encoded)
    rows = group.sum_over_ranks(rows)
    reasons = {}
    for r in range(size):
        start = r * (REASON_BYTES + 1)
        if rows[start]:
            raw = bytes(rows[start + 1:start + 1 + REASON_BYTES]).rstrip(b"\0")
            reasons[r] = raw.decode(errors="replace")
    return reasons


def open_shared_store(group: TPGroup, create: Callable[[str], HostKVStore],
                      attach: Callable[[str], HostKVStore]
                      ) -> tuple[HostKVStore, WriteNotices]:
    """This rank's view of the DP rank's one host pool and its write-notice channel.

    ``create(name)`` (rank 0) makes the pool, ``attach(name)`` (the others) maps it and checks
    its layout. Every rank must call this at the same point (two collectives).
    """
    rank, size = group.rank, group.size
    store: HostKVStore | None = None
    fds: list[int] = []
    fifos: list[Path] = []
    failure: BaseException | None = None
    if rank == 0:
        counter = next(_pool_counter)
        name = f"dsa-{os.getpid()}-tp{counter}"
        try:
            store = create(name)
            for reader in range(1, size):
                fifos.append(fifo_path(name, reader))
                _make_fifo(fifos[-1])
            announced = [1, os.getpid(), counter]
        except BaseException as error:  # every rank must learn it, then this one raises
            failure, announced = error, [0, os.getpid(), counter]
            for path in fifos:
                path.unlink(missing_ok=True)
        announced = group.broadcast_from_first(announced)
    else:
        announced = group.broadcast_from_first([0, 0, 0])
        name = f"dsa-{announced[1]}-tp{announced[2]}"
        if announced[0]:
            try:
                store = attach(name)
                fds.append(_open_reader(fifo_path(name, rank)))
            except BaseException as error:
                failure = error
    reasons = _exchange_failures(group, None if failure is None else str(failure))
    try:
        if reasons:
            told = "; ".join(f"TP rank {r} could not {'create' if r == 0 else 'attach to'} "
                             f"it: {why}" for r, why in sorted(reasons.items()))
            raise TensorParallelError(
                f"TP rank {rank} of {size}: the DP rank's shared host pool {name!r} is not "
                f"usable on every rank, so no rank serves from it: {told}") from failure
        if rank == 0:
            # Every reader opened its read end before the sum above: these opens succeed.
            for path in fifos:
                fds.append(os.open(path, os.O_WRONLY))
    except BaseException:
        for fd in fds:
            os.close(fd)
        if store is not None:
            store.close()
        raise
    finally:
        if rank == 0:
            for path in fifos:   # both ends are open (or failed): the names are not needed
                path.unlink(missing_ok=True)
    assert store is not None
    log.info("kvo: TP rank %d of %d %s host pool %r (%d bytes); rank 0 writes, %s",
             rank, size, "created" if rank == 0 else "attached to", name, store.pool.nbytes,
             "notifying the others through FIFOs" if rank == 0 else
             "this rank waits for its write notices")
    return store, WriteNotices(rank, fds, name)
