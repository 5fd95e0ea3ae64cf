"""A bank of E MLP experts computing on tokens already grouped by expert.

Shape legend
    A assignments (rows), grouped by expert: the first counts_E[0] rows belong to expert 0, ...
    D hidden size   H expert hidden size   F = H (gelu) or 2H (swiglu: gate and up fused)   E experts

Backends (chosen once, at construction):
    "reference"  a readable loop over experts (one matmul pair per expert)
    "grouped"    torch._grouped_mm over all experts at once (CPU and CUDA)
    "megablocks" grouped_gemm from MegaBlocks (CUDA only, optional extra)
    "auto"       "grouped" where torch has it, else "reference"
Every backend computes the same function on the same parameters; tests check they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.experts.grouped_mm import grouped_mm, grouped_mm_available

ACTIVATIONS = ("gelu", "swiglu")
BACKENDS = ("auto", "reference", "grouped", "megablocks")


@dataclass
class ExpertConfig:
    d_model: int
    d_hidden: int
    num_experts: int
    activation: str = "gelu"
    backend: str = "auto"

    def __post_init__(self) -> None:
        _checks.check_int("d_model", self.d_model)
        _checks.check_int("d_hidden", self.d_hidden)
        _checks.check_int("num_experts", self.num_experts)
        _checks.check_choice("activation", self.activation, ACTIVATIONS)
        _checks.check_choice("backend", self.backend, BACKENDS)


def resolve_backend(name: str) -> str:
    """Pick the concrete backend, or raise with the reason it cannot run here."""
    if name == "auto":
        return "grouped" if grouped_mm_available() else "reference"
    if name == "grouped" and not grouped_mm_available():
        raise ValueError(f"backend='grouped': torch {torch.__version__} has no torch._grouped_mm; "
                         "use backend='reference' or torch>=2.8")
    if name == "megablocks":
        from mode.experts import megablocks_backend

        megablocks_backend.require()
    return name


def activate(h_AF: Tensor, activation: str) -> Tensor:
    if activation == "gelu":
        return F.gelu(h_AF)
    gate_AH, up_AH = h_AF.chunk(2, dim=-1)
    return F.silu(gate_AH) * up_AH


class ExpertBank(nn.Module):
    def __init__(self, cfg: ExpertConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.backend = resolve_backend(cfg.backend)
        width = 2 * cfg.d_hidden if cfg.activation == "swiglu" else cfg.d_hidden
        self.w_in_EDF = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model, width))
        self.w_out_EHD = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_hidden, cfg.d_model))
        self.reset_parameters()
        self._forward = {
            "reference": self._forward_reference,
            "grouped": self._forward_grouped,
            "megablocks": self._forward_megablocks,
        }[self.backend]

    def reset_parameters(self, out_std: float | None = None) -> None:
        nn.init.normal_(self.w_in_EDF, std=1 / math.sqrt(self.cfg.d_model))
        nn.init.normal_(self.w_out_EHD, std=out_std or 1 / math.sqrt(self.cfg.d_hidden))

    def forward(self, x_AD: Tensor, counts_E: Tensor) -> Tensor:
        """``counts_E`` (int64, on x's device) gives each expert's number of rows, in order."""
        return self._forward(x_AD, counts_E)

    def _forward_reference(self, x_AD: Tensor, counts_E: Tensor) -> Tensor:
        w_in, w_out = self.w_in_EDF.to(x_AD.dtype), self.w_out_EHD.to(x_AD.dtype)  # same casting as "grouped"
        # unbind once: indexing w[e] per expert makes each backward fill a zero grad of the whole (E, ...) weight
        w_in, w_out = w_in.unbind(0), w_out.unbind(0)
        outs = []
        for e, x_eD in enumerate(x_AD.split(counts_E.tolist())):  # tolist: host sync, reference path only
            h = activate(x_eD @ w_in[e], self.cfg.activation)
            outs.append(h @ w_out[e])
        return torch.cat(outs) if outs else x_AD.new_zeros(0, self.cfg.d_model)

    def _forward_grouped(self, x_AD: Tensor, counts_E: Tensor) -> Tensor:
        offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        w_in, w_out = self.w_in_EDF.to(x_AD.dtype), self.w_out_EHD.to(x_AD.dtype)
        h_AF = grouped_mm(x_AD, w_in, offsets_E)
        return grouped_mm(activate(h_AF, self.cfg.activation), w_out, offsets_E)

    def _forward_megablocks(self, x_AD: Tensor, counts_E: Tensor) -> Tensor:
        from mode.experts import megablocks_backend

        return megablocks_backend.expert_mlp(x_AD, counts_E, self.w_in_EDF, self.w_out_EHD,
                                             lambda h: activate(h, self.cfg.activation))
