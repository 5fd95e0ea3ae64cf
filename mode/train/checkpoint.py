"""Checkpoint files: one format, safe to open from anywhere, never half-written.

The format (version 1; docs/checkpoints.md)
    A zip-format ``torch.save`` file holding one dict of tensors and plain data only (dict, list, tuple,
    str, int, float, bool, None): ``format`` = "mode-checkpoint", ``version``, ``model_cfg`` (the
    ``LMConfig`` as a dict), ``model`` (the state dict), and for resuming ``train_cfg``, ``optimizer``,
    ``step``, ``flops``, ``tokens``, ``wall``, ``elapsed_s``, ``history``, ``sampler_rng``,
    ``torch_rng``, ``cuda_rng`` (a list: the state of the GPU the saving process trains on; empty where it
    never used CUDA; files written before held one state per visible GPU) and ``routing_acc``; ``data``
    (``mode.train.data.Corpus.record``: bytes or token shards, and the tokenizer that decodes them).

Sharded folders
    Training on a device mesh writes a folder instead (``mode.parallel.checkpoint``: DCP shards plus
    ``meta.json``). This module knows files only; the folder format registers its reader here
    (``register_folder_reader``; importing ``mode.parallel`` does it), so ``load_checkpoint`` and
    ``load_model`` read such a folder too, in this process, as the same dict with full tensors, under the
    same rule: nothing in it is unpickled except DCP's own metadata classes and tensors.

Reading never runs code from the file
    ``torch.load(weights_only=True)`` refuses every pickled object other than tensors and plain data, so a
    file built to run a command when unpickled is rejected before anything in it runs. The zip's CRC32s
    are checked first (truncation and flipped bits are caught, the latter as ``ChecksumError``; torch.load
    alone reads neither), then the
    structure: a file that is not a valid checkpoint raises ``CheckpointError`` (a ``ValueError``) naming
    the file and what is wrong. The model is rebuilt from the validated ``LMConfig`` on the meta device and
    its keys and shapes compared with the file before any memory is allocated for it.

Writing is atomic
    ``atomic_write`` writes a temporary file in the same folder, flushes and fsyncs it, renames it over
    the target and fsyncs the folder: the previous file stays whole until the new one is complete. A
    failed write (a full disk, a read-only folder) raises ``WriteError`` (an ``OSError``) that names the
    file and says the previous one is unchanged; a killed process leaves at most a ``.NAME.*.tmp`` file,
    removed by the next write of NAME.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import numbers
import os
import pickle
import secrets
import shutil
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mode.model import LM, LMConfig

FORMAT = "mode-checkpoint"
VERSION = 1  # the newest version this code writes and reads; files without "format" are version 0

STALL_ENV = "MODE_TEST_STALL_WRITE"  # test hook: "<path suffix>@<n>", see atomic_write

# key -> accepted types, checked on load (bool is excluded from the numbers separately)
_MODEL_KEYS = {"model_cfg": dict, "model": dict}
_TRAIN_KEYS = {
    "train_cfg": dict,
    "optimizer": dict,
    "step": int,
    "flops": (int, float),
    "tokens": int,
    "wall": (int, float),
    "history": list,
    "sampler_rng": Tensor,
    "torch_rng": Tensor,
}
_OPTIONAL_KEYS = {
    "step": int,
    "cuda_rng": list,
    "routing_acc": dict,
    "elapsed_s": (int, float),
    "expert_parallel": dict,
    "parallel": dict,
    "data": dict,
}
_PLAIN = (str, int, float, bool, type(None))


class CheckpointError(ValueError):
    """A file that is not a valid checkpoint: unreadable, truncated, corrupt, unsafe, or of the wrong shape."""


class ChecksumError(CheckpointError):
    """A file whose bytes changed since it was saved: a zip member failing its CRC32 (single files), or a
    sharded checkpoint's file whose SHA-256 differs from its ``SHA256SUMS`` line (``mode.parallel.dcp_safe``)."""


