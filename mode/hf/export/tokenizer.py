"""The tokenizer a mode model was trained with, as a transformers fast tokenizer (``tokenizer.json`` and
``tokenizer_config.json``), so that ``AutoTokenizer`` encodes any text to the ids the model trained on.

    bytes    mode's byte-level data (``mode.train.data.encode``: id = UTF-8 byte): a ``tokenizers`` BPE model with
             the 256 byte symbols of GPT-2's byte-to-unicode table as its vocabulary (id = byte) and no merges,
             a ByteLevel pre-tokenizer without regex splits or prefix space, and the ByteLevel decoder
    tokens   the ``tokenizer.json`` the token shards were written with (``mode tokenize``; its sha256 checked),
             copied with its post-processor removed: mode encodes with ``add_special_tokens=False``, so
             ``AutoTokenizer``'s default encoding then gives the same ids
"""

from __future__ import annotations

import json
from pathlib import Path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are the text's UTF-8 bytes (256 ids, no special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_tokenizer(out: Path, record: dict | None, tokenizer: str | Path | None, vocab_size: int) -> str:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``; returns the kind ("bytes" or
    "tokens"). ``record``: the checkpoint's data record (``Corpus.record()``; None: bytes); ``tokenizer``: a
    copy of the recorded tokenizer.json (same sha256), or for a model passed without a record, its
    tokenizer.json."""
    from transformers import PreTrainedTokenizerFast

    kind = "bytes" if (record is None or record.get("kind", "bytes") == "bytes") and tokenizer is None else "tokens"
    if kind == "bytes":
        if vocab_size != 256:
            raise ValueError(
                f"tokenizer=None: the model has vocab_size={vocab_size}, not the 256 byte ids; pass "
                "tokenizer=PATH (the tokenizer.json it was trained with)"
            )
        tok = byte_tokenizer()
    else:
        from mode.train.data import text_codec  # checks the recorded sha256 against the file
        from mode.train.tokens import TokenizerRef, load_tokenizer

        where = "export"
        if record is not None and record.get("tokenizer") is not None:
            text_codec(record, where, tokenizer)
            tok = TokenizerRef.from_dict(record["tokenizer"], where).load(where, tokenizer)
        else:
            if tokenizer is None:
                raise ValueError("tokenizer: the checkpoint records no tokenizer; pass the tokenizer.json it used")
            tok = load_tokenizer(tokenizer)
        spec = json.loads(tok.to_str())
        spec["post_processor"] = None  # mode encodes with add_special_tokens=False
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(json.dumps(spec))
        if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
            raise ValueError(
                f"tokenizer: {tok.get_vocab_size(with_added_tokens=True)} ids, more than the model's "
                f"vocab_size={vocab_size}"
            )
    PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False).save_pretrained(out)
    return kind
