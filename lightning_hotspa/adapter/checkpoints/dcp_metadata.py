"""DCP's ``.metadata`` and non-tensor items read without running code (docs/checkpoint-trust.md).

Torch DCP stores its ``.metadata`` as a pickle and each non-tensor item of a state dict (an
optimizer's ``lr``, ``betas``, ...) as ``torch.save`` bytes that its default planner reads with
``weights_only=False``: whoever can write a checkpoint folder (and rewrite ``commit.json`` to match)
could run code through either. Here both go through an allow-list instead: the metadata through a
``pickle.Unpickler`` whose ``find_class`` knows only the classes DCP's metadata consists of (on
torch 2.11-2.13: ``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
``ChunkStorageMetadata``, ``TensorProperties`` and its memory-format enum, ``MetadataIndex``,
``StorageMeta``, the file system's ``_StorageInfo``, ``torch.Size``, dtypes, layouts and the
checkpoint id's ``pathlib`` path); the items through ``torch.load(weights_only=True)``. Anything
else is a :class:`~.trust.CheckpointError` naming the file and the refused global.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from .trust import DCP_METADATA, CheckpointError

__all__ = ["ALLOWED_GLOBALS", "SafeFileSystemReader", "SafeLoadPlanner", "load_dcp_metadata", "safe_dcp_load"]

_METADATA = "torch.distributed.checkpoint.metadata"
#: (module, name) of every class a DCP ``.metadata`` may name; dtypes and layouts are checked by value
ALLOWED_GLOBALS = frozenset({
    *((_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                               "TensorProperties", "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    *(("pathlib._local", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    ("collections", "OrderedDict"),
})


def _layout_by_name(name: str) -> torch.layout:
    """What ``torch.serialization._get_layout`` returns, without importing anything a pickle names."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise pickle.UnpicklingError(f"unknown torch layout {name!r}")


class _MetadataUnpickler(pickle.Unpickler):
    """``find_class`` from :data:`ALLOWED_GLOBALS`, torch dtypes and layouts only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout_by_name
        raise pickle.UnpicklingError(f"global {module}.{name} is not among the classes DCP metadata consists of")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {pid!r:.80} (DCP metadata has none)")


def load_dcp_metadata(data: bytes, where: str | os.PathLike) -> Any:
    """DCP metadata from its pickled bytes through the allow-list; a refused or broken pickle is a
    CheckpointError naming ``where`` (no code from the file runs).

    Args:
        data: the bytes of a ``.metadata`` file.
        where: the file, for the message.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any failure is a file we will not load
        raise CheckpointError(f"refusing to load {str(where)!r}: {type(exc).__name__}: {str(exc)[:300]}; a DCP "
                              f"metadata file holds only DCP's own classes (a planted or foreign pickle?)") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"refusing to load {str(where)!r}: it holds a {type(metadata).__name__}, not DCP "
                              f"Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader whose ``read_metadata`` goes through :func:`load_dcp_metadata`.

    Args:
        path: the checkpoint folder.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - DCP's signature
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_dcp_metadata(f.read(), path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # noqa: D102 - DCP's signature
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a planted item is refused, named
            raise CheckpointError(f"refusing the non-tensor checkpoint item {read_item.dest_index.fqn!r}: a "
                                  f"weights-only load cannot read it ({type(exc).__name__}: "
                                  f"{(str(exc).strip().splitlines() or [''])[0][:200]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state: dict[str, Any], path: str | os.PathLike, *, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``path`` through :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`.

    Args:
        state: the state dict to fill in place.
        path: the checkpoint folder.
        no_dist: load in this process alone (no process group).
    """
    dcp.load(state, storage_reader=SafeFileSystemReader(str(Path(path))), planner=SafeLoadPlanner(), no_dist=no_dist)
