"""Checkpoints (mode.train.checkpoint): never run code from a file, clear errors on bad files, atomic writes that
survive a kill or a full disk, bad output folders refused before training. docs/checkpoints.md."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import corpus, model_cfg, stable, train_cfg  # the tiny model and data of the training tests

import mode.train
import mode.train.data
from mode.cli import main
from mode.train import Trainer, checkpoint
from mode.train.checkpoint import CheckpointError, WriteError, load_checkpoint, read_checkpoint

ROOT = Path(__file__).resolve().parents[2]


class RunsCode:
    """Unpickling this calls open(marker, "w"): the marker file appears if anything unpickles it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def trained(tmp_path: Path, steps: int = 2, **kw) -> Trainer:
    t = Trainer(model_cfg("dense", "mod"), train_cfg(steps=steps, **kw), corpus(), tmp_path / "run", progress=False)
    t.run()
    return t


@pytest.fixture
def evil(tmp_path):
    """A checkpoint with every real key, plus one object whose unpickling runs code (creates the marker)."""
    t = trained(tmp_path)
    state = load_checkpoint(t.ckpt_path, training=True)
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({**state, "payload": RunsCode(marker)}, path)
    return path, marker


def test_the_malicious_file_is_live(evil):
    """Control: an unsafe load of the file does run its code, so the tests below are not vacuous."""
    path, marker = evil
    torch.load(path, weights_only=False)
    assert marker.exists()


REFUSED = "refused: it holds objects other than tensors and plain data"


@pytest.mark.parametrize(
    "loader", ["read_checkpoint", "load_checkpoint", "checkpoint.load_model", "train.load_model", "Trainer.load"]
)
def test_python_loaders_refuse_a_malicious_pickle(evil, tmp_path, loader):
    path, marker = evil
    load = {
        "read_checkpoint": read_checkpoint,
        "load_checkpoint": load_checkpoint,
        "checkpoint.load_model": checkpoint.load_model,
        "train.load_model": mode.train.load_model,
        "Trainer.load": lambda p: Trainer(
            model_cfg("dense", "mod"), train_cfg(), corpus(), tmp_path / "t", progress=False
        ).load(p),
    }[loader]
    with pytest.raises(CheckpointError, match=REFUSED) as info:
        load(path)
    assert str(path) in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("command", ["sample", "report"])
def test_cli_refuses_a_malicious_pickle(evil, capsys, command):
    path, marker = evil
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mode {command}: error: checkpoint {str(path)!r}: {REFUSED}")
    assert not marker.exists()


def test_compare_resume_refuses_a_malicious_pickle(evil, tmp_path, capsys):
    from mode.experiments.compare import run_compare

    path, marker = evil
    data = tmp_path / "text.txt"
    data.write_text(Path(mode.train.data.__file__).read_text() * 3)
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--quick",
        "--data",
        str(data),
        "--dense-steps",
        "1",
        "--only",
        "dense",
        "--out",
        str(out),
        "--no-progress",
    ]
    run_compare(out, quick=True, data=str(data), dense_steps=1, only=["dense"], progress=False)
    (out / "dense" / "result.json").unlink()  # as if killed before the variant finished
    (out / "dense" / "ckpt.pt").write_bytes(path.read_bytes())
    capsys.readouterr()
    assert main(args) == 2
    assert f"checkpoint {str(out / 'dense' / 'ckpt.pt')!r}: {REFUSED}" in capsys.readouterr().err
    assert not marker.exists()


def test_train_resume_refuses_a_malicious_pickle(tmp_path, capsys):
    """mode train --resume (Trainer.load), one process."""
    out = tmp_path / "run"
    out.mkdir()
    marker = tmp_path / "marker"
    torch.save({"format": "mode-checkpoint", "version": 1, "payload": RunsCode(marker)}, out / "ckpt.pt")
    data = tmp_path / "text.txt"
    data.write_text(Path(mode.train.data.__file__).read_text() * 3)
    rc = main(
        [
            "train",
            "--preset",
            "quick",
            "--steps",
            "1",
            "--data",
            str(data),
            "--out",
            str(out),
            "--resume",
            "--device",
            "cpu",
            "--no-progress",
        ]
    )
    assert rc == 2
    assert f"checkpoint {str(out / 'ckpt.pt')!r}: {REFUSED}" in capsys.readouterr().err
    assert not marker.exists()


