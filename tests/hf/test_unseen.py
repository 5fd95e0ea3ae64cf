"""``mode.hf.dense.unseen``: the out-of-domain sets are read from fixed, sorted file lists, documents sharing 13
words with the training text are left out, the windows and the text's SHA-256 are reproducible, a set that is
not installed is named with its install command, ``window_losses`` gives the held-out loss and the MACs at the
routed share, and ``mode convert`` reports each set's loss for the original and the conversion. The texts here
are written by the tests (no Debian package or corpus wheel needed); the code set reads the installed
transformers, which the test extra installs."""

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import V, tiny

S = 16
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch it from an old oak tree".split()


class ByteTokenizer:
    """UTF-8 bytes folded into the tiny models' vocabulary, end of text 0; no chat template."""

    eos_token_id = 0

    def __call__(self, text: str) -> dict:
        return {"input_ids": [1 + b % (V - 1) for b in text.encode("utf-8")]}


class ChatTokenizer(ByteTokenizer):
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize=False):
        assert not tokenize
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)


def _sentence(i: int, n: int = 20) -> str:
    g = torch.Generator().manual_seed(i)
    return " ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=g))


def _fortunes(root: Path, files) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(files):
        (root / name).write_text("\n%\n".join(_sentence(10 * k + i) for i in range(3)) + "\n%\n")


def test_prose_reads_each_fortune_of_the_files_in_sorted_order(hf, tmp_path):
    from mode.hf.dense.unseen import prose_documents

    _fortunes(tmp_path, ["b", "a"])
    per_file, root = prose_documents(tmp_path, files=["b", "a"])
    assert root == tmp_path
    assert per_file == [[_sentence(10 + i) for i in range(3)], [_sentence(i) for i in range(3)]]  # a, then b


def test_dialogue_pairs_the_turns_and_uses_the_chat_template(hf, tmp_path):
    from mode.hf.dense.unseen import dialogue_documents

    (tmp_path / "b.yml").write_text("conversations:\n- - Hi there\n  - Hello!\n  - How are you?\n")
    (tmp_path / "a.yml").write_text("conversations:\n- - Tell me a joke\n  - No.\n- - 42\n  - Why?\n")
    (tmp_path / "empty.yml").write_text("categories:\n- none\n")
    docs, files, _ = dialogue_documents(ByteTokenizer(), tmp_path)
    assert files == ["a.yml", "b.yml"]  # sorted; a file without a conversation gives no document
    assert docs == [
        "User: Tell me a joke\nAssistant: No.\nUser: 42\nAssistant: Why?\n",
        "User: Hi there\nAssistant: Hello!\n",
    ]
    docs, _, _ = dialogue_documents(ChatTokenizer(), tmp_path)  # the unpaired "How are you?" is left out
    assert docs[1] == "<user>Hi there</user><assistant>Hello!</assistant>"


def test_code_reads_the_sources_sorted_without_init(hf, tmp_path):
    from mode.hf.dense.unseen import code_documents

    for name, text in (("z.py", "z = 1\n"), ("__init__.py", "x = 0\n"), ("a.py", "a = 2\n"), ("n.txt", "no")):
        (tmp_path / name).write_text(text)
    assert code_documents(tmp_path)[:2] == (["a = 2\n", "z = 1\n"], ["a.py", "z.py"])


def test_overlapping_finds_13_shared_words_not_12(hf):
    from mode.hf.dense.unseen import ngram_set, overlapping

    ref = ngram_set([" ".join(f"r{i}" for i in range(40))])
    shared13 = "x y " + " ".join(f"r{i}" for i in range(5, 18)) + " z"
    shared12 = "x y " + " ".join(f"r{i}" for i in range(5, 17)) + " z"
    assert overlapping([shared13, shared12, "r1 r2"], ref) == [True, False, False]


