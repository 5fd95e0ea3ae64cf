"""DCP folders you can trust: metadata read without running code from the folder, and every file checked
against the SHA-256 sums written when it was saved.

Safe to read. DCP reads ``.metadata`` with plain ``pickle`` and non-tensor items with
``torch.load(weights_only=False)``, either of which would run code from a hostile folder. ``SafeReader`` reads
``.metadata`` with an unpickler that builds only DCP's own metadata classes, ``torch.Size`` and dtypes, and
refuses a checkpoint holding any non-tensor item, so DCP only ever reads tensors (with
``torch.load(weights_only=True)``). Shard files must lie inside the folder.

Checksums. A save writes ``SHA256SUMS`` into the folder (the format of coreutils' ``sha256sum``, so
``cd FOLDER && sha256sum -c SHA256SUMS`` checks a copy on any machine): one line per file of the save, the
DCP shards, ``.metadata`` and the JSON beside them. Each rank hashes the files *it* wrote
(``ChecksumWriter``; on machines that do not share a file system a rank sees only its own), rank 0 gathers the
sums (``gather_sums``) and writes the manifest atomically before the save is named complete. A reader
verifies each file before it uses it: ``.metadata`` and the JSON first, and each shard file as DCP is about to
read from it (``SafeReader.read_data``), so a rank hashes only the files it reads, on whatever layout loads the
checkpoint. A mismatch is ``mode.train.checkpoint.ChecksumError`` (a ``ValueError``) naming the file, the sum
it should have and the one it has. A folder without ``SHA256SUMS`` (saved before mode wrote one) loads with a
``UnverifiedCheckpointWarning``. SHA-256 rather than a CRC: the manifest is then the one ``sha256sum``
checks, and with SHA-NI hashlib hashes 1.2 GB/s per process here (zlib's CRC32 2.3 GB/s), a small cost
beside writing or reading the same bytes.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from mode.train import checkpoint

MANIFEST = "SHA256SUMS"  # "<sha256 hex>  <file name>" per line, as coreutils' sha256sum writes and checks
METADATA = ".metadata"
_LINE = re.compile(r"([0-9a-f]{64}) [ *]([^/\\]+)")


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint folder without ``SHA256SUMS`` (saved before mode wrote one): its files are not verified."""


# ---------------------------------------------------------------------------------------------- checksums


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that hashes each file this rank wrote, once it is complete: ``sums`` maps its name
    (relative to the folder) to its SHA-256. ``.metadata`` (rank 0, written after the shards) is not in it."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.sums: dict[str, str] = {}

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        results = fut.wait()  # FileSystemWriter writes synchronously: the files are closed here
        for name in sorted({r.storage_data.relative_path for r in results}):
            self.sums[name] = checkpoint.sha256_file(Path(self.path) / name)
        return fut


def gather_sums(sums: dict[str, str], group=None, distributed: bool = True) -> dict[str, str]:
    """Every rank's ``{file: sha256}`` merged (a collective over ``group`` when ``distributed``)."""
    if not distributed:
        return dict(sums)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sums, group=group)
    return {name: digest for part in gathered for name, digest in part.items()}


def manifest_text(sums: dict[str, str]) -> str:
    return "".join(f"{sums[name]}  {name}\n" for name in sorted(sums))


def write_manifest(folder: Path, sums: dict[str, str], extra_files: tuple[str, ...] = ()) -> dict[str, str]:
    """Rank 0, once every file is written: add the sums of ``.metadata`` and ``extra_files`` (rank 0's own) to
    ``sums`` and write ``SHA256SUMS`` atomically; returns the full manifest."""
    full = dict(sums)
    for name in (METADATA, *extra_files):
        full[name] = checkpoint.sha256_file(folder / name)
    checkpoint.atomic_write_text(folder / MANIFEST, manifest_text(full))
    return full


