"""mode: Mixture-of-Depths, Mixture-of-Experts and MoDE layers for PyTorch.

The package's layers (docs/architecture.md): the library core (``routing``, ``experts``, ``dispatch``,
``layers``, ``model``), ``hf`` beside it, then ``measure``, ``train``, ``parallel`` and ``experiments``, each
importing only those before it; ``cli`` on top.
"""

from mode.dispatch import Dispatcher, LocalDispatcher
from mode.experts import ExpertBank, ExpertConfig
from mode.layers import MLP, CausalSelfAttention, IntegratedMoDE, MoD, MoEConfig, MoELayer, StagedMoDE, TransformerBlock
from mode.routing import (
    Aux, ExpertChoiceConfig, ExpertChoiceRouter, MoDRouter, MoDRouterConfig, RoutingPlan, RoutingStats,
    TokenChoiceConfig, TokenChoiceRouter,
)

__version__ = "0.1.0"

__all__ = [
    "Aux", "CausalSelfAttention", "Dispatcher", "ExpertBank", "ExpertChoiceConfig", "ExpertChoiceRouter", "ExpertConfig",
    "IntegratedMoDE", "LocalDispatcher", "MLP", "MoD", "MoDRouter", "MoDRouterConfig", "MoEConfig", "MoELayer",
    "RoutingPlan", "RoutingStats", "StagedMoDE", "TokenChoiceConfig", "TokenChoiceRouter", "TransformerBlock",
]

import mode.parallel  # noqa: E402,F401  plugs the mesh runtime and the sharded-checkpoint reader into mode.train
