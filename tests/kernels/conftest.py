"""The Triton kernels of mode.kernels, tested where they can run.

``kernel_device``: on a machine with a GPU, CUDA (the compiled kernels the CUDA ops call, whatever the
session's device); without one, the CPU, with the kernels in triton's interpreter (~1000x slower than a GPU:
shapes stay tiny).

The interpreter needs ``TRITON_INTERPRET=1`` before triton is first imported: triton decorates its own
``triton.language`` helpers (``tl.zeros``, ``tl.sum``, ...) at import, and ``import mode`` imports triton (through
torch._dynamo). The root tests/conftest.py sets it on machines without a GPU, before any test module is
collected; ``kernel_device`` fails, saying so, where that did not take effect (triton imported earlier, or the
variable set to something else).

triton is Linux-only (the ``test`` extra installs it there): on other systems these tests skip for the
platform; on Linux a missing triton fails them.
"""

import os
import sys

import pytest
import torch

_GPU = torch.cuda.is_available()


def _interpreting_triton() -> bool:
    """Whether triton.language's own helpers were built for the interpreter (decided at triton's import)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return not isinstance(tl.zeros, JITFunction)


@pytest.fixture
def kernel_device(device: torch.device) -> torch.device:
    if not sys.platform.startswith("linux"):
        pytest.skip(f"triton runs on Linux only (this is {sys.platform})")
    import triton  # noqa: F401  (on Linux the test extra installs it: a missing triton is a failure)

    if _GPU:
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("TRITON_INTERPRET") != "1" or not _interpreting_triton():
        pytest.fail(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} when triton was imported: without a "
            "GPU the kernels run in triton's interpreter, which tests/conftest.py selects (TRITON_INTERPRET=1) "
            "before triton is imported; run pytest without setting it otherwise"
        )
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def host_tensors_by_default():
    """A tensor a test creates without naming a device is a host tensor (references, float64 truths, the CPU
    kernels' checks), also in a CUDA session; the Triton kernels' inputs name ``kernel_device``."""
    with torch.device("cpu"):
        yield
