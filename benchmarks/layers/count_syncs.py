"""Host synchronisations per training step (forward + backward) of every local layer, and of the LM.

Counted on any device with ``mode.measure.host_sync.HostSyncCounter`` (ops that would block the host on a GPU).
Prints a table and writes JSON (``--out``).

    PYTHONPATH=. python benchmarks/layers/count_syncs.py --out benchmarks/results/syncs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from mode import MLP, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, TransformerBlock  # noqa: E402
from mode.layers.mod import StagedMoDE  # noqa: E402
from mode.layers.moe import IntegratedMoDE  # noqa: E402
from mode.measure.host_sync import HostSyncCounter  # noqa: E402
from mode.model.config import LMConfig  # noqa: E402
from mode.model.lm import LM  # noqa: E402

D, H, B, S = 64, 128, 2, 32


def layers() -> dict:
    def moe(**kw):
        return MoELayer.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, **kw))

    def block(mlp):
        return TransformerBlock(D, 4, mlp)

    return {
        "MoD top-C": MoD(block(MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D, capacity=0.25))),
        "MoE token choice, dropless": moe(top_k=2),
        "MoE token choice, capacity 1.0": moe(top_k=2, capacity_factor=1.0),
        "MoE expert choice": moe(router="expert_choice"),
        "integrated MoDE": IntegratedMoDE.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, num_noop=4)),
        "staged MoDE": StagedMoDE(block(moe()), MoDRouter(MoDRouterConfig(d_model=D, capacity=0.25))),
    }


def count_step(fn) -> HostSyncCounter:
    with HostSyncCounter() as syncs:
        out = fn()
        loss = out[0].float().square().mean() + out[1].total()
        loss.backward()
    return syncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    mask_BS = torch.ones(B, S, dtype=torch.bool)
    mask_BS[0, S // 2 :] = False
    for name, layer in layers().items():
        x = torch.randn(B, S, D)
        plain = count_step(lambda: layer(x))  # noqa: B023 - called in this iteration
        padded = count_step(lambda: layer(x, mask_BS))  # noqa: B023 - called in this iteration
        rows.append(
            {
                "layer": name,
                "syncs": plain.count,
                "syncs_padded": padded.count,
                "reasons": dict(plain.by_reason + padded.by_reason),
            }
        )
    kinds = ("dense", "mod", "mod_random", "moe", "staged", "integrated")
    lm = LM(
        LMConfig(vocab_size=64, seq_len=S, d_model=D, n_heads=4, d_hidden=H, layers=kinds, num_noop=4, num_experts=4)
    )
    idx = torch.randint(0, 64, (B, S))
    s = count_step(lambda: (lm(idx, idx).loss, lm(idx, idx).aux))
    rows.append(
        {"layer": "LM, six kinds (two forwards)", "syncs": s.count, "syncs_padded": None, "reasons": dict(s.by_reason)}
    )
    print(f"{'layer':<34}{'syncs':>7}{'padded':>8}  reasons")
    for r in rows:
        print(
            f"{r['layer']:<34}{r['syncs']:>7}{'' if r['syncs_padded'] is None else r['syncs_padded']:>8}  "
            f"{r['reasons']}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
