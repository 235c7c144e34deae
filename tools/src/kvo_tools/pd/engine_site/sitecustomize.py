"""Test-only: decode's transfer engine wrapped by the callable ``KVO_TEST_ENGINE_WRAPPER`` names.

A server started with this directory on PYTHONPATH (``kvo_tools.pd.sites.wrapped_decode_env``)
runs this in each of its processes; when kvo's decode worker module is imported, every
``DecodePuller`` built without an ``engine_wrapper`` reads through that callable. How the tests
and the soak inject faults into a running decode. Production code never imports this module.
"""

from __future__ import annotations

import functools
import os

from kvo_tools.pd.sites import (
    ENGINE_WRAPPER_ENV,
    PULLER_MODULE,
    patch_on_import,
    wrap_decode_engines,
)

_VALUE = os.environ.get(ENGINE_WRAPPER_ENV)
if _VALUE:
    patch_on_import(PULLER_MODULE, functools.partial(wrap_decode_engines, value=_VALUE))
