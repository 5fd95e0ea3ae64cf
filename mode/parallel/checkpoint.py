"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards,
and a checkpoint saved on one layout loads on any other (any world size, any (dp, ep), one process).

The folder (docs/checkpoints.md)
    ``CKPT/latest``                  the name of the newest complete save, written atomically *last*
    ``CKPT/step-NNNNNNNN-XXXX/``     one save: DCP's ``.metadata`` and ``__R_0.distcp`` shard files, and
                                     ``meta.json`` (everything that is not a tensor: the model and training
                                     configs, step, FLOPs, history, the RNG states, the routing sums)
    DCP state: ``model.<name>`` (the state dict: every tensor at its *global* shape, expert tensors with
    all E rows) and ``optimizer.<name>.<key>`` (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq`` of each
    parameter, by parameter name).

Atomic: a save goes to a fresh ``step-*`` folder; ``latest`` is replaced (``mode.train.checkpoint.atomic_write``)
only when every rank's shards, ``meta.json`` and ``SHA256SUMS`` are complete, then older folders are removed
but the ``keep`` newest complete ones (``retain``; ``mode train --keep K``). A run killed while saving leaves
the previous save in place (and a partial folder, without ``SHA256SUMS``, that the next save removes).
``saves`` lists a checkpoint folder's saves newest first, ``is_complete`` tells a finished one:
``mode.parallel.resume`` falls back through them when the newest fails its checksums.

In the background: ``save_sharded_async`` copies this rank's shards to CPU memory (the only part the training
loop waits for), then ``dcp.async_save`` writes them and a thread finishes the save (sums, ``meta.json``,
``latest``), all on a process group of its own (gloo), so its collectives never interleave with training's.
``PendingSave.wait()`` returns when ``latest`` names it; start no other save, and end no process, before.

Safe to load, and checked: DCP would run code from a hostile folder; every read here goes through
``mode.parallel.dcp_safe.SafeReader``, which unpickles only DCP's own metadata, lets DCP read tensors only,
and checks each file against ``SHA256SUMS`` before using it (``mode.train.checkpoint.ChecksumError`` names
a file that changed). ``meta.json`` is JSON; both are validated like a single-file checkpoint
(``mode.train.checkpoint``) before any model is built.

Single files: ``read_sharded(folder)`` returns the dict of the single-file format (full tensors,
index-keyed AdamW state) in one process, with no process group. It is the folder reader registered with
``mode.train.checkpoint`` (``mode.parallel.register``), so ``load_checkpoint`` and ``load_model`` (hence
``mode sample`` and ``mode report``) read either kind; ``export`` writes a folder as one file.
``load_full`` distributes a single-file checkpoint's tensors into a parallelized model
(import).
"""

from __future__ import annotations

import json
import secrets
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, distribute_tensor

from mode.model import LM
from mode.parallel import dcp_safe
from mode.parallel.dcp_safe import ChecksumWriter, SafeReader
from mode.train import checkpoint, faults
from mode.train.config import TrainConfig
from mode.train.optim import build_optimizer

FORMAT = "mode-sharded-checkpoint"
VERSION = 1
LATEST = "latest"
META = "meta.json"
STEP_PREFIX = "step-"
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # the AdamW state of one parameter (amsgrad off)


# ---------------------------------------------------------------------------------------------- reading


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint folder (with ``latest``) or one of its save folders."""
    path = Path(path)
    return path.is_dir() and ((path / LATEST).is_file() or (path / ".metadata").is_file())


def _checkpoints_inside(folder: Path, limit: int = 4) -> str:
    """'; it holds the checkpoint(s) ...: pass one of them' for the checkpoint files and sharded folders in
    ``folder`` (else in its subfolders, e.g. runs/compare/<variant>/ckpt.pt), '' when there are none."""

    def found_in(d: Path) -> list[Path]:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            return []
        files = [p for p in entries if p.suffix == ".pt" and p.is_file()]
        files.sort(key=lambda p: (p.name != "ckpt.pt", p.name))  # the newest one first
        return files + [p for p in entries if is_sharded(p)]

    found = found_in(folder)
    if not found:
        try:
            subs = sorted(p for p in folder.iterdir() if p.is_dir())
        except OSError:
            subs = []
        found = [p for d in subs for p in found_in(d)]
    if not found:
        return ""
    more = f" (and {len(found) - limit} more)" if len(found) > limit else ""
    names = ", ".join(str(p) for p in found[:limit])
    return f"; it holds the checkpoint{'s' if len(found) > 1 else ''} {names}{more}: pass " + (
        "that" if len(found) == 1 else "one of them"
    )


