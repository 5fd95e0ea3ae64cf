"""Routers by name: registering a router is one line, and every MoE layer, LM config, FLOP count and report
can then use it.

The router protocol (what a registered router provides)
    config class   a dataclass; the MoE config passes it the fields it declares among ``d_model``,
                   ``num_experts``, ``top_k``, ``num_noop``, ``capacity_factor``, ``gate``, ``renormalize``,
                   ``balance_coef``, ``z_coef``, plus ``MoEConfig.router_options``. It validates itself and
                   answers, without building the module:
                       num_slots                     real + no-op expert slots
                       max_assignments_per_token     most experts one token can receive (histogram bounds)
                       causal_problem()              None when a token's routing depends only on itself
                                                     (the layer can decode token by token), else the
                                                     reason it cannot, as an error message
                       assignments(seq_len)          computed (token, expert) pairs for one sequence of
                                                     ``seq_len`` tokens under balanced routing
                       router_flops(seq_len)         forward FLOPs of routing one such sequence
    router class   an ``nn.Module`` built as ``router_cls(config)``, with ``num_experts`` and ``num_slots``,
                   whose ``forward(x_BSD, mask_BS=None)`` returns a ``RoutingPlan`` (static shapes:
                   computed assignments first, see ``mode.routing.plan``) whose ``aux.stats["router"]``
                   holds its ``RoutingStats``.

``examples/custom_router.py`` writes one in a single file and registers it with ``register_router``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mode.routing.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter


@dataclass(frozen=True)
class RouterSpec:
    name: str
    config_cls: type
    router_cls: type

    def config(self, fields: dict, options: dict | None = None):
        """Build the router config from the MoE fields it declares (others are ignored) and ``options``, which
        take precedence (``LMConfig`` has no ``gate`` field: ``router_options={"gate": "sigmoid"}`` sets it)."""
        declared = {f.name for f in dataclasses.fields(self.config_cls)}
        options = dict(options or {})
        unknown = sorted(set(options) - declared)
        if unknown:
            raise ValueError(
                f"router_options={options!r}: {unknown} are not fields of "
                f"{self.config_cls.__name__} (fields: {sorted(declared)})"
            )
        return self.config_cls(**{**{k: v for k, v in fields.items() if k in declared}, **options})


ROUTERS: dict[str, RouterSpec] = {}


def register_router(name: str, config_cls: type, router_cls: type, *, replace: bool = False) -> RouterSpec:
    """Make ``name`` usable as ``MoEConfig(router=name)`` and ``LMConfig(router=name)``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name={name!r}: must be a non-empty str")
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"config_cls={config_cls!r}: must be a dataclass")
    if name in ROUTERS and not replace and ROUTERS[name] != RouterSpec(name, config_cls, router_cls):
        raise ValueError(f"name={name!r}: a different router is already registered under it; pass replace=True")
    ROUTERS[name] = RouterSpec(name, config_cls, router_cls)
    return ROUTERS[name]


def get_router(name: str) -> RouterSpec:
    if not isinstance(name, str) or name not in ROUTERS:
        raise ValueError(
            f"router={name!r}: must be one of {', '.join(map(repr, ROUTERS))} "
            "(or a name registered with mode.routing.register_router)"
        )
    return ROUTERS[name]


register_router("token_choice", TokenChoiceConfig, TokenChoiceRouter)
register_router("expert_choice", ExpertChoiceConfig, ExpertChoiceRouter)
