"""The ``memcache`` KVStore backend (Memcache Hybrid on MemFabric, Ascend) and its MetaService.

Memcache needs one MetaService per machine (it holds a POSIX lock on
/tmp/mmc_meta_service.lock) and a client per process. The MetaService and the client's setup run
without an Ascend driver; the client's init and every data-path call need the driver, and kvo
raises StoreError quoting the library's reason when it is missing.

Memcache's put does not promise to replace an existing value, so put_from removes keys that
exist before putting them (not atomic: a reader in between sees the key absent, never stale).

Every data-path call (put, get, exists, remove) is bounded like Mooncake's (``call_timeout_s``,
bounded_calls.py): it runs in a worker thread through bounce memory and fails with
StoreUnavailableError, opening the circuit breaker, when the service does not answer in time; an
abandoned call never touches the caller's ranges. Memcache has no health probe here, so the
breaker half-opens on its own timer and the next call tries again. Not tested here with the
real library (its data path needs the driver); the bound is tested against a stand-in client.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from kvo_core.errors import ConfigError
from kvo_transport.ascend_log import explain, log_tap
from kvo_transport.bounded_calls import DEFAULT_CALL_TIMEOUT_S, check_call_timeout
from kvo_transport.buffer_store import BufferStore, guarded
from kvo_transport.errors import StoreError, backend_unavailable
from kvo_transport.keyed_batch import check_keyed_batch, check_keys
from kvo_transport.mooncake_master import LOOPBACK, accepts, free_loopback_port
from kvo_transport.regions import MemoryRegion

META_SERVICE_LOCK = Path("/tmp/mmc_meta_service.lock")
MEMCACHE_PROTOCOLS = (
    "host_rdma",
    "host_urma",
    "host_tcp",
    "host_shm",
    "device_rdma",
    "device_urma",
    "device_uboe",
    "device_sdma",
)
META_SERVICE_MAIN = (
    "import sys\nfrom memcache_hybrid import MetaService\nsys.exit(MetaService.main())\n"
)


def import_memcache() -> tuple[Any, Any]:
    """(memcache_hybrid, memfabric_hybrid), or BackendUnavailableError naming the extra."""
    try:
        import memcache_hybrid
        import memfabric_hybrid
    except ImportError as exc:
        raise backend_unavailable("memcache", "ascend", exc) from exc
    return memcache_hybrid, memfabric_hybrid


def meta_service_lock_holder() -> bool:
    """True when some process holds the machine-wide MetaService lock."""
    try:
        fd = os.open(META_SERVICE_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class MemcacheMetaService:
    """Context manager: a Memcache MetaService on 127.0.0.1, configured by a generated file.

    ``meta_service_url`` and ``config_store_url`` are what clients need; ``local_config_text()``
    renders a matching client file for MMC_LOCAL_CONFIG_PATH.
    """

    def __init__(self, *, start_timeout_s: float = 30.0, log_level: str = "warn") -> None:
        self.meta_port = free_loopback_port()
        self.config_store_port = free_loopback_port()
        self.metrics_port = free_loopback_port()
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level
        self._workdir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def meta_service_url(self) -> str:
        return f"tcp://{LOOPBACK}:{self.meta_port}"

    @property
    def config_store_url(self) -> str:
        return f"tcp://{LOOPBACK}:{self.config_store_port}"

    @property
    def meta_config_path(self) -> Path:
        if self._workdir is None:
            raise StoreError("the Memcache MetaService is not started")
        return self._workdir / "mmc-meta.conf"

    def meta_config_text(self) -> str:
        return (
            f"ock.mmc.meta_service_url = {self.meta_service_url}\n"
            f"ock.mmc.meta_service.config_store_url = {self.config_store_url}\n"
            f"ock.mmc.meta_service.metrics_url = http://{LOOPBACK}:{self.metrics_port}\n"
            f"ock.mmc.log_level = {self.log_level}\n"
        )

    def local_config_text(
        self, protocol: str = "host_rdma", dram_size: str = "1GB", world_size: int = 256
    ) -> str:
        return (
            f"ock.mmc.meta_service_url = {self.meta_service_url}\n"
            f"ock.mmc.local_service.config_store_url = {self.config_store_url}\n"
            f"ock.mmc.log_level = {self.log_level}\n"
            f"ock.mmc.local_service.world_size = {world_size}\n"
            f"ock.mmc.local_service.protocol = {protocol}\n"
            f"ock.mmc.local_service.dram.size = {dram_size}\n"
        )

    def output_tail(self, max_bytes: int = 4000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - max_bytes))
        return self._log.read().decode(errors="replace")

    def start(self) -> MemcacheMetaService:
        import_memcache()
        if self._process is not None:
            raise StoreError("this Memcache MetaService is already started")
        if meta_service_lock_holder():
            raise StoreError(
                f"another Memcache MetaService already runs on this machine (it holds the lock "
                f"{META_SERVICE_LOCK}); Memcache allows one per machine"
            )
        self._workdir = Path(tempfile.mkdtemp(prefix="kvo-mmc-meta-"))
        self.meta_config_path.write_text(self.meta_config_text())
        env = dict(os.environ, MMC_META_CONFIG_PATH=str(self.meta_config_path))
        self._log = tempfile.TemporaryFile(prefix="kvo-mmc-meta-log-")
        self._process = subprocess.Popen(
            [sys.executable, "-c", META_SERVICE_MAIN],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while not (accepts(self.meta_port) and accepts(self.config_store_port)):
            code = self._process.poll()
            if code is not None or time.monotonic() > deadline:
                tail = self.output_tail()
                self.stop()
                what = (
                    f"exited with code {code}"
                    if code is not None
                    else f"did not listen within {self.start_timeout_s} s"
                )
                raise StoreError(
                    f"Memcache MetaService {what} ({self.meta_service_url}); output ends with:\n"
                    f"{tail}"
                )
            time.sleep(0.05)
        return self

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, grace_s: float = 0.5) -> None:
        """Stop and reap the service; it ignores SIGTERM while serving, so SIGKILL follows."""
        process = self._process
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> MemcacheMetaService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@attrs.frozen
class MemcacheStoreOptions:
    """Fields of Memcache's LocalConfig plus the device the client initialises on."""

    meta_service_url: str
    config_store_url: str
    protocol: str = "host_rdma"
    dram_size: str = "1GB"
    world_size: int = 256
    device_id: int = 0
    log_level: str = "warn"
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    """The longest a data-path call may take before it fails (StoreUnavailableError) and opens
    the circuit breaker; 0: calls go to the client directly, unbounded (no bounce copy)."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MemcacheStoreOptions:
        allowed = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown memcache store option(s) {unknown}; allowed: {allowed}")
        missing = [n for n in ("meta_service_url", "config_store_url") if n not in options]
        if missing:
            raise ConfigError(f"memcache store option(s) {missing} are required (tcp://host:port)")
        made = cls(**options)
        for name in ("meta_service_url", "config_store_url"):
            url = getattr(made, name)
            scheme, _, rest = url.partition("://")
            host, _, port = rest.rpartition(":")
            if scheme != "tcp" or not host or not port.isdigit():
                raise ConfigError(f"memcache store option {name}={url!r} must be tcp://host:port")
        if made.protocol not in MEMCACHE_PROTOCOLS:
            raise ConfigError(
                f"memcache store option protocol={made.protocol!r}; "
                f"allowed: {', '.join(MEMCACHE_PROTOCOLS)}"
            )
        if isinstance(made.device_id, bool) or not isinstance(made.device_id, int) or (
            made.device_id < 0
        ):
            raise ConfigError(f"memcache store option device_id={made.device_id!r} must be >= 0")
        check_call_timeout("memcache", made.call_timeout_s)
        return made


_process_config: MemcacheStoreOptions | None = None
_process_config_lock = threading.Lock()


def claim_process_config(options: MemcacheStoreOptions) -> None:
    """Memcache keeps the first client configuration of a process and ignores later ones.

    A second client pointing elsewhere would silently use the first set-up (and hang if that
    service is gone), so refuse it up front.
    """
    global _process_config
    with _process_config_lock:
        if _process_config is None:
            _process_config = options
        elif _process_config != options:
            raise StoreError(
                "Memcache allows one client configuration per process; this process is already "
                f"set up with {_process_config}, not {options}"
            )


def reachable(url: str) -> bool:
    """Whether tcp://host:port accepts a TCP connection now."""
    import socket

    host, _, port = url.partition("://")[2].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def build_local_config(memcache: Any, options: MemcacheStoreOptions) -> Any:
    """The memcache_hybrid.LocalConfig that DistributedObjectStore.setup() receives."""
    config = memcache.LocalConfig()
    config.meta_service_url = options.meta_service_url
    config.config_store_url = options.config_store_url
    config.protocol = options.protocol
    config.dram_size = options.dram_size
    config.world_size = options.world_size
    config.log_level = options.log_level
    return config


