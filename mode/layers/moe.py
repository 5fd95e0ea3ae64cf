"""Mixture-of-Experts layer: router -> dispatch -> experts -> combine.

Shape legend: B batch, S tokens, T = B * S, D hidden, A/R rows grouped by expert.

Drop-in replacement for an MLP: ``forward(x_BSD, mask_BS=None) -> (y_BSD, Aux)`` returns only the
experts' contribution (the surrounding block adds the residual). Tokens routed to no-op experts or
dropped by capacity get zeros from the routed experts; copy and constant no-op experts
(``noop_kinds``, mode.layers.noop) add their gated share of the token's own input.

Shared experts (DeepSeek-MoE, Qwen2-MoE; ``num_shared``): always-on experts that every token of the layer
goes through, on its own process, with no routing and no dispatch. They are one MLP of hidden size
``shared_hidden`` (default ``num_shared * d_hidden``: the same FLOPs as ``num_shared`` separate experts),
added to the routed output, optionally scaled per token by ``sigmoid(x · w)`` (Qwen2-MoE's
``shared_expert_gate``). A token sent to a no-op expert still gets the shared experts.

The dispatcher (``mode.dispatch.base.Dispatcher``) is handed in (local by default, or an expert-parallel one
built on a process group); nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn

from mode import _checks
from mode._module_attr import set_module_attr
from mode.dispatch.base import Dispatcher
from mode.dispatch.local import LocalDispatcher
from mode.experts.bank import LAYOUTS, ExpertBank, ExpertConfig
from mode.layers.mlp import MLP
from mode.layers.noop import NOOP_KINDS, NoopExperts, noop_kinds
from mode.routing.plan import Aux
from mode.routing.registry import get_router

# The fields an MoE config hands to its router's config (each router takes those it declares).
ROUTER_FIELDS = (
    "d_model",
    "num_experts",
    "top_k",
    "num_noop",
    "capacity_factor",
    "gate",
    "renormalize",
    "balance_coef",
    "z_coef",
)


@dataclass
class MoEConfig:
    """Everything ``MoELayer.from_config`` needs: the router's, the experts' and the shared experts' settings
    (checked when built: a bad value raises ``ValueError`` or ``TypeError`` naming it).

    Args:
        d_model: the hidden size D.
        d_hidden: each expert's hidden size H.
        num_experts: the real experts E.
        router: a registered router name (``mode.routing.registry``): "token_choice" or "expert_choice", ...
        top_k: token choice: the experts each token chooses.
        num_noop: no-op expert slots (integrated MoDE).
        capacity_factor: token choice: the per-expert limit's factor, None dropless; expert choice: the
            picks per token, None 1.0.
        gate: token choice: "softmax", "sigmoid", ... (``TokenChoiceConfig``).
        renormalize: token choice: divide the k gates by their sum.
        balance_coef: token choice: the load-balancing loss's weight.
        z_coef: the router z-loss's weight.
        activation: the experts' activation: "gelu", "swiglu" or "relu2".
        backend: the experts' backend: "auto", "reference", "grouped" or "megablocks" (docs/backends.md).
        router_options: more fields of the router's own config (e.g. ``{"bias_balance": True}``).
        num_shared: always-on shared experts (DeepSeek-MoE, Qwen2-MoE), as one MLP.
        shared_hidden: that MLP's hidden size; None: ``num_shared * d_hidden``.
        shared_gate: scale the shared output by ``sigmoid(x . w)`` per token (Qwen2-MoE).
        expert_layout: how the expert weights are stored: "EDF" or "EFD" (as transformers does).
        noop_kinds: per no-op slot, "zero", "copy" or "constant" (``mode.layers.noop``), or one for all.
        expert_options: more ``ExpertConfig`` fields (biases, SwiGLU variants).
    """

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
    num_shared: int = 0  # always-on shared experts (DeepSeek-MoE, Qwen2-MoE)
    shared_hidden: int | None = None  # their one MLP's hidden size; None: num_shared * d_hidden
    shared_gate: bool = False  # Qwen2-MoE: the shared output times sigmoid(x · w), per token
    expert_layout: str = "EDF"  # ExpertConfig.layout: "EFD" stores the experts as transformers does
    noop_kinds: str | tuple = "zero"  # per no-op slot: "zero", "copy" or "constant" (mode.layers.noop)
    expert_options: dict = field(default_factory=dict)  # extra ExpertConfig fields (biases, SwiGLU variants)

    def __post_init__(self) -> None:
        if not isinstance(self.router_options, dict):
            raise TypeError(f"router_options={self.router_options!r}: must be a dict")
        if not isinstance(self.expert_options, dict):
            raise TypeError(f"expert_options={self.expert_options!r}: must be a dict of ExpertConfig fields")
        _checks.check_int("num_shared", self.num_shared, min_value=0)
        _checks.check_bool("shared_gate", self.shared_gate)
        _checks.check_choice("expert_layout", self.expert_layout, LAYOUTS)
        if self.shared_hidden is not None:
            _checks.check_int("shared_hidden", self.shared_hidden)
        if self.num_shared == 0 and (self.shared_hidden is not None or self.shared_gate):
            raise ValueError(
                f"shared_hidden={self.shared_hidden}, shared_gate={self.shared_gate}: need num_shared >= 1"
            )
        get_router(self.router)  # a registered name
        if isinstance(self.noop_kinds, str):  # one kind for every slot: kept as the name (num_noop may be huge)
            _checks.check_int("num_noop", self.num_noop, min_value=0)
            _checks.check_choice("noop_kinds", self.noop_kinds, NOOP_KINDS)
        else:
            self.noop_kinds = noop_kinds(self.noop_kinds, self.num_noop)
        if self.num_noop and self._adds_noop and self.router != "token_choice":
            raise ValueError(
                f"noop_kinds={self.noop_kinds}: copy and constant no-op experts need "
                f"router='token_choice' (got router={self.router!r})"
            )
        self.router_config()  # validates the router fields now, not at first forward
        self.expert_config()

    def router_config(self):
        """The config of the registered router ``self.router``, from the fields it declares."""
        fields = {name: getattr(self, name) for name in ROUTER_FIELDS}
        return get_router(self.router).config(fields, self.router_options)

    def expert_config(self) -> ExpertConfig:
        """The ``ExpertConfig`` of the routed experts' bank: the size, activation, backend and layout fields, plus
        ``expert_options``."""
        return ExpertConfig(
            d_model=self.d_model,
            d_hidden=self.d_hidden,
            num_experts=self.num_experts,
            activation=self.activation,
            backend=self.backend,
            layout=self.expert_layout,
            **self.expert_options,
        )

    @property
    def shared_hidden_size(self) -> int:
        """Hidden size of the shared experts' MLP (0: none)."""
        return self.shared_hidden or self.num_shared * self.d_hidden

    def build_shared(self) -> tuple[MLP | None, nn.Linear | None]:
        """The shared experts' MLP and gate (None where not configured)."""
        if not self.num_shared:
            return None, None
        gate = nn.Linear(self.d_model, 1, bias=False) if self.shared_gate else None
        return MLP(self.d_model, self.shared_hidden_size, self.activation), gate

    @property
    def _adds_noop(self) -> bool:
        """Whether a no-op slot adds something (a kind other than "zero")."""
        kinds = (self.noop_kinds,) if isinstance(self.noop_kinds, str) else self.noop_kinds
        return any(kind != "zero" for kind in kinds)

    @property
    def noop_kinds_per_slot(self) -> tuple[str, ...]:
        """The kind of each of the ``num_noop`` no-op slots (a single ``noop_kinds`` names every slot's)."""
        return noop_kinds(self.noop_kinds, self.num_noop)

    def build_noop(self) -> NoopExperts | None:
        """The no-op slots' module, where one of them adds something (None: all "zero", or none)."""
        if not self.num_noop or not self._adds_noop:
            return None
        return NoopExperts(self.noop_kinds_per_slot, self.d_model)


