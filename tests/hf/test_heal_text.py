"""``mode.hf.dense.heal_text`` (``mode convert --heal-text mix``): the model's own samples equal a slow
reference that recomputes every prefix, are fixed by the seed and cached by a key of the model and settings;
the source windows are read, never imported; the heal batches take equal shares of the sources; ``mode convert``
reports what healing read and keeps it out of the out-of-domain sets."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import V, tiny

S = 12


class Tok:
    """Bytes folded into the tiny models' vocabulary, end of text 0; a chat template when ``chat``."""

    eos_token_id = 0

    def __init__(self, chat: bool = True):
        self.chat_template = "x" if chat else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [1 + b % (V - 1) for b in text.encode("utf-8")]}

    def apply_chat_template(self, messages, tokenize=False):
        assert not tokenize
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)

    def get_vocab(self) -> dict:
        return {chr(65 + i): i for i in range(V)}


def _reference(model, prompt: list[int], n: int, seq_len: int, seed: int, top_p: float) -> torch.Tensor:
    """``sample_windows`` the slow way: one row at a time, the whole prefix recomputed for every token."""
    from mode.hf.dense.heal_text import _top_p_sample

    g = torch.Generator().manual_seed(seed)
    rows = [list(prompt) for _ in range(n)]
    with torch.no_grad():
        while len(rows[0]) < seq_len:
            logits_BV = torch.stack([model(torch.tensor([r]), use_cache=False).logits[0, -1] for r in rows])
            for r, t in zip(rows, _top_p_sample(logits_BV.float(), top_p, g).tolist()):
                r.append(t)
    return torch.tensor(rows)


def test_sampling_with_the_cache_equals_recomputing_every_prefix(hf):
    from mode.hf.dense.heal_text import sample_windows

    torch.manual_seed(0)
    model = tiny("llama", layers=2, initializer_range=0.5).train()
    state = torch.get_rng_state()
    got = sample_windows(model, [5, 6, 7], n=3, seq_len=S, seed=4, batch=3, top_p=1.0)
    assert torch.equal(torch.get_rng_state(), state) and model.training  # own generator; mode given back
    assert got.shape == (3, S) and got[:, :3].eq(torch.tensor([5, 6, 7])).all()
    assert torch.equal(got, _reference(model.eval(), [5, 6, 7], 3, S, seed=4, top_p=1.0))
    assert torch.equal(got, sample_windows(model, [5, 6, 7], n=3, seq_len=S, seed=4, batch=3, top_p=1.0))
    assert not torch.equal(got, sample_windows(model, [5, 6, 7], n=3, seq_len=S, seed=5, batch=3, top_p=1.0))
    assert sample_windows(model, [5], n=0, seq_len=S, seed=0).shape == (0, S)
    with pytest.raises(ValueError, match="prompt: 12 tokens"):
        sample_windows(model, [1] * S, n=1, seq_len=S, seed=0)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    from mode.hf.dense.heal_text import _top_p_sample

    logits_BV = torch.tensor([0.15, 0.5, 0.05, 0.3]).log().expand(4000, 4)
    g = torch.Generator().manual_seed(0)
    drawn = _top_p_sample(logits_BV, 0.75, g)  # 0.5 + 0.3 reach 0.75; 0.5 alone does not
    assert set(drawn.tolist()) == {1, 3}
    assert abs(float((drawn == 1).double().mean()) - 0.5 / 0.8) < 0.03
    assert set(_top_p_sample(logits_BV, 0.01, g).tolist()) == {1}  # the most likely token always stays