class MemcacheKVStore(BufferStore):
    """kvo's KVStore over Memcache Hybrid's DistributedObjectStore.

    ``modules`` is (memcache_hybrid, memfabric_hybrid); imported when not given.
    """

    backend = "memcache"
    _label = "Memcache"

    def __init__(self, modules: tuple[Any, Any] | None = None, **options: Any) -> None:
        self.options = MemcacheStoreOptions.from_options(options)
        self._mc, mf = modules if modules is not None else import_memcache()
        self._tap = log_tap(mf)
        for url in (self.options.meta_service_url, self.options.config_store_url):
            if not reachable(url):
                raise StoreError(
                    f"Memcache service at {url} does not accept connections (the client would "
                    "retry forever); start the MetaService first"
                )
        claim_process_config(self.options)
        client = self._mc.DistributedObjectStore()
        rc = client.setup(build_local_config(self._mc, self.options))
        if rc != 0:
            raise StoreError(f"Memcache client setup failed with return code {rc}")
        mark = self._tap.mark()
        rc = client.init(self.options.device_id)
        if rc != 0:
            reason = explain(self._tap.errors_since(mark))
            client.close()
            raise StoreError(
                f"Memcache client init on device {self.options.device_id} (meta service "
                f"{self.options.meta_service_url}) failed with return code {rc}: {reason}"
            )
        self._start(client, f"of meta service {self.options.meta_service_url}",
                    call_timeout_s=self.options.call_timeout_s)

    def _unregister_buffer(self, client: Any, region: MemoryRegion) -> int:
        return int(client.unregister_buffer(region.ptr, region.length))

    @guarded
    def put_from(
        self, keys: Sequence[str], addrs: Sequence[int], lengths: Sequence[int], *,
        settle: Callable[[], Collection[str]] | None = None,
    ) -> None:
        store = self._client()
        batch = check_keyed_batch(self._registry, keys, addrs, lengths, unique=True)
        if not batch.keys:
            if settle is not None:
                settle()
            return
        present = [k for k, here in zip(batch.keys, self.exists(batch.keys), strict=True) if here]
        if present:
            self.remove(present)
        codes = self._calls.put_keyed(f"put of {len(batch.keys)} keys", store.batch_put_from,
                                      batch.keys, batch.addrs, batch.lengths, settle)
        failed = {k: c for k, c in codes.items() if c != 0}
        if failed:
            raise StoreError(f"Memcache put failed for keys (code per key): {failed}")

    @guarded
    def get_into(
        self, keys: Sequence[str], addrs: Sequence[int], lengths: Sequence[int]
    ) -> list[bool]:
        store = self._client()
        batch = check_keyed_batch(self._registry, keys, addrs, lengths, unique=False)
        if not batch.keys:
            return []
        keys, lengths = batch.keys, batch.lengths
        codes = self._calls.get_into(
            f"get of {len(keys)} keys",
            lambda destinations: store.batch_get_into(keys, destinations, lengths),
            batch.addrs, lengths, landed=_got_value)
        ok = [_got_value(c, n) for c, n in zip(codes, batch.lengths, strict=True)]
        missed = [k for k, good in zip(batch.keys, ok, strict=True) if not good]
        if missed:
            present = {k for k, here in zip(missed, self.exists(missed), strict=True) if here}
            if present:
                failed = {k: c for k, c in zip(batch.keys, codes, strict=True) if k in present}
                raise StoreError(f"Memcache get failed for present keys (code per key): {failed}")
        return ok

    @guarded
    def exists(self, keys: Sequence[str]) -> list[bool]:
        store = self._client()
        checked = check_keys(keys)
        if not checked:
            return []
        codes = self._calls.call(f"exists() of {len(checked)} keys",
                                 lambda: store.batch_is_exist(checked))
        failed = {k: c for k, c in zip(checked, codes, strict=True) if c not in (0, 1)}
        if failed:
            raise StoreError(f"Memcache exists() failed (code per key): {failed}")
        return [c == 1 for c in codes]

    @guarded
    def remove(self, keys: Sequence[str]) -> None:
        store = self._client()
        checked = check_keys(keys)
        if not checked:
            return
        self._calls.call(f"remove of {len(checked)} keys", lambda: store.remove_batch(checked))
        still = [k for k, here in zip(checked, self.exists(checked), strict=True) if here]
        if still:
            raise StoreError(f"Memcache remove left keys in place: {still}")


def _got_value(code: int, length: int) -> bool:
    """Memcache's get answers 0 (or the byte count) for a range that got its value."""
    return code == 0 or code == length
