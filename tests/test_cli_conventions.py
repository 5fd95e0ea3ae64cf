"""The ``mode`` command line's conventions (docs/commands.md, 'Conventions'): no command replaces a file or
folder it did not write in this run unless told to (``--force``, or resuming its own run), refusing with one line and
status 2;
messages that name what was wrong and what to pass instead; ``--version``; every option's help with its default;
``--help`` answered without importing torch."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mode.train.data
from mode import cli
from mode.cli import main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("compare", "isoflop", "train", "export", "sample", "tokenize", "report", "convert")


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, *args, "-c", code] if code else [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_error_line(err: str, command: str) -> str:
    """The error a command printed: one line, in the CLI's 'mode CMD: error: ...' form."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"mode {command}: error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(Path(mode.train.data.__file__).read_text() * 3)
    return path


@pytest.fixture(scope="module")
def trained(text, tmp_path_factory) -> tuple[Path, str]:
    """A one-step ``mode train`` run's folder, and what the command printed."""
    out = tmp_path_factory.mktemp("train") / "run"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["train", "--steps", "1", "--data", str(text), "--out", str(out), "--no-progress"]) == 0
    return out, buf.getvalue()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A sharded checkpoint folder (``ckpt/`` with ``latest``), saved from this one process."""
    import numpy as np

    from mode.model import LMConfig
    from mode.parallel.checkpoint import save_sharded
    from mode.train import TrainConfig, Trainer
    from mode.train.data import Corpus

    arr = np.frombuffer(b"def f(x):\n    return x + 1\n" * 200, dtype=np.uint8)
    corpus = Corpus(train=arr[:4000], val=arr[4000:], source="synthetic")
    root = tmp_path_factory.mktemp("sharded")
    t = Trainer(
        LMConfig(seq_len=16, d_model=16, n_heads=2, d_hidden=32, layers=("dense", "mod")),
        TrainConfig(steps=1, batch_size=2, warmup_steps=1, eval_every=1, eval_batches=1, log_every=1),
        corpus,
        root / "run",
        progress=False,
    )
    t.run()
    save_sharded(root / "ckpt", t.model, t.optimizer, {**t._progress_state(), "routing_acc": t.routing.state_dict()})
    return root / "ckpt"


# ---------------------------------------------------------------------------------------------- 1: no data loss


def test_export_refuses_to_replace_a_file_it_did_not_write(sharded, tmp_path, capsys):
    other = tmp_path / "other_run.pt"
    other.write_bytes(b"another run's checkpoint")
    note = tmp_path / "notes.md"
    note.write_text("# my notes\n")
    for target in (other, note):
        assert main(["export", str(sharded), str(target)]) == 2
        line = one_error_line(capsys.readouterr().err, "export")
        assert repr(str(target)) in line and "already exists" in line and "--force" in line
    assert other.read_bytes() == b"another run's checkpoint" and note.read_text() == "# my notes\n"

    assert main(["export", str(sharded), str(tmp_path / "new" / "new.pt")]) == 0  # a new file: written
    assert main(["export", str(sharded), str(other), "--force"]) == 0  # told to: replaced
    from mode.train.checkpoint import load_model

    assert load_model(other)[1]["step"] == 1
    assert main(["export", str(sharded), str(tmp_path)]) == 2  # a folder is never replaced by a file
    assert "a folder; give the name of the file to write" in one_error_line(capsys.readouterr().err, "export")


def test_train_refuses_what_an_earlier_run_left_unless_forced_or_resumed(trained, text, tmp_path, capsys):
    src, _ = trained
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 7}\n')  # a run killed before its first checkpoint, or anyone's file
    args = ["train", "--steps", "1", "--data", str(text), "--out", str(out), "--no-progress"]
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err, "train")
    assert repr(str(out / "log.jsonl")) in line and "--force" in line
    assert (out / "log.jsonl").read_text() == '{"step": 7}\n'
    assert main([*args, "--force", "--resume"]) == 2
    assert "--force and --resume: give one of them" in one_error_line(capsys.readouterr().err, "train")

    (out / "ckpt-step-00000005.pt").write_bytes((src / "ckpt.pt").read_bytes())  # an old run's kept checkpoint
    (out / "tb").mkdir()
    assert main([*args, "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "log.jsonl"]  # the old run's files are gone
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume"]) == 0  # resuming its own run: no --force needed
    assert "resuming at step 1 of 2" in capsys.readouterr().out


def test_tokenize_refuses_another_tokenizer_json_unless_forced(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["def f(x): return x + 1\n" * 50], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "a.txt"
    src.write_text("def g(y):\n    return y * 2\n" * 300)
    out = tmp_path / "shards"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"someone": "else"}')
    args = ["tokenize", str(src), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(out)]
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err, "tokenize")
    assert "already holds 'tokenizer.json'" in line and "--force" in line
    assert (out / "tokenizer.json").read_text() == '{"someone": "else"}'
    assert main([*args, "--force"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(args) == 2  # its own shards are there now: a second run is refused too
    assert "already holds 'meta.json'" in one_error_line(capsys.readouterr().err, "tokenize")


@pytest.mark.parametrize("command,output", [("compare", "compare.md"), ("isoflop", "isoflop.md")])
def test_compare_and_isoflop_refuse_files_no_run_recorded(command, output, text, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / output).write_text("my own table\n")
    args = [command, "--quick", "--data", str(text), "--out", str(out), "--only", "dense", "--no-progress"]
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err, command)
    assert repr(str(out / output)) in line and "--force" in line
    assert (out / output).read_text() == "my own table\n"
    assert [p.name for p in out.iterdir()] == [output]  # refused before anything was written


def test_compare_force_replaces_and_a_rerun_resumes(text, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "compare.md").write_text("my own table\n")
    args = [
        "compare",
        "--quick",
        "--data",
        str(text),
        "--out",
        str(out),
        "--only",
        "dense",
        "--dense-steps",
        "1",
        "--no-progress",
        "--ckpt-every-s",
        "0",
    ]
    assert main([*args, "--force"]) == 0
    assert (out / "compare.md").read_text() != "my own table\n"
    capsys.readouterr()
    assert main(args) == 0  # its own run, recorded in compare_run.json: resumed, nothing refused
    assert "done in an earlier run" in capsys.readouterr().out


def test_report_refuses_to_replace_an_earlier_report_unless_forced(trained, tmp_path, capsys):
    src, _ = trained
    out = tmp_path / "report"
    args = ["report", str(src / "ckpt.pt"), "--out", str(out), "--batches", "1", "--batch-size", "2"]
    assert main(args) == 0
    before = (out / "report.json").read_bytes()
    (out / "report.json").write_text("edited")
    capsys.readouterr()
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err, "report")
    assert repr(str(out / "report.json")) in line and "3 more" in line and "--force" in line
    assert (out / "report.json").read_text() == "edited"
    assert main([*args, "--force"]) == 0
    assert (out / "report.json").read_bytes() == before
    capsys.readouterr()
    assert main([*args[:3], str(out / "report.json"), *args[4:]]) == 2  # --out a file: said before evaluating
    assert "is a file, not a folder" in one_error_line(capsys.readouterr().err, "report")


def test_sample_writes_nothing(trained, capsys):
    src, _ = trained
    before = sorted(p.name for p in src.rglob("*"))
    assert main(["sample", str(src / "ckpt.pt"), "--max-new-tokens", "2"]) == 0
    assert sorted(p.name for p in src.rglob("*")) == before


# ---------------------------------------------------------------------------------------------- 7: messages


def test_export_of_a_file_says_it_wants_a_sharded_folder(trained, tmp_path, capsys):
    src, _ = trained
    assert main(["export", str(src / "ckpt.pt"), str(tmp_path / "out.pt")]) == 2
    line = one_error_line(capsys.readouterr().err, "export")
    assert "a file; export reads a sharded checkpoint folder" in line and "not a file" not in line
    assert "mode sample, mode report and Trainer.load read it as it is" in line
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("command", ["sample", "report", "export"])
def test_a_run_folder_suggests_the_checkpoints_in_it(command, trained, tmp_path, capsys):
    src, _ = trained
    assert main([command, str(src)] + ([str(tmp_path / "x.pt")] if command == "export" else [])) == 2
    line = one_error_line(capsys.readouterr().err, command)
    assert "a folder, but not a sharded checkpoint folder" in line
    assert f"it holds the checkpoint {src / 'ckpt.pt'}: pass that" in line


def test_a_folder_of_runs_suggests_their_checkpoints(tmp_path, sharded, capsys):
    """``mode sample runs/compare``: the variants' checkpoints one level down (and sharded folders)."""
    for name in ("dense", "mod"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ckpt.pt").write_bytes(b"x")
    assert main(["sample", str(tmp_path)]) == 2
    line = one_error_line(capsys.readouterr().err, "sample")
    assert f"it holds the checkpoints {tmp_path / 'dense' / 'ckpt.pt'}, {tmp_path / 'mod' / 'ckpt.pt'}" in line
    assert line.endswith("pass one of them")
    assert main(["sample", str(sharded.parent)]) == 2  # a sharded checkpoint folder in it is suggested too
    assert f"it holds the checkpoint {sharded}: pass that" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- 8: conventions


def test_version(capsys, monkeypatch):
    from importlib import metadata

    try:
        installed = metadata.version("mode-torch")
    except metadata.PackageNotFoundError:
        installed = mode.__version__
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"mode {installed}\n"

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)  # not installed (a source tree on PYTHONPATH)
    assert cli.version() == mode.__version__


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_and_states_its_default():
    parser = cli.build_parser()
    subs = _subparsers(parser)
    assert sorted(subs) == sorted(COMMANDS)
    for name, p in [("mode", parser), *subs.items()]:
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            where = f"mode {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{where}: no help text"
            shown = formatter._get_help_string(action) % {"default": action.default}
            if action.option_strings and action.default is not None and action.default is not False:
                value = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
                assert f"default {value}" in shown, f"{where}: {shown!r}"
    sample = subs["sample"].format_help()
    assert "(default 200)" in sample and "(default 0.8)" in sample
    assert "no progress bar; the plain progress lines" in " ".join(subs["train"].format_help().split())