def test_generated_windows_half_free_text_half_chats_cached_by_key(hf, tmp_path, monkeypatch):
    import mode.hf.dense.heal_text as ht

    torch.manual_seed(0)
    model = tiny("llama", layers=2)
    tok = Tok()
    chat = ht._chat_prefix(tok)
    assert chat == tok("<user>")["input_ids"]
    got = ht.generated_windows(model, tok, S, 5, seed=3, cache_dir=tmp_path)
    assert got.shape == (5, S) and got[:3, 0].eq(0).all()  # ceil(5 / 2) from the end-of-text token
    assert got[3:, : len(chat)].eq(torch.tensor(chat)).all()
    assert torch.equal(got[:3], ht.sample_windows(model, [0], 3, S, seed=3))
    (cached,) = (tmp_path / "generated").glob("*.safetensors")

    def refuse(*a, **k):
        raise AssertionError("sampled again instead of reading the cache")

    monkeypatch.setattr(ht, "sample_windows", refuse)
    assert torch.equal(ht.generated_windows(model, tok, S, 5, seed=3, cache_dir=tmp_path), got)
    with pytest.raises(AssertionError, match="sampled again"):  # another seed, another key
        ht.generated_windows(model, tok, S, 5, seed=4, cache_dir=tmp_path)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1  # other weights, another key
    with pytest.raises(AssertionError, match="sampled again"):
        ht.generated_windows(model, tok, S, 5, seed=3, cache_dir=tmp_path)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "generated").iterdir()] == [cached.name]  # nothing half-written
    plain = ht.generated_windows(model, Tok(chat=False), S, 4, seed=3)  # no template: free text only
    assert plain[:, 0].eq(0).all()


class TextTok(Tok):
    """``Tok`` with ``decode``: ids back to characters (ids are bytes + 1 here: exact for bytes below V - 1)."""

    def decode(self, ids) -> str:
        return "".join(chr(i - 1) if i else "|" for i in ids)


def test_written_text_leaves_out_the_prompt_the_sampler_began_with(hf):
    """The chat template's opening (a system prompt of 13+ words in SmolLM2's) is not the model's text: left in,
    every conversation of the dialogue set, written in the same template, would count as read and be dropped."""
    from mode.hf.dense.heal_text import prompts, written_text

    tok = TextTok()
    free, chat = prompts(tok, 64)
    assert free == [0] and chat == tok("<user>")["input_ids"]
    rows = torch.tensor([free + tok("A" * 63)["input_ids"], chat + tok("B" * (64 - len(chat)))["input_ids"]])
    assert written_text(tok, rows) == ["A" * 63, "B" * (64 - len(chat))]
    other = torch.tensor([tok("C" * 64)["input_ids"]])  # no known prompt: all of it
    assert written_text(tok, other) == ["C" * 64]
    assert prompts(Tok(chat=False), 64) == ([0], [0])