# ------------------------------------------------------------------------------ sharded checkpoints (DCP)


def sharded(t: Trainer, folder: Path) -> Path:
    """Save ``t`` as a sharded checkpoint from this one process (no process group); returns the save folder
    (``folder/step-*``)."""
    from mode.parallel.checkpoint import save_sharded

    meta = {**t._progress_state(), "routing_acc": t.routing.state_dict()}
    return save_sharded(folder, t.model, t.optimizer, meta)


def resum(folder: Path) -> None:
    """Rewrite the folder's SHA256SUMS to match its files as they are now: what someone who edits a folder by
    hand, or builds a hostile one, does too (so the checks behind the checksums are tested)."""
    from mode.parallel import dcp_safe

    sums = dcp_safe.read_manifest(folder, "test")
    (folder / dcp_safe.MANIFEST).write_text(
        dcp_safe.manifest_text({name: checkpoint.sha256_file(folder / name) for name in sums})
    )


def test_sharded_checkpoint_resumes_exactly_in_one_process(tmp_path):
    """Saved and resumed through DCP in one process: the uninterrupted run, bit for bit; export gives the
    single file the trainer itself writes (same tensors)."""
    from mode.parallel.checkpoint import export

    cfg = model_cfg("moe", "staged")
    a = Trainer(cfg, train_cfg(), corpus(), tmp_path / "a", progress=False)
    hist_a = a.run()
    b = Trainer(cfg, train_cfg(), corpus(), tmp_path / "b", progress=False)
    b.run(stop_step=6)
    folder = sharded(b, tmp_path / "b" / "ckpt")
    assert (folder / ".metadata").is_file() and (tmp_path / "b" / "ckpt" / "latest").is_file()
    b2 = Trainer(cfg, train_cfg(), corpus(), tmp_path / "b2", progress=False)
    b2.load(tmp_path / "b" / "ckpt")
    assert b2.step == 6
    assert stable(b2.run()) == stable(hist_a)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b2.model.named_parameters()):
        assert torch.equal(p, q), n
    single = export(tmp_path / "b" / "ckpt", tmp_path / "exported.pt")
    from_file, from_folder = load_checkpoint(single, training=True), load_checkpoint(tmp_path / "b" / "ckpt", True)
    written = load_checkpoint(b.ckpt_path, training=True)  # the trainer's own single file at step 6
    for key, v in written["model"].items():
        assert torch.equal(from_file["model"][key], v) and torch.equal(from_folder["model"][key], v), key
    for i, entry in written["optimizer"]["state"].items():
        for k, v in entry.items():
            assert torch.equal(from_file["optimizer"]["state"][i][k], v), (i, k)
    assert from_file["history"] == written["history"] and from_file["step"] == 6


@pytest.fixture
def sharded_ckpt(tmp_path):
    return sharded(trained(tmp_path), tmp_path / "sharded").parent


def test_sharded_checkpoint_with_a_malicious_metadata_pickle_is_refused(sharded_ckpt, tmp_path, capsys):
    """DCP reads .metadata with plain pickle: ours refuses anything but DCP's own metadata classes."""
    marker = tmp_path / "marker"
    folder = next(sharded_ckpt.glob("step-*"))
    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    resum(folder)  # a hostile folder comes with matching checksums
    with pytest.raises(CheckpointError, match="refused: its .metadata holds objects other than DCP metadata"):
        checkpoint.load_model(sharded_ckpt)
    for command in ("sample", "report"):
        assert main([command, str(sharded_ckpt)]) == 2
        assert "refused" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="refused"):
        Trainer(model_cfg("dense", "mod"), train_cfg(), corpus(), tmp_path / "t", progress=False).load(sharded_ckpt)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_with_a_pickled_item_is_refused(tmp_path):
    """DCP unpickles non-tensor items with weights_only=False: a mode checkpoint holds tensors only, and a
    folder with any other item is refused before it is read."""
    import torch.distributed.checkpoint as dcp

    from mode.parallel.checkpoint import LATEST

    t = trained(tmp_path)
    marker = tmp_path / "marker"
    folder = sharded(t, tmp_path / "sharded")
    root = folder.parent
    meta = (folder / "meta.json").read_text()
    state = {"model": t.model.state_dict(), "evil": RunsCode(marker)}
    evil = root / "step-99999999-evil"
    dcp.save(state, checkpoint_id=evil, no_dist=True)
    (evil / "meta.json").write_text(meta)
    (root / LATEST).write_text(evil.name)
    with pytest.raises(
        CheckpointError, match="item 'evil' is a BytesStorageMetadata: a mode checkpoint holds tensors only"
    ):
        checkpoint.load_model(root)
    assert not marker.exists()


