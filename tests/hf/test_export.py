"""``mode.hf.export_transformers``: every layer kind and router, trained a few steps, out to transformers: the
layout chosen by exact math, logits equal to mode's (float32), greedy ``generate()`` equal to mode's, padding,
the tokenizer, and the refusals (an existing folder, a layout that cannot express the model, random routing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="mode.hf needs transformers 5.x: pip install -e '.[hf]'")

from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mode.hf.export import LAYOUTS, ModeForCausalLM, export_transformers
from mode.hf.export.tokenizer import byte_tokenizer
from mode.model import LMConfig
from mode.model.generate import generate
from mode.model.lm import LM
from tests import ties
from tests.hf.export_cases import CASES, NOT_CAUSAL, batch_ids, mode_logits, prompt_ids, trained

REL = 1e-4  # float32: the families sum in another order (experts, attention); mode's layout is bit-equal
GAP_FLOOR = 1e-5  # relative top-k gap above every rounding difference between the two implementations


def load(folder: Path, layout: str):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=layout == "mode").eval()


def assert_close_logits(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= REL * want.abs().max(), float((got - want).abs().max())


def greedy_margins(lm: LM, prompt: list[int], tokens: list[int]) -> list[float]:
    """The top-1 minus top-2 logit of mode's forward at each generated position (a near tie could flip)."""
    ids = torch.tensor([prompt + tokens])
    logits = mode_logits(lm, ids)[0, len(prompt) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_export_equals_mode(name, tmp_path):
    lm, _ = trained(name, tmp_path / "run")
    layout = CASES[name][1]
    res = export_transformers(lm, tmp_path / "hf")
    assert (res.layout, res.tokenizer) == (layout, "bytes")
    assert (res.not_causal is not None) == (name in NOT_CAUSAL)
    model = load(tmp_path / "hf", layout)
    ids = batch_ids()
    with ties.active() as gaps:
        want = mode_logits(lm, ids)
    if layout != "mode":
        assert gaps.smallest() > GAP_FLOOR  # no routing decision the family's rounding could flip
    with torch.no_grad():
        got = model(ids).logits.float()
    assert_close_logits(got, want, exact=layout == "mode")
    prompt = prompt_ids()
    if name in NOT_CAUSAL:
        with pytest.raises(ValueError, match=r"expert.choice|capacity_factor|causal='none'"):
            model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        return
    ref = generate(lm, [prompt], 16, temperature=0)[0]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    margins = greedy_margins(lm, prompt, ref)
    n = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))  # compare up to a near tie
    assert n >= 8, margins
    assert out[:n] == ref[:n]


