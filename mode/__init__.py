"""mode: Mixture-of-Depths, Mixture-of-Experts and MoDE layers for PyTorch."""

from mode.dispatch import LocalDispatcher
from mode.experts import ExpertBank, ExpertConfig
from mode.layers import MLP, CausalSelfAttention, IntegratedMoDE, MoD, MoEConfig, MoELayer, StagedMoDE, TransformerBlock
from mode.routing import (
    Aux, ExpertChoiceConfig, ExpertChoiceRouter, MoDRouter, MoDRouterConfig, RoutingPlan, RoutingStats,
    TokenChoiceConfig, TokenChoiceRouter,
)

__version__ = "0.1.0"

__all__ = [
    "Aux", "CausalSelfAttention", "ExpertBank", "ExpertChoiceConfig", "ExpertChoiceRouter", "ExpertConfig",
    "IntegratedMoDE", "LocalDispatcher", "MLP", "MoD", "MoDRouter", "MoDRouterConfig", "MoEConfig", "MoELayer",
    "RoutingPlan", "RoutingStats", "StagedMoDE", "TokenChoiceConfig", "TokenChoiceRouter", "TransformerBlock",
]
