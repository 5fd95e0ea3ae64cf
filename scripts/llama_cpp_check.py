"""Check that Hugging Face transformers folders convert with llama.cpp's own converter and decode the same.

For each folder: convert with llama.cpp's ``convert_hf_to_gguf.py`` (float32 GGUF, in a temporary folder),
greedy-decode with ``llama-cpp-python`` from the prompt's token ids, greedy-decode with transformers
(``AutoModelForCausalLM.from_pretrained(dir)``, ``generate(do_sample=False)``), and, when given, with the mode
checkpoint the folder was exported from (``mode.model.generate.generate(temperature=0.0)``). Prints a table and
writes JSON.

Setup (once; llama-cpp-python builds llama.cpp from source, about 7 minutes on 2 CPU cores)::

    pip install llama-cpp-python sentencepiece          # sentencepiece: the converter imports it
    V=$(python -c "import llama_cpp; print(llama_cpp.__version__)")
    mkdir -p ~/.cache/mode/llama_cpp && cd ~/.cache/mode/llama_cpp
    pip download --no-binary :all: --no-deps llama-cpp-python==$V && tar xzf llama_cpp_python-$V.tar.gz
    # the converter is then ~/.cache/mode/llama_cpp/llama_cpp_python-$V/vendor/llama.cpp/convert_hf_to_gguf.py

Run::

    python scripts/llama_cpp_check.py HF_DIR [HF_DIR ...] --prompt "Once upon a time" --max-new-tokens 32 \\
        --out result.json [--mode-checkpoint CKPT ...] [--llama-cpp-dir DIR] [--keep-gguf DIR]
    python scripts/llama_cpp_check.py --make-tiny /tmp/tiny --out result.json   # tiny random folders, then check

``--mode-checkpoint``: one per HF_DIR, in the same order. ``--make-tiny DIR`` writes tiny random float32 models
(Llama, Arcee relu2 and gelu, Qwen3-MoE, Mixtral; vocab 256, byte-level tokenizer) to DIR and checks those.

The converter runs unpatched on disk, through a wrapper (``_CONVERT_WRAPPER``) that imports it and overrides two
things at runtime, only where the stock converter would fail:

- ``TextModel.get_vocab_base_pre``: the converter recognises a BPE pre-tokenizer only by the hash of a test
  string's token ids, so a byte-level tokenizer of its own raises "BPE pre-tokenizer was not recognized". The
  override keeps the stock answer when there is one and otherwise writes ``tokenizer.ggml.pre = "default"``
  (``"gpt-2"`` for a ByteLevel pre-tokenizer with the GPT-2 regex and merges). With no merges every split gives
  the same byte tokens, so llama.cpp then tokenizes text exactly as transformers does.
- ``gguf.SpecialVocab.add_to_gguf``: a vocabulary with no merges writes no ``tokenizer.ggml.merges`` (gguf
  cannot write an empty array) and llama.cpp then refuses the file ("cannot find tokenizer merges"). The
  override writes one merge that can never apply (``"ĠĠ ĠĠ"``: no merge ever forms the symbol ``ĠĠ``).

Token ids go to llama.cpp directly (``Llama.eval``), so neither override can change the compared tokens.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

DEFAULT_LLAMA_CPP_ROOT = Path.home() / ".cache" / "mode" / "llama_cpp"

# Runs in a subprocess: argv = [llama_cpp_dir, converter args...].
_CONVERT_WRAPPER = r"""
import json, logging, sys
from pathlib import Path

llama_dir = Path(sys.argv[1])
sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *sys.argv[2:]]
sys.path.insert(0, str(llama_dir))
import convert_hf_to_gguf as converter  # puts the vendored gguf-py first on sys.path
import gguf
from conversion.base import TextModel

log = logging.getLogger("llama_cpp_check")
INERT_MERGE = "\u0120\u0120 \u0120\u0120"
stock_pre = TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return stock_pre(self, tokenizer)
    except NotImplementedError:
        tok = json.loads((Path(self.dir_model) / "tokenizer.json").read_text(encoding="utf-8"))
        merges = tok.get("model", {}).get("merges") or []
        pre = tok.get("pre_tokenizer") or {}
        pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        gpt2_regex = len(pres) == 1 and pres[0].get("type") == "ByteLevel" and pres[0].get("use_regex", True)
        res = "gpt-2" if merges and gpt2_regex else "default"
        if merges and res == "default":
            log.warning("pre-tokenizer %s unknown to llama.cpp: writing 'default'; llama.cpp may split text "
                        "differently from transformers (token ids fed directly are unaffected)", pre.get("type"))
        else:
            log.warning("pre-tokenizer not in llama.cpp's hash table: writing %r (%d merges)", res, len(merges))
        return res


