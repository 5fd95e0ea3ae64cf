"""Mixture-of-Experts layer: router -> dispatch -> experts -> combine.

Shape legend: B batch, S tokens, T = B * S, D hidden, A/R rows grouped by expert.

Drop-in replacement for an MLP: ``forward(x_BSD, mask_BS=None) -> (y_BSD, Aux)`` returns only the
experts' contribution (the surrounding block adds the residual). Tokens routed to no-op experts or
dropped by capacity get zeros. The dispatcher (``mode.dispatch.base.Dispatcher``) is handed in (local by
default, or an expert-parallel one built on a process group); nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from mode.dispatch.base import Dispatcher
from mode.dispatch.local import LocalDispatcher
from mode.experts.bank import ExpertBank, ExpertConfig
from mode.routing.plan import Aux
from mode.routing.registry import get_router

# The fields an MoE config hands to its router's config (each router takes those it declares).
ROUTER_FIELDS = ("d_model", "num_experts", "top_k", "num_noop", "capacity_factor", "gate", "renormalize",
                 "balance_coef", "z_coef")


@dataclass
class MoEConfig:
    d_model: int
    d_hidden: int
    num_experts: int = 8
    router: str = "token_choice"  # a name in mode.routing.registry.ROUTERS
    top_k: int = 1  # token choice only
    num_noop: int = 0
    capacity_factor: float | None = None  # token choice: None = dropless; expert choice: None = 1.0
    gate: str = "softmax"  # token choice only
    renormalize: bool = False  # token choice only
    balance_coef: float = 0.01  # token choice only
    z_coef: float = 1e-3
    activation: str = "gelu"
    backend: str = "auto"
    router_options: dict = field(default_factory=dict)  # extra fields of the router's own config

    def __post_init__(self) -> None:
        if not isinstance(self.router_options, dict):
            raise TypeError(f"router_options={self.router_options!r}: must be a dict")
        get_router(self.router)  # a registered name
        self.router_config()  # validates the router fields now, not at first forward
        self.expert_config()

    def router_config(self):
        """The config of the registered router ``self.router``, from the fields it declares."""
        fields = {name: getattr(self, name) for name in ROUTER_FIELDS}
        return get_router(self.router).config(fields, self.router_options)

    def expert_config(self) -> ExpertConfig:
        return ExpertConfig(d_model=self.d_model, d_hidden=self.d_hidden, num_experts=self.num_experts,
                            activation=self.activation, backend=self.backend)


def build_router(cfg: MoEConfig) -> nn.Module:
    return get_router(cfg.router).router_cls(cfg.router_config())


class MoELayer(nn.Module):
    def __init__(self, router: nn.Module, experts: ExpertBank, dispatcher=None):
        super().__init__()
        if not isinstance(router, nn.Module) or not hasattr(router, "num_experts"):
            raise TypeError(f"router={type(router).__name__}: must be a router module (nn.Module with num_experts)")
        if not isinstance(experts, ExpertBank):
            raise TypeError(f"experts={type(experts).__name__}: must be an ExpertBank")
        self.router = router
        self.set_experts(experts, dispatcher)

    def set_experts(self, experts: ExpertBank, dispatcher=None) -> None:
        """Use ``experts`` through ``dispatcher`` (None: local). ``mode.parallel`` calls this to make the
        layer expert-parallel from outside: the bank then holds this rank's share of the experts."""
        if not isinstance(experts, ExpertBank):
            raise TypeError(f"experts={type(experts).__name__}: must be an ExpertBank")
        dispatcher = dispatcher if dispatcher is not None else LocalDispatcher()
        if not isinstance(dispatcher, Dispatcher):
            raise TypeError(f"dispatcher={type(dispatcher).__name__}: must be a mode.dispatch.Dispatcher (subclass "
                            "it: num_local_experts, dispatch, combine)")
        router = self.router
        local = dispatcher.num_local_experts(router.num_experts)  # E, or E / P when expert-parallel
        if experts.num_experts != local:
            if local == router.num_experts:
                raise ValueError(f"router.num_experts={router.num_experts}: must equal "
                                 f"experts.num_experts={experts.num_experts}")
            raise ValueError(f"experts.num_experts={experts.num_experts}: must equal this rank's share of "
                             f"router.num_experts={router.num_experts}, which is {local} "
                             "(num_experts / expert-parallel group size)")
        self.experts = experts  # the same slot in _modules: parameter names and order are unchanged
        self.dispatcher = dispatcher
        self._gates_in_experts = dispatcher.gates_in_experts  # the combine path, chosen once

    @classmethod
    def from_config(cls, cfg: MoEConfig, dispatcher=None) -> "MoELayer":
        return cls(build_router(cfg), ExpertBank(cfg.expert_config()), dispatcher)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> tuple[Tensor, Aux]:
        plan = self.router(x_BSD, mask_BS)  # validates x's shape and dtype
        B, S, D = x_BSD.shape
        x_RD, counts_R, state = self.dispatcher.dispatch(x_BSD.reshape(B * S, D), plan)  # B*S may be 0
        padded = self.dispatcher.rows_padded(plan)
        if self._gates_in_experts:  # the bank applies the gates where that is cheapest (bank.py)
            y_RD = self.experts(x_RD, counts_R, padded=padded, gate_A=plan.weight_A)
            y_TD = self.dispatcher.combine_gated(y_RD, plan, state)
        else:  # gates stay on the token's own process: combine applies them
            y_RD = self.experts(x_RD, counts_R, padded=padded)
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