def test_standard_folders_load_without_mode(tmp_path):
    """Each standard-family export loads, computes mode's logits and decodes mode's tokens in a process that
    cannot import mode."""
    expect = {}
    for name, (_, layout) in CASES.items():
        if layout == "mode":
            continue
        lm, _ = trained(name, tmp_path / f"run_{name}")
        export_transformers(lm, tmp_path / name)
        ids = batch_ids()
        save_file({"ids": ids, "logits": mode_logits(lm, ids)}, str(tmp_path / f"{name}.safetensors"))
        expect[name] = {"layout": layout, "prompt": prompt_ids(), "tokens": generate(lm, [prompt_ids()], 6, 0.0)[0]}
    (tmp_path / "expect.json").write_text(json.dumps(expect))
    script = f"""
import json, sys
class NoMode:
    def find_spec(self, name, path=None, target=None):
        if name == "mode" or name.startswith("mode."):
            raise ImportError("this process must not import mode")
sys.meta_path.insert(0, NoMode())
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
root = {str(tmp_path)!r}
for name, e in json.load(open(root + "/expect.json")).items():
    model = AutoModelForCausalLM.from_pretrained(root + "/" + name, dtype=torch.float32).eval()
    assert type(model).__name__.lower().startswith(e["layout"].replace("_", "")), type(model).__name__
    t = load_file(root + "/" + name + ".safetensors")
    with torch.no_grad():
        got = model(t["ids"]).logits
    err = float((got - t["logits"]).abs().max())
    assert err <= 1e-4 * float(t["logits"].abs().max()), (name, err)
    tok = AutoTokenizer.from_pretrained(root + "/" + name)
    assert tok("def f(x):")["input_ids"] == list(b"def f(x):")
    out = model.generate(torch.tensor([e["prompt"]]), max_new_tokens=6, do_sample=False)
    print(name, out[0, len(e["prompt"]):].tolist() == e["tokens"])
print("modules", any(m == "mode" or m.startswith("mode.") for m in sys.modules))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split("\n")
    assert "modules False" in lines
    assert sum(line.endswith(" True") for line in lines) >= len(expect) - 1  # greedy, a rare near tie aside


def test_left_padded_batch_equals_each_prompt(tmp_path):
    lm, _ = trained("mixed_pattern", tmp_path / "run")
    export_transformers(lm, tmp_path / "hf")
    model = load(tmp_path / "hf", "mode")
    prompts = [prompt_ids(12), prompt_ids(7)]
    P = 12
    ids = torch.zeros(2, P, dtype=torch.long)
    mask = torch.zeros(2, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :], mask[b, P - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        for b, p in enumerate(prompts):
            alone = model(torch.tensor([p])).logits[0]
            assert (padded[b, P - len(p) :] - alone).abs().max() <= 1e-5 * alone.abs().max()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)[:, P:]
    assert out.tolist() == generate(lm, prompts, 10, temperature=0)


def test_byte_tokenizer_encodes_any_text_to_its_bytes(tmp_path):
    lm = LM(LMConfig(**{"seq_len": 16, "d_model": 16, "n_heads": 2, "d_hidden": 32, "layers": ("dense",)}))
    export_transformers(lm, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ["", "def f(x):\n\treturn x  # é ü 漢字 🙂", " leading space", "\x00\x01\xff", "a\r\nb"]:
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode()), text
        assert tok.decode(ids) == text
    assert byte_tokenizer().get_vocab_size() == 256


def test_bpe_tokenizer_of_token_data(tmp_path):
    """A model trained on mode tokenize's shards: its tokenizer.json goes beside it, and AutoTokenizer encodes
    text to the ids mode trained on (the tokenizer's post-processor, which mode does not apply, removed)."""
    import tokenizers

    from mode.cli import main

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        show_progress=False,
        special_tokens=["<bos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def f(x): return x + 1\n" * 50], trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "a.txt"
    src.write_text("def g(y):\n    return y * 2\n" * 400)
    shards = tmp_path / "shards"
    assert main(["tokenize", str(src), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(shards)]) == 0
    args = ["train", "--preset", "quick", "--layers", "dense,mod", "--steps", "2", "--data", str(shards)]
    assert main([*args, "--out", str(tmp_path / "run"), "--no-progress", "--eval-every", "100"]) == 0
    assert main(["export", str(tmp_path / "run" / "ckpt.pt"), str(tmp_path / "hf"), "--format", "transformers"]) == 0
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def h(z):\n    return z + 12\n"
    assert hf_tok(text)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    manifest = json.loads((tmp_path / "hf" / "mode_export.json").read_text())
    assert (manifest["layout"], manifest["tokenizer"]) == ("mode", "tokens")


def test_refusals_and_atomic_writes(tmp_path, monkeypatch):
    lm, ckpt = trained("moe_gelu", tmp_path / "run", steps=1)
    out = tmp_path / "hf"
    with pytest.raises(ValueError, match=r"layout='mixtral': the model has activation='gelu'"):
        export_transformers(lm, out, layout="mixtral")
    with pytest.raises(ValueError, match=r"layout='llama': the model has MoE layers"):
        export_transformers(lm, out, layout="llama")
    with pytest.raises(ValueError, match=r"layout='nope': must be one of"):
        export_transformers(lm, out, layout="nope")
    random_mod = LM(LMConfig(seq_len=16, d_model=16, n_heads=2, d_hidden=32, layers=("dense", "mod_random")))
    with pytest.raises(ValueError, match=r"layers\[1\]='mod_random': random routing"):
        export_transformers(random_mod, out)
    assert not out.exists()
    # a failure after the folder was partly written leaves nothing, neither at out nor beside it
    monkeypatch.setattr("mode.hf.export.export._verify", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        export_transformers(ckpt, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    monkeypatch.undo()
    export_transformers(ckpt, out)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"exists; pass force=True"):
        export_transformers(ckpt, out)
    export_transformers(LM(lm.cfg), out, force=True)  # another model: replaced whole
    assert (out / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


def test_layouts_are_the_documented_families():
    assert list(LAYOUTS) == ["llama", "arcee", "mixtral", "qwen2_moe", "glm4_moe"]
    assert ModeForCausalLM.config_class.model_type == "mode_lm"


@pytest.mark.parametrize(
    "layers,layout",
    [
        ("dense,dense,dense,dense", "arcee"),  # the quick preset's GELU MLPs
        ("moe,moe,moe,moe", "mode"),  # GELU experts: no standard MoE family has them
        ("staged,staged,moe,moe", "mode"),
        ("integrated,moe,integrated,moe", "mode"),
    ],
)
def test_mode_export_command_on_quick_preset_checkpoints(layers, layout, tmp_path, capsys):
    """``mode export CKPT OUT --format transformers`` on ``mode train --preset quick`` checkpoints of each kind:
    AutoModelForCausalLM and AutoTokenizer load the folder, with logits equal to mode's."""
    from mode.cli import main
    from mode.train import load_model

    run = tmp_path / "run"
    args = ["train", "--preset", "quick", "--layers", layers, "--steps", "2", "--batch-size", "4"]
    assert main([*args, "--eval-every", "100", "--out", str(run), "--no-progress"]) == 0
    out = tmp_path / "hf"
    assert main(["export", str(run / "ckpt.pt"), str(out), "--format", "transformers"]) == 0
    printed = capsys.readouterr().out
    assert f"({layout} layout;" in printed and "checked: logits equal mode's" in printed
    lm, _ = load_model(run / "ckpt.pt")
    model = load(out, layout)
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("def f(x):\n    return x + 1\n")["input_ids"]])
    with torch.no_grad():
        assert_close_logits(model(ids).logits, mode_logits(lm.eval(), ids), exact=layout == "mode")
    assert main(["export", str(run / "ckpt.pt"), str(out), "--format", "transformers"]) == 2
    assert "exists; pass force=True (--force)" in capsys.readouterr().err
    assert main(["export", str(run / "ckpt.pt"), str(tmp_path / "x.pt"), "--layout", "mode"]) == 2
    assert "--layout=mode: only with --format transformers" in capsys.readouterr().err


def test_buffers_no_folder_holds_get_their_built_values(tmp_path):
    """transformers loads on the meta device and allocates the buffers a checkpoint leaves out (bias balancing's
    load and target shares) empty: ``ModeForCausalLM`` gives them their built values, so training goes on right."""
    cfg = LMConfig(
        layers=("moe", "integrated"),
        num_noop=2,
        top_k=2,
        router_options={"bias_balance": True, "noop_target": 0.3},
        seq_len=16,
        d_model=16,
        n_heads=2,
        d_hidden=32,
    )
    lm = LM(cfg)
    export_transformers(lm, tmp_path / "hf")
    model = load(tmp_path / "hf", "mode")
    built = dict(lm.named_buffers())
    for name, buf in model.model.named_buffers():
        assert torch.equal(buf, built[name]), name


def test_beam_search_with_mode_caches_equals_without(tmp_path):
    """Beam search reorders mode's per-layer caches with the beams (``ModeCache.reorder_cache``): the same beams
    as recomputing every step without a cache."""
    lm, _ = trained("mixed_pattern", tmp_path / "run")
    export_transformers(lm, tmp_path / "hf")
    model = load(tmp_path / "hf", "mode")
    prompt = torch.tensor([prompt_ids(9), prompt_ids(9)[::-1]])
    kw = dict(max_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=2, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kw)
    uncached = model.generate(prompt, use_cache=False, **kw)
    assert cached.tolist() == uncached.tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_folders(dtype, tmp_path):
    """``dtype="bfloat16"``: the folder holds the weights rounded to it; its logits (loaded in float32) equal mode's
    with the same rounded weights."""
    lm, _ = trained("moe_renormalized", tmp_path / "run")
    res = export_transformers(lm, tmp_path / "hf", dtype=dtype)
    assert res.max_logit_diff is not None
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.dtype == getattr(torch, dtype)