class WriteError(OSError):
    """A file could not be written (full disk, unwritable folder, ...); the previous file is unchanged."""


class OutputExistsError(ValueError):
    """An output path that already holds a file or folder the command did not write in this run: the commands
    never replace one unless told to (``--force``, or resuming their own run)."""


def refuse_existing(paths, hint: str = "") -> None:
    """``OutputExistsError`` naming the first of ``paths`` that exists (a file, a folder or a link) and how many
    more do, saying to pass ``--force`` (after ``hint``, another way out); nothing when none exists."""
    found = [Path(p) for p in paths if os.path.lexists(p)]
    if found:
        more = f" (and {len(found) - 1} more of this command's outputs)" if len(found) > 1 else ""
        raise OutputExistsError(
            f"{str(found[0])!r} already exists{more}; {hint}pass --force to replace "
            f"{'them' if len(found) > 1 else 'it'}"
        )


# ---------------------------------------------------------------------------------------------- writing


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a folder; the rename is then as durable as the OS makes it
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _stall_point(path: Path) -> bool:
    """Test hook: ``MODE_TEST_STALL_WRITE="ckpt.pt@2"`` makes the third write (0-based 2) of a file whose
    path ends with ``ckpt.pt`` stop half-way (half the bytes written and flushed) and sleep, so that a test
    can kill the process in the middle of a write."""
    spec = os.environ.get(STALL_ENV)
    if not spec:
        return False
    suffix, _, n = spec.rpartition("@")
    if not str(path).endswith(suffix):
        return False
    seen = _stall_counts.get(suffix, 0)
    _stall_counts[suffix] = seen + 1
    return seen == int(n)


_stall_counts: dict[str, int] = {}  # test hook only: writes seen per suffix in this process


