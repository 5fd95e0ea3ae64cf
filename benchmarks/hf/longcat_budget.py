"""LongCat-Flash's zero-computation experts held at a budget by the correction bias, after ``to_mode_moe``.

    PYTHONPATH=. python benchmarks/hf/longcat_budget.py            # 4 targets x 3 seeds, 300 steps (~2 min)
    PYTHONPATH=. python benchmarks/hf/longcat_budget.py --quick    # 1 target, 1 seed, 20 steps (the smoke test)

LongCat-Flash (Meituan, 560B) routes each token among its real experts and ``zero_expert_num`` identity ("zero
computation") experts, and a controller moves a selection-only bias so that the *average* number of activated
experts stays fixed. ``mode.hf.to_mode_moe`` turns those experts into no-op slots of kind "copy" (``g * x``) of an
``IntegratedMoDE``, and ``to_mode_moe(model, noop_target=s)`` makes the family's own
``router.e_score_correction_bias`` our bias controller (``mode.routing.update_expert_bias``): it holds the share
of choices on the zero experts at ``s``.

A random LongCat config of transformers' own class (hidden 64, 2 layers, 16 real + 8 zero experts, top-2, every
weight drawn; nothing downloaded), trained with AdamW (lr 1e-3) on i.i.d. Zipf token ids (the controller, not the
language model, is what is measured), batch 8 x 32, bias step 0.002 (0.01 overshoots: a score is ~1/24 here).
Per target and seed: the realised share of choices on the zero experts at each step (summed over layers), its
mean and max deviation over the second half of training, and the activated experts per token that follow. Writes
benchmarks/results/longcat_budget.json and
a PNG of the share over steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, print_table, save_figure, write_json  # noqa: E402

E, Z, K, D, V = 16, 8, 2, 64, 256


def build(seed: int):
    """A random LongCat-Flash causal LM (transformers' own classes), every weight drawn."""
    import transformers as tf

    cfg = tf.LongcatFlashConfig(
        vocab_size=V,
        hidden_size=D,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=E,
        zero_expert_num=Z,
        num_experts_per_tok=K,
        expert_ffn_hidden_size=32,
        ffn_hidden_size=96,
        routed_scaling_factor=6.0,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name or not t.is_floating_point() or t.dim() == 0:
                continue
            if "e_score_correction_bias" in name:
                t.zero_()  # the controller starts from no bias, as a fresh LongCat run does
                continue
            scale = 1.0 if "norm" in name else t.shape[-1] ** -0.5
            t.copy_(
                (1.0 if "norm" in name else 0.0)
                + torch.randn(t.shape, generator=g) * scale * (0.1 if "norm" in name else 1.0)
            )
    return model.float()


def run(target: float, seed: int, steps: int, batch: int, seq: int, rate: float) -> dict:
    import mode.hf as mh
    from mode.routing import update_expert_bias

    model = mh.to_mode_moe(build(seed), noop_target=target)
    for slot in mh.converted_moe(model).values():
        slot.moe.router.cfg.bias_rate = rate
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + seed)
    p = 1.0 / torch.arange(1, V - 2, dtype=torch.float64)
    shares, losses = [], []
    model.train()
    for _ in range(steps):
        ids = torch.multinomial(p / p.sum(), batch * seq, replacement=True, generator=g).view(batch, seq) + 3
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        update_expert_bias(model)
        stats = list(mh.collect_aux(model).stats.values())
        shares.append(sum(float(s.noop) for s in stats) / sum(float(s.requested_X.sum()) for s in stats))
        losses.append(float(loss.detach()))
    half = shares[steps // 2 :]
    mean = statistics.mean(half)
    return dict(
        target=target,
        seed=seed,
        steps=steps,
        share_first=shares[0],
        share_mean_2nd_half=mean,
        deviation_mean=mean - target,
        deviation_max=max(abs(s - target) for s in half),
        experts_per_token=K * (1 - mean),
        experts_per_token_target=K * (1 - target),
        within_2_points=abs(mean - target) <= 0.02,
        shares=shares,
        losses=losses,
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {}
    for r in rows:
        c = colors.setdefault(r["target"], f"C{len(colors)}")
        ax.plot(
            r["shares"],
            color=c,
            lw=0.8,
            alpha=0.7,
            label=f"target {r['target']:.2f}" if r["seed"] == rows[0]["seed"] else None,
        )
        ax.axhline(r["target"], color=c, ls="--", lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of choices on the zero experts")
    ax.set_title(
        f"LongCat-Flash (random, {E} real + {Z} zero experts, top-{K}) after to_mode_moe: the bias holds the budget",
        fontsize=8,
    )
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one target, one seed, 20 steps")
    p.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rate", type=float, default=0.002, help="the bias step per optimizer step")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    targets, seeds, steps = ([0.2], 1, 20) if args.quick else (args.targets, args.seeds, args.steps)
    rows = []
    t0 = time.time()
    for target in targets:
        for seed in range(seeds):
            rows.append(run(target, seed, steps, batch=8, seq=32, rate=args.rate))
            r = rows[-1]
            print(
                f"  target {target:.2f} seed {seed}: share {r['share_first']:.3f} -> {r['share_mean_2nd_half']:.3f} "
                f"(2nd half), max dev {r['deviation_max']:.3f}  [{time.time() - t0:.0f} s]",
                file=sys.stderr,
                flush=True,
            )
    print()
    print_table(
        rows,
        [
            ("target", "target", ".2f"),
            ("seed", "seed", "d"),
            ("share_first", "share, step 1", ".3f"),
            ("share_mean_2nd_half", "share, 2nd half", ".3f"),
            ("deviation_max", "max |dev|", ".3f"),
            ("experts_per_token", "experts/token", ".3f"),
            ("within_2_points", "within 2 pts", ""),
        ],
    )
    stem = "longcat_budget" + ("_quick" if args.quick else "")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{stem}.json")
    payload = dict(
        benchmark="longcat_budget",
        command=" ".join(["longcat_budget.py"] + sys.argv[1:]),
        machine=machine_info(torch.device("cpu")),
        config=dict(real=E, zero=Z, top_k=K, d_model=D, rate=args.rate, batch=8, seq=32),
        results=rows,
    )
    path = write_json(out, payload)
    plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {path} and {out.with_suffix('.png')}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
