"""Tiny LMs of every layer kind and router ``mode train`` offers, trained a few steps, and what an export must
give for each (tests/hf/test_export*.py). Shared so that the tests and the subprocess check use one list."""

from __future__ import annotations

import copy

import numpy as np
import torch

from mode.model import LMConfig
from mode.model.lm import LM
from mode.train import TrainConfig, Trainer
from mode.train.data import Corpus

BASE = dict(seq_len=32, d_model=32, n_heads=2, d_hidden=64, num_experts=4, top_k=1)

# name -> (LMConfig fields, the layout export picks)
CASES: dict[str, tuple[dict, str]] = {
    "dense_swiglu": (dict(layers=("dense", "dense"), activation="swiglu"), "llama"),
    "dense_gelu_untied": (dict(layers=("dense", "dense"), activation="gelu", tie_embeddings=False), "arcee"),
    "dense_relu2": (dict(layers=("dense", "dense"), activation="relu2"), "arcee"),
    "moe_renormalized": (
        dict(layers=("moe", "moe"), activation="swiglu", top_k=2, router_options={"renormalize": True}),
        "mixtral",
    ),
    "moe_and_dense": (dict(layers=("moe", "dense"), activation="swiglu", top_k=2), "qwen2_moe"),
    "moe_shared_gated": (
        dict(layers=("moe", "moe"), activation="swiglu", num_shared=1, shared_gate=True),
        "qwen2_moe",
    ),
    "moe_sigmoid_groups_bias": (
        dict(
            layers=("dense", "moe", "moe"),
            activation="swiglu",
            num_experts=8,  # 2 groups of 4: the top 2 come from the kept group's 4, no -inf at the boundary
            top_k=2,
            num_shared=1,
            router_options={
                "gate": "sigmoid",
                "renormalize": True,
                "bias_balance": True,
                "bias_rate": 0.05,
                "n_group": 2,
                "topk_group": 1,
                "scale": 2.5,
            },
        ),
        "glm4_moe",
    ),
    "moe_sigmoid": (dict(layers=("moe", "moe"), activation="swiglu", router_options={"gate": "sigmoid"}), "glm4_moe"),
    "moe_gelu": (dict(layers=("moe", "moe"), activation="gelu"), "mode"),
    "moe_softmax_bias_balance": (
        dict(layers=("moe", "moe"), activation="swiglu", router_options={"bias_balance": True}),
        "mode",
    ),
    "mod_predictor": (dict(layers=("dense", "mod"), causal="predictor", capacity=0.25), "mode"),
    "staged_aux_bce": (dict(layers=("moe", "staged"), causal="aux_bce", capacity=0.25), "mode"),
    "integrated_zero": (dict(layers=("moe", "integrated"), num_noop=2, top_k=2), "mode"),
    "integrated_copy_constant": (
        dict(layers=("integrated", "integrated"), num_noop=2, noop_kinds=("copy", "constant"), top_k=2),
        "mode",
    ),
    "mixed_pattern": (
        dict(layers=("dense", "staged", "moe", "integrated"), num_noop=1, causal="predictor", activation="swiglu"),
        "mode",
    ),
    # not causal: the forward reads later tokens, generate() raises (as mode sample does)
    "expert_choice": (dict(layers=("moe", "moe"), router="expert_choice"), "mode"),
    "capacity_drops": (dict(layers=("moe", "moe"), capacity_factor=1.0), "mode"),
    "mod_top_c": (dict(layers=("dense", "mod"), causal="none", capacity=0.25), "mode"),
}
NOT_CAUSAL = ("expert_choice", "capacity_drops", "mod_top_c")


def corpus() -> Corpus:
    rng = np.random.default_rng(0)
    words = ["def ", "return ", "self", ".x", " = ", "(", ")", ":\n", "    ", "import ", "mode", "1", "+", "é"]
    text = "".join(rng.choice(words, size=4000)).encode()
    arr = np.frombuffer(text, dtype=np.uint8)
    cut = int(len(arr) * 0.9)
    return Corpus(train=arr[:cut], val=arr[cut:], source="synthetic")


_TRAINED: dict[tuple[str, int], tuple[LM, object]] = {}  # per process: the training is seeded, so reuse is exact


def trained(name: str, out, steps: int = 4) -> tuple[LM, object]:
    """The case's LM after ``steps`` optimizer steps (seeded), and its checkpoint path (under ``out`` the first
    time this process trains the case; later calls get a copy of that model and that path)."""
    if (name, steps) in _TRAINED:
        lm, path = _TRAINED[name, steps]
        return copy.deepcopy(lm), path
    fields, _ = CASES[name]
    cfg = LMConfig(**{**BASE, **fields})
    t = Trainer(
        cfg,
        TrainConfig(
            steps=steps, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=100, eval_batches=1, log_every=100, seed=0
        ),
        corpus(),
        out,
        progress=False,
    )
    t.run()
    t.model.eval()
    _TRAINED[name, steps] = (copy.deepcopy(t.model), t.ckpt_path)
    return t.model, t.ckpt_path


def prompt_ids(n: int = 12) -> list[int]:
    return list(b"def f(x):\n    return x")[:n]


@torch.no_grad()
def mode_logits(lm: LM, ids_BS: torch.Tensor) -> torch.Tensor:
    from mode.model.generate import causal_problem

    causal = lm.cfg.uses_mod and causal_problem(lm.cfg) is None
    return lm(ids_BS, causal_routing=causal).logits_BSV.float()


def batch_ids(vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 24), generator=g)
