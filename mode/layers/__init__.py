from mode.layers.attention import CausalSelfAttention
from mode.layers.block import TransformerBlock
from mode.layers.mlp import MLP
from mode.layers.mod import MoD, StagedMoDE
from mode.layers.moe import IntegratedMoDE, MoEConfig, MoELayer

__all__ = [
    "CausalSelfAttention",
    "IntegratedMoDE",
    "MLP",
    "MoD",
    "MoEConfig",
    "MoELayer",
    "StagedMoDE",
    "TransformerBlock",
]