stock_add = gguf.SpecialVocab.add_to_gguf


def add_to_gguf(self, gw, quiet=False):
    if self.load_merges and not self.merges:
        log.warning("no BPE merges: writing one inert merge %r (llama.cpp requires tokenizer.ggml.merges)",
                    INERT_MERGE)
        self.merges = [INERT_MERGE]
    return stock_add(self, gw, quiet=quiet)


TextModel.get_vocab_base_pre = get_vocab_base_pre
gguf.SpecialVocab.add_to_gguf = add_to_gguf
converter.main()
"""


def find_llama_cpp_dir(given: str | None) -> Path:
    """The vendored llama.cpp folder holding convert_hf_to_gguf.py (given, or the newest under the cache)."""
    if given is not None:
        candidates = [Path(given).expanduser()]
    else:
        try:
            import llama_cpp

            version = llama_cpp.__version__
        except ImportError:
            version = "*"
        pattern = str(DEFAULT_LLAMA_CPP_ROOT / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp")
        candidates = [Path(p) for p in sorted(glob.glob(pattern), reverse=True)]
    for c in candidates:
        if (c / "convert_hf_to_gguf.py").is_file():
            return c
    raise SystemExit(
        f"llama.cpp's convert_hf_to_gguf.py not found (looked in {[str(c) for c in candidates] or pattern}).\n"
        "Get it from the llama-cpp-python sdist of the installed version:\n"
        '  V=$(python -c "import llama_cpp; print(llama_cpp.__version__)")\n'
        f"  mkdir -p {DEFAULT_LLAMA_CPP_ROOT} && cd {DEFAULT_LLAMA_CPP_ROOT}\n"
        "  pip download --no-binary :all: --no-deps llama-cpp-python==$V && tar xzf llama_cpp_python-$V.tar.gz\n"
        "or pass --llama-cpp-dir PATH/TO/llama.cpp (a checkout with convert_hf_to_gguf.py and gguf-py)."
    )


def convert(llama_dir: Path, hf_dir: Path, out: Path) -> str:
    """Runs llama.cpp's converter (through the wrapper) on hf_dir; returns its log."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    cmd = [sys.executable, "-c", _CONVERT_WRAPPER, str(llama_dir), str(hf_dir), "--outtype", "f32"]
    proc = subprocess.run([*cmd, "--outfile", str(out)], capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} (rc {proc.returncode}):\n{log[-3000:]}")
    return log


def prompt_ids(hf_dir: Path, prompt: str) -> list[int]:
    """The prompt's ids by the folder's tokenizer (for a byte-level vocabulary: its UTF-8 bytes)."""
    if not (hf_dir / "tokenizer.json").is_file() and not (hf_dir / "tokenizer_config.json").is_file():
        return list(prompt.encode("utf-8"))
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(hf_dir)(prompt, add_special_tokens=False)["input_ids"])


def decode_transformers(hf_dir: Path, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the raw logits of each step (n x V)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # decode exactly n tokens, as the other two do
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    return tokens, torch.stack([lg[0].float() for lg in out.logits]).numpy()


def decode_llama_cpp(gguf_path: Path, ids: list[int], n: int, prompt: str, n_threads: int) -> dict:
    """Greedy tokens by argmax over llama.cpp's logits (eval one token at a time), its logits, the sampler's
    greedy tokens (``Llama.generate(top_k=1, temp=0)``) and llama.cpp's own tokenization of the prompt."""
    from llama_cpp import Llama

    f32 = 0  # GGML_TYPE_F32: llama.cpp's KV cache is float16 by default
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=len(ids) + n + 8,
        n_threads=n_threads,
        logits_all=True,
        type_k=f32,
        type_v=f32,
        verbose=False,
    )
    llm.reset()
    llm.eval(ids)
    tokens, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(row)
        tokens.append(int(row.argmax()))
        llm.eval([tokens[-1]])
    llm.reset()
    sampled = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        sampled.append(int(t))
        if len(sampled) == n:
            break
    text_ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
    return {"tokens": tokens, "logits": np.stack(logits), "sampled": sampled, "text_ids": list(text_ids)}


