from mode.routing.bias_balance import bias_routers, update_expert_bias
from mode.routing.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from mode.routing.losses import load_balancing_loss, router_z_loss
from mode.routing.mod_topk import MoDRouter, MoDRouterConfig
from mode.routing.plan import Aux, RoutingPlan, RoutingStats
from mode.routing.registry import ROUTERS, get_router, register_router
from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter

__all__ = [
    "Aux",
    "ExpertChoiceConfig",
    "ExpertChoiceRouter",
    "MoDRouter",
    "MoDRouterConfig",
    "ROUTERS",
    "RoutingPlan",
    "RoutingStats",
    "TokenChoiceConfig",
    "TokenChoiceRouter",
    "get_router",
    "load_balancing_loss",
    "bias_routers",
    "register_router",
    "router_z_loss",
    "update_expert_bias",
]