def test_a_set_is_reproducible_and_leaves_out_what_the_training_text_holds(hf, tmp_path):
    from mode.hf.dense.unseen import PROSE_FILES, ngram_set, text_sha256, unseen_text

    _fortunes(tmp_path, PROSE_FILES)
    tok = ByteTokenizer()
    a = unseen_text("prose", tok, S, n_windows=8, root=tmp_path)
    b = unseen_text("prose", tok, S, n_windows=8, root=tmp_path)
    assert a == b and torch.equal(a.windows_WS, b.windows_WS) and a.windows_WS.shape == (8, S)
    assert a.files == tuple(sorted(PROSE_FILES)) and a.dropped == 0 and a.documents == len(PROSE_FILES)
    first = sorted(PROSE_FILES)[0]
    assert a.text_sha256 == text_sha256(
        ["\n\n".join(_sentence(10 * PROSE_FILES.index(f) + i) for i in range(3)) for f in sorted(PROSE_FILES)]
    )
    seen = ngram_set([_sentence(10 * PROSE_FILES.index(first))])  # one fortune is training text
    c = unseen_text("prose", tok, S, n_windows=8, seen=seen, root=tmp_path)
    assert c.dropped == 1 and c.text_sha256 != a.text_sha256
    info = c.info()
    assert info["windows"] == 8 and info["seq_len"] == S and "windows_WS" not in info
    json.dumps(info)
    (tmp_path / first).unlink()
    with pytest.raises(ValueError, match="apt-get install fortunes"):
        unseen_text("prose", tok, S, root=tmp_path)
    with pytest.raises(ValueError, match="expected one of"):
        unseen_text("poetry", tok, S)


def test_the_code_set_reads_the_installed_transformers(hf):
    from mode.hf.dense.unseen import unseen_text

    code = unseen_text("code", ByteTokenizer(), 64, n_windows=16)
    assert code.files[:2] == ("candidate_generator.py", "configuration_utils.py") and code.windows_WS.shape == (16, 64)
    assert Path(code.root).parts[-2:] == ("transformers", "generation")


def test_a_missing_set_is_skipped_with_its_install_command(hf, monkeypatch):
    import mode.hf.dense.unseen as u

    monkeypatch.setattr(u, "FORTUNES_DIR", "/nonexistent/fortunes")
    monkeypatch.setattr(u, "_builtin_ngrams", lambda: set())  # the stdlib's docstrings are not what is tested here
    sets, missing = u.unseen_sets(ByteTokenizer(), 64, 4, names=("prose", "code"), missing="skip")
    assert list(sets) == ["code"] and "apt-get install fortunes" in missing["prose"]
    with pytest.raises(ValueError, match="/nonexistent/fortunes"):
        u.unseen_sets(ByteTokenizer(), 64, 4, names=("prose",))


def test_window_losses_give_the_held_out_loss_and_the_macs_at_the_routed_share(hf):
    from mode.hf.convert_command import held_out_loss
    from mode.hf.dense.unseen import window_losses

    torch.manual_seed(0)
    model = tiny("llama", layers=4, initializer_range=0.1)
    x_WS = torch.randint(1, V, (6, S))
    loss_W, macs = window_losses(model, x_WS)
    assert loss_W.shape == (6,) and macs == 1.0
    assert float(loss_W.double().mean()) == pytest.approx(held_out_loss(model, x_WS), rel=1e-6)
    hf.to_mod(model, layers=[1, 2], capacity=0.5, causal="threshold")
    hf.calibrate(model, [x_WS])
    _, macs = window_losses(model.eval(), torch.randint(1, V, (6, S)))  # other windows: another routed share
    plain = hf.conversion_macs(model, S)  # at the capacity
    assert macs < 1.0 and macs != pytest.approx(plain, rel=1e-9)
    with hf.routing(model, "topk"):  # top-C routes exactly the capacity: the planned count
        _, macs_topc = window_losses(model, x_WS)
    assert macs_topc == pytest.approx(plain, rel=1e-6)