def test_python_source_is_read_not_run_tests_left_out(tmp_path):
    from mode.hf.dense.heal_text import python_source_windows

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("T" * 400)
    (tmp_path / "a.py").write_text("raise SystemExit('imported')\n" + "A" * 200)
    (tmp_path / "b.py").write_text("B" * 300)
    tok = Tok()
    got = python_source_windows(tok, S, 1000, root=tmp_path)
    every = torch.tensor(
        tok("raise SystemExit('imported')\n" + "A" * 200)["input_ids"] + [0] + tok("B" * 300)["input_ids"] + [0]
    )
    assert torch.equal(got, every[: len(every) // S * S].view(-1, S))
    assert len(python_source_windows(tok, S, 3, root=tmp_path)) == 3
    with pytest.raises(ValueError, match="not a directory"):
        python_source_windows(tok, S, 3, root=tmp_path / "none")
    (tmp_path / "only_tests" / "test").mkdir(parents=True)
    (tmp_path / "only_tests" / "test" / "t.py").write_text("T" * 400)
    with pytest.raises(ValueError, match="holds no"):
        python_source_windows(tok, S, 3, root=tmp_path / "only_tests")


def test_heal_batches_take_equal_shares_of_the_sources():
    from mode.hf.dense.heal_text import mixed_heal_batches

    sources = {k: 100 * i + torch.arange(n * 2).view(n, 2) for i, (k, n) in enumerate([("a", 40), ("b", 9), ("c", 30)])}
    batches = mixed_heal_batches(sources, steps=10, per_step=3, seed=0)
    rows = torch.cat(batches)
    assert len(batches) == 10 and rows.shape == (30, 2)
    by_source = [(rows[:, 0] // 100 == i).sum().item() for i in range(3)]
    assert by_source == [10, 10, 10]  # ceil(30 / 3) each; b's 9 windows all once, one again
    a_rows = rows[rows[:, 0] < 100]
    assert len({tuple(r) for r in a_rows.tolist()}) == 10  # no repeats where the source is large enough
    b_rows = {tuple(r) for r in rows[rows[:, 0] // 100 == 1].tolist()}
    assert b_rows == {tuple(r) for r in sources["b"].tolist()}
    assert torch.equal(rows, torch.cat(mixed_heal_batches(sources, 10, 3, seed=0)))
    assert not torch.equal(rows, torch.cat(mixed_heal_batches(sources, 10, 3, seed=1)))
    with pytest.raises(ValueError, match="each needs at least one window"):
        mixed_heal_batches({"a": sources["a"], "b": sources["b"][:0]}, 2, 2, 0)
    with pytest.raises(ValueError, match="steps=0"):
        mixed_heal_batches(sources, 0, 2, 0)


def test_unseen_sets_leave_out_what_healing_also_reads(hf, tmp_path, monkeypatch):
    import mode.hf.dense.unseen as u

    monkeypatch.setattr(u, "_builtin_ngrams", lambda: set())
    (tmp_path / "py").mkdir()
    lines = [" ".join(f"w{i}x{j}" for j in range(20)) for i in range(6)]
    for i, line in enumerate(lines):
        (tmp_path / "py" / f"m{i}.py").write_text(f"# {line}\n" * 3)
    monkeypatch.setattr(u, "_package_dir", lambda pkg, sub: tmp_path / "py")
    tok = Tok()
    plain, _ = u.unseen_sets(tok, 8, 4, names=["code"])
    less, _ = u.unseen_sets(tok, 8, 4, names=["code"], also_read=["said: " + lines[2] + " and more"])
    assert plain["code"].dropped == 0 and less["code"].dropped == 1
    assert less["code"].text_sha256 != plain["code"].text_sha256


def test_mode_convert_heals_on_the_mix_and_reports_it(hf, tmp_path, monkeypatch):
    import mode.hf.dense.heal_text as ht
    from mode.cli import main

    sys.path.insert(0, str(Path(__file__).parent))
    from test_unseen import _checkpoint, _sentence

    text = " ".join(_sentence(100 + i) for i in range(150))
    (tmp_path / "text.txt").write_text(text)
    _checkpoint(tmp_path / "ckpt", text)
    seen = {}
    real = ht.mixed_heal_batches

    calls = []

    def spy(sources, steps, per_step, seed):
        seen.update(sources)
        calls.append((steps, per_step))
        return real(sources, steps, per_step, seed)

    monkeypatch.setattr(ht, "mixed_heal_batches", spy)
    monkeypatch.setattr(ht, "docstring_windows", lambda tok, s: torch.arange(40 * s).view(40, s) % V)
    out = tmp_path / "out"
    argv = ["convert", str(tmp_path / "ckpt"), "--macs", "0.8", "--out", str(out), "--data", str(tmp_path / "text.txt")]
    argv += ["--seq-len", "32", "--fit-windows", "8", "--val-windows", "4", "--heal-steps", "3", "--heal-tokens", "64"]
    argv += ["--min-capacity", "0.25", "--unseen-windows", "0", "--no-progress", "--heal-text", "mix"]
    assert main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0
    report = json.loads((out / "convert_report.json").read_text())
    heal_text = report["heal_text"]
    assert heal_text["kind"] == "mix" and list(heal_text["sources"]) == list(ht.MIX_SOURCES)
    assert [heal_text["sources"][k]["windows"] for k in ("docstrings", "code", "generated")] == [2, 2, 2]  # 6 / 4
    assert heal_text["sources"]["generated"]["sha256"] == ht.windows_sha256(seen["generated"])
    assert report["result"]["heal"]["steps"] == 3 and len(list((tmp_path / "cache" / "generated").iterdir())) == 1
    assert calls == [(3, 2)] and report["fit_text"] == {"kind": "train", "sources": {}}
    assert main([*argv, "--force", "--cache-dir", "none", "--heal-text", "train"]) == 0
    assert json.loads((out / "convert_report.json").read_text())["heal_text"] == {"kind": "train", "sources": {}}
    assert calls == [(3, 2)]  # the training text alone: no mix drawn
    assert main([*argv, "--force", "--cache-dir", "none", "--heal-text", "train", "--fit-text", "mix"]) == 0
    report = json.loads((out / "convert_report.json").read_text())
    assert calls[1:] == [(1, 8)]  # the 8 fit windows from the mix, healing on the training text
    assert report["fit_text"]["kind"] == "mix" and list(report["fit_text"]["sources"]) == list(ht.MIX_SOURCES)
    assert report["heal_text"] == {"kind": "train", "sources": {}}