@pytest.mark.parametrize(
    "how,msg",
    [
        ("no_latest", "a folder, but not a sharded checkpoint folder"),
        ("bad_latest", "latest names 'step-nope', which is not a save folder in it"),
        ("bad_meta", "meta.json is missing or not JSON"),
        ("wrong_shape", "model.embed.weight is torch.float32 (256, 16), this model needs torch.float32 (256, 8)"),
    ],
)
def test_bad_sharded_checkpoints_get_clear_errors(sharded_ckpt, how, msg):
    import json

    folder = next(sharded_ckpt.glob("step-*"))
    if how == "no_latest":
        (sharded_ckpt / "latest").unlink()
    elif how == "bad_latest":
        (sharded_ckpt / "latest").write_text("step-nope")
    elif how == "bad_meta":
        (folder / "meta.json").write_text("{not json")
    else:  # a config whose tensors do not fit the saved ones: refused before anything is allocated
        meta = json.loads((folder / "meta.json").read_text())
        meta["model_cfg"]["d_model"] = 8
        meta["model_cfg"]["d_hidden"] = 16
        (folder / "meta.json").write_text(json.dumps(meta))
    if how in ("bad_meta", "wrong_shape"):
        resum(folder)  # edited by hand, checksums included: the next checks still hold
    with pytest.raises(CheckpointError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        checkpoint.load_model(sharded_ckpt)


# ------------------------------------------------------------------------------------- invalid files


def _corrupt(tmp_path: Path, how: str) -> Path:
    good = trained(tmp_path).ckpt_path
    data = good.read_bytes()
    path = tmp_path / f"{how}.pt"
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":  # one bit of the model weights
        b = bytearray(data)
        b[len(b) // 2] ^= 0x10
        path.write_bytes(bytes(b))
    elif how == "garbage":
        path.write_bytes(b"not a checkpoint at all\n" * 10)
    elif how == "empty":
        path.write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "how,msg",
    [
        ("truncated", "truncated or not a checkpoint"),
        ("flipped", "fails its CRC32 check"),
        ("garbage", "truncated or not a checkpoint"),
        ("empty", "truncated or not a checkpoint"),
    ],
)
def test_damaged_files_get_a_clear_error(tmp_path, capsys, how, msg):
    path = _corrupt(tmp_path, how)
    for load in (load_checkpoint, checkpoint.load_model):
        with pytest.raises(CheckpointError, match=msg) as info:
            load(path)
        assert str(info.value).startswith(f"checkpoint {str(path)!r}: ")
    assert main(["sample", str(path)]) == 2
    assert msg in capsys.readouterr().err


def test_a_flipped_byte_in_any_member_of_a_file_is_a_checksum_error_naming_it(tmp_path):
    """The single file's checksums are the zip's CRC32s, one per member (the pickle, every tensor's storage,
    the version records): a flipped byte in any of them is a ChecksumError naming that member."""
    import struct
    import zipfile

    from mode.train.checkpoint import ChecksumError

    good = trained(tmp_path).ckpt_path
    data = good.read_bytes()
    with zipfile.ZipFile(good) as z:
        members = [m for m in z.infolist() if m.file_size > 0]
    assert len(members) > 5 and any(m.filename.endswith("data.pkl") for m in members)
    for m in members:
        name_len, extra_len = struct.unpack("<HH", data[m.header_offset + 26 : m.header_offset + 30])
        start = m.header_offset + 30 + name_len + extra_len  # the member's bytes (stored, not compressed)
        bad = bytearray(data)
        bad[start + m.compress_size // 2] ^= 0x01
        path = tmp_path / "flipped.pt"
        path.write_bytes(bytes(bad))
        with pytest.raises(ChecksumError, match=f"corrupt: '{m.filename}' inside it fails its CRC32 check"):
            load_checkpoint(path)


def _save_raw(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


def test_invalid_contents_get_a_clear_error(tmp_path):
    t = trained(tmp_path)
    state = load_checkpoint(t.ckpt_path, training=True)
    cases = {
        "a list": ([1, 2], "holds a list, not a checkpoint dict"),
        "other format": ({**state, "format": "something-else"}, "format='something-else': not a mode checkpoint"),
        "newer": ({**state, "version": checkpoint.VERSION + 1}, "written by a newer mode"),
        "no model": ({k: v for k, v in state.items() if k != "model"}, "the key 'model' is missing"),
        "bad step": ({**state, "step": "3"}, "step is a str, must be a int"),
        "unknown cfg field": (
            {**state, "model_cfg": {**state["model_cfg"], "d_modle": 3}},
            "model_cfg has unknown field(s) d_modle",
        ),
        "invalid cfg": (
            {**state, "model_cfg": {**state["model_cfg"], "capacity": 1.5}},
            "model_cfg is invalid: capacity=1.5: must be in (0, 1]",
        ),
        "wrong shape": (
            {**state, "model": {**state["model"], "embed.weight": torch.zeros(3, 3)}},
            "model['embed.weight'] is torch.float32 (3, 3), the model_cfg needs",
        ),
        "extra weight": ({**state, "model": {**state["model"], "x": torch.zeros(1)}}, "unexpected ['x']"),
        "bad rng": ({**state, "torch_rng": torch.zeros(3)}, "torch_rng: must be a CPU RNG state"),
    }
    for name, (obj, msg) in cases.items():
        path = _save_raw(tmp_path / f"{name}.pt", obj)
        with pytest.raises(
            CheckpointError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
        ):
            if name in ("wrong shape", "extra weight"):
                checkpoint.load_model(path)
            else:
                load_checkpoint(path, training=True)
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="a folder, but not a sharded checkpoint folder"):
        load_checkpoint(tmp_path)


def test_resume_with_another_model_names_the_field(tmp_path):
    t = trained(tmp_path)
    other = Trainer(model_cfg("dense", "mod", capacity=0.5), train_cfg(), corpus(), tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="its model has capacity=0.25, this run's has capacity=0.5"):
        other.load(t.ckpt_path)


def test_checkpoint_before_the_format_field_still_loads(tmp_path):
    """Version 0 (no format/version keys, as written before docs/checkpoints.md) loads safely."""
    t = trained(tmp_path)
    state = load_checkpoint(t.ckpt_path, training=True)
    legacy = _save_raw(tmp_path / "v0.pt", {k: v for k, v in state.items() if k not in ("format", "version")})
    model, _ = checkpoint.load_model(legacy)
    for k, v in t.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    t2 = Trainer(model_cfg("dense", "mod"), train_cfg(steps=2), corpus(), tmp_path / "t2", progress=False)
    t2.load(legacy)
    assert t2.step == 2


def test_saving_something_unloadable_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint\['x'\]: a RunsCode cannot be stored"):
        checkpoint.save_checkpoint(tmp_path / "c.pt", {"x": RunsCode(tmp_path / "m")})
    assert not (tmp_path / "c.pt").exists()
    # numpy scalars and tuple subclasses are stored as the plain values they stand for (loadable)
    import collections

    import numpy as np

    Pair = collections.namedtuple("Pair", "a b")
    checkpoint.save_checkpoint(
        tmp_path / "c.pt",
        {"history": [{"loss": np.float64(1.5), "n": np.int64(3)}], "pair": Pair(1, 2.0), "flag": np.bool_(True)},
    )
    state = read_checkpoint(tmp_path / "c.pt")
    assert state["history"] == [{"loss": 1.5, "n": 3}] and type(state["history"][0]["n"]) is int
    assert state["pair"] == (1, 2.0) and type(state["pair"]) is tuple and state["flag"] is True


# --------------------------------------------------------------------------------------- atomic writes


class FaultyOs:
    """``os`` as mode.train.checkpoint sees it, with failures injected: ``full(path)`` makes the write of a file
    opened at ``path`` run out of space half-way; ``denied(path)`` makes opening it fail."""

    def __init__(self, full=lambda path: False, denied=lambda path: False):
        self.full, self.denied, self._paths = full, denied, {}

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777):
        if self.denied(str(path)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        fd = os.open(path, flags, mode)
        self._paths[fd] = str(path)
        return fd

    def fdopen(self, fd, mode="r"):
        f = os.fdopen(fd, mode)
        return FullDisk(f) if self.full(self._paths.pop(fd, "")) else f


class FullDisk:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)


def _temps(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp"))


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    t = Trainer(model_cfg("dense", "mod"), train_cfg(steps=4, ckpt_every=1), corpus(), tmp_path, progress=False)
    t.run(stop_step=2)
    monkeypatch.setattr(checkpoint, "os", FaultyOs(full=lambda p: ".ckpt.pt." in p))
    with pytest.raises(
        WriteError,
        match=f"could not write {str(t.ckpt_path)!r}: No space left on device "
        r"\(the previous file, if any, is unchanged\)",
    ):
        t.run()  # the checkpoint at step 3 fails
    assert load_checkpoint(t.ckpt_path, training=True)["step"] == 2
    assert _temps(tmp_path) == []  # the half-written temporary file was removed


def test_full_disk_during_compare_is_a_clean_error(tmp_path, monkeypatch, capsys):
    data = tmp_path / "text.txt"
    data.write_text(Path(mode.train.data.__file__).read_text() * 3)
    out = tmp_path / "cmp"
    monkeypatch.setattr(checkpoint, "os", FaultyOs(full=lambda p: ".ckpt.pt." in p))
    rc = main(
        [
            "compare",
            "--quick",
            "--data",
            str(data),
            "--dense-steps",
            "1",
            "--only",
            "dense",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert f"mode compare: error: could not write {str(out / 'dense' / 'ckpt.pt')!r}: No space left" in err
    assert "rerun the same command to resume" in err
    assert not (out / "compare.json").exists() and not (out / "dense" / "result.json").exists()
    assert _temps(out / "dense") == []


def test_results_are_written_atomically(tmp_path, monkeypatch):
    """A failing write of compare.json leaves no compare.json (never a half report)."""
    from mode.experiments.compare import run_compare

    data = tmp_path / "text.txt"
    data.write_text(Path(mode.train.data.__file__).read_text() * 3)
    monkeypatch.setattr(checkpoint, "os", FaultyOs(full=lambda p: ".compare.json." in p))
    with pytest.raises(WriteError, match="compare.json"):
        run_compare(tmp_path / "cmp", quick=True, data=str(data), dense_steps=1, only=["dense"], progress=False)
    assert not (tmp_path / "cmp" / "compare.json").exists() and _temps(tmp_path / "cmp") == []
    assert (tmp_path / "cmp" / "dense" / "result.json").is_file()  # the finished variant is kept for a rerun


_KILLED_SAVE = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import torch
torch.set_num_threads(1)
from test_train import corpus, model_cfg, train_cfg
from mode.train import Trainer
Trainer(model_cfg("dense", "mod"), train_cfg(steps=4, ckpt_every=1), corpus(), {out!r}, progress=False).run()
"""


def _wait_for_temp(proc: subprocess.Popen, folder: Path, timeout: float = 60.0) -> Path:
    """The temporary file of a write the stall hook stopped half-way (once it has bytes in it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # the stall hook marks the stuck write (an ordinary write in progress also has a non-empty temp file)
        stalled = sorted(folder.glob(".*.tmp.stalled"))
        if stalled:
            return Path(str(stalled[0])[: -len(".stalled")])
        if proc.poll() is not None:
            raise AssertionError(
                f"the process ended (rc {proc.returncode}) before stalling:\n{proc.stderr.read().decode()}"
            )
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the write never stalled")


def test_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, checkpoint.STALL_ENV: "ckpt.pt@2"}  # the third save (step 3) stops half-way
    script = _KILLED_SAVE.format(tests=str(ROOT / "tests" / "train"), root=str(ROOT), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        tmp = _wait_for_temp(proc, out)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert load_checkpoint(out / "ckpt.pt", training=True)["step"] == 2  # the previous one, whole
    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint(tmp)  # the half-written file is what a non-atomic save would have left
    # resuming from it finishes the run exactly as an uninterrupted one, and the next save clears the debris
    resumed = Trainer(model_cfg("dense", "mod"), train_cfg(steps=4, ckpt_every=1), corpus(), out, progress=False)
    resumed.load()
    hist = resumed.run()
    ref = Trainer(model_cfg("dense", "mod"), train_cfg(steps=4), corpus(), tmp_path / "ref", progress=False).run()
    assert stable(hist) == stable(ref)
    assert _temps(out) == []


# -------------------------------------------------------------------------------- time-based checkpoints


def test_ckpt_every_s_checkpoints_on_the_clock(tmp_path, monkeypatch):
    saves = []
    real_save = Trainer.save
    monkeypatch.setattr(Trainer, "save", lambda self, path=None: saves.append(self.step) or real_save(self, path))
    Trainer(model_cfg("dense"), train_cfg(steps=4, ckpt_every_s=1e-9), corpus(), tmp_path / "a", progress=False).run()
    assert saves == [1, 2, 3, 4]  # due after every step; no second save at the end
    saves.clear()
    Trainer(model_cfg("dense"), train_cfg(steps=4, ckpt_every_s=3600.0), corpus(), tmp_path / "b", progress=False).run()
    assert saves == [4]
    with pytest.raises(ValueError, match="ckpt_every_s=0: must be finite and > 0"):
        train_cfg(ckpt_every_s=0)


# ------------------------------------------------------------------------------------ bad output folders


def test_output_folder_that_is_a_file(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"out_dir={str(afile)!r}: is a file, not a folder"):
        Trainer(model_cfg("dense"), train_cfg(), corpus(), afile, progress=False)
    assert main(["compare", "--quick", "--out", str(afile), "--no-progress"]) == 2
    assert f"mode compare: error: out={str(afile)!r}: is a file, not a folder" in capsys.readouterr().err
    inside = afile / "sub"
    assert main(["compare", "--quick", "--out", str(inside), "--no-progress"]) == 2
    assert "a part of the path is a file" in capsys.readouterr().err


def test_unwritable_output_folder_fails_before_training(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ro"
    monkeypatch.setattr(checkpoint, "os", FaultyOs(denied=lambda p: p.startswith(str(out))))
    started = []
    monkeypatch.setattr(Trainer, "run", lambda self, *a, **k: started.append(self.name))
    assert main(["compare", "--quick", "--out", str(out), "--dense-steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"mode compare: error: out={str(out)!r}: cannot write into the folder: Permission denied" in err
    assert started == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot write into the folder"):
            checkpoint.prepare_dir(out)
    finally:
        out.chmod(0o700)


# ------------------------------------------------------------------------------------- balancing biases


RECIPES = dict(num_noop=1, num_shared=1, router_options=dict(bias_balance=True, bias_rate=0.01, gate="sigmoid"))


@pytest.mark.parametrize("kind", ["file", "sharded"])
def test_the_balancing_bias_survives_a_checkpoint_and_resumes_exactly(tmp_path, kind):
    """The routers' bias_X is model state: saved in both checkpoint kinds, restored by load(), and a resumed
    run continues the uninterrupted one bit for bit (biases included)."""
    cfg = model_cfg("moe", "staged", "integrated", **RECIPES)
    a = Trainer(cfg, train_cfg(), corpus(), tmp_path / "a", progress=False)
    a.run()
    b = Trainer(cfg, train_cfg(), corpus(), tmp_path / "b", progress=False)
    b.run(stop_step=6)
    saved = [r.bias_X.clone() for r in b.bias_routers]
    assert len(saved) == 3 and all(v.abs().sum() > 0 for v in saved)
    path = b.ckpt_path if kind == "file" else sharded(b, tmp_path / "b" / "sharded").parent
    b2 = Trainer(cfg, train_cfg(), corpus(), tmp_path / "b2", progress=False)
    assert not any(r.bias_X.any() for r in b2.bias_routers)
    b2.load(path)
    for got, want in zip((r.bias_X for r in b2.bias_routers), saved, strict=True):
        assert torch.equal(got, want)
    assert stable(b2.run()) == stable(a.history)
    for r, q in zip(a.bias_routers, b2.bias_routers, strict=True):
        assert torch.equal(r.bias_X, q.bias_X)


# ------------------------------------------------------------------------------------------- GPU RNG states


class FakeCuda:
    """torch.cuda's RNG calls on a machine with ``n`` GPUs, this process on ``current``: records every read
    and write; ``get_rng_state_all`` (every GPU's state, read from every rank) must not be called."""

    def __init__(self, monkeypatch, n: int = 4, current: int = 2, initialized: bool = True):
        self.reads, self.writes = [], []
        for name, fn in {
            "is_available": lambda: True,
            "is_initialized": lambda: initialized,
            "device_count": lambda: n,
            "current_device": lambda: current,
            "get_rng_state": self.get,
            "set_rng_state": self.set,
            "get_rng_state_all": self.get_all,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    @staticmethod
    def state(i: int) -> torch.Tensor:
        return torch.full((16,), 10 + i, dtype=torch.uint8)

    def get(self, device):
        self.reads.append(device)
        return self.state(device)

    def set(self, state, device):
        self.writes.append((int(state[0]), device))

    def get_all(self):
        raise AssertionError("get_rng_state_all reads every GPU's state")


def test_only_this_processs_gpu_rng_state_is_saved(monkeypatch):
    cuda = FakeCuda(monkeypatch, n=4, current=2)
    state = checkpoint.rng_state()
    assert cuda.reads == [2] and len(state["cuda_rng"]) == 1 and torch.equal(state["cuda_rng"][0], cuda.state(2))
    assert torch.equal(state["torch_rng"], torch.get_rng_state())
    assert len(checkpoint.rng_state(torch.device("cuda", 3))["cuda_rng"]) == 1 and cuda.reads[-1] == 3
    with pytest.raises(ValueError, match=r"device=cpu: must be a CUDA device \(the GPU whose RNG state is saved\)"):
        checkpoint.rng_state("cpu")


def test_no_gpu_rng_state_where_cuda_was_never_initialised(monkeypatch):
    """A CPU run on a GPU machine: nothing of CUDA was drawn from, and saving does not start CUDA."""
    cuda = FakeCuda(monkeypatch, initialized=False)
    assert checkpoint.rng_state()["cuda_rng"] == [] and cuda.reads == []


def test_the_saved_gpu_state_goes_to_this_processs_gpu(monkeypatch):
    cuda = FakeCuda(monkeypatch, n=4, current=2)
    checkpoint.set_rng_state({"torch_rng": torch.get_rng_state(), "cuda_rng": [cuda.state(0)]})
    assert cuda.writes == [(10, 2)]  # the saving process's GPU (cuda:0 there) into this one's (cuda:2)
    checkpoint.set_rng_state({"torch_rng": torch.get_rng_state(), "cuda_rng": []})
    assert cuda.writes == [(10, 2)]


def test_an_older_checkpoint_with_every_gpus_state_restores_this_processs_own(tmp_path, monkeypatch):
    """Files written before held get_rng_state_all(): one state per GPU of the saving machine. Resuming
    restores the entry of this process's GPU; a file from a machine with fewer GPUs restores none (a
    warning), and still resumes."""
    t = trained(tmp_path)
    state = load_checkpoint(t.ckpt_path, training=True)
    old = tmp_path / "old.pt"
    checkpoint.save_checkpoint(old, {**state, "cuda_rng": [FakeCuda.state(i) for i in range(3)]})
    resumed, far = (
        Trainer(model_cfg("dense", "mod"), train_cfg(steps=2), corpus(), tmp_path / name, progress=False)
        for name in ("r", "f")
    )  # built before torch.cuda is faked
    cuda = FakeCuda(monkeypatch, n=4, current=1)
    resumed.load(old)
    assert resumed.step == 2 and cuda.writes == [(11, 1)]
    cuda = FakeCuda(monkeypatch, n=4, current=3)
    with pytest.warns(
        UserWarning,
        match=r"cuda_rng: the checkpoint holds the RNG states of 3 GPUs, none for "
        r"this process's GPU cuda:3: its generator is left as it is",
    ):
        far.load(old)
    assert far.step == 2 and cuda.writes == []
