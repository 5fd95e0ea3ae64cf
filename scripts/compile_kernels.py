"""Compile every variant of mode.kernels' Triton kernels ahead of time for a CUDA architecture, without a GPU.

    PYTHONPATH=$PWD python scripts/compile_kernels.py [--arch 90]

triton compiles to a cubin with the ptxas it ships, so this checks on a CPU machine what triton's interpreter
(which tests/kernels runs) does not: that the kernels type-check and lower for the GPU under the installed
triton. It prints the number of variants compiled and exits 1 on the first failure. Nothing is launched.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter


def variants():
    from mode.kernels import combine_triton as C, router_triton as R, swiglu_triton as S

    for dt, flag in itertools.product(("fp32", "bf16", "fp16"), (False, True)):
        p = f"*{dt}"
        yield (
            S.swiglu_fwd_kernel,
            dict(h_ptr=p, gate_ptr=p, out_ptr=p, A="i32", H="i32"),
            dict(HAS_GATE=flag, BLOCK_A=S.BLOCK_A, BLOCK_H=S.MAX_BLOCK_H),
        )
        yield (
            S.swiglu_bwd_kernel,
            dict(dout_ptr=p, h_ptr=p, gate_ptr=p, dh_ptr=p, dgate_ptr=p, A="i32", H="i32"),
            dict(HAS_GATE=flag, BLOCK_A=S.BLOCK_A, BLOCK_H=S.MAX_BLOCK_H),
        )
        yield (
            C.gather_kernel,
            dict(
                src_ptr=p,
                idx_ptr="*i64",
                w_ptr="*fp32",
                y_ptr=p,
                out_ptr=p,
                dw_ptr="*fp32",
                A="i32",
                D="i32",
                num_src="i32",
            ),
            dict(HAS_WEIGHT=flag, BLOCK_R=C.BLOCK_ROWS, BLOCK_D=C.MAX_BLOCK_D),
        )
        yield (
            C.combine_kernel,
            dict(y_ptr=p, w_ptr="*fp32", inv_ptr="*i64", out_ptr=p, T="i32", D="i32", num_rows="i32"),
            dict(K=8, HAS_WEIGHT=flag, BLOCK_T=C.BLOCK_ROWS, BLOCK_D=C.MAX_BLOCK_D),
        )
    for (sigmoid, renorm, valid), (X, k) in itertools.product(
        itertools.product((False, True), repeat=3), ((8, 2), (256, 8))
    ):
        bt, bx, bk = R._blocks(X, k)
        consts = dict(K=k, SIGMOID=sigmoid, RENORM=renorm, HAS_VALID=valid, BT=bt, BX=bx, BK=bk)
        yield (
            R.router_fwd_kernel,
            dict(
                logits_ptr="*fp32",
                valid_ptr="*u8",
                gate_ptr="*fp32",
                chosen_ptr="*i64",
                sums_ptr="*fp32",
                counts_ptr="*i32",
                T="i32",
                X="i32",
                scale="fp32",
            ),
            consts,
        )
        yield (
            R.router_bwd_kernel,
            dict(
                dgate_ptr="*fp32",
                dsums_ptr="*fp32",
                logits_ptr="*fp32",
                valid_ptr="*u8",
                chosen_ptr="*i64",
                dlogits_ptr="*fp32",
                T="i32",
                X="i32",
                scale="fp32",
            ),
            consts,
        )
    yield from routed_rows_variants()


def routed_rows_variants():
    """The MoD rows' kernels: every gate with and without a slot mask in float32, the raw and "one" gates in
    bfloat16 and float16."""
    from mode.kernels import routed_rows_triton as M

    blocks = dict(BLOCK_R=M.BLOCK_ROWS, BLOCK_D=M.MAX_BLOCK_D)
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        yield (
            M.gather_kernel,
            dict(x_ptr=p, pos_ptr="*i64", out_ptr=p, n_slots="i32", S="i32", C="i32", D="i32"),
            blocks,
        )
        yield (
            M.add_rows_kernel,
            dict(keep_ptr=p, dx_ptr=p, pos_ptr="*i64", out_ptr=p, n_slots="i32", S="i32", C="i32", D="i32"),
            blocks,
        )
        yield (
            M.copy_check_kernel,
            dict(x_ptr=p, r_ptr="*fp32", out_ptr=p, flag_ptr="*i32", n_rows="i32", D="i32"),
            blocks,
        )
        yield M.copy_zero_kernel, dict(dout_ptr=p, dx_ptr=p, dr_ptr="*fp32", n_rows="i32", D="i32"), blocks
        for gate, valid in itertools.product(M.GATE_CODES.values(), (False, True)):
            if dt != "fp32" and (valid or gate in (1, 2)):
                continue
            consts = dict(GATE=gate, HAS_VALID=valid, **blocks)
            yield (
                M.combine_kernel,
                dict(
                    xs_ptr=p,
                    y_ptr=p,
                    r_ptr="*fp32",
                    pos_ptr="*i64",
                    valid_ptr="*u8",
                    out_ptr=p,
                    flag_ptr="*i32",
                    finite_ptr="*i8",
                    n_slots="i32",
                    S="i32",
                    C="i32",
                    D="i32",
                    n_flags="i32",
                ),
                dict(consts, BLOCK_F=256),
            )
            yield (
                M.combine_bwd_kernel,
                dict(
                    dout_ptr=p,
                    xs_ptr=p,
                    y_ptr=p,
                    r_ptr="*fp32",
                    pos_ptr="*i64",
                    valid_ptr="*u8",
                    dx_ptr=p,
                    dxs_ptr=p,
                    dy_ptr=p,
                    dr_ptr="*fp32",
                    n_slots="i32",
                    S="i32",
                    C="i32",
                    D="i32",
                ),
                consts,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100/H200)")
    parser.add_argument("--only-routed-rows", action="store_true", help="only the MoD rows' kernels")
    args = parser.parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    done = 0
    for fn, signature, consts in routed_rows_variants() if args.only_routed_rows else variants():
        src = ASTSource(triton.jit(fn), {**signature, **{k: "constexpr" for k in consts}}, constexprs=consts)
        try:
            triton.compile(src, target=target)
        except Exception as exc:  # noqa: BLE001 - report which variant, then stop
            print(f"FAILED {fn.__name__} {consts}: {type(exc).__name__}: {exc}")
            return 1
        done += 1
    print(f"triton {triton.__version__}: {done} kernel variants compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
