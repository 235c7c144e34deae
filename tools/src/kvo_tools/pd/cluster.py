"""Start and stop the P/D deployment's processes: vLLM API servers, the proxy, a Mooncake master.

Shared by the demo (kvo_tools.demo), the end-to-end tests (tests/e2e/test_pd.py) and the
benchmark (kvo_tools.bench.e2e). Every process starts in its own session (process group) with
its output in a log file; stopping sends SIGTERM to the whole group, then SIGKILL after a grace
period, so nothing survives the caller — also after Ctrl-C or a failed check. A server that
dies while starting raises with the tail of its log.

Everything binds 127.0.0.1 unless a caller passes ``host`` and a ``netns`` to run in (the
beyond-loopback test, kvo_tools.pd.netns). Mooncake binds every interface, so callers run inside a
loopback-only network namespace (``in_loopback_namespace`` / ``reexec_in_namespace``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

PYTHON = sys.executable
SERVED_MODEL = "kvo-tiny"
BLOCK_SIZE = 32
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}assistant:")

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # The API server still runs its engine core in a second process; this keeps the worker in
    # that process instead of a third one (one fewer interpreter start, ~half the start time).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache, used by the tests
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Attention without split-KV reduces a context in one fixed order, whatever the thread and
    # batch layout; the engines compared bit for bit then differ only where the flow differs.
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
}


STORE_LEASE_MS = 10_000
"""Mooncake Store lease per get/put. The 200 ms used elsewhere is too short when two loaded
CPU cores serve three engines: a batched get outlives it and fails with LEASE_EXPIRED."""


def start_master() -> Any:
    """A Mooncake master on loopback with a lease long enough for this machine."""
    from kvo_transport.mooncake_master import MooncakeMaster

    return MooncakeMaster(default_kv_lease_ttl_ms=STORE_LEASE_MS).start()


class ClusterError(RuntimeError):
    """A process of the deployment failed to start or misbehaved; the message says which."""


def in_namespace() -> bool:
    return os.environ.get("KVO_IN_NETNS") == "1"


def reexec_in_namespace(argv: Sequence[str]) -> None:
    """Re-run this program inside a loopback-only network namespace (root + unshare needed)."""
    if in_namespace():
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise ClusterError(
            "Mooncake listens on every network interface, so this must run inside a private "
            "network namespace with only loopback. Run it through nox (nox -s demo), or as "
            "root: unshare -n sh -c 'ip link set lo up && KVO_IN_NETNS=1 python ...'")
    command = " ".join(shlex.quote(a) for a in [PYTHON, *argv])
    os.execvp("unshare", ["unshare", "-n", "sh", "-c",
                          f"ip link set lo up && KVO_IN_NETNS=1 exec {command}"])


def free_port() -> int:
    from kvo_transport.mooncake_master import free_loopback_port

    return free_loopback_port()


def write_chat_template(directory: Path) -> Path:
    path = directory / "chat_template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


# -- processes ---------------------------------------------------------------------------------

@attrs.define
class Managed:
    """One started process (its own process group) and its log file."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]
    url: str | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_bytes: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-max_bytes:].decode("utf-8", "replace")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        # The group may still hold children (vLLM's engine core); take them down too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the whole group at once (fault tests: a crash, not a shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


class Cluster:
    """Owns started processes; ``close`` (or leaving the ``with``) stops them, newest first."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[Managed] = []
        self._starts: dict[str, int] = {}
        """Processes started per name (a restart keeps the earlier logs: ``log_path_for``)."""
        workdir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process group at once, then wait; SIGKILL what outlives the grace."""
        running = [m for m in reversed(self.processes) if m.alive()]
        for managed in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(managed.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for managed in running:
            with contextlib.suppress(Exception):
                managed.stop(grace_s=max(0.1, deadline - time.monotonic()))
        self.processes.clear()

    def start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None,
              url: str | None = None, netns: str | None = None) -> Managed:
        """``netns``: the named network namespace to run in (``ip netns exec``)."""
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        log_path = self.log_path_for(name)
        full_env = {**os.environ, **(env or {})}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=full_env,
                                       start_new_session=True)
        managed = Managed(name=name, argv=argv, log_path=log_path, process=process, url=url)
        self.processes.append(managed)
        return managed

    def log_path_for(self, name: str) -> Path:
        """The log of the next process named ``name``: ``name.log`` for the first, then
        ``name.restart1.log``, ``name.restart2.log``, ... so that a restarted process (a
        killed decode) never overwrites the log of the one before it."""
        starts = self._starts[name] = self._starts.get(name, 0) + 1
        return self.workdir / (f"{name}.log" if starts == 1 else f"{name}.restart{starts - 1}.log")

    def start_vllm(self, name: str, model: Path, port: int,
                   kv_transfer_config: Mapping[str, Any] | None = None,
                   extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                   max_model_len: int = 4096, block_size: int = BLOCK_SIZE,
                   host: str = "127.0.0.1", netns: str | None = None) -> Managed:
        argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", SERVED_MODEL, "--host", host, "--port", str(port),
                "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
                "--block-size", str(block_size), "--seed", "0",
                "--distributed-executor-backend", "uni",
                "--chat-template", str(write_chat_template(self.workdir)),
                "--disable-uvicorn-access-log", *extra_args]
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        return self.start(name, argv, {**ENGINE_ENV, "VLLM_HOST_IP": host, **(env or {})},
                          url=f"http://{host}:{port}", netns=netns)

    def start_proxy(self, port: int, prefill_url: str, decode_url: str,
                    extra_args: Sequence[str] = (), name: str = "proxy",
                    host: str = "127.0.0.1", netns: str | None = None,
                    env: Mapping[str, str] | None = None) -> Managed:
        argv = [PYTHON, "-m", "kvo_vllm.proxy", "--prefill", prefill_url, "--decode",
                decode_url, "--host", host, "--port", str(port), *extra_args]
        return self.start(name, argv, env, url=f"http://{host}:{port}", netns=netns)


