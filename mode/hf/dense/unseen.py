"""Out-of-domain text: held-out losses of a conversion on text that no step of it saw.

Shape legend: W windows, S sequence.

A conversion's skip costs, fits, router labels, thresholds and healing all read its training text (the built-in
English text, ``english_windows`` and ``docstring_windows``, or ``--data``), and its held-out windows come from
the same source. Users run the converted model on everything, so ``mode convert`` and the Pareto benchmark also
report the loss on these sets, which no conversion step reads:

    prose     English fortune cookies: the Debian ``fortunes`` package's non-technical files (``PROSE_FILES``:
              literature, humorists, wisdom, people, ...), ``apt-get install fortunes``
    dialogue  the English conversations of the ``chatterbot-corpus`` wheel (BSD, PyPI), each topic file one chat
              in the tokenizer's chat template (SmolLM2: ChatML), ``pip install --no-deps chatterbot-corpus==1.3.3``
    code      Python: the ``transformers/generation/*.py`` files of the installed transformers (the hf extra)

Each set reads a fixed, sorted file list, drops every document (a fortune, a conversation, a source file) that
shares an ``n``-word sequence (13) with the training text (``overlapping``), and keeps ``n_windows`` windows
evenly spaced over the rest. ``UnseenText.text_sha256`` is the SHA-256 of the documents as tokenized, so two
results say whether they measured the same text; the text depends on the installed package versions.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mode import _checks
from mode.hf.dense.windows import token_windows

UNSEEN_SETS = ("prose", "dialogue", "code")
FORTUNES_DIR = "/usr/share/games/fortunes"
# the fortunes package's English files of general prose (not computers, linux, debian, perl, art, poems)
PROSE_FILES = (
    "education",
    "food",
    "humorists",
    "law",
    "literature",
    "love",
    "medicine",
    "people",
    "pets",
    "politics",
    "science",
    "sports",
    "wisdom",
    "work",
)
INSTALL = {
    "prose": "apt-get install fortunes",
    "dialogue": "pip install --no-deps chatterbot-corpus==1.3.3",
    "code": "pip install -e '.[hf]' (transformers)",
}
NGRAM = 13  # a document sharing this many consecutive words with the training text is left out


@dataclass(frozen=True)
class UnseenText:
    """One out-of-domain set: its name, where it was read (``root`` and the sorted ``files`` under it), how many
    documents it kept and ``dropped`` (they overlap the training text), the SHA-256 of the kept documents (each
    UTF-8 encoded and followed by a NUL byte, in order), and ``windows_WS``, ``(W, S)`` token ids."""

    name: str
    root: str
    files: tuple[str, ...]
    documents: int
    dropped: int
    text_sha256: str
    windows_WS: torch.Tensor = field(repr=False, compare=False)

    def info(self) -> dict:
        """The set without its tokens, for a report: name, root, files, documents, dropped, text_sha256,
        windows, seq_len."""
        W, S = self.windows_WS.shape
        return dict(
            name=self.name,
            root=self.root,
            files=list(self.files),
            documents=self.documents,
            dropped=self.dropped,
            text_sha256=self.text_sha256,
            windows=W,
            seq_len=S,
        )


def text_sha256(documents: Sequence[str]) -> str:
    """SHA-256 of ``documents``, each UTF-8 encoded and followed by a NUL byte."""
    h = hashlib.sha256()
    for doc in documents:
        h.update(doc.encode("utf-8") + b"\0")
    return h.hexdigest()


def _root(name: str, root: str | Path | None, default: Callable[[], Path | None]) -> Path:
    base = Path(root) if root is not None else default()
    if base is None or not base.is_dir():
        raise ValueError(
            f"unseen set {name!r}: {str(base) if base is not None else 'its package'} not found "
            f"(install it: {INSTALL[name]})"
        )
    return base


def _package_dir(package: str, sub: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / sub


def prose_documents(root: str | Path | None = None, files: Sequence[str] = PROSE_FILES) -> tuple[list[list[str]], Path]:
    """``(fortunes, root)``: for each of ``files`` under ``root`` (default the Debian ``fortunes`` package's
    folder), in sorted order, its fortunes (the texts between ``%`` lines)."""
    base = _root("prose", root, lambda: Path(FORTUNES_DIR))
    out: list[list[str]] = []
    for name in sorted(files):
        path = base / name
        if not path.is_file():
            raise ValueError(f"unseen set 'prose': {path} not found (install it: {INSTALL['prose']})")
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append([d.strip() for d in text.split("\n%\n") if d.strip().strip("%").strip()])
    return out, base


def _chat(tokenizer, turns: list[tuple[str, str]]) -> str:
    """One chat: the tokenizer's chat template when it has one, else ``User:`` / ``Assistant:`` lines."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": r, "content": c} for u, a in turns for r, c in (("user", u), ("assistant", a))]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "".join(f"User: {u}\nAssistant: {a}\n" for u, a in turns)


