"""A new MoE router in one file, registered in one line, trained in a small LM, then reported by
`mode report` and counted by the FLOP code, without touching any file of the library.

The router: **top-p token choice** (dynamic k). Each token takes its most probable experts until their
probabilities add up to ``threshold``, at most ``top_k`` of them, so confident tokens use one expert and
uncertain ones several. Its plan has the static size ``T * top_k``: the choices a token does not need
become padding after the computed assignments, as the routing-plan contract asks (no host sync).

    PYTHONPATH=. python examples/custom_router.py            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.routing import register_router
from mode.routing.losses import load_balancing_loss, router_z_loss
from mode.routing.plan import Aux, RoutingPlan, RoutingStats, count_per, entropy_of, group_by_expert, scalar


@dataclass
class TopPConfig:
    d_model: int
    num_experts: int
    top_k: int = 2  # most experts one token can take
    threshold: float = 0.5  # probability mass a token's experts must cover
    balance_coef: float = 0.01
    z_coef: float = 1e-3

    def __post_init__(self) -> None:
        _checks.check_int("d_model", self.d_model)
        _checks.check_int("num_experts", self.num_experts)
        _checks.check_int("top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k}: must be <= num_experts={self.num_experts}")
        _checks.check_fraction("threshold", self.threshold)

    # the router protocol (mode.routing.registry): what the FLOP and per-token compute code asks
    @property
    def num_slots(self) -> int:
        return self.num_experts

    @property
    def max_assignments_per_token(self) -> int:
        return self.top_k

    def causal_problem(self) -> str | None:
        return None  # each token decides alone

    def assignments(self, seq_len: int) -> float:
        """Balanced (uniform) probabilities: a token needs ceil(threshold * E) experts, at most top_k."""
        return seq_len * min(self.top_k, math.ceil(self.threshold * self.num_experts))

    def router_flops(self, seq_len: int) -> float:
        return 2 * seq_len * self.d_model * self.num_experts


class TopPRouter(nn.Module):
    """Shape legend: B batch, S sequence, T = B * S, D hidden, E experts, K = top_k, A = T * K."""

    def __init__(self, cfg: TopPConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = self.num_slots = cfg.num_experts
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, cfg.d_model) * cfg.d_model**-0.5)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> RoutingPlan:
        _checks.check_hidden("x", x_BSD, self.cfg.d_model, device=self.weight.device)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2], device=self.weight.device)
        B, S, D = x_BSD.shape
        T, K, E, dev = B * S, self.cfg.top_k, self.num_experts, x_BSD.device
        valid_T = None if mask_BS is None else mask_BS.reshape(T)
        with _checks.float32_region(dev):
            logits_TE = F.linear(x_BSD.reshape(T, D).float(), self.weight.float())
            _checks.check_finite_logits("TopPRouter", logits_TE)
            probs_TE = logits_TE.softmax(-1)
            gate_TK, chosen_TK = probs_TE.topk(K, dim=-1)
            mass_before_TK = gate_TK.cumsum(-1) - gate_TK  # probability already covered before choice j
            needed_TK = mass_before_TK < self.cfg.threshold  # the first choice always counts
            aux = Aux()
            aux.add_loss("balance", load_balancing_loss(probs_TE, chosen_TK[:, :1], valid_T), self.cfg.balance_coef)
            aux.add_loss("z_loss", router_z_loss(logits_TE, valid_T), self.cfg.z_coef)
        computed_TK = needed_TK if valid_T is None else needed_TK & valid_T[:, None]
        expert_key_A = torch.where(computed_TK, chosen_TK, E).reshape(-1)  # E: padding, sorts last
        token_A = torch.arange(T, device=dev).repeat_interleave(K)
        token_A, expert_A, gate_A, counts_E = group_by_expert(token_A, expert_key_A, gate_TK.reshape(-1), E, T)
        requested_E = count_per(chosen_TK.reshape(-1), E, computed_TK.reshape(-1))
        aux.stats["router"] = RoutingStats(
            kept_E=counts_E.float(),
            requested_X=requested_E.float(),
            dropped=torch.zeros((), device=dev),
            noop=torch.zeros((), device=dev),
            tokens=scalar(T, dev) if valid_T is None else valid_T.sum().float(),
            compute_T=count_per(token_A, T, expert_A < E).float(),
            entropy=entropy_of(probs_TE.detach(), valid_T),
            batch_shape=(B, S),
        )
        return RoutingPlan(
            token_idx_A=token_A, expert_idx_A=expert_A, weight_A=gate_A, counts_E=counts_E, num_tokens=T, aux=aux
        )


register_router("top_p", TopPConfig, TopPRouter)  # the one line: now usable as MoEConfig/LMConfig(router="top_p")


def main() -> None:
    from mode.cli import main as mode_cli
    from mode.measure.flops import forward_flops_per_token, measured_flops
    from mode.model import LMConfig, alternate
    from mode.train import TrainConfig, Trainer
    from mode.train.data import stdlib_corpus

    torch.set_num_threads(2)
    cfg = LMConfig(
        seq_len=128,
        d_model=64,
        n_heads=2,
        d_hidden=256,
        layers=alternate(4, "dense", "moe"),
        num_experts=4,
        top_k=3,
        router="top_p",
        router_options={"threshold": 0.6},
    )
    out = Path(tempfile.mkdtemp(prefix="custom_router_"))
    trainer = Trainer(
        cfg,
        TrainConfig(steps=60, batch_size=8, eval_every=60, warmup_steps=10, lr=3e-3),
        stdlib_corpus(max_bytes=2_000_000),
        out,
        name="top_p",
        progress=False,
    )
    trainer.run()
    print(f"trained 60 steps: val loss {trainer.history[-1].get('val_loss', float('nan')):.3f}")

    # FLOPs: the analytic count asks the router (nominal, and realized from a forward pass) ...
    model = trainer.model.eval()
    idx = torch.randint(0, 256, (2, cfg.seq_len))
    counted, result = measured_flops(model, idx)
    realized = forward_flops_per_token(cfg, aux=result.aux) * idx.numel()
    print(
        f"forward FLOPs per token: nominal {forward_flops_per_token(cfg):.3e}, realized "
        f"{realized / idx.numel():.3e}, torch's flop counter {counted / idx.numel():.3e}"
    )
    # ... and `mode report` reads the checkpoint (this process has registered the router).
    sys.exit(mode_cli(["report", str(trainer.ckpt_path), "--batches", "2", "--out", str(out / "report")]))


if __name__ == "__main__":
    main()