def wait_healthy(servers: Sequence[Managed], timeout_s: float,
                 progress: Callable[[str], None] | None = None) -> None:
    """Poll each server's /health until all answer 200; raise naming the one that failed."""
    deadline = time.monotonic() + timeout_s
    waiting = [s for s in servers if s.url is not None]
    last_note = time.monotonic()
    started = time.monotonic()
    while waiting:
        for server in list(waiting):
            if not server.alive():
                raise ClusterError(f"{server.name} exited with code {server.process.returncode} "
                                   f"while starting; its log ends with:\n{server.log_tail()}")
            if http_ok(f"{server.url}/health"):
                waiting.remove(server)
                if progress is not None:
                    progress(f"{server.name} is up ({time.monotonic() - started:.0f} s)")
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            tails = "\n".join(f"--- {s.name}:\n{s.log_tail(1500)}" for s in waiting)
            raise ClusterError(f"{names} not healthy within {timeout_s:g} s\n{tails}")
        if progress is not None and time.monotonic() - last_note > 15:
            last_note = time.monotonic()
            progress("still starting: " + ", ".join(s.name for s in waiting)
                     + f" ({time.monotonic() - started:.0f} s)")
        time.sleep(0.5)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 300.0
              ) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"error": {"message": text.decode("utf-8", "replace")}}


def get_json(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body = json.loads(response.read())
    if not isinstance(body, dict):
        raise ClusterError(f"GET {url} answered {type(body).__name__}, not a JSON object")
    return body


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks stop the processes."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- kv_transfer_config for each role ------------------------------------------------------------

def prefill_transfer_config(store_master: str, kv_port: int, stats_file: Path | None = None,
                            shared_buffers: int = 2, layer_deadline_s: float = 60.0,
                            handshake_timeout_s: float = 30.0) -> dict[str, Any]:
    """KvoMultiConnector: 8 layers in 1 + shared_buffers physical buffers, remote D2H on top.

    A store load that fails (the Mooncake master died) is recomputed on prefill; the request's
    hand-off is given up and the decode told so (SEND_ABORTED), which recomputes the prompt
    itself: the client gets its answer, not an error."""
    extra: dict[str, Any] = {
        "layerwise": {"store_master_address": store_master, "shared_buffers": shared_buffers,
                      "independent_layers": [0], "prefetch_depth": 1,
                      "store_segment_bytes": 256 * 1024 * 1024,
                      "layer_deadline_s": layer_deadline_s},
        "remote_d2h": {"kv_port": kv_port, "layer_deadline_s": layer_deadline_s,
                       "handshake_timeout_s": handshake_timeout_s},
    }
    if stats_file is not None:
        extra["stats_file"] = str(stats_file)
    return {"kv_connector": "KvoMultiConnector",
            "kv_connector_module_path": "kvo_vllm.remote_d2h", "kv_role": "kv_producer",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def d2h_prefill_transfer_config(kv_port: int, stats_file: Path | None = None,
                                layer_deadline_s: float = 60.0,
                                handshake_timeout_s: float = 30.0) -> dict[str, Any]:
    """RemoteD2HConnector alone on prefill: every layer published to decode, nothing saved to
    a store (what a P/D-only deployment runs; vLLM's MooncakeConnector pair does the same)."""
    extra: dict[str, Any] = {"kv_port": kv_port, "layer_deadline_s": layer_deadline_s,
                             "handshake_timeout_s": handshake_timeout_s}
    if stats_file is not None:
        extra["stats_file"] = str(stats_file)
    return {"kv_connector": "RemoteD2HConnector",
            "kv_connector_module_path": "kvo_vllm.remote_d2h", "kv_role": "kv_producer",
            "kv_connector_extra_config": extra}


def decode_transfer_config(kv_port: int, stats_file: Path | None = None,
                           layer_deadline_s: float = 60.0, handshake_timeout_s: float = 30.0,
                           failure_policy: str = "recompute",
                           read_retries: int = 2) -> dict[str, Any]:
    """RemoteD2HConnector on decode; a failed pull is recomputed (``failure_policy``)."""
    extra: dict[str, Any] = {"kv_port": kv_port, "layer_deadline_s": layer_deadline_s,
                             "handshake_timeout_s": handshake_timeout_s,
                             "read_retries": read_retries}
    if stats_file is not None:
        extra["stats_file"] = str(stats_file)
    return {"kv_connector": "RemoteD2HConnector",
            "kv_connector_module_path": "kvo_vllm.remote_d2h", "kv_role": "kv_consumer",
            "kv_load_failure_policy": failure_policy, "kv_connector_extra_config": extra}
