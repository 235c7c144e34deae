"""Builds and loads kvo's C++/OpenMP host ops on first use (PyTorch's JIT extension tooling).

The sources ship inside the package (``kvo_kernels/csrc``); the first call compiles them with the
host compiler into ``~/.cache/kvo/torch_extensions/<python>-<torch>/<name>/`` (override with
``KVO_TORCH_EXTENSIONS_DIR``) and later calls, in any process, reuse the built library. The
library's name carries a digest of every source and header, so an upgraded package never loads
a stale build (PyTorch's own check sees only the listed sources, not the headers). PyTorch holds
a file lock while building, so concurrent processes do not race; a process-local lock keeps
threads from loading twice; a failed build is not retried in the same process.

``kvo-build-native-ops`` (or ``python -m kvo_kernels.native_build``) builds them ahead of time,
e.g. while building a container image, so no server compiles them at start-up.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from kvo_core.errors import KvoError

CSRC = Path(__file__).parent / "csrc"
EXTENSION_PREFIX = "kvo_native_ops"
SOURCES = ("residency.cpp", "sparse_copy.cpp", "row_identity.cpp")
HEADERS = ("residency_rows.h", "lru_log.h", "residency_scan.h", "sparse_copy.h",
           "row_identity.h", "index_matrix.h")
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)

log = logging.getLogger("kvo.kernels.native_build")
_lock = threading.Lock()
_module: ModuleType | None = None


class NativeBuildError(KvoError, RuntimeError):
    """The C++ host ops could not be compiled or loaded; the message carries the compiler output."""


_failure: NativeBuildError | None = None


def build_directory() -> Path:
    """Where the compiled library lives: one folder per Python and torch version (ABI)."""
    root = os.environ.get("KVO_TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvo" / "torch_extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return base / tag.replace("+", "_")


def extension_name() -> str:
    """``kvo_native_ops_<digest>``: changes whenever a source, header or flag changes."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join((*CFLAGS, *LDFLAGS)).encode())
    return f"{EXTENSION_PREFIX}_{digest.hexdigest()[:16]}"


STALE_LOCK_S = 900.0
"""A build lock older than this is left by a builder that died (killed mid-build): a build
takes about a minute here, several on a loaded machine. PyTorch would wait on it forever."""


def reclaim_stale_lock(directory: Path, *, now: float | None = None) -> bool:
    """Remove ``directory/lock`` when it is older than ``STALE_LOCK_S``; True if removed."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("removing %s: a build lock %.0f s old, left by a build that did not finish",
                lock, age)
    lock.unlink(missing_ok=True)
    return True


def _compiler() -> str:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise NativeBuildError(
            f"kvo's native residency op needs a C++ compiler with OpenMP (gcc), but {compiler!r} "
            "is not on PATH; install g++ (e.g. apt-get install g++) or set CXX")
    return compiler


def compile_and_load(name: str, sources: Sequence[Path], directory: Path, *,
                     python_module: bool = False) -> ModuleType | None:
    """Compile ``sources`` into the library ``name`` under ``directory`` and load it.

    Loading runs the library's ``TORCH_LIBRARY`` registrations; with ``python_module`` the
    library is also imported as a Python module (its ``PYBIND11_MODULE``), and returned.
    Raises NativeBuildError with the compiler's output when the compiler is missing or the
    build fails.
    """
    built = directory / f"{name}.so"
    if built.is_file():  # the name carries the sources' digest: this build is current
        try:
            return load_built(name, built, python_module=python_module)
        except (OSError, ImportError) as error:  # unreadable or broken: build it again
            log.warning("could not load %s (%s); building it again", built, error)
    compiler = _compiler()
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    reclaim_stale_lock(directory)
    log.info("kvo: compiling native host ops %s (%s) with %s into %s: about a minute, once per "
             "kvo/torch/Python version (build them ahead with `kvo-build-native-ops`)",
             name, ", ".join(Path(s).name for s in sources), compiler, directory)
    started = time.monotonic()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            is_python_module=python_module,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:
        raise NativeBuildError(
            f"building kvo's native ops ({', '.join(Path(s).name for s in sources)}) in "
            f"{directory} failed; compiler output:\n{error}") from error
    log.info("kvo: native host ops %s built in %.1f s: %s", name, time.monotonic() - started,
             built)
    return module if python_module else None


def load_built(name: str, library: Path, *, python_module: bool) -> ModuleType | None:
    """Load an already built library without PyTorch's build step.

    ``cpp_extension.load`` takes the build directory's lock even when nothing needs building,
    and waits forever on a lock a killed process left behind; every process that only loads
    the op (each vLLM worker) would hang on it. Loading the file directly takes no lock.
    """
    if not python_module:
        torch.ops.load_library(str(library))
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_native_ops() -> ModuleType:
    """Compile (once) and load the native ops, registering ``torch.ops.kvo.residency_update``.

    Returns the library as a Python module too: its ``residency_update`` is the same C++
    function without the dispatcher in front (~5 us less per call here, a tenth of a
    one-row update).
    """
    global _module, _failure
    with _lock:
        if _failure is not None:  # one build attempt per process, not one per caller
            raise _failure
        if _module is None:
            name = extension_name()
            try:
                _module = compile_and_load(name, [CSRC / source for source in SOURCES],
                                           build_directory() / name, python_module=True)
            except NativeBuildError as error:
                _failure = error
                raise
        module = _module
    if module is None:  # compile_and_load returns the module when asked to
        raise NativeBuildError("kvo's native ops built but did not load as a module")
    return module


def main(argv: Sequence[str] | None = None) -> int:
    """``kvo-build-native-ops``: build (or find) the native ops now and print where they are."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="kvo-build-native-ops",
        description="Build kvo's C++/OpenMP host ops ahead of time (e.g. in a container image) "
                    "into the cache the servers load them from: $KVO_TORCH_EXTENSIONS_DIR, "
                    "default ~/.cache/kvo/torch_extensions.")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    name = extension_name()
    library = build_directory() / name / f"{name}.so"
    cached = library.is_file()
    started = time.monotonic()
    try:
        load_native_ops()
    except NativeBuildError as error:
        print(f"kvo-build-native-ops: {error}", file=sys.stderr)
        return 1
    state = "already built" if cached else f"built in {time.monotonic() - started:.1f} s"
    print(f"kvo native ops {state}: {library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