def dialogue_documents(tokenizer, root: str | Path | None = None) -> tuple[list[str], list[str], Path]:
    """``(documents, files, root)``: each ``*.yml`` file under ``root`` (default ``chatterbot_corpus/data/english``
    of the installed wheel) as one chat of its conversations' turns in (user, assistant) pairs (a conversation's
    unpaired last turn is left out, so the roles alternate), files in sorted order."""
    import yaml

    base = _root("dialogue", root, lambda: _package_dir("chatterbot_corpus", "data/english"))
    docs: list[str] = []
    names: list[str] = []
    for path in sorted(base.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        turns = [
            (str(conv[i]).strip(), str(conv[i + 1]).strip())
            for conv in data.get("conversations") or []
            if isinstance(conv, list)
            for i in range(0, len(conv) - 1, 2)
        ]
        if turns:
            docs.append(_chat(tokenizer, turns))
            names.append(path.name)
    return docs, names, base


def code_documents(root: str | Path | None = None) -> tuple[list[str], list[str], Path]:
    """``(documents, files, root)``: each ``*.py`` file directly under ``root`` (default the installed
    transformers' ``generation`` folder), sorted, ``__init__.py`` left out."""
    base = _root("code", root, lambda: _package_dir("transformers", "generation"))
    paths = [p for p in sorted(base.glob("*.py")) if p.name != "__init__.py"]
    return [p.read_text(encoding="utf-8") for p in paths], [p.name for p in paths], base


def ngram_set(texts: Iterable[str], n: int = NGRAM) -> set[int]:
    """The hashes of every ``n`` consecutive whitespace-separated words of ``texts`` (what ``overlapping``
    compares with)."""
    _checks.check_int("n", n)
    seen: set[int] = set()
    for text in texts:
        words = text.split()
        seen.update(hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1))
    return seen


def overlapping(documents: Sequence[str], seen: set[int], n: int = NGRAM) -> list[bool]:
    """For each document, whether it shares ``n`` consecutive whitespace-separated words with the text of
    ``seen`` (``ngram_set(reference, n)``)."""
    return [not seen.isdisjoint(ngram_set([doc], n)) for doc in documents]


def training_texts(data: str | Path | None = None) -> list[str]:
    """The text a conversion's steps may read: every ``pydoc_data`` topic (training and held out), the standard
    library's docstrings (``docstring_windows``' text), and the ``data`` file when given."""
    from pydoc_data.topics import topics

    from mode.hf.dense.windows import stdlib_docstrings

    texts = [topics[k] for k in sorted(topics)] + stdlib_docstrings()
    if data is not None:
        texts.append(Path(data).read_text(encoding="utf-8"))
    return texts


@functools.lru_cache(maxsize=1)
def _builtin_ngrams() -> set[int]:
    """``ngram_set(training_texts())``, built once per process (the docstrings take seconds to parse)."""
    return ngram_set(training_texts())


