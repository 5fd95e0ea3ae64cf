"""The Triton kernels of mode.kernels, tested where they can run.

``kernel_device``: on a machine with a GPU, CUDA (the compiled kernels the CUDA ops call, whatever the
session's device); without one, the CPU, with the kernels in triton's interpreter (~1000x slower than a GPU:
shapes stay tiny).

The interpreter needs ``TRITON_INTERPRET=1`` before triton is first imported: triton decorates its own
``triton.language`` helpers (``tl.zeros``, ...) at import. This conftest sets it when it is loaded, at
collection, before any test runs, on machines without a GPU only (where no compiled triton kernel can run,
so the setting changes nothing else); ``mode`` never imports triton on its own. A test module that imported
triton at its top before this point would defeat it: ``kernel_device`` then fails and says so.

triton is Linux-only (the ``test`` extra installs it there): on other systems these tests skip for the
platform; on Linux a missing triton fails them.
"""

import os
import sys

import pytest
import torch

_GPU = torch.cuda.is_available()
_TRITON_BEFORE = "triton" in sys.modules
if not _GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def kernel_device(device: torch.device) -> torch.device:
    if not sys.platform.startswith("linux"):
        pytest.skip(f"triton runs on Linux only (this is {sys.platform})")
    import triton  # noqa: F401  (on Linux the test extra installs it: a missing triton is a failure)

    if _GPU:
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    if _TRITON_BEFORE or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1 (or the variable "
                    "was changed): run tests/kernels in a pytest process of its own")
    return torch.device("cpu")
