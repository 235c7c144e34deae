"""What a started process group holds: resident memory and /dev/shm files (Linux /proc).

The soak records this for every engine at its start and end, so a leak of memory or of
shared-memory files over a long run shows up in its JSON. A group is one ``Managed`` process
and its children (vLLM's engine core): ``Managed`` starts each in a process group of its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SHM = "/dev/shm/"


def group_pids(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # Fields after the command name (which may hold spaces and parentheses).
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return sorted(pids)


RSS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes",
              "RssShmem": "rss_shmem_bytes"}
"""/proc/PID/status fields summed per group: all resident memory, and its three kinds
(anonymous: heaps, the store segment; file: mapped libraries and weights, faulted in as code
paths are first used; shmem: shared anonymous memory such as kvo's bounce buffers)."""


def _rss(pid: int) -> dict[str, int]:
    found = dict.fromkeys(RSS_FIELDS.values(), 0)
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name = line.split(":", 1)[0]
            if name in RSS_FIELDS:
                found[RSS_FIELDS[name]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found


def _shm_paths(pid: int) -> set[str]:
    """/dev/shm files the process maps or holds open (" (deleted)" marks unlinked ones)."""
    paths: set[str] = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(SHM):
                paths.add(parts[5])
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(SHM):
                paths.add(target)
    except OSError:
        pass
    return paths


def footprint(pgid: int) -> dict[str, Any]:
    """{pids, rss_bytes and its kinds (RSS_FIELDS; summed over the group: shared pages count
    once per process), shm_files (sorted paths), shm_bytes (sizes of those still linked)}."""
    pids = group_pids(pgid)
    shm: set[str] = set()
    for pid in pids:
        shm |= _shm_paths(pid)
    size = 0
    for path in shm:
        try:
            size += os.stat(path).st_size
        except OSError:
            pass  # unlinked (" (deleted)") or gone
    rss = dict.fromkeys(RSS_FIELDS.values(), 0)
    for pid in pids:
        for key, value in _rss(pid).items():
            rss[key] += value
    return {"pgid": pgid, "pids": len(pids), **rss, "shm_files": sorted(shm), "shm_bytes": size}


def shm_listing(directory: str = SHM) -> dict[str, Any]:
    """Every file in /dev/shm now: count, total bytes and names (all processes, not one
    engine; the names tell whose a leftover is: vLLM's ``psm_*``, semaphores ``sem.*``,
    kvo's ``kvo-*``)."""
    total = 0
    names: list[str] = []
    try:
        for entry in os.scandir(directory):
            try:
                total += entry.stat(follow_symlinks=False).st_size
                names.append(entry.name)
            except OSError:
                continue
    except OSError:
        pass
    return {"files": len(names), "bytes": total, "names": sorted(names)}
