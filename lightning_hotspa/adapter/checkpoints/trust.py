"""What a checkpoint folder must pass before anything in it is unpickled (docs/checkpoint-trust.md).

Every checkpoint folder ends with ``commit.json``, written last before the folder is renamed into
place: the format version, the step, the world that wrote it and the size and sha256 of every file
in it. Our own metadata (``meta.pt``: Lightning's loops, callbacks, schedulers, hyper-parameters,
the data position and the planner's state) is read with ``torch.load(weights_only=True)`` and a
short allow-list of plain-data types, and a save that would store anything else is refused when it
is written. DCP's ``.metadata`` and its non-tensor items are pickles by torch's design: they are
read only after every file of the folder matched its checksum, and then only through the
allow-lists of :mod:`.dcp_metadata`. A checksum stops corruption, not an author who rewrites
``commit.json`` too; the allow-lists stop such an author from running code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...checks import is_int, read_json_object
from ...paths import escapes, points_to

__all__ = ["COMMIT_FILE", "META_FILE", "DCP_METADATA", "KIND_SHARED", "KIND_NODE_LOCAL", "FORMAT", "VERSION",
           "CheckpointError", "LegacyCheckpointError", "sha256_file", "file_entries", "encode_meta", "write_fsync",
           "read_meta", "write_marker", "read_marker", "verify_files", "has_legacy_layout", "verify_checkpoint",
           "LEGACY_HINT", "outside_folder", "marker_digest", "name_step", "save_via_file"]

COMMIT_FILE = "commit.json"  # the commit marker: the last file a save writes
META_FILE = "meta.pt"  # our metadata (rank 0 / each node's first rank)
DCP_METADATA = ".metadata"  # DCP's, written after every rank's shards
KIND_SHARED, KIND_NODE_LOCAL = "shared", "node-local"  # the marker's "kind"
FORMAT = "lightning_hotspa checkpoint"
VERSION = 2  # 1: main before commit markers (pickled meta.pt, no checksums): refused
_CHUNK = 1 << 22
MARKER_SHA = "marker_sha256"  # the marker's own checksum: sha256 of its canonical JSON without this field
_NAME_STEP = re.compile(r"(?:^|[^0-9A-Za-z_])step=(\d+)(?![0-9])")
LEGACY_HINT = ("it was written by an older lightning_hotspa: no commit.json with checksums, and its meta.pt is a "
               "pickle that runs code when loaded. If you wrote it yourself (or trust who did), convert it once with "
               "`hotspa upgrade-checkpoint FOLDER` (that one command unpickles it), then resume from it")


class CheckpointError(OSError):
    """A checkpoint that cannot be written or read; the message names the path."""


class LegacyCheckpointError(CheckpointError):
    """A folder in the pre-commit-marker format (version 1), refused unconverted."""


def _allowed_types() -> list[Any]:
    """Plain-data types our metadata may hold beyond torch's weights-only defaults."""
    from ...models.config import Llama3RopeScaling, LlamaConfig

    allowed: list[Any] = [LlamaConfig, Llama3RopeScaling]
    try:
        from lightning.fabric.utilities.data import AttributeDict

        allowed.append(AttributeDict)
    except ImportError:  # pragma: no cover - Lightning is a dependency of the adapter
        pass
    return allowed


def sha256_file(path: Path) -> str:
    """The sha256 of one file, read in 4 MiB chunks.

    Args:
        path: the file.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_entries(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "sha256"}}`` of files in ``folder``, as the commit marker lists them.

    Args:
        folder: where the files are.
        names: their names (no folders).
    """
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)} for n in sorted(set(names))}


def _weights_only_load(data: bytes | Path) -> Any:
    """``torch.load(weights_only=True)`` of bytes or a file, our allow-list added."""
    with torch.serialization.safe_globals(_allowed_types()):
        return torch.load(io.BytesIO(data) if isinstance(data, bytes) else data, map_location="cpu", weights_only=True)


