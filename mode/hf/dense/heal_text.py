"""What a conversion heals on: its training text alone, or a mix that reaches past it (``--heal-text mix``).

Shape legend: W windows, S sequence, B batch (rows sampled together), V vocabulary.

Healing distils the converted model towards the original on the heal windows. On the training text alone
(``"train"``: the built-in topics, or ``--data``) it recovers most of the loss on that text and much less on
text unlike it (docs/results/heal_vs_prune.md, "out of domain"). ``"mix"`` draws the heal windows in equal
shares from four sources, none of which is an out-of-domain set (``mode.hf.dense.unseen``):

    train       the training windows (what ``"train"`` heals on)
    docstrings  the standard library's docstrings (``docstring_windows``)
    code        the standard library's Python source (``python_source_windows``: files spread over it)
    generated   text the original model samples itself (``generated_windows``): half free text from the
                end-of-text token, half chats opened with the tokenizer's chat template (system prompt and
                user header; the model writes the question and the answer). Distilling on the teacher's own
                samples needs no outside text (LLM-QAT's data-free distillation, Liu et al. 2023).

Every source is data read or sampled here, never imported code. The generated windows depend on the model, the
seed and the CPU's kernels; ``generated_windows`` caches them (safetensors, written atomically) under a key of
the model's weights, the tokenizer's vocabulary and the settings, and the report records their SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from mode import _checks
from mode.hf.dense.windows import _DOC_SKIP, batches_of, docstring_windows, source_files, stdlib_root, token_windows
from mode.train.progress import Progress, phase

MIX_SOURCES = ("train", "docstrings", "code", "generated")
SOURCE_FILES = 64  # standard-library files python_source_windows reads, evenly spaced over the sorted list
TOP_P = 0.95  # nucleus sampling of generated_windows (temperature 1)


def python_source_windows(tokenizer, seq_len: int, n: int, root: str | Path | None = None) -> torch.Tensor:
    """``(n, S)`` windows of Python source: ``SOURCE_FILES`` ``*.py`` files evenly spaced over the sorted files
    under ``root`` (None: this Python's standard library; tests and ``pydoc_data`` left out, as for the
    docstrings), each read as text, never imported; ``n`` windows evenly spaced over theirs (all when fewer)."""
    _checks.check_int("n", n)
    base = stdlib_root(root)
    files = source_files(base)
    if not files:
        raise ValueError(f"root={str(base)!r}: holds no *.py file outside {sorted(_DOC_SKIP)}")
    pick = sorted(set(torch.linspace(0, len(files) - 1, min(SOURCE_FILES, len(files))).long().tolist()))
    texts = [files[i].read_text(encoding="utf-8", errors="replace") for i in pick]
    windows_WS = token_windows(tokenizer, texts, seq_len)
    return windows_WS[torch.linspace(0, len(windows_WS) - 1, min(n, len(windows_WS))).long()]


def _chat_prefix(tokenizer) -> list[int]:
    """The token ids that open a chat's first user turn (system prompt included where the template adds one),
    or ``[]`` when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "\x00MODE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return list(tokenizer(text.split(marker)[0], add_special_tokens=False)["input_ids"])


def _top_p_sample(logits_BV: torch.Tensor, top_p: float, g: torch.Generator) -> torch.Tensor:
    """``(B,)`` tokens drawn from the smallest set of most likely tokens whose probability reaches ``top_p``."""
    probs_BV = torch.softmax(logits_BV.double(), dim=-1)
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    keep_BV = sorted_BV.cumsum(-1) - sorted_BV < top_p  # the most likely token is always kept
    sorted_BV = sorted_BV * keep_BV
    pick_B1 = torch.multinomial(sorted_BV, 1, generator=g)
    return order_BV.gather(-1, pick_B1)[:, 0]


