"""``export_transformers``: a mode checkpoint (or LM) as a folder that transformers loads, with its tokenizer.

    export_transformers("runs/train/ckpt.pt", "exported/")          # AutoModelForCausalLM.from_pretrained("exported/")
    export_transformers("runs/mesh/ckpt", "exported/", force=True)  # a sharded folder of any (dp, ep) mesh

The layout is chosen by exact math (``mode.hf.export.layouts``): the first standard family whose forward is
mode's (``llama``, ``arcee``, ``mixtral``, ``qwen2_moe``, ``glm4_moe``), which loads in a process that never
imports mode;
otherwise ``mode``, mode's own transformers class (``ModeForCausalLM``, loaded with ``trust_remote_code=True``
and mode installed). ``layout=`` names one; an LM it cannot express is a ``ValueError`` naming the feature.

The folder is written beside ``out`` under a temporary name and renamed into place when complete: a failed
export leaves nothing at ``out``; an existing ``out`` is replaced only with ``force=True``. Before the rename,
the written folder is loaded back with transformers and its logits compared with mode's (``verify``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from mode import _checks
from mode.hf.export.layouts import LAYOUTS, Layout
from mode.model.config import LMConfig
from mode.model.generate import causal_problem
from mode.model.lm import LM

BUILTIN_KINDS = ("dense", "mod", "mod_random", "moe", "staged", "integrated")
MODE_LAYOUT = "mode"
LAYOUT_NAMES = ("auto", *LAYOUTS, MODE_LAYOUT)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MANIFEST = "mode_export.json"

# The file a mode-layout folder carries for trust_remote_code: transformers imports it and finds the classes.
REMOTE_CODE = '''"""mode's LM as a transformers model (written by mode.hf.export_transformers; needs mode installed)."""

from mode.hf.export.modeling import ModeConfig, ModeForCausalLM