def save_folder(path: str | Path) -> Path:
    """The save folder a checkpoint path names: ``path/<latest>``, or ``path`` itself if it is one."""
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    if not path.exists():
        raise checkpoint.CheckpointError(f"{where}: no such file or folder")
    if not path.is_dir():
        raise checkpoint.CheckpointError(f"{where}: not a sharded checkpoint folder (a file)")
    if (path / ".metadata").is_file():
        return path
    if not (path / LATEST).is_file():
        raise checkpoint.CheckpointError(
            f"{where}: a folder, but not a sharded checkpoint folder (no {LATEST!r} "
            f"file and no DCP .metadata in it){_checkpoints_inside(path)}"
        )
    name = (path / LATEST).read_text().strip()
    if not name.startswith(STEP_PREFIX) or "/" in name or "\\" in name or not (path / name).is_dir():
        raise checkpoint.CheckpointError(f"{where}: {LATEST} names {name!r}, which is not a save folder in it")
    return path / name


def read_meta(folder: Path, where: str, training: bool, reader: SafeReader | None = None) -> dict:
    """``meta.json`` of a save folder as the single-file checkpoint dict minus the tensors of the model and
    the optimizer (RNG states and routing sums as tensors again), validated (``mode.train.checkpoint.check_state``;
    ``training``: the state for resuming must be complete); checked against ``SHA256SUMS`` first (``reader``)."""
    if reader is not None:
        reader.verify(META)
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise checkpoint.CheckpointError(f"{where}: {META} is missing or not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise checkpoint.CheckpointError(f"{where}: {META}: format must be {FORMAT!r}")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
        raise checkpoint.CheckpointError(f"{where}: {META}: version={version!r}: this mode reads 1 to {VERSION}")
    state = {k: v for k, v in meta.items() if k not in ("format", "version")}
    try:
        for key in ("sampler_rng", "torch_rng"):
            if key in state:
                state[key] = torch.tensor(state[key], dtype=torch.uint8, device="cpu")  # RNG states live on the host
        if "cuda_rng" in state:
            state["cuda_rng"] = [torch.tensor(r, dtype=torch.uint8, device="cpu") for r in state["cuda_rng"]]
        if "routing_acc" in state:
            acc = state["routing_acc"]
            state["routing_acc"] = {
                "sums": {k: torch.tensor(v, dtype=torch.float64, device="cpu") for k, v in acc.get("sums", {}).items()},
                "layer_kinds": acc.get("layer_kinds"),
            }
    except (TypeError, ValueError, RuntimeError, AttributeError, OverflowError) as e:
        raise checkpoint.CheckpointError(f"{where}: {META}: a malformed RNG state or routing sum ({e})") from None
    checkpoint.check_state(state, where, training, tensors=False)
    return state


def _stored_dtype(md: dcp_metadata.Metadata) -> torch.dtype:
    """float64 when every floating model tensor was saved in float64 (a ``Trainer(dtype=torch.float64)`` run),
    else float32, the dtype ``LM`` is built in."""
    dtypes = {
        item.properties.dtype
        for k, item in md.state_dict_metadata.items()
        if k.startswith("model.")
        and isinstance(item, dcp_metadata.TensorStorageMetadata)
        and item.properties.dtype.is_floating_point
    }
    return torch.float64 if dtypes == {torch.float64} else torch.float32


def _check_shapes(expected: dict[str, Tensor], md: dcp_metadata.Metadata, prefix: str, where: str) -> None:
    """Every ``expected`` tensor is in the checkpoint under ``prefix + name`` with the same global shape and
    dtype (DTensors: their global shape)."""
    items = md.state_dict_metadata
    for name, t in expected.items():
        item = items.get(prefix + name)
        if item is None:
            raise checkpoint.CheckpointError(f"{where}: {prefix}{name} is missing")
        if not isinstance(item, dcp_metadata.TensorStorageMetadata):  # saved as bytes: an object, not a tensor
            raise checkpoint.CheckpointError(f"{where}: {prefix}{name} is not a tensor in the checkpoint")
        if tuple(item.size) != tuple(t.shape) or item.properties.dtype != t.dtype:
            raise checkpoint.CheckpointError(
                f"{where}: {prefix}{name} is {item.properties.dtype} {tuple(item.size)}, this model needs "
                f"{t.dtype} {tuple(t.shape)}"
            )


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}  # tied weights: their first name


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters in the order of ``optimizer.state_dict()``'s integer keys."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_skeleton(model: nn.Module, optimizer: torch.optim.Optimizer, md: dcp_metadata.Metadata) -> dict:
    """name -> {step, exp_avg, exp_avg_sq} for every parameter whose state the checkpoint holds, as empty
    tensors laid out like the parameter (DTensors stay DTensors), for DCP to load into."""
    names = _param_names(model)
    items = md.state_dict_metadata
    out = {}
    for p in _optimizer_params(optimizer):
        name = names[id(p)]
        if f"optimizer.{name}.exp_avg" not in items:
            continue  # never stepped (no gradient yet): no state, as in the saving run
        out[name] = {
            "step": torch.zeros((), dtype=torch.float32, device="cpu"),  # non-capturable AdamW's
            "exp_avg": torch.zeros_like(p.detach()),
            "exp_avg_sq": torch.zeros_like(p.detach()),
        }
    return out


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, by_name: dict) -> None:
    names = _param_names(model)
    sd = optimizer.state_dict()
    sd["state"] = {
        i: by_name[names[id(p)]] for i, p in enumerate(_optimizer_params(optimizer)) if names[id(p)] in by_name
    }
    optimizer.load_state_dict(sd)