def unseen_text(
    name: str,
    tokenizer,
    seq_len: int,
    n_windows: int = 64,
    seen: set[int] | None = None,
    root: str | Path | None = None,
) -> UnseenText:
    """The out-of-domain set ``name`` (``UNSEEN_SETS``) read from ``root`` (None: where its package installs it),
    the documents overlapping the training text left out (``seen``: ``ngram_set(training_texts())``; None: none
    checked), cut into ``seq_len`` windows of which
    ``n_windows`` evenly spaced are kept (all when there are fewer). Raises ``ValueError`` naming the install
    command when the text is not there, or when it makes no window."""
    _checks.check_int("n_windows", n_windows)
    if name not in UNSEEN_SETS:
        raise ValueError(f"unseen set {name!r}: expected one of {UNSEEN_SETS}")
    if name == "prose":  # each fortune checked, each file's kept fortunes one document (blank lines between)
        per_file, base = prose_documents(root)
        files = sorted(PROSE_FILES)
        hits = [overlapping(f, seen) if seen else [False] * len(f) for f in per_file]
        kept = ["\n\n".join(d for d, h in zip(f, hit, strict=True) if not h) for f, hit in zip(per_file, hits)]
        dropped = sum(sum(h) for h in hits)
    else:
        if name == "dialogue":
            docs, files, base = dialogue_documents(tokenizer, root)
        else:
            docs, files, base = code_documents(root)
        hit = overlapping(docs, seen) if seen else [False] * len(docs)
        kept = [d for d, h in zip(docs, hit, strict=True) if not h]
        dropped = sum(hit)
    windows_WS = token_windows(tokenizer, kept, seq_len)
    if len(windows_WS) == 0:
        raise ValueError(f"unseen set {name!r}: {base} makes no window of {seq_len} tokens")
    pick = torch.linspace(0, len(windows_WS) - 1, min(n_windows, len(windows_WS))).long()
    return UnseenText(name, str(base), tuple(files), len(kept), dropped, text_sha256(kept), windows_WS[pick])


def unseen_sets(
    tokenizer,
    seq_len: int,
    n_windows: int = 64,
    names: Sequence[str] = UNSEEN_SETS,
    data: str | Path | None = None,
    missing: str = "raise",
    also_read: Sequence[str] = (),
) -> tuple[dict[str, UnseenText], dict[str, str]]:
    """``(sets, missing_sets)``: ``unseen_text`` of each of ``names`` with the documents overlapping
    ``training_texts(data)`` or ``also_read`` (more text the conversion reads, e.g. ``--heal-text mix``'s) left
    out. ``missing="skip"``: a set whose text is not installed goes to ``missing_sets`` with the reason
    (``"raise"``: it raises)."""
    if missing not in ("raise", "skip"):
        raise ValueError(f"missing={missing!r}: expected 'raise' or 'skip'")
    seen = _builtin_ngrams()
    if data is not None:
        seen = seen | ngram_set([Path(data).read_text(encoding="utf-8")])
    if also_read:
        seen = seen | ngram_set(also_read)
    sets: dict[str, UnseenText] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            sets[name] = unseen_text(name, tokenizer, seq_len, n_windows, seen)
        except ValueError as e:
            if missing == "raise" or name not in UNSEEN_SETS:
                raise
            skipped[name] = str(e)
    return sets, skipped


def window_losses(model, windows_WS: torch.Tensor, seq_len: int | None = None, batch: int = 8):
    """``(loss_W, macs)``: each window's mean next-token loss (nats/token; eval mode, causal routing, no cache)
    and the model's MACs per token ÷ the original's at ``seq_len`` (default the windows' length) with each MoD
    layer at the share its router took on these windows (a pruned or unconverted model: its fixed count)."""
    import torch.nn.functional as F

    from mode.hf._compat import decoder_config
    from mode.hf.dense.macs import _parts, macs_per_token
    from mode.hf.dense.routing import collect_aux
    from mode.hf.dense.windows import batches_of

    model.eval()
    out: list[torch.Tensor] = []
    taken: dict[int, list[float]] = {}
    with torch.no_grad():
        for x_BS in batches_of(windows_WS, batch):
            logits = model(x_BS, use_cache=False).logits
            out.append(F.cross_entropy(logits[:, :-1].transpose(1, 2), x_BS[:, 1:], reduction="none").mean(1))
            for key, stats in collect_aux(model).stats.items():
                if key.endswith(".mod.router"):  # "layers.{i}.mod.router": the share routed in this batch
                    taken.setdefault(int(key.split(".")[1]), []).append(float(stats.compute_T.float().mean()))
    parts, n_layers = _parts(model)
    kept = (getattr(model, "mode_conversion", None) or {}).get("pruned", {}).get("kept") or list(range(n_layers))
    for j, shares in taken.items():
        parts[kept[j]]["share"] = sum(shares) / len(shares)
    config = decoder_config(model)
    S = windows_WS.shape[1] if seq_len is None else seq_len
    return torch.cat(out), macs_per_token(config, S, parts, n_layers) / macs_per_token(config, S, {}, n_layers)