def decode_mode(ckpt: str, ids: list[int], n: int) -> list[int]:
    from mode.model.generate import generate
    from mode.train import load_model

    model, _ = load_model(ckpt)
    return generate(model, [ids], n, temperature=0.0)[0]


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def check_folder(hf_dir: Path, args, llama_dir: Path, ckpt: str | None, gguf_dir: Path) -> dict:
    cfg = json.loads((hf_dir / "config.json").read_text())
    family = (cfg.get("architectures") or ["?"])[0]
    if family == "ArceeForCausalLM":
        family += f"({cfg.get('hidden_act')})"
    elif "norm_topk_prob" in cfg:
        family += f"(norm_topk={cfg['norm_topk_prob']})"
    row: dict = {"folder": str(hf_dir), "family": family}
    gguf_path = gguf_dir / f"{hf_dir.name}.gguf"
    try:
        log = convert(llama_dir, hf_dir, gguf_path)
    except RuntimeError as e:
        row.update(converted=False, error=str(e).splitlines()[-1][:300])
        print(e, file=sys.stderr)
        return row
    row["converted"] = True
    banner = ("WARNING:hf-to-gguf:**", "WARNING:hf-to-gguf: ")  # the stock "not recognized" box, then overridden
    warnings = [ln for ln in log.splitlines() if ln.startswith("WARNING") and not ln.startswith(banner)]
    row["converter_warnings"] = [ln for ln in warnings if ln.rstrip() != "WARNING:hf-to-gguf:"]
    ids = prompt_ids(hf_dir, args.prompt)
    n = args.max_new_tokens
    hf_tokens, hf_logits = decode_transformers(hf_dir, ids, n)
    try:
        lc = decode_llama_cpp(gguf_path, ids, n, args.prompt, args.threads)
    except Exception as e:  # noqa: BLE001 - a model llama.cpp refuses is a result, not a crash
        row.update(loaded=False, error=f"{type(e).__name__}: {e}"[:300])
        return row
    margins = top2_margin(hf_logits)
    diff = first_diff(hf_tokens, lc["tokens"])
    agree = n if diff is None else diff  # steps whose logits are comparable (same prefix)
    row.update(
        loaded=True,
        prompt_ids=ids,
        transformers_tokens=hf_tokens,
        llama_cpp_tokens=lc["tokens"],
        llama_cpp_sampler_tokens=lc["sampled"],
        tokens_equal=diff is None,
        first_diff=diff,
        sampler_equal=lc["sampled"] == lc["tokens"],
        first_logit_maxabs=float(np.abs(hf_logits[0] - lc["logits"][0]).max()),
        logit_maxabs_agreeing_steps=float(np.abs(hf_logits[: agree + 1] - lc["logits"][: agree + 1]).max()),
        min_top2_margin=float(margins[:agree].min()) if agree else None,
        margin_at_first_diff=None if diff is None else float(margins[diff]),
        llama_tokenize_equal=lc["text_ids"] == ids,
    )
    if ckpt is not None:
        mode_tokens = decode_mode(ckpt, ids, n)
        row.update(mode_checkpoint=ckpt, mode_tokens=mode_tokens, mode_first_diff=first_diff(hf_tokens, mode_tokens))
        row["mode_equal"] = row["mode_first_diff"] is None
    return row


