"""Fused kernels where torch cannot fuse: each one op, a torch reference on the CPU, Triton on CUDA.

Shape legend: T tokens, X expert slots, K top-k, A assignment rows, D hidden, H expert hidden, F = 2H;
MoD: B batch, S sequence, C routed slots per sequence.

    gated_swiglu(h_AF, gate_A)                 mode_kernels::swiglu        gate_A * silu(h[:, :H]) * h[:, H:]
    router_topk(logits_TX, k, ...)             mode_kernels::router        scores, top-k, renormalisation, and the
                                                                           balance / z-loss / entropy sums, counts
    gather_rows(x_TD, token_A, inv_TK)         mode_kernels::gather_rows   x_TD[token_A]
    combine_rows(y_AD, w_A, token_A, inv_TK)   mode_kernels::combine_rows  out[t] = sum of t's rows times w
    gather_routed(x_BSD, pos_BC)               mode_kernels::routed_gather MoD: each sequence's routed rows
    combine_routed(x, x_BCD, y_BCD, r_BS, ...) mode_kernels::routed_combine  MoD: x + g(r) (y - x) written back
                                                                           at the routed rows; scores finite?
    (swiglu.py, router.py, combine.py, routed_rows.py; their Triton kernels in swiglu_triton.py,
    router_triton.py, combine_triton.py, routed_rows_triton.py)

Every op is a ``torch.library.custom_op`` with its backward as a second op (``*_backward``), a fake kernel
for torch.compile, and ``register_autograd``: eager, compiled and counted, each is one call on every device.
Its default kernel (the CPU's) is a readable torch reference; where triton is installed the CUDA kernel
is the Triton one (``*_triton.py``, imported on the first launch; this package never imports triton before).
``*_triton`` functions (``swiglu_triton``, ...) launch the Triton kernels directly, on CUDA tensors or, with
``TRITON_INTERPRET=1``, on CPU tensors in triton's interpreter: tests/kernels runs them so. docs/kernels.md
has the formulas, the tests and what the expert bank uses (``ExpertConfig.fused_kernels``).
"""

from mode.kernels._triton import available
from mode.kernels.combine import combine_rows, gather_rows, inverse_index
from mode.kernels.routed_rows import combine_routed, gather_routed
from mode.kernels.router import RouterOut, router_topk
from mode.kernels.swiglu import gated_swiglu

__all__ = [
    "RouterOut",
    "available",
    "combine_routed",
    "combine_rows",
    "gated_swiglu",
    "gather_routed",
    "gather_rows",
    "inverse_index",
    "router_topk",
]
