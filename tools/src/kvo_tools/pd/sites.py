"""Test-only code plugged into a vLLM server from outside: a ``sitecustomize`` on its PYTHONPATH.

The harness (tests, soak, benchmarks) starts a server with one of these directories first on
``PYTHONPATH`` and the directory's environment variable set; Python runs the directory's
``sitecustomize`` at the start of every process of that server (API server, engine core, TP
workers), and it patches kvo when kvo is imported. Production config names none of it:

- ``TIMING_SITE`` (``timed_prefill_env``): stamps a prefill's KvoMultiConnector hook calls;
- ``ENGINE_SITE`` (``wrapped_decode_env``): decode's transfer engine is wrapped by a callable,
  e.g. the fault injection of ``kvo_tools.pd.faulty_engine`` (``faulty_decode_env``) or the
  pull timeline of ``kvo_tools.pd.timing_engine`` (``timed_decode_env``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

TIMING_SITE = Path(__file__).resolve().parent / "timing_site"
ENGINE_SITE = Path(__file__).resolve().parent / "engine_site"
ENGINE_WRAPPER_ENV = "KVO_TEST_ENGINE_WRAPPER"
"""``{"factory": "module:callable", "options": {...}}`` (JSON) for ``ENGINE_SITE``."""
PULLER_MODULE = "kvo_vllm.remote_d2h.decode_worker"
"""Where ``DecodePuller`` lives: its ``engine_wrapper`` argument is what ENGINE_SITE fills in."""


def on_pythonpath(site: Path) -> str:
    """``PYTHONPATH`` with ``site`` first, then this process's own (its sources, plugins)."""
    return os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))


def timed_prefill_env(out_file: Path) -> dict[str, str]:
    """The environment of a prefill whose hook calls are stamped into ``out_file``."""
    return {"KVO_TIMING_OUT": str(out_file), "PYTHONPATH": on_pythonpath(TIMING_SITE)}


def wrapped_decode_env(factory: str, **options: Any) -> dict[str, str]:
    """The environment of a decode whose transfer engine ``factory`` ('module:callable',
    called as ``factory(engine, layer_regions, **options)``) wraps."""
    load_factory(factory)  # a wrong name fails here, in the harness, not in the server
    return {ENGINE_WRAPPER_ENV: json.dumps({"factory": factory, "options": options}),
            "PYTHONPATH": on_pythonpath(ENGINE_SITE)}


def faulty_decode_env(control_file: Path) -> dict[str, str]:
    """A decode that injects the faults ``control_file`` names (``kvo_tools.pd.faulty_engine``;
    ``{tp_rank}`` in the path names one file per TP rank)."""
    return wrapped_decode_env("kvo_tools.pd.faulty_engine:wrap", control_file=str(control_file))


def timed_decode_env(out_file: Path) -> dict[str, str]:
    """A decode whose pulls are stamped into ``out_file`` (``kvo_tools.pd.timing_engine``)."""
    return wrapped_decode_env("kvo_tools.pd.timing_engine:wrap", out_file=str(out_file))


def load_factory(factory: str) -> Callable[..., Any]:
    """The callable ``factory`` ('module:callable') names; ValueError saying why not."""
    module_name, _, attribute = factory.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"engine wrapper factory must be 'module:callable', got {factory!r}")
    try:
        loaded = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"engine wrapper factory {factory!r} cannot be loaded: {error}") from error
    if not callable(loaded):
        raise ValueError(f"engine wrapper factory {factory!r} is not callable")
    return loaded  # type: ignore[no-any-return]


def engine_wrapper_from_env(value: str) -> Callable[..., Any]:
    """The wrapper ``ENGINE_WRAPPER_ENV`` holds, its options bound; ValueError naming the value."""
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"{ENGINE_WRAPPER_ENV} is not JSON ({error}): {value!r}") from error
    if not isinstance(spec, Mapping) or not isinstance(spec.get("options", {}), Mapping) \
            or set(spec) - {"factory", "options"}:
        raise ValueError(f"{ENGINE_WRAPPER_ENV} must be {{'factory': 'module:callable', "
                         f"'options': {{...}}}}, got {value!r}")
    return functools.partial(load_factory(str(spec.get("factory"))), **spec.get("options", {}))


def wrap_decode_engines(module: ModuleType, value: str) -> None:
    """Every ``DecodePuller`` built without an ``engine_wrapper`` gets the one ``value``
    (``ENGINE_WRAPPER_ENV``) names; loaded when the first puller is built (vLLM's import of
    kvo must not fail on it), so a bad value fails that puller with the reason."""
    puller = module.DecodePuller
    original = puller.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("engine_wrapper") is None:
            kwargs["engine_wrapper"] = engine_wrapper_from_env(value)
        original(self, *args, **kwargs)

    puller.__init__ = __init__


def patch_on_import(target: str, patch: Callable[[ModuleType], None]) -> None:
    """Run ``patch`` on module ``target`` once it is imported (at once if it already is)."""
    if target in sys.modules:
        patch(sys.modules[target])
        return
    sys.meta_path.insert(0, _PatchingFinder(target, patch))


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the path finder load ``target``, then patches it."""

    def __init__(self, target: str, patch: Callable[[ModuleType], None]) -> None:
        self._target = target
        self._patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module
        patch = self._patch

        def exec_module(module: ModuleType) -> None:
            original(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