def make_tiny(root: Path) -> list[Path]:
    """Tiny random float32 folders with a byte-level tokenizer (ids == UTF-8 bytes); weights drawn at std 0.2
    so that greedy margins dwarf float32 rounding."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in bs]
    byte_to_char = {b: chr(b) for b in bs} | {b: chr(256 + i) for i, b in enumerate(extra)}  # GPT-2 bytes_to_unicode
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    moe = dict(num_experts_per_tok=2, **common)
    q2 = dict(intermediate_size=128, num_experts=8, norm_topk_prob=False, qkv_bias=False, **moe)
    q2["tie_word_embeddings"] = False  # llama.cpp's Qwen2-MoE graph needs its own output.weight
    specs = {
        "llama": tf.LlamaConfig(intermediate_size=128, attention_bias=False, mlp_bias=False, **common),
        "arcee_relu2": tf.ArceeConfig(intermediate_size=128, hidden_act="relu2", **common),
        "arcee_gelu": tf.ArceeConfig(intermediate_size=128, hidden_act="gelu", **common),
        "qwen3moe": tf.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, **moe),
        "qwen3moe_no_renorm": tf.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=8, norm_topk_prob=False, **moe),
        # Qwen2-MoE (the layout mode's exporter writes for token-choice MoE): llama.cpp never renormalises the
        # top-k gates, needs MoE in every layer and an untied output; the variants probe each of these
        "qwen2moe": tf.Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, **q2),
        "qwen2moe_renorm": tf.Qwen2MoeConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, **(q2 | {"norm_topk_prob": True})
        ),
        "qwen2moe_tied": tf.Qwen2MoeConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, **(q2 | {"tie_word_embeddings": True})
        ),
        "qwen2moe_no_shared": tf.Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=0, **q2),
        "qwen2moe_dense_layer0": tf.Qwen2MoeConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[0], **q2
        ),
        "mixtral": tf.MixtralConfig(intermediate_size=32, num_local_experts=8, **moe),
        # llama.cpp's OLMoE graph needs its own output.weight: untied
        "olmoe": tf.OlmoeConfig(intermediate_size=32, num_experts=8, **(moe | {"tie_word_embeddings": False})),
        "olmoe_tied": tf.OlmoeConfig(intermediate_size=32, num_experts=8, **moe),
        "deepseek_v3": tf.DeepseekV3Config(
            moe_intermediate_size=32,
            intermediate_size=128,
            n_routed_experts=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,  # llama.cpp reads q_lora_rank unless n_layer is 26 or 27 (V2-Lite)
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=32,
            head_dim=16,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            scoring_func="sigmoid",  # not a DeepseekV3Config field: without it llama.cpp gates with softmax
            topk_method="noaux_tc",
            **moe,
        ),
    }
    # a trained BPE (merges, GPT-2 regex split): the "tokens" kind of export rather than bytes
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    from tokenizers.trainers import BpeTrainer

    trainer = BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([__doc__] * 4, trainer)
    specs["llama_bpe"] = tf.LlamaConfig(intermediate_size=128, **(common | {"vocab_size": bpe.get_vocab_size()}))
    dirs = []
    for name, cfg in specs.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg).float()
        with torch.no_grad():  # DeepSeek-V3's selection bias starts at zero: make it count
            for key, t in [*model.named_parameters(), *model.named_buffers()]:
                if key.endswith("e_score_correction_bias"):
                    t.normal_(0.0, 0.5)
        model.save_pretrained(root / name)
        tokenizer = bpe if name == "llama_bpe" else tok
        tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False).save_pretrained(
            root / name
        )
        dirs.append(root / name)
    return dirs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dirs", nargs="*", type=Path, help="transformers folders (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--mode-checkpoint", action="append", default=[], help="one per HF_DIR, in order")
    p.add_argument("--llama-cpp-dir", help=f"folder with convert_hf_to_gguf.py (default: in {DEFAULT_LLAMA_CPP_ROOT})")
    p.add_argument("--keep-gguf", type=Path, help="write the GGUF files here instead of a temporary folder")
    p.add_argument("--make-tiny", type=Path, help="write tiny random folders here and check them too")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    dirs = list(args.hf_dirs) + (make_tiny(args.make_tiny) if args.make_tiny else [])
    if not dirs:
        p.error("give HF_DIR(s) or --make-tiny DIR")
    if args.mode_checkpoint and len(args.mode_checkpoint) != len(args.hf_dirs):
        p.error(f"{len(args.mode_checkpoint)} --mode-checkpoint for {len(args.hf_dirs)} HF_DIR: give one per HF_DIR")
    llama_dir = find_llama_cpp_dir(args.llama_cpp_dir)
    import llama_cpp

    ckpts = args.mode_checkpoint + [None] * (len(dirs) - len(args.mode_checkpoint))
    with tempfile.TemporaryDirectory() as tmp:
        gguf_dir = args.keep_gguf or Path(tmp)
        gguf_dir.mkdir(parents=True, exist_ok=True)
        rows = [check_folder(d, args, llama_dir, c, gguf_dir) for d, c in zip(dirs, ckpts)]
    import transformers

    result = {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_dir": str(llama_dir),
        "transformers": transformers.__version__,
        "gguf_venv": importlib.metadata.version("gguf"),
        "prompt": args.prompt,
        "max_new_tokens": args.max_new_tokens,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    def cell(r, key, fmt="{}"):
        v = r.get(key)
        return "-" if v is None else fmt.format(v)

    head = f"{'folder':<28} {'family':<36} {'tokens_equal':<12} {'first_diff':<10} {'logit0|diff|':<12} min_margin"
    print(head + (" mode_equal" if args.mode_checkpoint else ""))
    for r in rows:
        if not r.get("loaded"):
            print(f"{Path(r['folder']).name:<28} {r['family']:<36} FAILED: {r.get('error')}")
            continue
        line = (
            f"{Path(r['folder']).name:<28} {r['family']:<36} {str(r['tokens_equal']):<12} {cell(r, 'first_diff'):<10} "
            f"{cell(r, 'first_logit_maxabs', '{:.2e}'):<12} {cell(r, 'min_top2_margin', '{:.3f}'):<10}"
        )
        print(line + (f" {cell(r, 'mode_equal')}" if args.mode_checkpoint else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
