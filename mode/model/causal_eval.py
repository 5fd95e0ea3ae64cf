"""What sampling sees: a model's held-out loss under causal routing versus its training-time top-k routing.

Reports, for models with MoD layers trained with a causal method (paper sec. 3.5):
    causal_accuracy  how often the causal decision (logit > 0) agrees with the top-k decision,
                     measured in the top-k forward (the predictor's / router's training target)
    routed_fraction  fraction of tokens that causal routing sends through each MoD layer (target: capacity)
    loss_topk        LM loss with non-causal top-k routing (training-time behaviour)
    loss_causal      LM loss with causal routing (what autoregressive sampling gets)
    ar_gap           loss_causal / loss_topk - 1 (paper: 0.2-0.3%)
"""

from __future__ import annotations

from typing import cast

import torch

from mode.model.lm import LM
from mode.routing.keys import MOD, RouterKey, parse_router_key


@torch.no_grad()
def causal_eval(model: LM, batches) -> dict:
    if not model.cfg.uses_mod or model.cfg.causal == "none":
        raise ValueError("causal_eval: the model needs MoD layers built with causal='predictor' or 'aux_bce'")
    was_training = model.training
    model.eval()
    loss_topk = loss_causal = 0.0
    agree, routed, tokens = {}, {}, 0
    device = model.embed.weight.device
    for x_BS, y_BS in batches:
        x_BS, y_BS = x_BS.to(device), y_BS.to(device)  # eval_batches' windows stay on the CPU
        top = model(x_BS, y_BS)
        cau = model(x_BS, y_BS, causal_routing=True)
        loss_topk += float(top.loss)
        loss_causal += float(cau.loss)
        tokens += x_BS.numel()
        for name, st in top.aux.stats.items():
            if st.causal_accuracy is not None:
                agree[name] = agree.get(name, 0.0) + float(st.causal_accuracy) * float(st.tokens)
        for name, st in cau.aux.stats.items():
            key = parse_router_key(name)
            if key is not None and key.part == MOD:
                routed[name] = routed.get(name, 0.0) + float(st.kept_E.sum())
    model.train(was_training)
    n = len(batches)
    per_layer = {
        name: {"causal_accuracy": agree.get(name, 0.0) / tokens, "routed_fraction": routed[name] / tokens}
        # parsed above: an LM's names, layers.{i}.mod...
        for name in sorted(routed, key=lambda k: cast(int, cast(RouterKey, parse_router_key(k)).layer))
    }
    return {
        "loss_topk": loss_topk / n,
        "loss_causal": loss_causal / n,
        "ar_gap": loss_causal / loss_topk - 1,
        "causal_accuracy": sum(v["causal_accuracy"] for v in per_layer.values()) / len(per_layer),
        "routed_fraction": sum(v["routed_fraction"] for v in per_layer.values()) / len(per_layer),
        "capacity": model.cfg.capacity,
        "layers": per_layer,
    }
