"""Upstream's host-CPU LRU, built from a vllm-ascend checkout, for a side-by-side timing only.

vllm-ascend's sparse decode offload updates residency on the host with ``lru_resident_compact``
(``vllm_ascend/distributed/kv_transfer/sparse_kv_offload/sparse_kv_offload.cpp``): int32 state,
caller-owned outputs, every row's whole LRU order walked each step. kvo's target for its native
op was set against that function's cost "here", so the residency benchmark can time it on the
same trace, threads and steps as kvo's op. Nothing of it is kept in this repository: the
benchmark compiles the function from the file the user points ``KVO_UPSTREAM_LRU_SRC`` at
(the NPU-only includes dropped, a C entry point added) into a temporary shared library.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

import torch

ENV_VAR = "KVO_UPSTREAM_LRU_SRC"
ENTRY = "lru_resident_compact"
# Everything after the LRU in that file is NPU address work the benchmark does not need.
_CUT_BEFORE = ("int32_t compute_lru_resident_addrs", "PYBIND11_MODULE")
_NPU_INCLUDE = re.compile(r"#include\s*[<\"](torch|ATen|acl|torch_npu)[/.]")
_POINTERS = 15  # lru_resident_compact's pointer arguments, then six integers
_SHIM = """
#include "upstream_lru.inc"
extern "C" void kvo_bench_upstream_lru(
    uintptr_t a0, uintptr_t a1, uintptr_t a2, uintptr_t a3, uintptr_t a4, uintptr_t a5,
    uintptr_t a6, uintptr_t a7, uintptr_t a8, uintptr_t a9, uintptr_t a10, uintptr_t a11,
    uintptr_t a12, uintptr_t a13, uintptr_t a14, int64_t rows, int64_t topk, int64_t capacity,
    int64_t max_token, int64_t workspace_threads, int64_t threads) {
  lru_resident_compact(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, rows,
                       topk, capacity, max_token, workspace_threads, threads);
}
"""


class UpstreamBuildError(RuntimeError):
    """The upstream source is missing, is not the expected file, or did not compile."""


def build(source: Path) -> ctypes.CDLL:
    """Compiles upstream's LRU with the flags kvo's op uses (-O3 -fopenmp); returns the library."""
    if not source.is_file():
        raise UpstreamBuildError(f"{ENV_VAR}={source} is not a file; point it at "
                                 f"vllm-ascend's sparse_kv_offload.cpp")
    text = source.read_text()
    if f"void {ENTRY}(" not in text:
        raise UpstreamBuildError(f"{source} defines no {ENTRY}(...): not vllm-ascend's "
                                 f"sparse_kv_offload.cpp, or upstream renamed the function")
    cut = min((text.find(m) for m in _CUT_BEFORE if m in text), default=len(text))
    kept = [line for line in text[:cut].splitlines() if not _NPU_INCLUDE.search(line)]
    work = Path(tempfile.mkdtemp(prefix="kvo-upstream-lru-"))
    (work / "upstream_lru.inc").write_text("\n".join(kept) + "\n")
    (work / "shim.cpp").write_text(_SHIM)
    library = work / "libupstream_lru.so"
    command = ["c++", "-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-o", str(library),
               str(work / "shim.cpp")]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise UpstreamBuildError(f"compiling {source} failed ({' '.join(command)}):\n"
                                 f"{built.stderr[-2000:]}")
    lib = ctypes.CDLL(str(library))
    lib.kvo_bench_upstream_lru.argtypes = [ctypes.c_uint64] * _POINTERS + [ctypes.c_int64] * 6
    lib.kvo_bench_upstream_lru.restype = None
    return lib


class UpstreamTable:
    """R rows of upstream's LRU state (int32) with its workspaces and caller-owned outputs.

    Upstream has no first-offload path of its own, so a table starts from kvo's state after the
    first offload (``start_from``); from then on both apply the same steady steps.
    """

    def __init__(self, lib: ctypes.CDLL, rows: int, capacity: int, top_k: int, max_token: int,
                 threads: int) -> None:
        i32 = torch.int32
        self._lib, self._rows, self._capacity, self._top_k = lib, rows, capacity, top_k
        self._max_token, self._threads = max_token, threads
        self.slot_to_token = torch.full((rows, capacity), -1, dtype=i32)
        self.lru_slots = torch.arange(capacity, dtype=i32).repeat(rows, 1)
        self.req_ids = torch.arange(rows, dtype=torch.int64)
        self.last_req_ids = self.req_ids.clone()
        self.stable = torch.full((rows,), max_token, dtype=i32)
        self.topk = torch.empty((rows, top_k), dtype=i32)
        self.slots = torch.empty((rows, top_k), dtype=i32)
        self.miss_counts = torch.empty((rows,), dtype=i32)
        self.miss_tokens = torch.empty((rows, top_k), dtype=i32)
        self.miss_slots = torch.empty((rows, top_k), dtype=i32)
        self._mark = torch.zeros((threads, max_token), dtype=i32)
        self._pos = torch.full((threads, max_token), -1, dtype=i32)
        self._slot_ws = torch.empty((threads, 3 * capacity), dtype=i32)
        self._miss_ws = torch.empty((threads, top_k), dtype=i32)
        self._epochs = torch.zeros((threads,), dtype=i32)
        self._args = [t.data_ptr() for t in (
            self.req_ids, self.last_req_ids, self.topk, self.stable, self.slot_to_token,
            self.lru_slots, self.slots, self.miss_counts, self.miss_tokens, self.miss_slots,
            self._mark, self._pos, self._slot_ws, self._miss_ws, self._epochs)]

    def start_from(self, slot_tokens: torch.Tensor, lru_order: torch.Tensor) -> None:
        self.slot_to_token.copy_(slot_tokens)
        self.lru_slots.copy_(lru_order)

    def set_topk(self, topk: torch.Tensor) -> None:
        """The step's selection as int32, outside the timing (upstream receives int32)."""
        self.topk.copy_(topk)

    def update(self) -> None:
        self._lib.kvo_bench_upstream_lru(*self._args, self._rows, self._top_k, self._capacity,
                                         self._max_token, self._threads, self._threads)

    def outputs(self) -> dict[str, torch.Tensor]:
        """The last update's outputs (int32, like kvo's ResidencyResult)."""
        return dict(slots=self.slots, miss_counts=self.miss_counts,
                    miss_tokens=self.miss_tokens, miss_slots=self.miss_slots)
