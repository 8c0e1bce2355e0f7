"""``hotspa upgrade-checkpoint FOLDER``: a checkpoint written before commit markers, converted once.

Such a folder (format version 1) has a pickled ``meta.pt`` and no checksums, so it is refused on
load. Converting it reads that ``meta.pt`` weights-only with the metadata allow-list (plus numpy's
scalar and array constructors, which old saves held) and DCP's ``.metadata`` through DCP's allow-list
(:mod:`.dcp_metadata`), rewrites ``meta.pt`` as weights-only-readable metadata and writes the commit
marker with every file's checksum (docs/checkpoint-trust.md). An old ``meta.pt`` that holds anything
else is refused, naming the type, unless ``trust_pickle`` (``--trust-pickle``): then it is unpickled
in full, after a line on stderr that says so. Never a prompt: a closed stdin cannot answer for you.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from .trust import (
    COMMIT_FILE,
    DCP_METADATA,
    KIND_NODE_LOCAL,
    KIND_SHARED,
    META_FILE,
    CheckpointError,
    _allowed_types,
    encode_meta,
    file_entries,
    has_legacy_layout,
    name_step,
    outside_folder,
    read_meta,
    verify_checkpoint,
    write_fsync,
    write_marker,
)

__all__ = ["TRUST_FLAG", "upgrade_legacy_checkpoint"]

TRUST_FLAG = "--trust-pickle"


def _numpy_globals() -> list[Any]:
    """numpy's scalar, dtype and array constructors (data only), as old metadata pickled them."""
    import numpy as np

    found: list[Any] = [np.dtype, np.ndarray]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        try:
            mod = __import__(module, fromlist=["scalar", "_reconstruct"])
        except ImportError:
            continue
        found += [getattr(mod, n) for n in ("scalar", "_reconstruct") if hasattr(mod, n)]
    found += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")]
    return found


def _read_old_meta(file: Path, trust_pickle: bool) -> Any:
    """The old ``meta.pt`` through the allow-list, or (``trust_pickle``) unpickled in full, said on stderr."""
    try:
        with torch.serialization.safe_globals([*_allowed_types(), *_numpy_globals()]):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch names the refused global
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"type {found.group(1)}" if found else (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        if not trust_pickle:
            raise CheckpointError(
                f"{str(file)!r} holds {what}, which a weights-only load cannot read; nothing was changed. If you "
                f"wrote this checkpoint yourself (or trust who did), unpickle it in full, which runs any code it "
                f"holds: `hotspa upgrade-checkpoint {file.parent} {TRUST_FLAG}`") from None
    print(f"hotspa upgrade-checkpoint: unpickling {str(file)!r} in full ({TRUST_FLAG}): any code it holds runs now",
          file=sys.stderr, flush=True)
    try:
        return torch.load(file, map_location="cpu", weights_only=False)  # the explicit trust, asked for by flag
    except Exception as exc:  # noqa: BLE001 - whatever the pickle raised: one line naming the file
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"{str(file)!r} could not be unpickled even in full ({TRUST_FLAG}): "
                              f"{type(exc).__name__}: {first}; nothing was changed") from None


def upgrade_legacy_checkpoint(folder: str | os.PathLike, *, trust_pickle: bool = False) -> Path:
    """Converts a version-1 checkpoint folder in place; returns it.

    Args:
        folder: a folder main wrote before commit markers (``meta.pt`` + ``.metadata``, no versioned marker).
        trust_pickle: unpickle an old ``meta.pt`` in full when the allow-list cannot read it (runs its code).
    """
    from .dcp_metadata import load_dcp_metadata

    path = Path(folder)
    if not has_legacy_layout(path):
        raise CheckpointError(f"{str(path)!r} is not an old-format hotspa checkpoint (meta.pt and .metadata "
                              f"without a versioned {COMMIT_FILE}); nothing to convert")
    names = [p.name for p in path.glob("*.distcp")] + [DCP_METADATA, META_FILE]
    outside = [problem for name in [*names, COMMIT_FILE] if (problem := outside_folder(path, name))]
    if outside:  # nothing outside the folder is read, let alone checksummed into its marker
        raise CheckpointError(f"cannot convert {str(path)!r}: {'; '.join(outside)}; copy the files into the "
                              f"folder first. Nothing was changed")
    load_dcp_metadata((path / DCP_METADATA).read_bytes(), path / DCP_METADATA)  # DCP's classes only
    meta = _read_old_meta(path / META_FILE, trust_pickle)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{str(path / META_FILE)!r} holds a {type(meta).__name__}, not a checkpoint's metadata")
    old_marker = {}
    if (path / COMMIT_FILE).is_file():
        old_marker = json.loads((path / COMMIT_FILE).read_text())  # a node-local copy's v1 marker
    saved = meta.get("hotspa") or {}
    if old_marker:
        fields = {"kind": KIND_NODE_LOCAL, **{k: old_marker.get(k) for k in
                                           ("node", "ranks", "world_size", "node_map", "layouts")}}
    else:
        fields = {"kind": KIND_SHARED, "world_size": saved.get("world_size"), "layouts": saved.get("layouts")}
    fields["global_step"] = meta.get("global_step")
    named = name_step(path)
    if named is not None and fields["global_step"] is not None and named != fields["global_step"]:
        raise CheckpointError(f"cannot convert {str(path)!r}: its name says step={named}, its {META_FILE} holds "
                              f"global_step {fields['global_step']!r} (a renamed folder?); the loader would refuse "
                              f"it. Nothing was changed")
    write_fsync(path / META_FILE, encode_meta(meta, path / META_FILE))
    write_marker(path, fields, file_entries(path, names))
    try:  # what the loader will check, checked now: a folder we call converted also loads
        read_meta(path / META_FILE, verify_checkpoint(path))
    except CheckpointError as exc:
        (path / COMMIT_FILE).unlink(missing_ok=True)  # left in the old format, not half converted
        raise CheckpointError(f"cannot convert {str(path)!r}: the result fails the loader's check ({exc}); it "
                              f"was left in the old format") from None
    return path
