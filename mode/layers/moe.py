"""Mixture-of-Experts layer: router -> dispatch -> experts -> combine.

Shape legend: B batch, S tokens, T = B * S, D hidden, A/R rows grouped by expert.

Drop-in replacement for an MLP: ``forward(x_BSD, mask_BS=None) -> (y_BSD, Aux)`` returns only the
experts' contribution (the surrounding block adds the residual). Tokens routed to no-op experts or
dropped by capacity get zeros. The dispatcher is handed in (local by default, or an expert-parallel
one built on a process group); nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from mode import _checks
from mode.dispatch.local import LocalDispatcher
from mode.experts.bank import ExpertBank, ExpertConfig
from mode.routing.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from mode.routing.plan import Aux
from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter

ROUTERS = ("token_choice", "expert_choice")


@dataclass
class MoEConfig:
    d_model: int
    d_hidden: int
    num_experts: int = 8
    router: str = "token_choice"
    top_k: int = 1  # token choice only
    num_noop: int = 0
    capacity_factor: float | None = None  # token choice: None = dropless; expert choice: None = 1.0
    gate: str = "softmax"  # token choice only
    renormalize: bool = False  # token choice only
    balance_coef: float = 0.01  # token choice only
    z_coef: float = 1e-3
    activation: str = "gelu"
    backend: str = "auto"

    def __post_init__(self) -> None:
        _checks.check_choice("router", self.router, ROUTERS)
        self.router_config()  # validates the router fields now, not at first forward
        self.expert_config()

    def router_config(self) -> TokenChoiceConfig | ExpertChoiceConfig:
        if self.router == "token_choice":
            return TokenChoiceConfig(
                d_model=self.d_model, num_experts=self.num_experts, top_k=self.top_k, num_noop=self.num_noop,
                gate=self.gate, renormalize=self.renormalize, capacity_factor=self.capacity_factor,
                balance_coef=self.balance_coef, z_coef=self.z_coef)
        return ExpertChoiceConfig(
            d_model=self.d_model, num_experts=self.num_experts, num_noop=self.num_noop, z_coef=self.z_coef,
            capacity_factor=1.0 if self.capacity_factor is None else self.capacity_factor)

    def expert_config(self) -> ExpertConfig:
        return ExpertConfig(d_model=self.d_model, d_hidden=self.d_hidden, num_experts=self.num_experts,
                            activation=self.activation, backend=self.backend)


def build_router(cfg: MoEConfig) -> nn.Module:
    rcfg = cfg.router_config()
    return TokenChoiceRouter(rcfg) if isinstance(rcfg, TokenChoiceConfig) else ExpertChoiceRouter(rcfg)


class MoELayer(nn.Module):
    def __init__(self, router: nn.Module, experts: ExpertBank, dispatcher=None):
        super().__init__()
        dispatcher = dispatcher if dispatcher is not None else LocalDispatcher()
        local = dispatcher.num_local_experts(router.num_experts)  # E, or E / P when expert-parallel
        if experts.num_experts != local:
            if local == router.num_experts:
                raise ValueError(f"router.num_experts={router.num_experts}: must equal "
                                 f"experts.num_experts={experts.num_experts}")
            raise ValueError(f"experts.num_experts={experts.num_experts}: must equal this rank's share of "
                             f"router.num_experts={router.num_experts}, which is {local} "
                             "(num_experts / expert-parallel group size)")
        self.router = router
        self.experts = experts
        self.dispatcher = dispatcher

    @classmethod
    def from_config(cls, cfg: MoEConfig, dispatcher=None) -> "MoELayer":
        return cls(build_router(cfg), ExpertBank(cfg.expert_config()), dispatcher)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> tuple[Tensor, Aux]:
        plan = self.router(x_BSD, mask_BS)  # validates x's shape and dtype
        B, S, D = x_BSD.shape
        x_RD, counts_R, state = self.dispatcher.dispatch(x_BSD.reshape(B * S, D), plan)
        y_RD = self.experts(x_RD, counts_R)
        y_TD = self.dispatcher.combine(y_RD, plan, state)
        return y_TD.view(B, S, D), Aux().merge(plan.aux)


class IntegratedMoDE(MoELayer):
    """Integrated MoDE (Raposo et al. 2024, sec. 5): one router over real experts *and* no-op experts.

    A token sent to a no-op skips the MLP (its residual passes unchanged); attention still runs.
    """

    def __init__(self, router: nn.Module, experts: ExpertBank, dispatcher=None):
        if router.num_slots == router.num_experts:
            raise ValueError("num_noop=0: integrated MoDE needs at least one no-op expert (num_noop >= 1)")
        super().__init__(router, experts, dispatcher)
