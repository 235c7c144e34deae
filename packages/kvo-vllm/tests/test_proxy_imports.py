"""kvo-proxy runs on a host without torch or vLLM (the ``kvo-vllm[proxy]`` extra).

The proxy is started for real, as ``python -m kvo_vllm.proxy``, in a process where importing
torch, vLLM or the connectors' other heavy dependencies raises ImportError; it must serve its
health route, and none of those modules may have been imported.
"""

from __future__ import annotations

import importlib
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

BLOCKED = ("torch", "vllm", "numpy", "zmq", "msgspec", "triton", "kvo_kernels")

RUNNER = """
import importlib.abc, sys
BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed on a proxy-only host")
        return None

sys.meta_path.insert(0, Blocker())
import atexit, runpy
atexit.register(lambda: print("IMPORTED", sorted(m for m in sys.modules
                                                 if m.split(".")[0] in BLOCKED), flush=True))
sys.argv = ["kvo-proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
            "--port", "{port}"]
runpy.run_module("kvo_vllm.proxy", run_name="__main__")
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_proxy_serves_with_torch_and_vllm_unimportable() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", RUNNER.format(blocked=BLOCKED, port=port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    status = r.status
                break
            except OSError:
                time.sleep(0.2)
        assert status == 200, (proc.poll(), proc.stderr.read() if proc.poll() is not None
                               else "no answer on /health")
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "IMPORTED []" in out, (out, err[-3000:])


def test_the_connectors_still_load_by_name_from_the_remote_d2h_package() -> None:
    """vLLM loads ``kv_connector_module_path="kvo_vllm.remote_d2h"`` by importing the module and
    looking the class up by name: the lazy import must answer that (and refuse other names)."""
    module = importlib.import_module("kvo_vllm.remote_d2h")
    from kvo_vllm.remote_d2h.connector import RemoteD2HConnector
    from kvo_vllm.remote_d2h.multi import KvoMultiConnector

    assert module.RemoteD2HConnector is RemoteD2HConnector
    assert module.KvoMultiConnector is KvoMultiConnector
    with pytest.raises(AttributeError, match="NoSuchConnector"):
        _ = module.NoSuchConnector