def _checkpoint(folder: Path, text: str) -> None:
    """A tiny Llama and a word-level tokenizer of ``text`` as a transformers checkpoint folder."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[EOS]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(sorted(set(text.split()))[: V - 2])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", unk_token="[UNK]").save_pretrained(folder)
    torch.manual_seed(0)
    tiny("llama", layers=4, initializer_range=0.1).save_pretrained(folder)


def test_mode_convert_reports_each_unseen_set(hf, tmp_path, monkeypatch, capsys):
    import mode.hf.dense.unseen as u
    from mode.cli import main
    from mode.hf.convert_command import load_model

    monkeypatch.setattr(u, "FORTUNES_DIR", str(tmp_path / "fortunes"))  # prose written here; no dialogue wheel
    monkeypatch.setattr(u, "_package_dir", lambda pkg, sub: None if pkg == "chatterbot_corpus" else tmp_path / "py")
    monkeypatch.setattr(u, "_builtin_ngrams", lambda: set())
    _fortunes(tmp_path / "fortunes", u.PROSE_FILES)
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "m.py").write_text("\n".join(f"x{i} = {i}  # {_sentence(i)}" for i in range(40)))
    text = " ".join(_sentence(100 + i) for i in range(150))
    (tmp_path / "text.txt").write_text(text)
    _checkpoint(tmp_path / "ckpt", text)
    out = tmp_path / "out"
    argv = ["convert", str(tmp_path / "ckpt"), "--macs", "0.8", "--out", str(out), "--data", str(tmp_path / "text.txt")]
    argv += ["--seq-len", "32", "--fit-windows", "8", "--val-windows", "4", "--heal-steps", "1", "--heal-tokens", "64"]
    argv += ["--min-capacity", "0.25", "--unseen-windows", "6", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "note: unseen set 'dialogue'" in printed and "pip install --no-deps chatterbot-corpus" in printed
    report = json.loads((out / "convert_report.json").read_text())
    assert sorted(report["unseen"]) == ["code", "prose"]
    original, tokenizer, _ = load_model(str(tmp_path / "ckpt"))
    back = hf.load_conversion(load_model(str(tmp_path / "ckpt"))[0], out)
    for name, row in report["unseen"].items():
        assert f"unseen {name}" in printed and row["windows"] == 6 and len(row["window_losses"]) == 6
        root = tmp_path / ("fortunes" if name == "prose" else "py")
        x_WS = u.unseen_text(name, tokenizer, 32, 6, seen=u.ngram_set([text]), root=root)  # --data left out
        assert x_WS.text_sha256 == row["text_sha256"]
        base_W, _ = u.window_losses(original, x_WS.windows_WS)
        got_W, macs = u.window_losses(back, x_WS.windows_WS)
        assert row["original_loss"] == pytest.approx(float(base_W.double().mean()), rel=1e-6)
        assert row["loss"] == pytest.approx(float(got_W.double().mean()), rel=1e-6)
        assert row["d_loss_pct"] == pytest.approx(100 * (row["loss"] / row["original_loss"] - 1))
        assert row["macs_measured"] == pytest.approx(macs)
    assert report["unseen"]["prose"]["dropped"] == 12  # the fortunes of files 10-13 are sentences of --data
    assert len(report["held_out"]["window_losses"]) == 4
    assert main([*argv, "--force", "--unseen-windows", "0"]) == 0
    assert json.loads((out / "convert_report.json").read_text())["unseen"] == {}


def _report(folder: Path, seed: int, shift: float) -> None:
    """A ``convert_report.json`` as ``mode convert`` writes it: held-out and one unseen set, 4 windows each."""
    folder.mkdir()
    held = {"original_loss": 2.0, "window_losses": [2.0 + shift + 0.01 * i for i in range(4)], "macs_measured": 0.85}
    unseen = {
        "prose": {
            "window_losses": [3.0 + 2 * shift + 0.01 * i for i in range(4)],
            "original_window_losses": [3.0] * 4,
            "macs_measured": 0.86,
            "text_sha256": "ab" * 32,
        }
    }
    report = {"settings": {"seed": seed}, "result": {"macs": 0.84}, "held_out": held, "unseen": unseen}
    (folder / "convert_report.json").write_text(json.dumps(report))


def test_heal_vs_prune_unseen_pairs_two_recipes_by_seed(hf, tmp_path):
    """benchmarks/hf/heal_vs_prune_unseen.py on two reports per recipe: each text's Δ % per seed, a − b with its
    intervals; folders of other seeds are refused."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from benchmarks.hf.heal_vs_prune_unseen import main

    for name, seed, shift in (("a0", 0, 0.02), ("a1", 1, 0.04), ("b0", 0, 0.1), ("b1", 1, 0.1)):
        _report(tmp_path / name, seed, shift)
    out = tmp_path / "r.json"
    got = main(["--a", *(str(tmp_path / f) for f in ("a0", "a1")), "--b", str(tmp_path / "b0"), str(tmp_path / "b1")]
               + ["--out", str(out)])  # fmt: skip
    held, prose = got["texts"]["in-domain"], got["texts"]["prose"]
    assert held["a_d_loss_pct"] == pytest.approx([100 * (2.035 / 2 - 1), 100 * (2.055 / 2 - 1)])
    assert held["diff_pct"] == pytest.approx(100 * (0.03 - 0.1) / 2)  # the mean shift of a minus b's, in % of 2.0
    assert prose["diff_pct"] == pytest.approx(100 * (0.06 - 0.2) / 3) and prose["a_macs"] == 0.86
    assert prose["bootstrap_ci_pct"][0] - 1e-4 <= prose["diff_pct"] <= prose["bootstrap_ci_pct"][1] + 1e-4
    assert held["t_ci_pct"] is not None and json.loads(out.read_text())["seeds"] == [0, 1]
    with pytest.raises(SystemExit):
        main(["--a", str(tmp_path / "a0"), "--b", str(tmp_path / "b1"), "--out", str(out)])


