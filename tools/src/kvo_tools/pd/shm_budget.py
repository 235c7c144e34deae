"""How large the soak's private /dev/shm must be for its engines' shapes (``--shm-mib``).

A vLLM engine at TP > 1 (multiprocessing executor, one node) creates shared-memory ring
buffers at start (vLLM's ``shm_broadcast.ShmRingBuffer``: Python shared memory, files
``/dev/shm/psm_*``), each ``chunks x (chunk bytes + 1 + readers)`` bytes:

- the scheduler's broadcast to the workers: ``VLLM_MQ_MAX_CHUNK_BYTES_MB`` MiB (16) x 10 chunks,
  read by every worker;
- one response queue per worker: 24 MiB x 10 chunks, one reader;
- the TP group's broadcaster: 4 MiB x 6 chunks, read by the other ranks.

At TP 2 that is 664 MiB per engine (the soak's footprints measured 696254546 bytes in 4 files,
this sum to the byte). A TP 1 engine creates none. The files are sparse (tmpfs charges only
the pages written), but vLLM refuses to create a buffer larger than the free space, and a page
first written once the tmpfs is full is a SIGBUS in the engine. So the soak's tmpfs must hold
every live engine's buffers written through (``needed_mib``). An engine killed with SIGKILL
leaves its files behind (vLLM unlinks them at a clean shutdown only), so the default
(``default_mib``) also leaves room for one more engine's buffers per decode restart the soak
may cause. None of these files are kvo's.

vLLM 0.32's sizes; ``tests/test_soak_shm_budget.py`` checks them against the installed vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

MIB = 1 << 20
BASE_MIB = 256
"""What the soak's engines need besides the ring buffers (a few semaphore files at TP 1),
with room to spare: the private tmpfs's size before TP 2 existed."""
BROADCAST_CHUNKS = 10
RESPONSE_CHUNK_BYTES = 24 * MIB
RESPONSE_CHUNKS = 10
TP_GROUP_CHUNK_BYTES = 4 * MIB
TP_GROUP_CHUNKS = 6
DEFAULT_MQ_CHUNK_MIB = 16
"""vLLM's default ``VLLM_MQ_MAX_CHUNK_BYTES_MB``."""


def _ring_bytes(chunk_bytes: int, chunks: int, readers: int) -> int:
    """One ``ShmRingBuffer``: its data chunks, and per chunk a written flag and a flag per
    reader."""
    return chunks * (chunk_bytes + 1 + readers)


def mq_chunk_mib(env: Mapping[str, str] = os.environ) -> int:
    """The engines' ``VLLM_MQ_MAX_CHUNK_BYTES_MB`` (they inherit the soak's environment)."""
    value = env.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", "")
    return int(value) if value.strip().isdigit() else DEFAULT_MQ_CHUNK_MIB


def engine_ring_bytes(tp: int, chunk_mib: int = DEFAULT_MQ_CHUNK_MIB) -> int:
    """The /dev/shm bytes (sparse) one engine at tensor parallelism ``tp`` creates at start."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if tp == 1:
        return 0
    return (_ring_bytes(chunk_mib * MIB, BROADCAST_CHUNKS, tp)
            + tp * _ring_bytes(RESPONSE_CHUNK_BYTES, RESPONSE_CHUNKS, 1)
            + _ring_bytes(TP_GROUP_CHUNK_BYTES, TP_GROUP_CHUNKS, tp - 1))


def needed_mib(engine_tps: Sequence[int], chunk_mib: int = DEFAULT_MQ_CHUNK_MIB) -> int:
    """The smallest private /dev/shm (MiB) in which engines of these TPs all start and can
    write their ring buffers through."""
    rings = sum(engine_ring_bytes(tp, chunk_mib) for tp in engine_tps)
    return BASE_MIB + math.ceil(rings / MIB)


def default_mib(engine_tps: Sequence[int], decode_tp: int, decode_restarts: int,
                chunk_mib: int = DEFAULT_MQ_CHUNK_MIB) -> int:
    """``needed_mib`` plus the files of every decode the soak may kill (``decode_restarts``)."""
    left_behind = decode_restarts * engine_ring_bytes(decode_tp, chunk_mib)
    return needed_mib(engine_tps, chunk_mib) + math.ceil(left_behind / MIB)


def describe(engine_tps: Mapping[str, int], chunk_mib: int = DEFAULT_MQ_CHUNK_MIB) -> str:
    """Where ``needed_mib`` comes from, for an error message."""
    parts = [f"{name} TP {tp}: {engine_ring_bytes(tp, chunk_mib) / MIB:.0f} MiB"
             for name, tp in engine_tps.items()]
    return (f"{BASE_MIB} MiB base + vLLM's shared-memory ring buffers ({', '.join(parts)}; "
            f"VLLM_MQ_MAX_CHUNK_BYTES_MB={chunk_mib})")
