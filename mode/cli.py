"""The `mode` command line: `mode compare`, `mode sample`, `mode report` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mode", description="Mixture-of-Depths / MoE / MoDE toolkit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compare", help="train dense, MoD, MoE, staged and integrated MoDE at equal training FLOPs")
    p.add_argument("--quick", action="store_true", help="small models, a few minutes on 2 CPU cores")
    p.add_argument("--data", help="a UTF-8 text file (default: the Python standard library's sources)")
    p.add_argument("--out", default="runs/compare", help="output folder (JSON, PNG, logs, checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-steps", type=int, help="budget = this many steps of the dense model")
    p.add_argument("--only", nargs="+", help="train only these variants (also: integrated_mode_matched and "
                                             "staged_mode_matched, staged and integrated MoDE paired at about "
                                             "equal per-token FLOPs; see docs/compare.md)")
    p.add_argument("--causal", default="predictor", choices=("predictor", "aux_bce"),
                   help="causal routing method the learned MoD variants train for sampling")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; use 1 when other "
                                               "jobs share the cores, see docs/compare.md)")
    p.add_argument("--ckpt-every-s", type=float, default=300.0,
                   help="checkpoint the variant in training every this many seconds (default 300; 0: only when "
                        "it ends). A killed run resumes when rerun with the same arguments (docs/checkpoints.md)")
    p.add_argument("--fresh", action="store_true",
                   help="discard an earlier run found in --out (its checkpoints and results) and start over")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("sample", help="generate text from a checkpoint (causal routing, KV cache)")
    p.add_argument("checkpoint", help="a ckpt.pt written by training (e.g. runs/compare/mod/ckpt.pt); read "
                                      "without running code from it (docs/checkpoints.md)")
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); default: 'def '")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")

    p = sub.add_parser("report", help="load balance and per-token compute of a trained checkpoint: table, JSON, PNGs")
    p.add_argument("checkpoint", help="a ckpt.pt written by training (e.g. runs/compare/mod/ckpt.pt)")
    p.add_argument("--data", help="a UTF-8 text file whose validation split (last 10%%) is evaluated "
                                  "(default: the validation split of the built-in corpus)")
    p.add_argument("--out", help="output folder (default: <checkpoint folder>/report)")
    p.add_argument("--batches", type=int, default=8, help="evaluation batches (default 8)")
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: the checkpoint's training batch)")
    p.add_argument("--causal-routing", action="store_true",
                   help="route MoD layers by their causal decision (what sampling sees) instead of top-C")
    p.add_argument("--top", type=int, default=10, help="how many bytes / words with the most and least compute")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")

    args = parser.parse_args(argv)
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            print(f"mode {args.command}: error: --threads={args.threads}: must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "compare":
        from mode.checkpoint import WriteError
        from mode.compare import run_compare

        try:
            run_compare(args.out, quick=args.quick, data=args.data, seed=args.seed, dense_steps=args.dense_steps,
                        only=args.only, progress=not args.no_progress, causal=args.causal,
                        ckpt_every_s=args.ckpt_every_s, fresh=args.fresh)
        except ValueError as e:
            print(f"mode compare: error: {e}", file=sys.stderr)
            return 2
        except WriteError as e:  # a full disk mid-run: the last checkpoint is whole, rerun to resume
            print(f"mode compare: error: {e}; rerun the same command to resume from the last checkpoint",
                  file=sys.stderr)
            return 1
    elif args.command == "sample":
        return _sample(args)
    elif args.command == "report":
        return _report(args)
    return 0


def _sample(args) -> int:
    from mode.data import decode, encode
    from mode.model.generate import generate
    from mode.train import load_model

    try:
        model, _ = load_model(args.checkpoint)
        prompts = args.prompt or ["def "]
        outs = generate(model, [encode(p).tolist() for p in prompts], args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"mode sample: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs):
        print(f"--- prompt: {prompt!r}")
        print(prompt + decode(out))
    return 0


def _report(args) -> int:
    from mode.report import run_report

    try:
        run_report(args.checkpoint, data=args.data, out=args.out, batches=args.batches, batch_size=args.batch_size,
                   causal_routing=args.causal_routing, top=args.top)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"mode report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
