"""The `mode` command line: `mode compare`, `mode isoflop`, `mode train`, `mode export`, `mode sample`,
`mode report`, `mode tokenize` (more subcommands join as they land). `python -m mode ...` is the same;
torchrun starts `mode train` as `torchrun ... -m mode train ...`.

Conventions (tests/test_cli_conventions.py): a user's mistake is one line, `mode CMD: error: ...`, on stderr and
exit status 2 (1: a failed write or collective); no command replaces a file or folder that it did not write in
this run unless told to (`--force`, or resuming its own run: `train --resume`, a `compare`/`isoflop` rerun);
`--version`; every option's help states its default; building the parser imports no torch."""

from __future__ import annotations

import argparse
import sys

# The parser imports no torch (``mode --help`` and ``mode <command> --help`` answer at once): the commands import
# what they need when they run. The defaults it states that live in modules importing torch are written here
# too; tests/test_cli_conventions.py checks them against those modules.
ROUTED_BLOCKS = ("every_other", "all_but_first")  # mode.experiments.compare.ROUTED_BLOCKS
GATES = ("raw", "sigmoid", "one", "ste")  # mode.routing.mod_topk.GATES
RECIPE_DEFAULTS = {"routed": "every_other", "capacity": 0.125, "gate": "raw"}  # compare.DEFAULT_RECIPE


def version() -> str:
    """The installed distribution's version (``mode-torch``), else the package's ``__version__``."""
    from importlib import metadata

    try:
        return metadata.version("mode-torch")
    except metadata.PackageNotFoundError:
        import mode

        return getattr(mode, "__version__", "unknown")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it states it already (or has none worth stating:
    None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default %(default)s)"


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    """The MoD recipe of the mod, mod_random and staged_mode variants (mode.experiments.compare.MoDRecipe)."""
    p.add_argument(
        "--mod-routed", default=RECIPE_DEFAULTS["routed"], choices=ROUTED_BLOCKS, help="which blocks MoD routes"
    )
    p.add_argument(
        "--mod-capacity",
        type=float,
        default=RECIPE_DEFAULTS["capacity"],
        help="share of each sequence a routed block processes",
    )
    p.add_argument(
        "--mod-gate",
        default=RECIPE_DEFAULTS["gate"],
        choices=GATES,
        help="what multiplies a routed block's output (docs/isoflop.md)",
    )


def _recipe(args):
    from mode.experiments.compare import MoDRecipe

    return MoDRecipe(routed=args.mod_routed, capacity=args.mod_capacity, gate=args.mod_gate)