def test_the_defaults_the_help_states_are_the_real_ones():
    """The parser imports no torch, so it restates a few defaults of modules that do: they must agree."""
    from mode.experiments.compare import DEFAULT_RECIPE, ROUTED_BLOCKS, preset
    from mode.model import LMConfig
    from mode.parallel import command, process_group
    from mode.routing.mod_topk import GATES
    from mode.train import preempt

    assert cli.ROUTED_BLOCKS == ROUTED_BLOCKS and cli.GATES == GATES
    assert cli.RECIPE_DEFAULTS == dataclasses.asdict(DEFAULT_RECIPE)
    assert {k: getattr(LMConfig(), k) for k in command.MODEL_DEFAULTS} == command.MODEL_DEFAULTS
    assert (command.DEFAULT_GRACE_S, command.EXIT_PREEMPTED) == (preempt.DEFAULT_GRACE_S, preempt.EXIT_PREEMPTED)
    assert (command.TIMEOUT_ENV, command.DEFAULT_TIMEOUT_S) == (
        process_group.TIMEOUT_ENV,
        process_group.DEFAULT_TIMEOUT_S,
    )
    assert (preset(True).dense_steps, preset(False).dense_steps) == (150, 1200)  # compare --dense-steps' help
    train_help = " ".join(_subparsers(cli.build_parser())["train"].format_help().split())
    for option, field in (("steps", "steps"), ("lr", "lr"), ("batch-size", "batch_size"), ("top-k", "top_k")):
        parsed = command.build_parser().parse_args([])
        shown = []
        for name in command.PRESETS:
            parsed.preset = name
            model_cfg, train_cfg, _ = command.configs(parsed)
            value = getattr(train_cfg if hasattr(train_cfg, field) else model_cfg, field)
            shown.append(f"{name} {value:g}")
        assert f"the preset's: {', '.join(shown)}" in train_help, option


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_no_torch(command):
    """``mode --help`` and ``mode CMD --help``: argparse alone answers (-X importtime lists every import)."""
    res = run_python("", "-X", "importtime", "-m", "mode.cli", *([command] if command else []), "--help")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"usage: mode {command}".rstrip())
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time")}
    assert "mode" in imported and not {"torch", "numpy"} & imported


