"""Run a ``mooncake_master`` (the Mooncake Store's metadata server) on loopback for a scope.

The master binds its RPC and metrics listeners to 127.0.0.1 here, but Mooncake clients bind all
interfaces, so callers run everything inside a loopback-only network namespace.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from kvo_transport.errors import StoreError, backend_unavailable

LOOPBACK = "127.0.0.1"


def find_master_binary() -> str:
    """Path of the ``mooncake_master`` executable shipped in the mooncake wheel (or on PATH)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "mooncake_master"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("mooncake_master")
    if found is None:
        raise backend_unavailable(
            "mooncake", "mooncake", FileNotFoundError("no mooncake_master executable found")
        )
    return found


_handed_out: set[int] = set()
_LOWEST_PICKED_PORT = 20000
"""Above the ports Mooncake picks for itself at random (0.3.13: its store client's segment port
from about 12300-14300, MC_STORE_CLIENT_MIN/MAX_PORT; its transfer engine's handshake and TCP
listeners from 15000-17000): a port handed out here for a server starting beside a Mooncake
client is not one that client takes first (seen in CI: a decode's control port taken by a
prefill's store client)."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound as 0 (Linux; the usual default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and not handed out before.

    Picked at random below the kernel's ephemeral range: a port taken from inside it (by
    binding port 0) goes back to the pool the moment the probe closes, and any process that
    binds port 0 meanwhile (vLLM's and Mooncake's internal listeners do, by the dozen) may get
    it first (seen in CI: a decode's control socket found its port taken). Falls back to the
    kernel's choice when no range below the ephemeral one exists.
    """
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    if low - _LOWEST_PICKED_PORT >= 1000:
        for _ in range(200):
            port = rng.randrange(_LOWEST_PICKED_PORT, low)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((LOOPBACK, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def accepts(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """Context manager: start ``mooncake_master`` on 127.0.0.1, give ``.address``, stop on exit."""

    def __init__(
        self,
        rpc_port: int | None = None,
        *,
        default_kv_lease_ttl_ms: int = 200,
        start_timeout_s: float = 30.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.rpc_port = rpc_port if rpc_port is not None else free_loopback_port()
        self.metrics_port = free_loopback_port()
        self.default_kv_lease_ttl_ms = default_kv_lease_ttl_ms
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        return [
            find_master_binary(),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.default_kv_lease_ttl_ms}",
            *self.extra_args,
        ]

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The last output of the master process (stdout and stderr interleaved)."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - max_bytes))
        return self._log.read().decode(errors="replace")

    def start(self) -> MooncakeMaster:
        if self._process is not None:
            raise StoreError(f"mooncake_master at {self.address} is already started")
        argv = self.command()
        self._log = tempfile.TemporaryFile(prefix="kvo-mooncake-master-")
        self._process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.start_timeout_s
        while not accepts(self.rpc_port):
            code = self._process.poll()
            if code is not None:
                tail = self.log_tail()
                self._cleanup()
                raise StoreError(
                    f"mooncake_master exited with code {code} before accepting on {self.address}; "
                    f"command: {' '.join(argv)}; its output ends with:\n{tail}"
                )
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise StoreError(
                    f"mooncake_master did not accept connections on {self.address} within "
                    f"{self.start_timeout_s} s; its output ends with:\n{tail}"
                )
            time.sleep(0.05)
        return self

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the master and reap it (SIGKILL if it ignores SIGTERM)."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"MooncakeMaster({self.address}, {state})"
