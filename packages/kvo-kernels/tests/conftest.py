"""Test-session setup that must happen before any test module imports the Triton kernels.

``triton.jit`` picks interpreter or GPU compilation when a kernel module is imported, from
``TRITON_INTERPRET``. Without a CUDA device the kernels can only run in the interpreter, so it is
switched on here; with one, it is switched off (unless ``KVO_TRITON_INTERPRET_ON_GPU=1``) so the
same tests run compiled, at production shapes.
"""

from __future__ import annotations

import os

import torch

if torch.cuda.is_available() and os.environ.get("KVO_TRITON_INTERPRET_ON_GPU") != "1":
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