def _plain(obj: Any) -> Any:
    """``obj`` with numpy scalars and arrays made Python numbers and tensors (weights-only readable)."""
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _plain(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


def encode_meta(meta: Mapping[str, Any], path: Path) -> bytes:
    """Our metadata as ``torch.save`` bytes, refused (naming ``path``) if a weights-only load could not read it.

    Args:
        meta: Lightning's checkpoint dict without the model and optimizer states.
        path: the file it is meant for (named in the error).
    """
    buffer = io.BytesIO()
    try:
        torch.save(_plain(dict(meta)), buffer)
        _weights_only_load(buffer.getvalue())
    except Exception as exc:  # noqa: BLE001 - torch's errors name the type
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"type {found.group(1)}" if found else (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CheckpointError(
            f"cannot write {str(path)!r}: the checkpoint's metadata (Lightning's loops, callbacks, LR schedulers, "
            f"hyper-parameters) holds a value a weights-only load cannot read back ({what}); a checkpoint must "
            f"load without running code, so store plain data there (dict, list, str, numbers, tensors, LlamaConfig)"
        ) from None
    return buffer.getvalue()


def write_fsync(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs it.

    Args:
        path: the file.
        data: its bytes.
    """
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_via_file(obj: Any, file: Path) -> None:
    """``torch.save`` through a Python file object, so a full disk is an OSError naming its cause.

    Args:
        obj: what to save.
        file: the file to write.
    """
    with open(file, "wb") as f:
        torch.save(obj, f)


def read_meta(path: Path, marker: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Our metadata, read with ``weights_only=True`` (no code runs); errors name the file.

    Args:
        path: a ``meta.pt`` of a checkpoint folder.
        marker: its folder's commit marker: the metadata's ``global_step`` must be the marker's.
    """
    try:
        meta = _weights_only_load(path)
    except Exception as exc:  # noqa: BLE001 - a bad file is a CheckpointError naming it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot read the checkpoint metadata {str(path)!r}: {type(exc).__name__}: "
                              f"{first[:400]}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(meta).__name__}, not a checkpoint's metadata dict")
    step = None if marker is None else marker.get("global_step")
    if step is not None and meta.get("global_step") != step:
        raise CheckpointError(f"{str(path.parent / COMMIT_FILE)!r} says global_step {step}, but {META_FILE} holds "
                              f"global_step {meta.get('global_step')!r}: the marker or the metadata was edited or "
                              f"swapped; nothing was loaded")
    return meta


def write_marker(folder: Path, fields: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]]) -> None:
    """Writes (and fsyncs) ``commit.json``: ``fields`` plus the format, version and file checksums.

    Args:
        folder: the checkpoint folder being committed.
        fields: ``kind``, ``global_step``, ``world_size`` and, node-local, ``node`` / ``ranks`` / ``node_map``.
        files: :func:`file_entries` of every file in the folder.
    """
    marker = {"format": FORMAT, "version": VERSION, **fields, "files": dict(sorted(files.items()))}
    marker[MARKER_SHA] = marker_digest(marker)
    write_fsync(folder / COMMIT_FILE, json.dumps(marker, indent=1).encode())


def marker_digest(marker: Mapping[str, Any]) -> str:
    """sha256 of the marker's canonical JSON (sorted keys, no spaces) without its own checksum field.

    Args:
        marker: a commit marker's fields.
    """
    body = {k: v for k, v in marker.items() if k != MARKER_SHA}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def name_step(folder: Path) -> int | None:
    """The step a checkpoint folder's name states (``epoch=0-step=100``, ``step=2``; ``.old`` kept), or None.

    Args:
        folder: a checkpoint folder.
    """
    found = _NAME_STEP.findall(folder.name)
    return int(found[0]) if len(found) == 1 else None


def outside_folder(folder: Path, name: str) -> str | None:
    """Why ``folder/name`` must not be read as part of the checkpoint (it resolves outside the folder), or None.

    Args:
        folder: a checkpoint folder.
        name: a file name in it.
    """
    target = escapes(folder / name, [folder])
    if target is None:
        return None
    return f"{points_to(folder / name, target)}, outside the folder {str(folder)!r} (every file must lie in it)"


def has_legacy_layout(folder: Path) -> bool:
    """A folder main wrote before commit markers: ``meta.pt`` and ``.metadata``, no versioned marker.

    Args:
        folder: a candidate checkpoint folder.
    """
    if not ((folder / META_FILE).is_file() and (folder / DCP_METADATA).is_file()):
        return False
    marker = folder / COMMIT_FILE
    if not marker.is_file():
        return True
    try:
        return "version" not in json.loads(marker.read_text())
    except (ValueError, OSError, AttributeError, TypeError):
        return False


