"""A private /dev/shm for the soak, and filling it up to a small remainder (test-only).

Filling the machine's /dev/shm would take memory and room from every other process on it (on
a shared machine: other people's tests). So the soak runs in a mount namespace of its own with
a small tmpfs mounted on /dev/shm (``reexec_with_private_shm``): every engine it starts shares
that one, as the engines of one host share theirs, and it is gone when the soak's last process
exits, whatever happened. ``filled`` fills it up to ``remainder`` bytes and always removes the
filler again. Production code never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

SHM = Path("/dev/shm")
MARK = "KVO_SOAK_PRIVATE_SHM"
"""Set (to the size in MiB) in the re-executed soak: its /dev/shm is the private tmpfs."""
FILLER = "kvo-soak-filler"


def private() -> bool:
    return bool(os.environ.get(MARK))


def why_no_private_shm() -> str | None:
    """Why this process cannot get a private /dev/shm (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (a mount namespace with a tmpfs on /dev/shm)"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs util-linux's unshare and mount"
    return None


def reexec_with_private_shm(argv: Sequence[str], size_mib: int) -> None:
    """Re-run this program in a new mount namespace (mounts not propagated back) with a
    ``size_mib`` MiB tmpfs on /dev/shm; returns only when already there."""
    if private():
        return
    command = " ".join(shlex.quote(a) for a in [sys.executable, *argv])
    os.execvp("unshare", [
        "unshare", "--mount", "--propagation", "private", "sh", "-c",
        f"mount -t tmpfs -o size={size_mib}m,mode=1777 kvo-soak-shm {SHM} && "
        f"{MARK}={size_mib} exec {command}"])


def free_bytes() -> int:
    stat = os.statvfs(SHM)
    return stat.f_bavail * stat.f_frsize


@contextlib.contextmanager
def filled(remainder: int) -> Iterator[int]:
    """/dev/shm filled until ``remainder`` bytes are left (what is left is yielded); the filler
    is removed on the way out, also after an error. Only in the private /dev/shm."""
    if not private():
        raise RuntimeError("refusing to fill a /dev/shm that is not the soak's private one")
    path = SHM / FILLER
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        size = max(0, free_bytes() - remainder)
        if size:
            os.posix_fallocate(fd, 0, size)
        yield free_bytes()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