NO_PROGRESS_HELP = (
    "no progress bar; the plain progress lines (on stdout: every 20 s, and when each run ends) still "
    "print. Without a terminal on stderr there is never a bar, only the lines"
)


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mode convert`` options (run by ``mode.hf.convert_command``; here, so that --help imports no torch)."""
    p.add_argument("model", help="'smollm2' (SmolLM2-135M-Instruct, fetched once) or a local checkpoint folder")
    p.add_argument("--macs", type=float, required=True, help="target MACs per token ÷ the original's, in (0, 1)")
    p.add_argument("--out", required=True, help="a new or empty folder for the conversion and its report")
    p.add_argument("--force", action="store_true", help="overwrite a conversion already in --out")
    p.add_argument("--method", choices=("mod", "prune"), default="mod", help="MoD layers, or whole layers deleted")
    p.add_argument(
        "--part",
        choices=("layer", "attention", "mlp", "mixed"),
        default="layer",
        help="what a MoD token skips (mixed: attention in some layers, the MLP in others)",
    )
    p.add_argument("--causal", choices=("threshold", "aux_bce"), default="threshold", help="MoD's decode decision")
    p.add_argument("--skip-rank", type=int, help="rank of the estimate for a skipped part / deleted layer")
    p.add_argument("--order", choices=("skip_cost", "every_other"), default="skip_cost", help="MoD layer order")
    p.add_argument("--min-capacity", type=float, default=0.5, help="the lowest MoD capacity the plan may use")
    p.add_argument(
        "--router-label",
        choices=("update", "residual"),
        default="update",
        help="the tokens a MoD router is fitted to route: the largest updates, or those the estimate misses most",
    )
    p.add_argument(
        "--prune-by",
        choices=("block_influence", "skip_cost"),
        default="block_influence",
        help="how --method prune ranks layers",
    )
    p.add_argument("--data", help="a UTF-8 text file, last tenth held out (default: the built-in English text)")
    p.add_argument("--seq-len", type=int, default=256, help="window length; the MACs are counted at it")
    p.add_argument("--fit-windows", type=int, default=64, help="training windows the fits measure on")
    p.add_argument("--val-windows", type=int, default=32, help="held-out windows the report's losses use")
    p.add_argument(
        "--unseen-windows",
        type=int,
        default=64,
        help="windows of each out-of-domain set (prose, dialogue, code: text no conversion step reads) the report's "
        "losses also use; 0: none",
    )
    p.add_argument("--heal-steps", type=int, default=100, help="healing optimizer steps (0: no healing)")
    p.add_argument("--heal-tokens", type=int, default=1024, help="tokens per healing step (whole windows)")
    p.add_argument("--heal-lr", type=float, default=1e-3, help="healing AdamW learning rate")
    p.add_argument(
        "--heal-probe-every",
        type=int,
        default=0,
        help="every N healing steps (and before the first), the held-out and out-of-domain losses of the model as "
        "the conversion would end there, into the report's heal_curve (0: none; each probe costs one evaluation)",
    )
    p.add_argument(
        "--router-lr", type=float, default=0.0, help="the MoD routers' healing learning rate (0: they stay as fitted)"
    )
    p.add_argument("--lora-rank", type=int, default=8, help="healing LoRA rank")
    p.add_argument(
        "--heal-layers",
        choices=("auto", "all"),
        default="auto",
        help="the layers healing puts adapters on: the converted ones (MoD) or those next to the deleted ones "
        "(prune), or every layer",
    )
    p.add_argument(
        "--calibrate",
        choices=("fit", "docstrings"),
        default="fit",
        help="the text MoD's causal thresholds are set on: the fit windows, or as many windows of the standard "
        "library's docstrings (text unlike the fit text)",
    )
    p.add_argument(
        "--fit-text",
        choices=("train", "mix"),
        default="train",
        help="what the skip costs, estimates and router fits read (--fit-windows of it): the training text, or "
        "equal shares of --heal-text mix's sources",
    )
    p.add_argument(
        "--heal-text",
        choices=("train", "mix"),
        default="train",
        help="what healing reads: the training text, or equal shares of it, the standard library's docstrings and "
        "source, and text the original model samples itself (mode.hf.dense.heal_text)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where --heal-text mix keeps the text the model sampled (default: $MODE_CACHE, else "
        "~/.cache/mode; 'none': no cache)",
    )
    p.add_argument("--objective", choices=("distill", "lm", "both"), default="distill", help="healing objective")
    p.add_argument(
        "--seed", type=int, default=0, help="the healing data order, the sampled text and LoRA initialisation"
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP.replace("each run", "healing"))


def build_parser() -> argparse.ArgumentParser:
    """The ``mode`` command line: every subcommand's options (no torch imported)."""
    parser = argparse.ArgumentParser(
        prog="mode", description="Mixture-of-Depths / MoE / MoDE toolkit", formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the installed version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)

    p = command("compare", "train dense, MoD, MoE, staged and integrated MoDE at equal training FLOPs")
    p.add_argument("--quick", action="store_true", help="small models, a few minutes on 2 CPU cores")
    p.add_argument(
        "--preset",
        choices=("quick", "default", "gpu"),
        default=None,
        help="quick, default (CPU), gpu (one H100/H200 with --device cuda --bf16; docs/compare.md)",
    )
    p.add_argument(
        "--data",
        help="a UTF-8 text file, or 'packages': the installed packages' sources (default: "
        "the Python standard library's sources; the gpu preset's: packages)",
    )
    p.add_argument(
        "--out",
        default="runs/compare",
        help="output folder (JSON, PNG, logs, checkpoints); a rerun with the same arguments resumes the run in it",
    )
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="train every variant on this many seeds (--seed, --seed + 1, ...); the table gives mean ± "
        "std and paired 95%% intervals for the claimed differences",
    )
    p.add_argument(
        "--dense-steps",
        type=int,
        help="budget = this many steps of the dense model (default: the preset's, 150 with --quick, else 1200)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        help="train only these variants (also: integrated_mode_matched and "
        "staged_mode_matched, staged and integrated MoDE paired at about "
        "equal per-token FLOPs; see docs/compare.md) (default: all)",
    )
    p.add_argument(
        "--causal",
        default="predictor",
        choices=("predictor", "aux_bce"),
        help="causal routing method the learned MoD variants train for sampling",
    )
    _add_recipe_args(p)
    p.add_argument("--device", help="where to train (default: the CPU); e.g. cuda")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="train under bfloat16 autocast (routers and the optimizer stay float32; docs/performance.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's; use 1 when other jobs share the cores, see docs/compare.md)",
    )
    p.add_argument(
        "--ckpt-every-s",
        type=float,
        default=300.0,
        help="checkpoint the variant in training every this many seconds (default 300; 0: only when "
        "it ends). A killed run resumes when rerun with the same arguments (docs/checkpoints.md)",
    )
    p.add_argument(
        "--fresh",
        "--force",
        dest="fresh",
        action="store_true",
        help="discard an earlier run found in --out (its record, checkpoints and results, or files of "
        "the same names no run recorded) and start over",
    )
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)

    p = command(
        "isoflop",
        "isoFLOP curves: every variant at several sizes and budgets; each "
        "variant's best size per budget, compared best against best",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="4 small sizes x 3 small budgets (docs/isoflop.md); the same as --preset quick",
    )
    p.add_argument(
        "--preset",
        choices=("quick", "default", "gpu"),
        default=None,
        help="sizes and budgets: quick, default (CPU), gpu (tens of millions of parameters; with "
        "--device cuda --bf16); docs/isoflop.md (default: default, or quick with --quick)",
    )
    p.add_argument("--device", help="where each run trains (default: the CPU); e.g. cuda")
    p.add_argument(
        "--bf16", action="store_true", help="train under bfloat16 autocast (routers and the optimizer stay float32)"
    )
    p.add_argument(
        "--data",
        help="a UTF-8 text file, or 'packages': the installed packages' sources (default: "
        "the Python standard library's sources; the gpu preset's: packages)",
    )
    p.add_argument(
        "--out",
        default="runs/isoflop",
        help="output folder (JSON, Markdown, PNGs, runs); a rerun resumes the sweep in it",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per run (paired: a seed fixes the data order)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--budgets", type=float, nargs="+", help="training-FLOP budgets (default: the preset's)")
    p.add_argument(
        "--only",
        nargs="+",
        help="train only these variants (dense, mod, mod_random, moe, staged_mode, integrated_mode) (default: all)",
    )
    p.add_argument(
        "--causal",
        default="predictor",
        choices=("predictor", "aux_bce"),
        help="causal routing method the learned MoD variants train for sampling",
    )
    _add_recipe_args(p)
    p.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once, each in its own process with --threads threads"
    )
    p.add_argument(
        "--threads", type=int, help="torch intra-op threads per run (default: torch's with --jobs 1, 1 with more jobs)"
    )
    p.add_argument(
        "--ckpt-every-s",
        type=float,
        default=300.0,
        help="checkpoint the run in training every this many seconds (default 300; 0: only when it "
        "ends). A killed sweep resumes when rerun (docs/isoflop.md)",
    )
    p.add_argument(
        "--fresh",
        "--force",
        dest="fresh",
        action="store_true",
        help="discard an earlier sweep found in --out (or files of the same names no sweep recorded) and start over",
    )
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)

    p = command("train", "train one LM: one process, or a (dp, ep) mesh under torchrun (docs/distributed.md)")
    from mode.parallel.command import build_parser as train_parser  # imports no torch

    train_parser(p)

    p = command(
        "export",
        "a checkpoint as one file (a sharded folder of mode train on several processes), or as a transformers "
        "folder (--format transformers; docs/export.md)",
    )
    p.add_argument(
        "checkpoint",
        help="a sharded checkpoint folder, e.g. runs/train/ckpt (--format transformers: also a single file, "
        "e.g. runs/train/ckpt.pt)",
    )
    p.add_argument(
        "out",
        help="the single file to write, e.g. runs/train/ckpt.pt, or with --format transformers the folder "
        "(new, unless --force)",
    )
    p.add_argument("--force", action="store_true", help="replace the file or folder at OUT (default: refused)")
    p.add_argument(
        "--format",
        default="file",
        choices=("file", "transformers"),
        help="file: mode's single checkpoint file; transformers: a folder AutoModelForCausalLM and "
        "AutoTokenizer load (default file)",
    )
    p.add_argument(
        "--layout",
        default="auto",
        help="--format transformers: auto (the standard family that computes exactly what the model "
        "computes, else mode's own class), llama, arcee, mixtral, qwen2_moe, glm4_moe, or mode (default auto)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="--format transformers: the weights' dtype in the folder (default float32)",
    )
    p.add_argument(
        "--tokenizer",
        help="--format transformers: the tokenizer.json of a model trained on token shards, when the one its "
        "checkpoint names has moved (same sha256)",
    )

    p = command("sample", "generate text from a checkpoint (causal routing, KV cache)")
    p.add_argument(
        "checkpoint",
        help="a ckpt.pt written by training (e.g. runs/compare/mod/ckpt.pt) or a sharded "
        "checkpoint folder (runs/train/ckpt); read without running code from it "
        "(docs/checkpoints.md)",
    )
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch) (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate after each prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--tokenizer",
        help="the tokenizer.json of a model trained on token shards, when the one its "
        "checkpoint names has moved (same sha256; docs/data.md)",
    )

    p = command("tokenize", "text to a folder of token shards for mode train --data (docs/data.md)")
    p.add_argument(
        "text",
        nargs="?",
        help="a UTF-8 text file or a folder of them (default: the built-in corpus, "
        "the Python standard library's sources)",
    )
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json (nothing is downloaded)")
    p.add_argument("--out", required=True, help="a new or empty folder for the shards and meta.json")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into an --out that holds shards, meta.json or another tokenizer.json: they are "
        "deleted first (default: refused)",
    )
    p.add_argument("--max-bytes", type=int, help="read at most this many bytes of text (whole files) (default: all)")
    p.add_argument("--shard-tokens", type=int, help="ids per shard (default 100,000,000)")
    p.add_argument(
        "--eot", help="a token of the tokenizer to put after every document, e.g. '<|endoftext|>' (default: none)"
    )

    p = command("convert", "a pretrained transformers model to a MAC budget: MoD or pruned, fitted, healed, saved")
    _convert_arguments(p)

    p = command("report", "load balance and per-token compute of a trained checkpoint: table, JSON, PNGs")
    p.add_argument(
        "checkpoint",
        help="a ckpt.pt written by training (e.g. runs/compare/mod/ckpt.pt) or a sharded checkpoint folder",
    )
    p.add_argument(
        "--data",
        help="a UTF-8 text file whose validation split (last 10%%) is evaluated, or a "
        "folder of token shards (default: the token folder the checkpoint was "
        "trained on, else the validation split of the built-in corpus)",
    )
    p.add_argument("--out", help="output folder (default: <checkpoint folder>/report)")
    p.add_argument("--force", action="store_true", help="replace the report files already in --out (default: refused)")
    p.add_argument("--batches", type=int, default=8, help="evaluation batches")
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: the checkpoint's training batch)")
    p.add_argument(
        "--causal-routing",
        action="store_true",
        help="route MoD layers by their causal decision (what sampling sees) instead of top-C",
    )
    p.add_argument("--top", type=int, default=10, help="how many bytes / words with the most and least compute")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":  # its own --threads handling and exit statuses
        from mode.parallel.command import run as run_train

        return run_train(args)
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            print(f"mode {args.command}: error: --threads={args.threads}: must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "compare":
        from mode.experiments.compare import run_compare
        from mode.train.checkpoint import WriteError

        try:
            run_compare(
                args.out,
                quick=args.preset or args.quick,
                data=args.data,
                seed=args.seed,
                dense_steps=args.dense_steps,
                only=args.only,
                progress=not args.no_progress,
                causal=args.causal,
                ckpt_every_s=args.ckpt_every_s,
                fresh=args.fresh,
                seeds=args.seeds,
                recipe=_recipe(args),
                device=args.device,
                bf16=args.bf16,
            )
        except ValueError as e:
            print(f"mode compare: error: {e}", file=sys.stderr)
            return 2
        except WriteError as e:  # a full disk mid-run: the last checkpoint is whole, rerun to resume
            print(
                f"mode compare: error: {e}; rerun the same command to resume from the last checkpoint", file=sys.stderr
            )
            return 1
    elif args.command == "isoflop":
        return _isoflop(args)
    elif args.command == "export":
        return _export(args)
    elif args.command == "sample":
        return _sample(args)
    elif args.command == "tokenize":
        return _tokenize(args)
    elif args.command == "report":
        return _report(args)
    elif args.command == "convert":
        from mode.hf.convert_command import run as run_convert

        return run_convert(args)
    return 0


def _isoflop(args) -> int:
    from mode.experiments.isoflop import run_isoflop
    from mode.train.checkpoint import WriteError

    try:
        run_isoflop(
            args.out,
            quick=args.preset or args.quick,
            data=args.data,
            seeds=args.seeds,
            first_seed=args.seed,
            budgets=args.budgets,
            only=args.only,
            causal=args.causal,
            jobs=args.jobs,
            threads=args.threads,
            progress=not args.no_progress,
            ckpt_every_s=args.ckpt_every_s,
            fresh=args.fresh,
            recipe=_recipe(args),
            device=args.device,
            bf16=args.bf16,
        )
    except (ValueError, TypeError) as e:
        print(f"mode isoflop: error: {e}", file=sys.stderr)
        return 2
    except WriteError as e:
        print(f"mode isoflop: error: {e}; rerun the same command to resume from the last checkpoints", file=sys.stderr)
        return 1
    return 0


def _export(args) -> int:
    from mode.parallel.checkpoint import export
    from mode.train.checkpoint import WriteError

    if args.format == "transformers":
        return _export_transformers(args)
    for flag, value, default in (("--layout", args.layout, "auto"), ("--dtype", args.dtype, "float32")):
        if value != default:
            print(f"mode export: error: {flag}={value}: only with --format transformers", file=sys.stderr)
            return 2
    if args.tokenizer is not None:
        print("mode export: error: --tokenizer: only with --format transformers", file=sys.stderr)
        return 2
    try:
        path = export(args.checkpoint, args.out, overwrite=args.force)
    except ValueError as e:
        print(f"mode export: error: {e}", file=sys.stderr)
        return 2
    except WriteError as e:
        print(f"mode export: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} (one file: mode sample, mode report, Trainer.load read it)")
    return 0


def _export_transformers(args) -> int:
    from mode.train.checkpoint import CheckpointError

    try:
        from mode.hf.export import export_transformers

        res = export_transformers(
            args.checkpoint, args.out, tokenizer=args.tokenizer, layout=args.layout, dtype=args.dtype, force=args.force
        )
    except (ValueError, TypeError, FileNotFoundError, CheckpointError, ImportError) as e:
        print(f"mode export: error: {e}", file=sys.stderr)
        return 2
    load = "trust_remote_code=True, mode installed" if res.layout == "mode" else "no mode needed"
    print(f"wrote {res.path}: {res.architecture} ({res.layout} layout; {load}), {res.tokenizer} tokenizer")
    print(f"  checked: logits equal mode's within {res.max_logit_diff:.2g}")
    if res.layout == "mode":  # why no standard family computes it
        for name, why in res.not_standard.items():
            print(f"  not {name}: {why}")
    if res.not_causal:
        print(f"  not causal: {res.not_causal}")
    return 0


def _sample(args) -> int:
    from mode.model.generate import generate
    from mode.train import load_model
    from mode.train.data import text_codec

    try:
        model, state = load_model(args.checkpoint)
        codec = text_codec(state.get("data"), f"checkpoint {args.checkpoint!r}", args.tokenizer)  # bytes or tokens
        prompts = args.prompt or ["def "]
        outs = generate(
            model,
            [codec.encode(p) for p in prompts],
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"mode sample: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs):
        print(f"--- prompt: {prompt!r}")
        print(prompt + codec.decode(out))
    return 0


def _tokenize(args) -> int:
    from mode.train.checkpoint import WriteError
    from mode.train.tokenize import DEFAULT_SHARD_TOKENS, tokenize

    try:
        meta = tokenize(
            args.tokenizer,
            args.out,
            args.text,
            max_bytes=args.max_bytes,
            eot=args.eot,
            shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
            progress=print,
            force=args.force,
        )
    except ValueError as e:
        print(f"mode tokenize: error: {e}", file=sys.stderr)
        return 2
    except WriteError as e:
        print(f"mode tokenize: error: {e}", file=sys.stderr)
        return 1
    assert meta.shards is not None, "tokenize: its meta lists the shards it wrote"
    print(
        f"wrote {args.out}: {len(meta.shards)} shard(s) of {meta.dtype} ids, vocab {meta.vocab_size}, from "
        f"{meta.source} (mode train --data {args.out})"
    )
    return 0


def _report(args) -> int:
    from mode.experiments.report import run_report

    try:
        run_report(
            args.checkpoint,
            data=args.data,
            out=args.out,
            batches=args.batches,
            batch_size=args.batch_size,
            causal_routing=args.causal_routing,
            top=args.top,
            force=args.force,
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"mode report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
