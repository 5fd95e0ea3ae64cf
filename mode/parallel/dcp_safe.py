"""Reading DCP checkpoint metadata without running code from the folder.

DCP reads ``.metadata`` with plain ``pickle`` and non-tensor items with ``torch.load(weights_only=False)``,
either of which would run code from a hostile folder. ``SafeReader`` reads ``.metadata`` with an unpickler
that builds only DCP's own metadata classes, ``torch.Size`` and dtypes, and refuses a checkpoint holding any
non-tensor item, so DCP only ever reads tensors (with ``torch.load(weights_only=True)``). Shard files must
lie inside the folder.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from mode.train import checkpoint


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
        elif module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath",
                                              "PureWindowsPath"):
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
        raise checkpoint.CheckpointError(f"{where}: refused: its .metadata holds objects other than DCP "
                                         f"metadata, and loading them could run code ({e})") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: one clear error
        raise checkpoint.CheckpointError(f"{where}: its .metadata is not readable ({type(e).__name__}: {e})") from None
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise checkpoint.CheckpointError(f"{where}: its .metadata is not DCP metadata")
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, dcp_metadata.TensorStorageMetadata):
            raise checkpoint.CheckpointError(f"{where}: item {key!r} is a {type(item).__name__}: a mode checkpoint "
                                             "holds tensors only (other items would be unpickled with code)")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or "/" in rel or "\\" in rel or rel.startswith(".") \
                or not (folder / rel).is_file():
            raise checkpoint.CheckpointError(f"{where}: shard file {rel!r}: must be a file inside the folder")
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from ``read_metadata`` (see the module docstring)."""

    def __init__(self, folder: Path, where: str):
        super().__init__(folder)
        self._folder, self._where = Path(folder), where

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        md = read_metadata(self._folder, self._where)
        md.storage_meta = md.storage_meta or dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