def build_router(cfg: MoEConfig) -> nn.Module:
    return get_router(cfg.router).router_cls(cfg.router_config())


class MoELayer(nn.Module):
    """A Mixture-of-Experts layer, a drop-in replacement for an MLP: route each token, send it to its experts,
    compute, and combine the gated outputs: ``y_t = sum_e g_te * expert_e(x_t)`` (plus the shared experts).

    Shape legend: B batch, S tokens, T = B * S, D hidden.

    Build it with ``MoELayer.from_config(MoEConfig(...))``, or from its parts:

    Args:
        router: a router module (``TokenChoiceRouter``, ``ExpertChoiceRouter``, ...) returning a ``RoutingPlan``.
        experts: the ``ExpertBank`` (this process's share of the experts when expert-parallel).
        dispatcher: what moves the tokens to the experts and back (``Dispatcher``); None: ``LocalDispatcher``.
        shared: the shared experts (an ``MLP``, or any module with the same call), run on every token.
        shared_gate: a ``Linear(d_model, 1)`` whose sigmoid scales their output per token.
        noop: what the router's no-op slots add (``mode.layers.noop.NoopExperts``; None: they add nothing).
    """

    router: nn.Module
    experts: ExpertBank
    dispatcher: Dispatcher
    shared_experts: nn.Module | None
    shared_gate: nn.Module | None
    noop: NoopExperts | None

    def __init__(
        self,
        router: nn.Module,
        experts: ExpertBank,
        dispatcher=None,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
        noop: NoopExperts | None = None,
    ):
        super().__init__()
        if not isinstance(router, nn.Module) or not hasattr(router, "num_experts"):
            raise TypeError(f"router={type(router).__name__}: must be a router module (nn.Module with num_experts)")
        if not isinstance(experts, ExpertBank):
            raise TypeError(f"experts={type(experts).__name__}: must be an ExpertBank")
        if shared is not None and not isinstance(shared, nn.Module):
            raise TypeError(f"shared={type(shared).__name__}: must be an nn.Module (e.g. mode.MLP)")
        if shared_gate is not None and shared is None:
            raise ValueError("shared_gate: needs shared experts (shared=None)")
        self.router = router
        self.set_experts(experts, dispatcher)
        self.shared_experts = shared  # registered after the experts: the routed layer's parameter order stays
        self.shared_gate = shared_gate
        if noop is not None:
            if not isinstance(noop, NoopExperts):
                raise TypeError(f"noop={type(noop).__name__}: must be a mode.layers.noop.NoopExperts")
            num_noop = cast(int, router.num_slots) - cast(int, router.num_experts)  # a router's ints
            if len(noop.kinds) != num_noop:
                raise ValueError(
                    f"noop.kinds={noop.kinds}: must name one kind per no-op slot of the router (num_noop={num_noop})"
                )
            if noop.needs_gates and not hasattr(router, "emit_noop_gates"):
                raise ValueError(
                    f"noop.kinds={noop.kinds}: copy and constant no-op experts need a router that "
                    f"gives each token's no-op gates (token choice), not {type(router).__name__}"
                )
            set_module_attr(router, "emit_noop_gates", noop.needs_gates)
        self.noop = noop
        self._noop_adds = noop is not None and noop.needs_gates  # the no-op path, chosen once

    def set_experts(self, experts: ExpertBank, dispatcher=None) -> None:
        """Use ``experts`` through ``dispatcher`` (None: local). ``mode.parallel`` calls this to make the
        layer expert-parallel from outside: the bank then holds this rank's share of the experts."""
        if not isinstance(experts, ExpertBank):
            raise TypeError(f"experts={type(experts).__name__}: must be an ExpertBank")
        dispatcher = dispatcher if dispatcher is not None else LocalDispatcher()
        if not isinstance(dispatcher, Dispatcher):
            raise TypeError(
                f"dispatcher={type(dispatcher).__name__}: must be a mode.dispatch.Dispatcher (subclass "
                "it: num_local_experts, dispatch, combine)"
            )
        router = self.router
        local = dispatcher.num_local_experts(cast(int, router.num_experts))  # E, or E / P when expert-parallel
        if experts.num_experts != local:
            if local == router.num_experts:
                raise ValueError(
                    f"router.num_experts={router.num_experts}: must equal experts.num_experts={experts.num_experts}"
                )
            raise ValueError(
                f"experts.num_experts={experts.num_experts}: must equal this rank's share of "
                f"router.num_experts={router.num_experts}, which is {local} "
                "(num_experts / expert-parallel group size)"
            )
        # Llama-4 scales each row's input by its gate. Where the dispatcher applies gates at the combine
        # (expert-parallel), a top-1 router's gate is per token: the tokens are scaled before dispatch instead
        self._scale_before_dispatch = getattr(experts.cfg, "gate_on_input", False) and not dispatcher.gates_in_experts
        if self._scale_before_dispatch and getattr(getattr(router, "cfg", None), "top_k", None) != 1:
            raise ValueError(
                f"experts.cfg.gate_on_input=True (Llama-4's router-scaled inputs) with "
                f"{type(dispatcher).__name__}, which applies the gates at the combine "
                "(gates_in_experts=False), needs top_k=1 (the gate is then per token, applied "
                f"before dispatch); got top_k={getattr(getattr(router, 'cfg', None), 'top_k', None)}"
            )
        self.experts = experts  # the same slot in _modules: parameter names and order are unchanged
        self.dispatcher = dispatcher
        # The combine path, chosen once: the bank applies the gates where it does so inside its computation (on
        # the hidden activation, or on the input rows); where it would multiply its output rows, the
        # dispatcher's weighted combine does the same multiply in its one op (mode.kernels.combine_rows)
        self._gates_in_experts = dispatcher.gates_in_experts and experts.gates_inside

    @classmethod
    def from_config(cls, cfg: MoEConfig, dispatcher=None) -> MoELayer:
        """The layer ``cfg`` describes: its registered router, an ``ExpertBank``, the shared experts and the no-op
        module where configured, behind ``dispatcher`` (None: a ``LocalDispatcher``)."""
        router, experts = build_router(cfg), ExpertBank(cfg.expert_config())
        shared, gate = cfg.build_shared()  # built after the routed layer: its random draws stay the same
        return cls(router, experts, dispatcher, shared, gate, cfg.build_noop())

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> tuple[Tensor, Aux]:
        """Route, dispatch, compute and combine.

        Args:
            x_BSD: the (normalised) hidden states.
            mask_BS: None, or False at padding (padded tokens are routed nowhere and get zeros).

        Returns:
            ``(y_BSD, aux)``: the experts' contribution only (the surrounding block adds the residual; a token
            that was dropped or sent to a "zero" no-op gets zeros from the routed experts), and the router's
            ``Aux`` (its losses, e.g. "balance" and "z_loss", and its stats under "router").
        """
        return self.apply_plan(x_BSD, self.router(x_BSD, mask_BS))  # the router validates x's shape and dtype

    def apply_plan(self, x_BSD: Tensor, plan) -> tuple[Tensor, Aux]:
        """Everything after routing: dispatch, experts, combine, shared experts. ``plan``: this layer's
        router's ``RoutingPlan`` for ``x_BSD`` (a caller that reads the plan first, e.g. the router logits
        transformers records, routes and then calls this)."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        if self._scale_before_dispatch:  # top-1, input-gated experts: g_t * x_t travels, the combine adds it
            g_T = x_TD.new_zeros(B * S, dtype=plan.weight_A.dtype).index_add(0, plan.token_idx_A, plan.weight_A)
            x_TD = x_TD * g_T[:, None].to(x_TD.dtype)
            plan = dataclasses.replace(plan, weight_A=plan.computed_A().to(plan.weight_A.dtype))
        x_RD, counts_R, state = self.dispatcher.dispatch(x_TD, plan)  # B*S may be 0
        padded = self.dispatcher.rows_padded(plan)
        if self._gates_in_experts:  # the bank applies the gates where that is cheapest (bank.py)
            y_RD = self.experts(x_RD, counts_R, padded=padded, gate_A=plan.weight_A)
            y_TD = self.dispatcher.combine_gated(y_RD, plan, state)
        else:  # gates stay on the token's own process: combine applies them
            y_RD = self.experts(x_RD, counts_R, padded=padded)
            y_TD = self.dispatcher.combine(y_RD, plan, state)
        if self._noop_adds:  # on the token's own process, from the plan: nothing is dispatched
            assert self.noop is not None, "MoELayer: _noop_adds is set only with no-op experts"
            y_TD = y_TD + self.noop(x_BSD.reshape(B * S, D), plan.noop_gate_TN).to(y_TD.dtype)
        y_BSD = y_TD.view(B, S, D)
        if self.shared_experts is not None:  # every token, on its own process: nothing to dispatch
            shared_BSD, _ = self.shared_experts(x_BSD)
            if self.shared_gate is not None:
                shared_BSD = torch.sigmoid(self.shared_gate(x_BSD)) * shared_BSD
            y_BSD = y_BSD + shared_BSD
        return y_BSD, Aux().merge(plan.aux)


class IntegratedMoDE(MoELayer):
    """Integrated MoDE (Raposo et al. 2024, sec. 5): one router over real experts *and* no-op experts.

    A token sent to a no-op skips the MLP (its residual passes unchanged); attention still runs. It is an
    ``MoELayer`` whose router has at least one no-op slot (``MoEConfig(num_noop=...)``); its call and return
    are ``MoELayer``'s.

    Shape legend: B batch, S tokens, D hidden.

    Args:
        router: a router with ``num_slots > num_experts`` (at least one no-op slot).
        experts: the ``ExpertBank`` of the real experts.
        dispatcher: None (local) or a ``Dispatcher``.
        shared: shared experts, as in ``MoELayer``.
        shared_gate: their gate, as in ``MoELayer``.
        noop: what the no-op slots add (None: nothing, the token skips the MLP).
    """

    def __init__(
        self,
        router: nn.Module,
        experts: ExpertBank,
        dispatcher=None,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
        noop: NoopExperts | None = None,
    ):
        if router.num_slots == router.num_experts:
            raise ValueError("num_noop=0: integrated MoDE needs at least one no-op expert (num_noop >= 1)")
        super().__init__(router, experts, dispatcher, shared, shared_gate, noop)
