"""Find a vLLM server's TP worker process by its rank, for the soak's ``decode_tp_rank_killed``.

vLLM's ``mp`` executor runs each TP rank in a process of its own, titled
``VLLM::Worker_TP<rank>`` (with ``_DP<rank>``/``_PP<rank>`` in front when those are > 1, and
``_DCP``/``_EP`` parts behind). The worker is a descendant of the API server (API server ->
engine core -> workers, or fewer levels), so it is looked up among the server's descendants by
walking ``/proc/<pid>/stat`` parent links; ``proc`` is the ``/proc`` to read (a fake tree in
unit tests).
"""

from __future__ import annotations

import re
from pathlib import Path

WORKER_TITLE = re.compile(r"^VLLM::Worker(?:_DP\d+)?(?:_PP\d+)?(?:_PCP\d+)?_TP(\d+)(?:_|$)")
"""vLLM's title of a TP worker process; group 1 is its TP rank."""


class NoTPWorker(RuntimeError):
    """No (or more than one) process of the server carries the wanted TP worker's title."""


def parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """pid -> parent pid of every process readable under ``proc``."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
        # the last ")".
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 2 and fields[1].isdigit():
            found[int(entry.name)] = int(fields[1])
    return found


def descendants(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process below ``root`` (children, their children, ...), nearest first."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents(proc).items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        below = sorted(pid for parent in frontier for pid in children.get(parent, ()))
        found += below
        frontier = below
    return found


def title(pid: int, proc: Path = Path("/proc")) -> str:
    """The process's title (its command line, NULs as spaces); "" when unreadable."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\x00", b" ").decode("utf-8", "replace").strip()


def tp_worker(server: int, tp_rank: int, proc: Path = Path("/proc")) -> int:
    """The pid of TP rank ``tp_rank``'s worker among ``server``'s descendants; raises
    NoTPWorker naming what it saw when there is not exactly one."""
    below = descendants(server, proc)
    titles = {pid: title(pid, proc) for pid in below}
    matches = [pid for pid, name in titles.items()
               if (match := WORKER_TITLE.match(name)) and int(match.group(1)) == tp_rank]
    if len(matches) != 1:
        seen = "; ".join(f"{pid}: {name[:60]!r}" for pid, name in titles.items()) or "none"
        raise NoTPWorker(f"expected one process titled VLLM::Worker..._TP{tp_rank} below "
                         f"server pid {server}, found {len(matches)} (its descendants: {seen})")
    return matches[0]
