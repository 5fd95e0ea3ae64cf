"""Convert a transformers decoder to Mixture-of-Depths, router-tune it, generate, and measure it.

    PYTHONPATH=. python examples/hf_convert.py                       # tiny random Llama, byte tokens
    PYTHONPATH=. python examples/hf_convert.py --model /path/to/local/checkpoint --capacities 1 0.5 0.25

Needs the ``hf`` extra (``pip install -e '.[hf]'``). Nothing is downloaded: ``--model`` must be a local
directory (``from_pretrained(..., local_files_only=True)``); without one the script builds a tiny random
Llama config whose vocabulary is the 256 bytes.

What it does, for each capacity: copy the model, ``mode.hf.to_mod`` every other layer (gate "ste", causal
"aux_bce"), router-tune it on the built-in corpus (the standard library's sources) with the base frozen
(``--objective distill``: match the unconverted model; ``lm``: next-token loss), then measure on fixed
held-out windows

    loss_topk     the loss with training-time top-C routing
    loss_causal   the loss with the causal decision (r > 0) that sampling uses
    routed        the fraction of tokens the causal decision routes (target: the capacity)
    tok/s         greedy generate() speed, MoD layers keeping sparse KV caches

against the original model's loss and speed. A random model shows the mechanics only: its numbers say
nothing about routing quality. docs/results/mod_byte_llama.md says what was measured.

Router tuning minimises the objective plus the routers' causal BCE ("aux_bce", weight 0.1), and the script
prints both (means of the first and last 10 steps). On the random model, whose output is near uniform
whatever is skipped, the distillation loss is about 0.005 and the weighted BCE about 0.14, so the BCE drives
the routers and the distillation loss may rise a little; with ``causal_coef=0`` it falls instead.

Shape legend: B batch, S sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import mode.hf as mh
from mode.train.data import stdlib_corpus


def load(args):
    """(model, encode, decode): a local checkpoint with its tokenizer, or a tiny random byte-level Llama."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.model is None:
        torch.manual_seed(args.seed)
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            attn_implementation="sdpa",
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = LlamaForCausalLM(cfg)
        return model.eval(), (lambda s: list(s.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", "replace"))
    model = AutoModelForCausalLM.from_pretrained(
        args.model, local_files_only=True, attn_implementation="sdpa", dtype=getattr(torch, args.dtype)
    )
    try:
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError):  # no tokenizer saved next to the weights: bytes, if the vocabulary allows
        if model.config.vocab_size < 256:
            raise
        print(f"{args.model}: no tokenizer found, using byte ids")
        return model.eval(), (lambda s: list(s.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", "replace"))
    return model.eval(), (lambda s: tok(s)["input_ids"]), (lambda ids: tok.decode(ids))


def windows(ids: list[int], n: int, seq_len: int, batch: int, offset: int = 0) -> list[torch.Tensor]:
    """``n`` batches of ``batch`` consecutive-token windows, evenly spaced (deterministic)."""
    t = torch.tensor(ids)
    starts = torch.linspace(offset, len(t) - seq_len - 1, n * batch).long()
    w_BS = t[starts[:, None] + torch.arange(seq_len)]
    return list(w_BS.split(batch))


@torch.no_grad()
def loss_on(model, batches, mode: str | None) -> tuple[float, float]:
    """Mean next-token loss, and the fraction of tokens routed through the MoD layers (nan: no MoD)."""
    losses, routed = [], []
    for ids_BS in batches:
        ctx = mh.routing(model, mode) if mode else contextlib.nullcontext()
        with ctx:
            losses.append(float(model(ids_BS, labels=ids_BS, use_cache=False).loss))
        if mode:
            stats = mh.collect_aux(model).stats
            routed += [float(s.kept_E.sum() / s.tokens) for k, s in stats.items() if ".mod." in k]
    return sum(losses) / len(losses), (sum(routed) / len(routed) if routed else float("nan"))


@torch.no_grad()
def speed(model, prompt_BS: torch.Tensor, new_tokens: int, repeats: int) -> tuple[float, list[int]]:
    """Median greedy generate() tokens per second (prompt excluded), and the tokens of the last run."""
    rates, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = model.generate(prompt_BS, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        rates.append(prompt_BS.shape[0] * new_tokens / (time.perf_counter() - t0))
    return sorted(rates)[len(rates) // 2], out[0, prompt_BS.shape[1] :].tolist()


def tuning_means(hist: list[dict]) -> tuple[dict, dict]:
    """The mean ``loss`` and ``aux`` of the first and of the last steps of a ``router_tune`` history (up to 10
    each: every step sees another batch, so one step's loss is noisy)."""
    k = max(1, min(10, len(hist) // 2))

    def mean(rows):
        return {key: sum(r[key] for r in rows) / len(rows) for key in ("loss", "aux")}

    return mean(hist[:k]), mean(hist[-k:])


def tuning_summary(hist: list[dict], objective: str) -> str:
    """``distill 0.0049 -> 0.0060, weighted causal BCE 0.1370 -> 0.1325 (means of the first and last 10 steps)``:
    the objective and the routers' weighted causal BCE (``aux``), which router tuning minimises together."""
    first, last = tuning_means(hist)
    k = max(1, min(10, len(hist) // 2))
    return (
        f"{objective} {first['loss']:.4f} -> {last['loss']:.4f}, weighted causal BCE {first['aux']:.4f} -> "
        f"{last['aux']:.4f} (means of the first and last {k} steps)"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local transformers checkpoint (default: tiny random Llama)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--capacities", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--layers", default="every_other")
    p.add_argument("--tune-steps", type=int, default=60)
    p.add_argument("--objective", default="distill", choices=["lm", "distill"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="how much of the built-in corpus to read")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, encode, decode = load(args)
    corpus = stdlib_corpus(max_bytes=args.corpus_bytes)
    train_ids = encode(bytes(corpus.train[:1_000_000]).decode("utf-8", "replace"))
    val_ids = encode(bytes(corpus.val[:200_000]).decode("utf-8", "replace"))
    train = windows(train_ids, max(1, args.tune_steps), args.seq_len, args.batch)
    val = windows(val_ids, args.eval_batches, args.seq_len, args.batch)
    prompt_text = "def main():\n    "
    prompt_BS = torch.tensor([encode(prompt_text)])

    base_loss, _ = loss_on(model, val, None)
    base_speed, base_tokens = speed(model, prompt_BS, args.new_tokens, args.repeats)
    rows = [
        {
            "model": "original",
            "capacity": 1.0,
            "loss_topk": base_loss,
            "loss_causal": base_loss,
            "routed": 1.0,
            "tok_per_s": base_speed,
        }
    ]
    print(f"original: loss {base_loss:.4f}, {base_speed:.1f} tok/s")
    layers = args.layers if args.layers in ("every_other", "all") else [int(i) for i in args.layers.split(",")]
    for cap in args.capacities:
        # kv="routed": the sparse cache this example reports on (the default, "all", keeps every token's K/V)
        conv = mh.to_mod(copy.deepcopy(model), layers=layers, capacity=cap, gate="ste", causal="aux_bce", kv="routed")
        t0 = time.perf_counter()
        hist = mh.router_tune(conv, train, steps=args.tune_steps, lr=args.lr, objective=args.objective)
        tune_s = time.perf_counter() - t0
        conv.eval()
        loss_topk, routed_topk = loss_on(conv, val, "topk")
        loss_causal, routed = loss_on(conv, val, "causal")
        tok_s, tokens = speed(conv, prompt_BS, args.new_tokens, args.repeats)
        with torch.no_grad(), mh.routing(conv, "causal"):
            cache = conv.generate(
                prompt_BS, max_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True
            ).past_key_values
        stored = {i: int(cache.layers[i].stored_tokens().sum()) for i in mh.mod_layers(conv)}
        rows.append(
            {
                "model": "mod",
                "capacity": cap,
                "loss_topk": loss_topk,
                "loss_causal": loss_causal,
                "routed": routed,
                "tok_per_s": tok_s,
                "tune_steps": args.tune_steps,
                "tune_s": tune_s,
                "tune_first": hist[0],
                "tune_last": hist[-1],
                "dense_len": cache.get_seq_length(),
                "stored_per_layer": stored,
            }
        )
        print(
            f"capacity {cap}: tuned {args.tune_steps} steps ({tune_s:.1f} s, "
            f"{tuning_summary(hist, args.objective)}); loss top-C {loss_topk:.4f}, causal {loss_causal:.4f}; "
            f"causal routes {routed:.3f} of tokens; {tok_s:.1f} tok/s ({tok_s / base_speed:.2f}x); KV stored per "
            f"MoD layer {stored} of {cache.get_seq_length()} tokens"
        )
        first, last = tuning_means(hist)
        if last["loss"] > first["loss"] and last["loss"] + last["aux"] < first["loss"] + first["aux"]:
            print(
                f"  ({args.objective} rose: tuning minimises {args.objective} + causal BCE, and the BCE, which "
                "teaches each router's logit to predict its own top-C choice, fell by more)"
            )
        print(f"  sample: {decode(tokens)!r}")
    print(f"original sample: {decode(base_tokens)!r}")
    print("\n| model | capacity | loss top-C | loss causal | routed (causal) | tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['capacity']} | {r['loss_topk']:.4f} | {r['loss_causal']:.4f} | "
            f"{r['routed']:.3f} | {r['tok_per_s']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