@torch.no_grad()
def sample_windows(
    model: nn.Module,
    prompt: list[int],
    n: int,
    seq_len: int,
    seed: int,
    batch: int = 32,
    top_p: float = TOP_P,
    progress: Progress | None = None,
    name: str = "generate",
) -> torch.Tensor:
    """``(n, S)`` windows, each ``prompt`` followed by ``S - len(prompt)`` tokens the model samples (temperature
    1, nucleus ``top_p``, no stop token), ``batch`` rows at a time with the model's KV cache; eval mode.
    ``seed`` fixes the draws (a ``torch.Generator`` of its own; the global RNG is untouched)."""
    _checks.check_int("n", n, min_value=0)
    if not prompt or len(prompt) >= seq_len:
        raise ValueError(f"prompt: {len(prompt)} tokens; needs 1 to seq_len - 1 = {seq_len - 1}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    rows: list[torch.Tensor] = []
    shown = phase(progress, name, n, "windows")
    for start in range(0, n, batch):
        b = min(batch, n - start)
        ids_BS = torch.tensor([prompt] * b, dtype=torch.long, device=device)
        out = model(ids_BS, use_cache=True)
        for _ in range(seq_len - len(prompt)):
            next_B = _top_p_sample(out.logits[:, -1].float().cpu(), top_p, g).to(device)
            ids_BS = torch.cat([ids_BS, next_B[:, None]], dim=1)
            if ids_BS.shape[1] == seq_len:
                break
            out = model(next_B[:, None], past_key_values=out.past_key_values, use_cache=True)
        rows.append(ids_BS.cpu())
        shown.advance(b)
    shown.close()
    model.train(was_training)
    return torch.cat(rows) if rows else torch.empty(0, seq_len, dtype=torch.long)


def model_digest(model: nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (names, dtypes, shapes, bytes), in ``state_dict`` order."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def windows_sha256(windows_WS: torch.Tensor) -> str:
    """SHA-256 of the token ids ``windows_WS`` (int64, row-major)."""
    return hashlib.sha256(windows_WS.to(torch.long).contiguous().numpy().tobytes()).hexdigest()


def prompts(tokenizer, seq_len: int) -> tuple[list[int], list[int]]:
    """The two prompts ``generated_windows`` samples from: the end-of-text token, and the chat's opening
    (``_chat_prefix``, cut to ``seq_len - 1`` tokens; the end-of-text token again without a chat template)."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return [eos], _chat_prefix(tokenizer)[: seq_len - 1] or [eos]


def written_text(tokenizer, windows_WS: torch.Tensor) -> list[str]:
    """The text the model wrote in each of ``generated_windows``' windows: decoded without the prompt it began
    with. The chat template's system prompt is not the model's text, and kept in it would make every chat of an
    out-of-domain set in the same template look read (``unseen_sets(also_read=...)``)."""
    free, chat = prompts(tokenizer, windows_WS.shape[1])
    texts = []
    for row in windows_WS.tolist():
        start = len(chat) if row[: len(chat)] == chat else len(free) if row[: len(free)] == free else 0
        texts.append(tokenizer.decode(row[start:]))
    return texts


def generated_windows(
    model: nn.Module,
    tokenizer,
    seq_len: int,
    n: int,
    seed: int,
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
) -> torch.Tensor:
    """``(n, S)`` windows the model samples itself (module doc): the first half from the end-of-text token,
    the rest from ``_chat_prefix`` (the free text again when the tokenizer has no chat template). With
    ``cache_dir``: read from ``cache_dir/generated/<key>.safetensors`` when there, else sampled and written."""
    _checks.check_int("n", n, min_value=0)
    free, chat = prompts(tokenizer, seq_len)
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    key_doc = {
        "model": model_digest(model),
        "vocab": vocab,
        "S": seq_len,
        "n": n,
        "seed": seed,
        "top_p": TOP_P,
        "prompts": [free, chat],
    }
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:32]
    path = None if cache_dir is None else Path(cache_dir) / "generated" / f"{key}.safetensors"
    if path is not None and path.is_file():
        from safetensors.torch import load_file

        windows_WS = load_file(str(path))["windows_WS"]
        if tuple(windows_WS.shape) == (n, seq_len):
            return windows_WS
    n_free = n - n // 2
    windows_WS = torch.cat(
        [
            sample_windows(model, free, n_free, seq_len, seed, progress=progress, name="generate (free text)"),
            sample_windows(model, chat, n - n_free, seq_len, seed + 1, progress=progress, name="generate (chats)"),
        ]
    )
    if path is not None:
        from safetensors.torch import save

        from mode.train.checkpoint import atomic_write

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, save({"windows_WS": windows_WS.contiguous()}, metadata={"key": json.dumps(key_doc)}))
    return windows_WS


def mix_sources(
    model: nn.Module,
    tokenizer,
    train_WS: torch.Tensor,
    windows: int,
    seed: int,
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """``MIX_SOURCES`` → ``(W, S)`` windows, ``windows`` of each (``train`` as it is: all its windows)."""
    _checks.check_int("windows", windows)
    S = train_WS.shape[1]
    doc_WS = docstring_windows(tokenizer, S)
    return {
        "train": train_WS,
        "docstrings": doc_WS[torch.linspace(0, len(doc_WS) - 1, min(windows, len(doc_WS))).long()],
        "code": python_source_windows(tokenizer, S, windows),
        "generated": generated_windows(model, tokenizer, S, windows, seed, cache_dir, progress),
    }


def mixed_heal_batches(sources: Mapping[str, torch.Tensor], steps: int, per_step: int, seed: int) -> list[torch.Tensor]:
    """A heal's ``steps`` batches of ``per_step`` windows, in equal shares from ``sources`` (``ceil(need / k)``
    of each, drawn without repeats by ``seed`` and cycled only beyond a source's size), shuffled together."""
    _checks.check_int("steps", steps)
    _checks.check_int("per_step", per_step)
    if not sources or any(len(w) == 0 for w in sources.values()):
        raise ValueError(f"sources: { ({k: len(w) for k, w in sources.items()}) }; each needs at least one window")
    g = torch.Generator().manual_seed(seed)
    need = steps * per_step
    share = math.ceil(need / len(sources))
    picked = []
    for windows_WS in sources.values():
        rounds = math.ceil(share / len(windows_WS))
        idx = torch.cat([torch.randperm(len(windows_WS), generator=g) for _ in range(rounds)])[:share]
        picked.append(windows_WS[idx])
    pool_WS = torch.cat(picked)
    return batches_of(pool_WS[torch.randperm(len(pool_WS), generator=g)[:need]], per_step)