def test_the_package_loads_its_names_on_first_use():
    """``import mode`` imports no torch; the public names, ``dir`` and the extension points of mode.train that
    mode.parallel fills all work as when the package imported everything."""
    res = run_python(
        "import sys, mode\n"
        "assert 'torch' not in sys.modules\n"
        "assert set(mode.__all__) <= set(dir(mode)) and 'MoD' in mode.__all__\n"
        "from mode import MoELayer\n"
        "from mode.layers import MoD\n"
        "assert mode.MoD is MoD and mode.layers.MoELayer is MoELayer\n"
        "from mode.train.checkpoint import _folder_readers\n"
        "from mode.train.runtime import _mesh_runtimes\n"
        "import mode.parallel\n"
        "assert _folder_readers == [mode.parallel._read_sharded] and _mesh_runtimes == [mode.parallel._mesh_runtime]\n"
        "try:\n    mode.nope\nexcept AttributeError as e:\n    assert 'nope' in str(e)\n"
        "else:\n    raise SystemExit(1)\n"
        "print('ok')\n"
    )
    assert res.returncode == 0 and res.stdout == "ok\n", res.stderr[-3000:]


def test_the_train_banner_names_the_device_once(trained):
    _, printed = trained
    banner = printed.splitlines()[0]
    assert banner.startswith("mode train: one process on cpu: global batch")
    assert "device cpu" not in banner