def test_unseen_curve_groups_recipes_and_pairs_mod_with_pruning_per_budget(hf, tmp_path):
    """benchmarks/hf/unseen_curve.py on reports at two budgets, two methods, one or two seeds and two heal texts:
    each recipe's curve (mean ± std per text), MoD − pruning only where both ran at the budget with the same heal
    text, and the PNG."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from benchmarks.hf.unseen_curve import main

    folders = []
    for method, macs, heal, seed, shift in [
        ("mod", 0.85, "train", 0, 0.02),
        ("mod", 0.85, "train", 1, 0.04),
        ("prune", 0.85, "train", 0, 0.1),
        ("prune", 0.85, "train", 1, 0.1),
        ("mod", 0.75, "train", 0, 0.2),
        ("mod", 0.85, "mix", 0, 0.01),
        ("prune", 0.85, "fit", 0, 0.01),
    ]:
        folder = tmp_path / f"{method}_{macs}_{heal}_{seed}"
        _report(folder, seed, shift)
        report = json.loads((folder / "convert_report.json").read_text())
        texts = {"fit": {"fit_text": "mix", "heal_text": "mix"}, "mix": {"heal_text": "mix"}}.get(heal, {})
        report["settings"].update(method=method, macs=macs, **texts)
        report["source"] = "tiny"
        (folder / "convert_report.json").write_text(json.dumps(report))
        folders.append(str(folder))
    out = tmp_path / "curve.json"
    got = main(["--folders", *folders, "--out", str(out)])
    assert sorted(got["curves"]) == ["mod", "mod, heal mix", "prune", "prune, fit mix, heal mix"]
    mod85 = got["curves"]["mod"]["0.85"]
    assert mod85["seeds"] == [0, 1] and mod85["texts"]["in-domain"]["mean"] == pytest.approx(100 * (2.045 / 2 - 1))
    assert mod85["texts"]["prose"]["std"] == pytest.approx(statistics.stdev([100 * 0.055 / 3, 100 * 0.095 / 3]))
    assert got["curves"]["mod"]["0.75"]["texts"]["prose"]["std"] is None  # one seed
    assert list(got["mod_minus_prune"]) == ["0.85"]  # no pruning at 0.75; mix healing and fitting differ
    assert got["mod_minus_prune"]["0.85"]["texts"]["in-domain"]["diff_pct"] == pytest.approx(100 * (0.03 - 0.1) / 2)
    assert out.with_suffix(".png").stat().st_size > 10_000
    bad = tmp_path / "mod_0.85_train_0_again"
    _report(bad, 0, 0.0)
    report = json.loads((bad / "convert_report.json").read_text())
    report["settings"].update(method="mod", macs=0.85)
    (bad / "convert_report.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"mod at 0.85: seed repeated in \[0, 1, 0\]"):
        main(["--folders", *folders, str(bad), "--out", str(out)])


def test_heal_curve_averages_each_recipe_over_seeds_at_the_steps_all_have(tmp_path):
    """benchmarks/hf/heal_curve.py on three probed conversions (two seeds of one recipe, one of another): the mean
    and std per step and text at the steps every seed has, tokens per step from the heal report, the PNG; a folder
    without a curve is refused by name."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from benchmarks.hf.heal_curve import main

    def write(name: str, method: str, seed: int, curve: list[dict]) -> str:
        folder = tmp_path / name
        folder.mkdir()
        report = {
            "settings": {"method": method, "macs": 0.85, "seed": seed, "heal_text": "mix"},
            "result": {"heal": {"steps": curve[-1]["step"], "tokens": curve[-1]["step"] * 1024}},
            "heal_curve": curve,
        }
        (folder / "convert_report.json").write_text(json.dumps(report))
        return str(folder)

    def point(step: int, held: float, prose: float) -> dict:
        return {"step": step, "held_out": held, "prose": prose}

    folders = [
        write("m0", "mod", 0, [point(0, 10.0, 20.0), point(50, 4.0, 14.0), point(100, 3.0, 12.0)]),
        write("m1", "mod", 1, [point(0, 12.0, 22.0), point(100, 5.0, 13.0)]),  # probed at 100 only
        write("p0", "prune", 0, [point(0, 11.0, 25.0), point(100, 6.0, 15.0)]),
    ]
    out = tmp_path / "curve.json"
    got = main(["--folders", *folders, "--out", str(out)])
    mod = got["curves"]["mod, heal mix @ 0.85"]
    assert mod["seeds"] == [0, 1] and mod["steps"] == [0, 100] and mod["tokens"] == [0, 102400]
    assert mod["texts"]["held_out"]["mean"] == [11.0, 4.0]
    stds = [statistics.stdev([20.0, 22.0]), statistics.stdev([12.0, 13.0])]
    assert mod["texts"]["prose"]["std"] == pytest.approx(stds)
    assert got["curves"]["prune, heal mix @ 0.85"]["texts"]["prose"]["std"] == [None, None]
    assert out.with_suffix(".png").stat().st_size > 10_000
    stopped = tmp_path / "stopped"  # a run stopped while it healed: the probes it wrote so far
    stopped.mkdir()
    settings = {"method": "mod", "macs": 0.75, "seed": 0, "heal_text": "mix", "heal_tokens": 1000, "seq_len": 256}
    (stopped / "heal_curve.partial.json").write_text(json.dumps({"settings": settings, "heal_curve": [point(0, 9, 9)]}))
    got = main(["--folders", str(stopped), "--out", str(out)])
    assert got["runs"][0]["partial"] and got["curves"]["mod, heal mix @ 0.75"]["tokens"] == [0]
    assert got["runs"][0]["tokens_per_step"] == 768  # whole windows
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "convert_report.json").write_text(json.dumps({"settings": {}}))
    with pytest.raises(ValueError, match="bare.*no heal_curve"):
        main(["--folders", str(bare), "--out", str(out)])
    with pytest.raises(ValueError, match="empty: holds neither"):
        (tmp_path / "empty").mkdir()
        main(["--folders", str(tmp_path / "empty"), "--out", str(out)])