def load_sharded(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, check=None, local: bool = False
) -> dict:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``), each rank reading only the chunks of its
    own shards (and verifying the files it reads against ``SHA256SUMS``); returns the rest of the state
    (``read_meta``), which ``check(state)`` sees first (it may raise). Every rank of the model's mesh calls
    it. ``local``: this process alone loads a plain model (no collectives, whether or not a process group
    exists)."""
    folder = save_folder(path)
    where = f"checkpoint {str(path)!r}"
    reader = SafeReader(folder, where)
    meta = read_meta(folder, where, optimizer is not None, reader)
    if check is not None:
        check(meta)
    _load_tensors(reader, where, model, optimizer, local)
    return meta


def _load_tensors(
    reader: SafeReader, where: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, local: bool
) -> None:
    md = reader.read_metadata()
    model_sd = model.state_dict()
    _check_shapes(model_sd, md, "model.", where)
    state: dict = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = _optimizer_skeleton(model, optimizer, md)
        for name, entry in state["optimizer"].items():
            _check_shapes({k: entry[k] for k in ("exp_avg", "exp_avg_sq")}, md, f"optimizer.{name}.", where)
    dcp_safe.load(state, reader, no_dist=local)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        _load_optimizer(model, optimizer, state["optimizer"])


def read_sharded(path: str | Path, training: bool = False) -> dict:
    """A sharded checkpoint as the single-file checkpoint dict (full tensors; with ``training``, the AdamW
    state keyed like ``optimizer.state_dict()``), in this process, with no process group needed."""
    folder = save_folder(path)
    where = f"checkpoint {str(path)!r}"
    reader = SafeReader(folder, where)
    meta = read_meta(folder, where, training, reader)
    cfg = checkpoint.model_config_from_dict(meta.get("model_cfg"), where)
    md = reader.read_metadata()
    dtype = _stored_dtype(md)
    with torch.device("meta"):  # shapes first: a checkpoint that does not fit its config allocates nothing
        _check_shapes(LM(cfg).to(dtype).state_dict(), md, "model.", where)
    with torch.device("cpu"):  # on the host, as torch.load(map_location="cpu") gives a single file's tensors
        model = LM(cfg).to(dtype)
        optimizer = None
        if training:
            try:
                tcfg = TrainConfig(**meta.get("train_cfg", {}))
            except (TypeError, ValueError) as e:
                raise checkpoint.CheckpointError(f"{where}: train_cfg is invalid: {e}") from None
            optimizer = build_optimizer(model, tcfg)
        _load_tensors(reader, where, model, optimizer, local=True)
    state = dict(meta, model={k: v.detach().clone() for k, v in model.state_dict().items()})
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    return state


def export(path: str | Path, out_file: str | Path, overwrite: bool = False) -> Path:
    """Write a sharded checkpoint as one single-file checkpoint (``mode.train.checkpoint``'s format), atomically.
    ``out_file`` must not exist unless ``overwrite`` (``checkpoint.OutputExistsError``, a ValueError)."""
    if Path(path).is_file():
        raise checkpoint.CheckpointError(
            f"checkpoint {str(path)!r}: a file; export reads a sharded checkpoint folder (what mode train on "
            "several processes writes, e.g. runs/train/ckpt) and writes it as one file. A .pt file is a "
            "single-file checkpoint already: mode sample, mode report and Trainer.load read it as it is"
        )
    out = Path(out_file)
    if out.is_dir():
        raise ValueError(
            f"out={str(out_file)!r}: a folder; give the name of the file to write, e.g. {str(out / 'ckpt.pt')!r}"
        )
    if not overwrite:
        checkpoint.refuse_existing([out])
    checkpoint.prepare_dir(out.parent, "out's folder")  # created if needed; a bad one fails before reading
    state = read_sharded(path, training=True)
    if not overwrite:  # written by someone else while the shards were read
        checkpoint.refuse_existing([out])
    return checkpoint.save_checkpoint(out, {k: v for k, v in state.items() if k not in ("format", "version")})


# ---------------------------------------------------------------------------------------------- import


@torch.no_grad()
def _copy_full(target: Tensor, full: Tensor) -> None:
    """Copy the part of the full tensor ``full`` that ``target`` holds (a DTensor: its local shard)."""
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank holds the full tensor, each keeps its own slice (no communication)
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict, where: str) -> None:
    """Put a single-file checkpoint's full tensors (``state["model"]``, index-keyed ``state["optimizer"]``)
    into a parallelized model and its optimizer: every rank keeps its shards (import)."""
    model_sd = model.state_dict()
    checkpoint.check_model_state(model_sd, state["model"], where)
    for key, target in model_sd.items():
        _copy_full(target, state["model"][key])
    if optimizer is None:
        return
    saved = state["optimizer"]
    params = _optimizer_params(optimizer)
    try:
        saved_groups = [len(g["params"]) for g in saved["param_groups"]]
        if saved_groups != [len(g["params"]) for g in optimizer.param_groups]:
            raise ValueError(
                f"parameter groups of sizes {saved_groups}, this model has "
                f"{[len(g['params']) for g in optimizer.param_groups]}"
            )
        by_name, names = {}, _param_names(model)
        for i, entry in saved["state"].items():
            p = params[int(i)]
            missing = [k for k in ADAM_KEYS if k not in entry]
            if missing:
                raise ValueError(f"state[{i}] lacks {missing}")
            new = {"step": entry["step"].detach().clone().float().cpu()}
            for k in ("exp_avg", "exp_avg_sq"):
                if tuple(entry[k].shape) != tuple(p.shape):
                    raise ValueError(
                        f"state[{i}][{k!r}] has shape {tuple(entry[k].shape)}, the parameter "
                        f"{names[id(p)]} {tuple(p.shape)}"
                    )
                new[k] = torch.zeros_like(p.detach())
                _copy_full(new[k], entry[k])
            by_name[names[id(p)]] = new
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as e:
        raise checkpoint.CheckpointError(f"{where}: its optimizer state does not fit this model: {e}") from None
    _load_optimizer(model, optimizer, by_name)


# ---------------------------------------------------------------------------------------------- writing


def _meta_json(meta: dict) -> str:
    """The non-tensor state as JSON: RNG states as lists of bytes, routing sums as lists of floats."""
    out = {"format": FORMAT, "version": VERSION}
    for key, value in meta.items():
        if key in ("sampler_rng", "torch_rng"):
            value = value.tolist()
        elif key == "cuda_rng":
            value = [r.tolist() for r in value]
        elif key == "routing_acc":
            value = {
                "sums": {k: v.double().tolist() for k, v in value.get("sums", {}).items()},
                "layer_kinds": list(value["layer_kinds"]) if value.get("layer_kinds") else None,
            }
        out[key] = value
    return json.dumps(out)


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """name -> AdamW state of that parameter (the live tensors: shards of DTensors)."""
    names = _param_names(model)
    return {
        names[id(p)]: {k: optimizer.state[p][k] for k in ADAM_KEYS}
        for p in _optimizer_params(optimizer)
        if p in optimizer.state and optimizer.state[p]
    }


def _save_folder_name(path: Path, meta: dict, group, distributed: bool, rank: int) -> Path:
    """Rank 0 creates ``path`` and names a fresh save folder in it; every rank gets the name (a broadcast)."""
    error: OSError | None = None
    token: list = [None]
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            token[0] = f"{STEP_PREFIX}{meta['step']:08d}-{secrets.token_hex(3)}"  # fresh: never over a good save
        except OSError as e:
            error = checkpoint.WriteError(f"could not create the checkpoint folder {str(path)!r}: {e.strerror or e}")
    if distributed:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(token, src=src, group=group)  # the folder name, or None: rank 0 failed
    if token[0] is None:
        raise error or checkpoint.WriteError(
            f"rank 0 could not create the checkpoint folder {str(path)!r} (see its error)"
        )
    return path / token[0]


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer_state_by_name(model, optimizer)}


def _write_error(folder: Path, path: Path, e: BaseException) -> checkpoint.WriteError:
    return checkpoint.WriteError(
        f"could not write the sharded checkpoint {str(folder)!r}: {e} (the previous "
        f"save, named by {str(path / LATEST)!r}, is unchanged)"
    )


def _finish(
    path: Path, folder: Path, sums: dict[str, str], meta_text: str, group, distributed: bool, rank: int, keep: int = 1
) -> Path:
    """After every rank's shards are written: gather the sums, rank 0 writes ``meta.json``, ``SHA256SUMS``,
    then ``latest`` (the switch), and removes older saves but the ``keep`` newest complete ones (``retain``).
    A failure anywhere raises on every rank."""
    error: OSError | None = None
    if distributed:
        faults.inject("save", dist.get_rank(), step_of(folder))  # tests: a rank killed here, its shards written
    sums = dcp_safe.gather_sums(sums, group, distributed)
    if rank == 0:
        try:
            checkpoint.atomic_write_text(folder / META, meta_text)
            dcp_safe.write_manifest(folder, sums, extra_files=(META,))
            checkpoint.atomic_write_text(path / LATEST, folder.name + "\n")  # the switch: now the newest save
        except OSError as e:
            error = e
    if distributed:
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=device)
        dist.all_reduce(failed, group=group)  # a barrier that carries rank 0's outcome
        if error is None and float(failed) > 0:
            raise checkpoint.WriteError(f"rank 0 could not write the checkpoint {str(path)!r} (see its error)")
    if error is not None:
        raise error
    if rank == 0:
        retain(path, keep, current=folder)
    return folder


def step_of(folder: Path) -> int:
    """The step in a save folder's name (``step-00000060-3fa2c1`` -> 60); -1 for another name."""
    digits = folder.name[len(STEP_PREFIX) :].split("-", 1)[0]
    return int(digits) if folder.name.startswith(STEP_PREFIX) and digits.isdigit() else -1


def is_complete(folder: Path) -> bool:
    """Whether a save folder was finished: its ``SHA256SUMS`` is written (atomically) after every shard,
    ``.metadata`` and ``meta.json``; a save killed before that has none."""
    return (folder / dcp_safe.MANIFEST).is_file()


def saves(path: str | Path) -> list[Path]:
    """The save folders of a checkpoint folder, newest first: by step, and at equal steps the one ``latest``
    names, then the most recently written. Complete or not (``is_complete``)."""
    path = Path(path)
    named = (path / LATEST).read_text().strip() if (path / LATEST).is_file() else None
    found = [f for f in path.glob(f"{STEP_PREFIX}*") if f.is_dir() and step_of(f) >= 0]
    return sorted(found, key=lambda f: (step_of(f), f.name == named, f.stat().st_mtime_ns), reverse=True)


def retain(path: Path, keep: int, current: Path) -> list[Path]:
    """Keep ``current`` and the newest complete saves, ``keep`` in all; remove the others, and every partial
    save (left by a run killed while saving). Rank 0, once ``latest`` names ``current``. Returns what it removed."""
    kept, removed = 1, []
    for old in saves(path):
        if old.name == current.name:
            continue
        if is_complete(old) and kept < keep:
            kept += 1
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed


def save_sharded(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict, group=None, keep: int = 1
) -> Path:
    """Save every rank's shards of ``model`` and ``optimizer`` and rank 0's ``meta`` (the non-tensor state)
    as a new save folder in ``path``, with ``SHA256SUMS``; every rank of ``group`` (default: the world) calls
    it. Without a process group, this process saves alone. Returns the save folder once ``latest`` names it;
    a failed write raises ``mode.train.checkpoint.WriteError`` on every rank, and ``latest`` keeps naming the
    previous save."""
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    meta_text = _meta_json(meta)
    folder = _save_folder_name(path, meta, group, distributed, rank)
    writer = ChecksumWriter(folder)
    try:  # DCP gathers every rank's outcome: one rank's failure raises on all of them
        with warnings.catch_warnings():  # without a group DCP warns that it saves in one process: intended
            warnings.simplefilter("ignore" if not distributed else "default")
            dcp.save(
                _tensor_state(model, optimizer), storage_writer=writer, process_group=group, no_dist=not distributed
            )
    except CheckpointException as e:
        raise _write_error(folder, path, e) from None
    return _finish(path, folder, writer.sums, meta_text, group, distributed, rank, keep)


class PendingSave:
    """A save running in the background (``save_sharded_async``). ``wait()`` returns its folder once ``latest``
    names it, or raises what the save raised (``WriteError``; a failed collective as it came)."""

    def __init__(self, folder: Path, future: Future):
        self.folder, self._future = folder, future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> Path:
        return self._future.result(timeout_s)


def save_sharded_async(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict, group, save_group, keep: int = 1
) -> PendingSave:
    """``save_sharded`` in the background: returns once this rank's shards are copied to CPU memory; the
    files, the sums, ``meta.json`` and ``latest`` are written by ``dcp.async_save`` and a thread of this
    process, whose collectives all run on ``save_group``: a gloo group of the same ranks as ``group``, used
    by nothing else (``dist.new_group(ranks, backend="gloo")``; the training collectives on ``group`` go on
    meanwhile). Every rank of ``group`` calls it, and calls ``wait()`` on the result before the next save,
    a load, or the end of the process. Costs one CPU copy of this rank's shards until the save ends."""
    path = Path(path)
    rank = dist.get_rank(group)
    meta_text = _meta_json(meta)  # now: the state of this step, and a non-JSON meta fails here
    folder = _save_folder_name(path, meta, group, True, rank)
    writer = ChecksumWriter(folder)
    try:
        written = dcp.async_save(_tensor_state(model, optimizer), storage_writer=writer, process_group=save_group)
    except CheckpointException as e:
        raise _write_error(folder, path, e) from None

    def finish() -> Path:
        try:
            cast(Future, written).result()  # no async_stager given: a Future, not an AsyncSaveResponse
        except CheckpointException as e:
            raise _write_error(folder, path, e) from None
        return _finish(path, folder, writer.sums, meta_text, save_group, True, dist.get_rank(save_group), keep)

    pool = ThreadPoolExecutor(1, thread_name_prefix="mode-checkpoint")
    future = pool.submit(finish)
    pool.shutdown(wait=False)  # the thread ends with ``finish``
    return PendingSave(folder, future)