__all__ = ["ModeConfig", "ModeForCausalLM"]
'''


@dataclass
class ExportResult:
    """What ``export_transformers`` wrote.

    Args:
        path: the folder.
        layout: the layout's name ("llama", "arcee", "mixtral", "qwen2_moe", "glm4_moe" or "mode").
        architecture: the transformers class that loads it.
        tokenizer: "bytes" or "tokens".
        not_standard: for each standard family not chosen, the feature it cannot express.
        max_logit_diff: the largest |logit difference| between the reloaded folder and mode (``verify``).
        not_causal: why the model's forward sees later tokens and ``generate()`` raises (expert choice, capacity
            drops, MoD without causal routing), or None.
    """

    path: Path
    layout: str
    architecture: str
    tokenizer: str
    not_standard: dict[str, str] = field(default_factory=dict)
    max_logit_diff: float | None = None
    not_causal: str | None = None


def choose_layout(cfg: LMConfig, layout: str = "auto") -> tuple[Layout | None, dict[str, str]]:
    """The standard family for ``cfg`` (None: mode's own class) and, per family passed over, why.
    ``layout`` names one: ``ValueError`` naming the feature it cannot express."""
    _checks.check_choice("layout", layout, LAYOUT_NAMES)
    for i, kind in enumerate(cfg.kinds):
        if kind.name not in BUILTIN_KINDS:
            raise ValueError(
                f"layers[{i}]={kind.name!r}: a layer kind registered outside mode; an exported folder rebuilds "
                f"mode's built-in kinds only ({', '.join(BUILTIN_KINDS)})"
            )
        if kind.mod == "random":
            raise ValueError(
                f"layers[{i}]={kind.name!r}: random routing (the paper's control) makes the forward a random "
                "function of its input; not exported"
            )
    reasons = {name: why for name, lay in LAYOUTS.items() if (why := lay.why_not(cfg)) is not None}
    if layout == MODE_LAYOUT:
        return None, reasons
    if layout != "auto":
        if layout in reasons:
            raise ValueError(f"layout={layout!r}: the model has {reasons[layout]}; layout='mode' writes it exactly")
        return LAYOUTS[layout], reasons
    chosen = next((lay for name, lay in LAYOUTS.items() if name not in reasons), None)
    return chosen, reasons


def _load(checkpoint_or_model) -> tuple[LM, dict | None, dict]:
    """The LM, its data record (None: unknown) and what to record of its source."""
    if isinstance(checkpoint_or_model, LM):
        return checkpoint_or_model, None, {"source": "an LM object"}
    if not isinstance(checkpoint_or_model, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_or_model={type(checkpoint_or_model).__name__}: must be a checkpoint path (a file or a "
            "sharded folder) or a mode.model.LM"
        )
    from mode.train.checkpoint import load_model

    model, state = load_model(Path(checkpoint_or_model))
    return model, state.get("data"), {"source": str(checkpoint_or_model), "step": state.get("step")}


def export_transformers(
    checkpoint_or_model,
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    layout: str = "auto",
    dtype: str = "float32",
    force: bool = False,
    verify: bool = True,
) -> ExportResult:
    """Write a mode checkpoint (single file or sharded folder) or ``LM`` as a transformers folder (module doc).

    Args:
        checkpoint_or_model: a checkpoint path, or a ``mode.model.LM``.
        out: the folder to write (new, or replaced with ``force``).
        tokenizer: the tokenizer.json the model was trained with, where the checkpoint's recorded one has
            moved (same sha256) or an LM is passed; None: the recorded one, or bytes for a 256-id model.
        layout: "auto", a family in ``LAYOUTS``, or "mode".
        dtype: the weights' dtype in the folder: "float32", "bfloat16" or "float16".
        force: replace an existing ``out``.
        verify: load the written folder back and compare its logits with mode's before it is put in place.

    Returns:
        An ``ExportResult``.
    """
    _checks.check_choice("dtype", dtype, tuple(DTYPES))
    _checks.check_bool("force", force)
    _checks.check_bool("verify", verify)
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not force:
        raise ValueError(f"out={str(out)!r}: exists; pass force=True (--force) to replace it")
    lm, record, source = _load(checkpoint_or_model)
    cfg = lm.cfg
    chosen, reasons = choose_layout(cfg, layout)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet_transformers():
        return _export(lm, cfg, chosen, reasons, record, source, tokenizer, dtype, verify, tmp, out)


def _export(lm, cfg, chosen, reasons, record, source, tokenizer, dtype, verify, tmp: Path, out: Path) -> ExportResult:
    try:
        tmp.mkdir()
        state = {k: v.detach().to("cpu", torch.float32) for k, v in lm.state_dict().items()}
        if chosen is None:
            architecture = _write_mode(cfg, state, tmp, DTYPES[dtype])
        else:
            architecture = _write_family(chosen, cfg, state, tmp, DTYPES[dtype])
        kind = _write_tokenizer(tmp, record, tokenizer, cfg.vocab_size)
        result = ExportResult(out, MODE_LAYOUT if chosen is None else chosen.name, architecture, kind, reasons)
        result.not_causal = causal_problem(cfg)
        if verify:
            result.max_logit_diff = _verify(lm, tmp, chosen is None, DTYPES[dtype])
        manifest = {
            "layout": result.layout,
            "architecture": architecture,
            "tokenizer": kind,
            "dtype": dtype,
            "not_standard": reasons,
            "max_logit_diff": result.max_logit_diff,
            "not_causal": result.not_causal,
            **source,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _put_in_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bars from transformers' save and load while exporting (the command prints its own lines)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _write_family(layout: Layout, cfg: LMConfig, state: dict, out: Path, dtype: torch.dtype) -> str:
    import transformers

    config = transformers.AutoConfig.for_model(layout.name, **layout.config(cfg))
    model_cls = getattr(transformers, layout.architecture)
    with torch.device("cpu"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")  # qwen2_moe's width-0 shared expert
        model = model_cls(config)
    tensors = {k: v.contiguous() for k, v in layout.tensors(cfg, state).items()}
    model.load_state_dict(tensors, strict=True)
    cast(Any, model).to(dtype).save_pretrained(out)
    return layout.architecture


def _write_mode(cfg: LMConfig, state: dict, out: Path, dtype: torch.dtype) -> str:
    from mode.hf.export.modeling import ModeConfig, ModeForCausalLM

    config = ModeConfig.from_lm_config(cfg)
    config.auto_map = {
        "AutoConfig": "modeling_mode.ModeConfig",
        "AutoModelForCausalLM": "modeling_mode.ModeForCausalLM",
    }
    config.architectures = ["ModeForCausalLM"]
    with torch.device("cpu"):
        model = ModeForCausalLM(config)
    model.model.load_state_dict(state, strict=True)
    cast(Any, model).to(dtype).save_pretrained(out)
    (out / "modeling_mode.py").write_text(REMOTE_CODE)
    return "ModeForCausalLM"


def _write_tokenizer(out: Path, record, tokenizer, vocab_size: int) -> str:
    from mode.hf.export.tokenizer import write_tokenizer

    return write_tokenizer(out, record, tokenizer, vocab_size)


@torch.no_grad()
def _verify(lm: LM, folder: Path, mode_layout: bool, dtype: torch.dtype) -> float:
    """Load ``folder`` with transformers (float32) and compare its logits with ``lm``'s on a fixed batch: ``lm``
    with its weights rounded to the folder's ``dtype`` (then both compute in float32 with the same weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=mode_layout).eval()
    if any(p.dtype != torch.float32 for p in lm.parameters()) or dtype != torch.float32:
        lm = copy.deepcopy(lm).to(dtype).to(torch.float32)
    cfg = lm.cfg
    gen = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(0, cfg.vocab_size, (2, min(cfg.seq_len, 32)), generator=gen)
    was_training = lm.training
    lm.eval()
    try:
        device = lm.embed.weight.device
        causal = cfg.uses_mod and causal_problem(cfg) is None
        want = lm(ids_BS.to(device), causal_routing=causal).logits_BSV.float().cpu()
    finally:
        lm.train(was_training)
    got = model(ids_BS).logits.float()
    diff = float((got - want).abs().max())
    bound = 1e-4 * float(want.abs().max()) + 1e-5  # float32 rounding of sums taken in another order
    if not diff <= bound:
        raise ValueError(
            f"export check: the folder's logits differ from mode's by {diff:.3g} (bound {bound:.3g}); nothing "
            "was written"
        )
    return diff


def _put_in_place(tmp: Path, out: Path) -> None:
    """Rename the complete folder to ``out``; an existing ``out`` (``force``) moves aside first and is
    deleted after."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