def read_manifest(folder: Path, where: str) -> dict[str, str] | None:
    """``SHA256SUMS`` of a save folder as ``{file: sha256}``; None (with a warning) when there is none."""
    path = folder / MANIFEST
    if not path.exists():
        warnings.warn(
            f"{where}: no {MANIFEST} in it (saved before mode wrote checksums): its files are not verified",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise checkpoint.ChecksumError(f"{where}: its {MANIFEST} is not readable ({e})") from None
    sums = {}
    for i, line in enumerate(text.splitlines(), 1):
        m = _LINE.fullmatch(line)
        if m is None:
            raise checkpoint.ChecksumError(f"{where}: {MANIFEST} line {i} is not '<sha256>  <file>': {line[:100]!r}")
        sums[m.group(2)] = m.group(1)
    return sums


def verify_file(folder: Path, name: str, sums: dict[str, str] | None, where: str) -> None:
    """Compare file ``name`` of ``folder`` with its line in the manifest ``sums`` (None: nothing to check)."""
    if sums is None:
        return
    expected = sums.get(name)
    if expected is None:
        raise checkpoint.ChecksumError(
            f"{where}: {name} is not listed in its {MANIFEST}: the folder was changed after it was saved"
        )
    try:
        actual = checkpoint.sha256_file(folder / name)
    except OSError as e:
        raise checkpoint.ChecksumError(
            f"{where}: {name} is listed in {MANIFEST} but cannot be read ({e.strerror or e})"
        ) from None
    if actual != expected:
        raise checkpoint.ChecksumError(
            f"{where}: {name} is corrupt: its SHA-256 is {actual}, {MANIFEST} says {expected} (changed since it "
            "was saved: a bad copy or disk? copy it again from the machine that saved it)"
        )


def verify_folder(folder: str | Path) -> list[str]:
    """Check every file listed in a save folder's ``SHA256SUMS`` (after copying a checkpoint to another
    machine); returns the names checked, or raises ``ChecksumError`` naming the first bad file. ``folder``: a
    save folder, or a trainer's checkpoint folder (the save its ``latest`` names)."""
    folder = Path(folder)
    where = f"checkpoint {str(folder)!r}"
    latest = folder / "latest"
    if not (folder / MANIFEST).exists() and latest.is_file():
        name = latest.read_text().strip()
        if name and "/" not in name and "\\" not in name and name not in (".", ".."):
            folder = folder / name
    if not (folder / MANIFEST).is_file():
        raise checkpoint.ChecksumError(f"{where}: no {MANIFEST} in it: nothing to verify")
    sums = cast(dict[str, str], read_manifest(folder, where))  # a dict: the manifest is there (checked above)
    for name in sorted(sums):
        verify_file(folder, name, sums, where)
    return sorted(sums)


def checksum_failure(e: CheckpointException) -> checkpoint.CheckpointError | None:
    """The first ``CheckpointError`` a rank raised inside DCP (gathered into a ``CheckpointException``)."""
    for exc, _ in e.failures.values():
        if isinstance(exc, checkpoint.CheckpointError):
            return exc
    return None


# ---------------------------------------------------------------------------------------------- reading


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: its own classes, ``torch.Size``, dtypes, layouts, paths."""

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:  # defined there, not imported (typing.Any ...)
                return obj
        elif module == _StorageInfo.__module__ and name == "_StorageInfo":
            return _StorageInfo
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        elif module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            import pathlib

            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: Path, where: str) -> dcp_metadata.Metadata:
    """The DCP metadata of one save folder, unpickled safely and checked: tensors only, shard files inside
    the folder."""
    path = folder / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise checkpoint.CheckpointError(f"{where}: no readable DCP metadata ({e.strerror or e})") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise checkpoint.CheckpointError(
            f"{where}: refused: its .metadata holds objects other than DCP "
            f"metadata, and loading them could run code ({e})"
        ) from None
    except Exception as e:  # noqa: BLE001 - a damaged file: one clear error
        raise checkpoint.CheckpointError(f"{where}: its .metadata is not readable ({type(e).__name__}: {e})") from None
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise checkpoint.CheckpointError(f"{where}: its .metadata is not DCP metadata")
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, dcp_metadata.TensorStorageMetadata):
            raise checkpoint.CheckpointError(
                f"{where}: item {key!r} is a {type(item).__name__}: a mode checkpoint "
                "holds tensors only (other items would be unpickled with code)"
            )
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or "/" in rel or "\\" in rel or rel.startswith(".") or not (folder / rel).is_file():
            raise checkpoint.CheckpointError(f"{where}: shard file {rel!r}: must be a file inside the folder")
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from ``read_metadata``, and which verifies every file against
    the folder's ``SHA256SUMS`` before reading it (see the module docstring). ``verify(name)`` checks another
    file of the folder (the JSON beside the shards); each file is hashed once per reader."""

    def __init__(self, folder: Path, where: str):
        super().__init__(folder)
        self._folder, self._where = Path(folder), where
        self.sums = read_manifest(self._folder, where)  # None: an old folder, read unverified (warned)
        self._verified: set[str] = set()

    def verify(self, name: str) -> None:
        if name not in self._verified:
            verify_file(self._folder, name, self.sums, self._where)
            self._verified.add(name)

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        self.verify(METADATA)
        md = read_metadata(self._folder, self._where)
        md.storage_meta = md.storage_meta or dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _verify_plan(self, plan) -> None:
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self.verify(name)  # only the files this rank reads from, each in full

    def prepare_local_plan(self, plan):
        # DCP's planning step, which it runs on every rank and whose errors it gathers: a bad file fails the
        # load on every rank before any rank reads a byte into a tensor
        self._verify_plan(plan)
        return super().prepare_local_plan(plan)

    def read_data(self, plan, planner):
        self._verify_plan(plan)  # the same files (already verified: no second hash)
        return super().read_data(plan, planner)


def load(state: dict, reader: SafeReader, no_dist: bool) -> None:
    """``dcp.load(state, storage_reader=reader)``; a rank's ``CheckpointError`` (a file that fails its checksum),
    which DCP gathers from every rank into a ``CheckpointException``, comes out as itself on every rank."""
    try:
        with warnings.catch_warnings():  # without a group DCP warns that it loads in one process: intended
            if no_dist:
                warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, no_dist=no_dist)
    except CheckpointException as e:
        failure = checksum_failure(e)
        if failure is None:
            raise
        raise failure from None
