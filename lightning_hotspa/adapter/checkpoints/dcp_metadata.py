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
from torch.distributed.checkpoint.api import CheckpointException

from .trust import DCP_METADATA, CheckpointError

__all__ = ["ALLOWED_GLOBALS", "SafeFileSystemReader", "SafeLoadPlanner", "check_storage", "first_failure",
           "load_dcp_metadata", "safe_dcp_load", "safe_dcp_save"]

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


def first_failure(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's ``CheckpointException`` (which wraps every rank's), else ``exc``.

    Args:
        exc: what ``dcp.load`` / ``dcp.save`` raised.
    """
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and failures:
        found = next(iter(failures.values()))
        return found[0] if isinstance(found, tuple) else found
    return exc


_LIKELY = ("truncated, a rank file swapped with another rank's, or files of a save at another world size "
           "(rank count)")


def check_storage(path: Path, metadata: Any) -> None:
    """Every rank file DCP's metadata places data in is a plain file of the folder, long enough for
    it; else a CheckpointError naming the file and the likely cause (before DCP reads a byte).

    Args:
        path: the checkpoint folder.
        metadata: its DCP metadata (read through the allow-list).
    """
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"refusing to load {str(path)!r}: its {DCP_METADATA} places data in {name!r}, "
                                  f"not a file of the folder")
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"cannot load {str(path)!r}: its {DCP_METADATA} places data in {name}, which the "
                                  f"folder lacks ({_LIKELY}?)")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(f"cannot load {str(path)!r}: {name} is {size} bytes, its {DCP_METADATA} places "
                                  f"data up to byte {end} ({_LIKELY}?)")


def safe_dcp_load(state: dict[str, Any], path: str | os.PathLike, *, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``path`` through :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`, after :func:`check_storage`. A failure while reading a rank file is a
    CheckpointError naming the folder, the file's error and the likely cause; a failed collective
    and a tensor that does not fit ``state`` (another model: the caller names it) are raised as they are.

    Args:
        state: the state dict to fill in place.
        path: the checkpoint folder.
        no_dist: load in this process alone (no process group).
    """
    reader = SafeFileSystemReader(str(Path(path)))
    check_storage(Path(path), reader.read_metadata())
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException; sorted below
        cause = first_failure(exc)
        if isinstance(cause, CheckpointError) or _is_misfit(cause) or _is_collective(cause):
            raise
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        raise CheckpointError(f"cannot load {str(path)!r}: a rank file could not be read ({type(cause).__name__}: "
                              f"{first}); its checksums match commit.json, so it was written so or rehashed: "
                              f"{_LIKELY}?") from exc


def _is_misfit(exc: BaseException) -> bool:
    """A saved tensor whose size differs from the module's (a different model, named by the caller)."""
    text = str(exc)
    return "Size mismatch" in text or "size mismatch" in text or "shape" in text and "mismatch" in text


def _is_collective(exc: BaseException) -> bool:
    from ...collective_names import is_collective_failure

    return is_collective_failure(exc)


def safe_dcp_save(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.save``; a failure to write (a full disk, a folder that went away) is a CheckpointError
    naming ``path`` and the cause, a failed collective is raised as it is.

    Args:
        state: the state dict to save.
        path: the checkpoint folder, for the message.
        kwargs: ``storage_writer`` and ``planner``, as ``dcp.save`` takes them.
    """
    from ...paths import cause_of

    try:
        dcp.save(state, **kwargs)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one line naming the folder and the cause
        cause = first_failure(exc)
        if _is_collective(cause):
            raise
        raise CheckpointError(f"cannot write a checkpoint to {str(path)!r}: {cause_of(cause)}") from exc