def atomic_write(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` by ``data`` atomically: temp file in the same folder, fsync, rename, fsync folder."""
    path = Path(path)
    folder = path.parent
    for stale in folder.glob(f".{path.name}.*.tmp*"):  # left by a process killed while writing (and test markers)
        try:
            stale.unlink()
        except OSError:
            pass
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666: the umask applies, as for open()
        with os.fdopen(fd, "wb") as f:
            half = len(data) // 2 if _stall_point(path) else 0
            if half:
                f.write(data[:half])
                f.flush()
                Path(f"{tmp}.stalled").touch()  # tells the test this write (not an earlier one) is stuck here
                time.sleep(3600)  # killed here by the test
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise WriteError(
            f"could not write {str(path)!r}: {e.strerror or e} (the previous file, if any, is unchanged)"
        ) from e
    _fsync_dir(folder)  # the rename itself survives a power cut
    return path


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex), read 1 MiB at a time. hashlib releases the GIL on large buffers,
    so a background save that hashes its files stays in the background."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, text.encode("utf-8"))


def replace_dir(tmp: str | Path, path: str | Path) -> Path:
    """Put the complete folder ``tmp`` at ``path`` (a sibling of it), replacing any folder there: the old one
    is renamed aside, ``tmp`` renamed in, the parent fsynced, then the old one removed. ``path`` names the old
    folder or the new one at every moment, never a mix (a crash between the two renames leaves the old one
    aside, under a name starting with ``.<name>.old-``)."""
    tmp, path = Path(tmp), Path(path)
    old = path.parent / f".{path.name}.old-{secrets.token_hex(4)}" if path.exists() else None
    if old is not None:
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def prepare_dir(path: str | os.PathLike, name: str = "out") -> Path:
    """Create folder ``path`` if needed and prove that a file can be written in it, or raise a ValueError
    naming ``name`` (the argument it came from) and the reason. Call before any training starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}={str(path)!r}: is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{name}={str(path)!r}: cannot create the folder: a part of the path is a file") from None
    except OSError as e:
        raise ValueError(f"{name}={str(path)!r}: cannot create the folder: {e.strerror or e}") from e
    probe = path / f".write-test.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"mode")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"{name}={str(path)!r}: cannot write into the folder: {e.strerror or e}") from e
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return path


def _plain(value, where: str):
    """``value`` as what ``torch.load(weights_only=True)`` reads back: tensors and plain data. Numbers of
    other types (numpy scalars) become Python numbers and tuple or dict subclasses plain ones; anything
    else is a TypeError. Returns ``value`` itself when nothing needed converting (state dicts keep their
    OrderedDict and its metadata)."""
    if isinstance(value, Tensor):
        if type(value) not in (Tensor, torch.nn.Parameter):
            raise TypeError(f"{where}: a {type(value).__name__} cannot be stored (plain tensors only)")
        return value
    if type(value) in _PLAIN:
        return value
    if isinstance(value, dict):
        out, changed = {}, type(value) not in (dict, OrderedDict)
        for k, v in value.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: key {k!r} of type {type(k).__name__} (str or int keys only)")
            out[k] = _plain(v, f"{where}[{k!r}]")
            changed = changed or out[k] is not v
        return out if changed else value
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if type(value) in (list, tuple) and all(a is b for a, b in zip(items, value)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, np.generic):
        return _plain(value.item(), where)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return str(value)
    raise TypeError(f"{where}: a {type(value).__name__} cannot be stored (tensors and plain data only)")


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write ``state`` (tensors and plain data) as a version-``VERSION`` checkpoint, atomically."""
    plain = _plain({"format": FORMAT, "version": VERSION, **state}, "checkpoint")
    buf = io.BytesIO()
    torch.save(plain, buf)
    return atomic_write(path, buf.getvalue())


def _cuda_index(device: torch.device | int | None) -> int:
    """The GPU a process trains on: ``device`` (a CUDA device or its index), else the current one (under
    torchrun each rank's own, ``mode.parallel.process_group``)."""
    if device is None:
        return torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}: must be a CUDA device (the GPU whose RNG state is saved)")
    return device.index if device.index is not None else torch.cuda.current_device()


def rng_state(device: torch.device | int | None = None) -> dict:
    """Every RNG a training step draws from, besides the data sampler's own generator: the CPU generator and
    the generator of the GPU this process trains on (``device``; default: the current GPU). Only that one:
    every rank saves its own and reads no other GPU's. ``cuda_rng`` is empty where this process never
    initialised CUDA (its GPU generators were never drawn from; nor is CUDA started here to read them)."""
    cuda = [torch.cuda.get_rng_state(_cuda_index(device))] if torch.cuda.is_initialized() else []
    return {"torch_rng": torch.get_rng_state(), "cuda_rng": cuda}


def set_rng_state(state: dict, device: torch.device | int | None = None) -> None:
    """Restore what ``rng_state`` saved: the CPU generator, and the saved GPU state into this process's GPU
    (``device``; default: the current GPU). A file from before held one state per visible GPU: the entry of
    this process's GPU is restored (there is none when the file comes from a machine with fewer GPUs: a
    warning, and GPU random draws are not the saved run's)."""
    torch.set_rng_state(state["torch_rng"])
    cuda = state.get("cuda_rng") or []
    if not cuda or not torch.cuda.is_available():
        return
    index = _cuda_index(device)
    if len(cuda) == 1:
        saved = cuda[0]
    elif index < len(cuda):  # the older format: one state per GPU of the saving machine
        saved = cuda[index]
    else:
        warnings.warn(
            f"cuda_rng: the checkpoint holds the RNG states of {len(cuda)} GPUs, none for this "
            f"process's GPU cuda:{index}: its generator is left as it is",
            stacklevel=2,
        )
        return
    torch.cuda.set_rng_state(saved, index)


# ---------------------------------------------------------------------------------------------- reading


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def read_checkpoint(path: str | Path) -> dict:
    """The raw dict of a checkpoint file, read without running any code from it; checks the file (zip
    CRCs), the format and the version, not the contents (``load_checkpoint`` does)."""
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    if not path.exists():
        raise CheckpointError(f"{where}: no such file")
    if not path.is_file():
        raise CheckpointError(f"{where}: not a file")
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every member and checks its CRC32
    except zipfile.BadZipFile as e:
        raise CheckpointError(
            f"{where}: truncated or not a checkpoint (not a complete torch zip file: {_first_line(e)})"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{where}: cannot be read: {e.strerror or e}") from e
    if bad is not None:
        raise ChecksumError(f"{where}: corrupt: {bad!r} inside it fails its CRC32 check")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{where}: refused: it holds objects other than tensors and plain data, and "
            f"loading them could run code from the file ({_first_line(e)})"
        ) from None
    except Exception as e:  # noqa: BLE001 - whatever torch raises on a damaged archive becomes one clear error
        raise CheckpointError(
            f"{where}: not a readable torch checkpoint ({type(e).__name__}: {_first_line(e)})"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: holds a {type(state).__name__}, not a checkpoint dict")
    fmt = state.get("format")
    if fmt is None:  # before version 1: the same dict without format and version
        version = 0
    elif fmt != FORMAT:
        raise CheckpointError(f"{where}: format={fmt!r}: not a mode checkpoint (expected {FORMAT!r})")
    else:
        version = state.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise CheckpointError(f"{where}: version={version!r}: must be an int >= 1")
        if version > VERSION:
            raise CheckpointError(
                f"{where}: version={version}: written by a newer mode; this one reads versions up to {VERSION}"
            )
    return state


def _check_keys(state: dict, spec: dict, where: str, required: bool) -> None:
    for key, types in spec.items():
        if key not in state:
            if required:
                raise CheckpointError(f"{where}: the key {key!r} is missing")
            continue
        v = state[key]
        if isinstance(v, bool) or not isinstance(v, types):
            names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            raise CheckpointError(f"{where}: {key} is a {type(v).__name__}, must be a {names}")


FolderReader = Callable[..., dict]  # (path, training=...) -> the single-file checkpoint dict
_folder_readers: list[FolderReader] = []  # mode.parallel registers the sharded format's reader on import


def register_folder_reader(reader: FolderReader) -> None:
    """Let ``load_checkpoint`` read checkpoint folders with ``reader(path, training=...)``, which returns the
    dict of the single-file format (``mode.parallel`` registers ``read_sharded``; the same reader twice
    changes nothing)."""
    if reader not in _folder_readers:
        _folder_readers.append(reader)


def _read_folder(path: str | Path, training: bool) -> dict:
    if not _folder_readers:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: a folder, and no reader of checkpoint folders is "
            "registered; sharded checkpoints are read by mode.parallel: import it first"
        )
    return _folder_readers[-1](path, training=training)


def load_checkpoint(path: str | Path, training: bool = False) -> dict:
    """Read and validate a checkpoint: the model part always, the training state when ``training``
    (resuming). ``path`` is a single file, or a sharded checkpoint folder (``mode.parallel.checkpoint``,
    read in this process as the same dict, full tensors). Raises ``CheckpointError`` naming the file and
    the problem."""
    state = _read_folder(path, training) if Path(path).is_dir() else read_checkpoint(path)
    check_state(state, f"checkpoint {str(path)!r}", training)
    return state


def check_state(state: dict, where: str, training: bool, tensors: bool = True) -> None:
    """The structure of a checkpoint dict (see the module docstring); ``tensors=False`` checks everything
    but the model and optimizer tensors (a sharded checkpoint's ``meta.json``, before its tensors load)."""
    _check_keys(state, _MODEL_KEYS if tensors else {"model_cfg": dict}, where, required=True)
    _check_keys(
        state,
        _TRAIN_KEYS if tensors else {k: v for k, v in _TRAIN_KEYS.items() if k != "optimizer"},
        where,
        required=training,
    )
    _check_keys(state, _OPTIONAL_KEYS, where, required=False)
    if tensors:
        bad = [k for k, v in state["model"].items() if not isinstance(k, str) or not isinstance(v, Tensor)]
        if bad:
            raise CheckpointError(f"{where}: model[{bad[0]!r}]: the model state must map names to tensors")
    model_config_from_dict(state["model_cfg"], where)  # validates; the caller rebuilds what it needs
    if training:
        size = torch.get_rng_state().numel()  # both are CPU generators' states
        for key in ("sampler_rng", "torch_rng"):
            if state[key].dtype != torch.uint8 or tuple(state[key].shape) != (size,):
                raise CheckpointError(
                    f"{where}: {key}: must be a CPU RNG state (uint8, shape ({size},)), got "
                    f"{state[key].dtype} of shape {tuple(state[key].shape)}"
                )
        bad = [i for i, r in enumerate(state.get("cuda_rng", [])) if not isinstance(r, Tensor)]
        if bad:
            raise CheckpointError(f"{where}: cuda_rng[{bad[0]}]: must be a tensor (a GPU's RNG state)")
        if any(not isinstance(r, dict) for r in state["history"]):
            raise CheckpointError(f"{where}: history: must be a list of dicts (the logged records)")
        if state["step"] < 0:
            raise CheckpointError(f"{where}: step={state['step']}: must be >= 0")


def model_config_from_dict(d: object, where: str = "checkpoint") -> LMConfig:
    """Rebuild and validate the ``LMConfig`` stored as a dict (unknown fields are an error; fields added
    since the file was written take their defaults)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: model_cfg is a {type(d).__name__}, must be a dict")
    known = {f.name for f in dataclasses.fields(LMConfig)}
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise CheckpointError(
            f"{where}: model_cfg has unknown field(s) {', '.join(unknown)} (written by another version of mode?)"
        )
    try:
        return LMConfig(**d)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: model_cfg is invalid: {e}") from None


def check_model_state(model_sd: dict, file_sd: dict, where: str) -> None:
    """The file's model state has exactly the model's keys, shapes and dtypes (a clear error, not
    ``load_state_dict``'s)."""
    missing = [k for k in model_sd if k not in file_sd]
    unexpected = [k for k in file_sd if k not in model_sd]
    if missing or unexpected:
        what = (
            (f"missing {missing[:3]}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {unexpected[:3]}" if unexpected else "")
        )
        raise CheckpointError(f"{where}: its model state does not fit its model_cfg: {what}")
    for k, v in model_sd.items():
        if file_sd[k].shape != v.shape or file_sd[k].dtype != v.dtype:
            raise CheckpointError(
                f"{where}: model[{k!r}] is {file_sd[k].dtype} {tuple(file_sd[k].shape)}, the "
                f"model_cfg needs {v.dtype} {tuple(v.shape)}"
            )


def load_model(path: str | Path) -> tuple[LM, dict]:
    """Rebuild the LM stored in a checkpoint (a single file or a sharded folder; for sampling, reports,
    evaluation); returns it (on the CPU, in training mode) with the validated checkpoint dict."""
    state = load_checkpoint(path)
    where = f"checkpoint {str(path)!r}"
    cfg = model_config_from_dict(state["model_cfg"], where)
    # a float64 run (Trainer(dtype=torch.float64)) loads as it trained; every other in float32
    floating = {t.dtype for t in state["model"].values() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    dtype = torch.float64 if floating == {torch.float64} else torch.float32
    with torch.device("meta"):  # shapes only: a file whose tensors do not fit its config allocates nothing
        check_model_state(LM(cfg).to(dtype).state_dict(), state["model"], where)
    with torch.device("cpu"):  # on the CPU whatever the default device (the caller moves it)
        model = LM(cfg).to(dtype)
    model.load_state_dict(state["model"])
    return model, state
