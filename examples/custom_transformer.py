"""A user-defined transformer mixing dense, MoD, MoE, staged-MoDE and integrated-MoDE layers, and MoD around
a block written here.

    PYTHONPATH=. python examples/custom_transformer.py [--steps 60] [--log-every 10] [--threads 1]

Nothing here is a framework: the model is a plain ``nn.Module`` (byte embedding, a stack of layers, a
head), and every layer from ``mode`` is called as ``layer(x_BSD) -> (y_BSD, Aux)``. ``MoD`` wraps any block:
``ConvBlock`` below is this file's own, with ``forward(x)`` only. The model merges the layers' ``Aux`` under a
per-layer prefix, adds ``aux.total()`` (the weighted router losses) to the language-model loss, prints a line
every ``--log-every`` steps, and at the end prints each layer's aux losses and routing statistics.
About 40 s on a 2-core CPU (measured once with ``OMP_NUM_THREADS=2`` and the default ``--threads 1``, while
other jobs shared the cores: 39 s, 26 s of it training, 10 s of CPU time).

Data: the byte-level source of the standard library's ``json`` package (on every machine with Python).
Note: MoD top-C routing looks at the whole sequence, so this trains the non-causal router; sampling
needs the causal predictor (see the library docs).

Shape legend: B batch, S sequence, D hidden, V vocabulary (256 bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from mode import (  # noqa: E402
    MLP,
    Aux,
    IntegratedMoDE,
    MoD,
    MoDRouter,
    MoDRouterConfig,
    MoEConfig,
    MoELayer,
    StagedMoDE,
    TransformerBlock,
)


class ConvBlock(nn.Module):
    """A block of one's own: a causal depthwise convolution over the last 4 tokens, then an MLP, each with a
    residual. Its ``forward`` takes ``x`` alone, so ``MoD`` passes it nothing else. Under MoD it sees only the
    routed tokens, so its 4 tokens are the last 4 routed ones.

    Shape legend: B batch, C tokens (the routed ones under MoD), D hidden.
    """

    def __init__(self, d: int, width: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.conv = nn.Conv1d(d, d, width, groups=d, padding=width - 1)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x_BCD: Tensor) -> Tensor:
        C = x_BCD.shape[1]
        h_BCD = x_BCD + self.conv(self.norm1(x_BCD).transpose(1, 2))[..., :C].transpose(1, 2)  # causal: left pad
        return h_BCD + self.mlp(self.norm2(h_BCD))


class TinyLM(nn.Module):
    """Byte-level decoder: embedding -> [dense, MoD, MoE, staged MoDE, integrated MoDE, MoD(ConvBlock)] ->
    norm -> head."""

    def __init__(self, d: int = 128, n_heads: int = 4, experts: int = 4, capacity: float = 0.25):
        super().__init__()
        self.embed = nn.Embedding(256, d)

        def moe(**kw) -> MoEConfig:
            return MoEConfig(d_model=d, d_hidden=2 * d, num_experts=experts, **kw)

        self.layers = nn.ModuleDict(
            {
                "dense": TransformerBlock(d, n_heads, MLP(d, 4 * d)),
                # Only the top `capacity` fraction of each sequence goes through this block (the paper uses
                # 0.125; 0.25 here because the sequences are short).
                "mod": MoD(TransformerBlock(d, n_heads, MLP(d, 4 * d)), MoDRouter(MoDRouterConfig(d, capacity))),
                # Top-2 with a capacity limit: an expert takes at most 1.0 x its fair share, the rest is dropped.
                "moe": TransformerBlock(d, n_heads, MoELayer.from_config(moe(top_k=2, capacity_factor=1.0))),
                # MoD in front of an MoE block: skipped tokens skip attention and experts.
                "staged": StagedMoDE(
                    TransformerBlock(d, n_heads, MoELayer.from_config(moe(top_k=1))),
                    MoDRouter(MoDRouterConfig(d, capacity)),
                ),
                # One router over 4 experts + 1 no-op expert: a no-op token skips the MLP only.
                "integrated": TransformerBlock(d, n_heads, IntegratedMoDE.from_config(moe(top_k=1, num_noop=1))),
                # MoD around a block written above: the routed quarter of each sequence goes through ConvBlock.
                "mod_own": MoD(ConvBlock(d), MoDRouter(MoDRouterConfig(d, capacity))),
            }
        )
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, tokens_BS: Tensor) -> tuple[Tensor, Aux]:
        x_BSD = self.embed(tokens_BS)
        aux = Aux()
        for name, layer in self.layers.items():
            x_BSD, layer_aux = layer(x_BSD)
            aux.merge(layer_aux, f"{name}.")  # prefixes keep every layer's losses and stats apart
        return self.head(self.norm(x_BSD)), aux


def load_bytes() -> Tensor:
    """The source files of the stdlib ``json`` package, as one byte tensor."""
    files = sorted(Path(json.__file__).parent.glob("*.py"))
    return torch.tensor(list(b"".join(f.read_bytes() for f in files)), dtype=torch.long)


def batch(data: Tensor, batch_size: int, seq: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    start = torch.randint(0, data.numel() - seq - 1, (batch_size,), generator=gen)
    window_BS = torch.stack([data[s : s + seq + 1] for s in start.tolist()])
    return window_BS[:, :-1], window_BS[:, 1:]  # inputs, next-byte targets


def print_routing(aux: Aux, layer_names: list[str]) -> None:
    print("\nper layer: aux losses (raw value x coef)")
    for layer in layer_names:
        items = [
            f"{key.split('.', 1)[1]}={value.item():.4f} x {aux.coefs[key]:g}"
            for key, value in aux.losses.items()
            if key.split(".", 1)[0] == layer
        ]
        print(f"  {layer:<11} " + (", ".join(items) or "none"))
    print("\nper router: routing stats (last validation batch)")
    for key, st in aux.stats.items():
        tokens = st.tokens.item()
        if st.entropy is None:  # MoD router: one "expert" (the block); skipping is the no-op
            print(
                f"  {key:<26} MoD routed fraction {st.kept_E[0].item() / tokens:.3f} "
                f"({int(st.kept_E[0].item())}/{int(tokens)} tokens)"
            )
            continue
        share_E = st.kept_E / st.kept_E.sum().clamp_min(1)
        requested = st.requested_X.sum().item()
        print(
            f"  {key:<26} per-expert share {[round(v, 3) for v in share_E.tolist()]}, "
            f"dropped {int(st.dropped.item())}, no-op share {st.noop.item() / requested:.3f}, "
            f"entropy {st.entropy.item():.3f} nats, tokens {int(tokens)}"
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10, help="print a line every N steps (and the last one)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: this model's matmuls are tiny, and on a busy 2-core machine "
        "two OpenMP threads made a step about 30x slower than one)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.log_every < 1:
        p.error(f"--steps={args.steps}, --log-every={args.log_every}: must be >= 1")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = load_bytes()
    split = int(0.9 * data.numel())
    train, val = data[:split], data[split:]
    print(f"data: {data.numel():,} bytes of the json package source ({train.numel():,} train, {val.numel():,} val)")

    model = TinyLM()
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, layers {list(model.layers)}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)

    t_start = time.perf_counter()
    seen = 0
    for step in range(1, args.steps + 1):
        x_BS, y_BS = batch(train, args.batch, args.seq, gen)
        logits_BSV, aux = model(x_BS)
        lm_loss = F.cross_entropy(logits_BSV.flatten(0, 1), y_BS.flatten())
        loss = lm_loss + aux.total()  # weighted balance and z losses of every router
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += x_BS.numel()
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - t_start
            print(
                f"step {step:3d}/{args.steps}  lm loss {lm_loss.item():.4f} ({lm_loss.item() / math.log(2):.3f} "
                f"bits/byte)  aux {aux.total().item():.4f}  {seen / elapsed:,.0f} tok/s  {elapsed:.1f} s"
            )

    model.eval()
    with torch.no_grad():
        x_BS, y_BS = batch(val, args.batch, args.seq, gen)
        logits_BSV, aux = model(x_BS)
        val_loss = F.cross_entropy(logits_BSV.flatten(0, 1), y_BS.flatten()).item()
    print(
        f"\nvalidation lm loss {val_loss:.4f} ({val_loss / math.log(2):.3f} bits/byte); "
        f"uniform would be {math.log(256):.4f}; {time.perf_counter() - t_start:.1f} s in all"
    )
    print_routing(aux, list(model.layers))
    return {"train_loss": lm_loss.item(), "val_loss": val_loss, "stats": aux.stats}


if __name__ == "__main__":
    main()