def read_marker(folder: Path) -> dict[str, Any]:
    """The folder's ``commit.json``, checked field by field; errors name the file and the field.

    Args:
        folder: a checkpoint folder.
    """
    file = folder / COMMIT_FILE
    if not file.is_file():
        if has_legacy_layout(folder):
            raise LegacyCheckpointError(f"cannot load {str(folder)!r}: {LEGACY_HINT}")
        raise CheckpointError(f"{str(folder)!r} has no {COMMIT_FILE}: not a committed hotspa checkpoint")
    if outside_folder(folder, COMMIT_FILE):
        raise CheckpointError(f"cannot load {str(folder)!r}: {outside_folder(folder, COMMIT_FILE)}")
    marker = read_json_object(file, error=CheckpointError, hint=": a corrupt commit marker",
                              what="commit marker object")
    if "version" not in marker and has_legacy_layout(folder):
        raise LegacyCheckpointError(f"cannot load {str(folder)!r}: {LEGACY_HINT}")
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(f"{str(file)!r}: format {marker.get('format')!r} version {marker.get('version')!r}; "
                              f"this lightning_hotspa reads {FORMAT!r} version {VERSION}")
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{str(file)!r}: field 'files' must be a non-empty object of file checksums, "
                              f"got {files!r:.200}")
    for name, entry in files.items():
        if not name or name != Path(name).name or name in (".", ".."):
            raise CheckpointError(f"{str(file)!r}: 'files' lists {name!r}, which is not a plain file name in the "
                                  f"folder")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{str(file)!r}: files[{name!r}] must be {{\"bytes\": int, \"sha256\": str}}, "
                                  f"got {entry!r:.200}")
    step = marker.get("global_step")
    if step is not None and not is_int(step):
        raise CheckpointError(f"{str(file)!r}: field 'global_step' must be an integer, got {step!r}")
    if MARKER_SHA in marker and marker[MARKER_SHA] != marker_digest(marker):
        raise CheckpointError(f"{str(file)!r} was edited after its save ({MARKER_SHA} differs from its content, "
                              f"global_step {step!r}): a marker's fields are not trusted once changed; resume from "
                              f"another checkpoint")
    named = name_step(folder)
    if named is not None and step is not None and named != step and not folder.name.endswith(".tmp"):
        raise CheckpointError(f"{str(file)!r} says global_step {step}, but the folder's name says step={named}: an "
                              f"edited marker or a renamed folder; nothing was loaded")
    return marker


def verify_files(folder: Path, marker: Mapping[str, Any], required: Iterable[str], *, share: tuple[int, int] = (0, 1),
                 gather: Callable[[Any], list[Any]] = lambda x: [x],
                 progress: Callable[[list[str]], Iterable[str]] | None = None) -> None:
    """Checks every listed file's size and sha256 (this caller: its ``share`` of them); raises, on every
    caller alike, a :class:`CheckpointError` naming each file that differs.

    Args:
        folder: the checkpoint folder.
        marker: its :func:`read_marker`.
        required: names the marker must list (``meta.pt``, ``.metadata``).
        share: ``(index, count)``: this process checks the files whose sorted position is ``index`` mod ``count``.
        gather: returns every caller's value (one all-gather; single process: ``[x]``).
        progress: wraps this caller's list of files while they are hashed (a command's progress
            bar); None: nothing shown.
    """
    files = marker["files"]
    problems = [f"{COMMIT_FILE} lists no {name!r}" for name in required if name not in files]
    index, count = share
    mine = [name for i, name in enumerate(sorted(files)) if i % count == index]
    for name in (progress(mine) if progress else mine):
        path, entry = folder / name, files[name]
        if outside_folder(folder, name):
            problems.append(f"{name}: {outside_folder(folder, name)}")
            continue
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{name}: {size} bytes, {COMMIT_FILE} says {entry['bytes']} (truncated or replaced)")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from {COMMIT_FILE} (corrupted bytes)")
    everyone = sorted({p for ps in gather(problems) for p in ps})
    if everyone:
        raise CheckpointError(f"checkpoint {str(folder)!r} failed its integrity check, nothing was loaded: "
                              f"{'; '.join(everyone)}. Resume from another checkpoint (an earlier step)")


def verify_checkpoint(folder: Path, *, share: tuple[int, int] = (0, 1),
                      gather: Callable[[Any], list[Any]] = lambda x: [x],
                      progress: Callable[[list[str]], Iterable[str]] | None = None) -> dict[str, Any]:
    """Reads the commit marker and checks the files against it, before anything in the folder is
    unpickled; every caller raises the same error (one all-gather each) or gets the marker.

    Args:
        folder: the checkpoint folder.
        share: ``(index, count)`` of this caller among those checking this folder.
        gather: returns every caller's value.
        progress: wraps the files while they are hashed (:func:`verify_files`).
    """
    marker, problem = None, None
    try:
        marker = read_marker(folder)
    except CheckpointError as exc:
        problem = (type(exc).__name__, str(exc))
    problems = [p for p in gather(problem) if p]
    if problems:
        kind, text = problems[0]
        raise (LegacyCheckpointError if kind == LegacyCheckpointError.__name__ else CheckpointError)(text)
    assert marker is not None
    verify_files(folder, marker, (META_FILE, DCP_METADATA), share=share, gather=gather, progress=progress)
    return marker
