"""``hotspa upgrade-checkpoint FOLDER``: a checkpoint written before commit markers, converted once.

Such a folder (format version 1) has a pickled ``meta.pt`` and no checksums, so it is refused on
load. Converting it unpickles that ``meta.pt`` (the one step that trusts the folder: run it only
on folders you, or someone you trust, wrote), rewrites it as weights-only-readable metadata and
writes the commit marker with every file's checksum (docs/checkpoint-trust.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkpoint_trust import (
    COMMIT_FILE,
    DCP_METADATA,
    KIND_NODE_LOCAL,
    KIND_SHARED,
    META_FILE,
    CheckpointError,
    encode_meta,
    file_entries,
    has_legacy_layout,
    write_fsync,
    write_marker,
)

__all__ = ["upgrade_legacy_checkpoint"]


def upgrade_legacy_checkpoint(folder: str | os.PathLike) -> Path:
    """Converts a version-1 checkpoint folder in place (trusting its pickled ``meta.pt``); returns it.

    Args:
        folder: a folder main wrote before commit markers (``meta.pt`` + ``.metadata``, no versioned marker).
    """
    path = Path(folder)
    if not has_legacy_layout(path):
        raise CheckpointError(f"{str(path)!r} is not an old-format hotspa checkpoint (meta.pt and .metadata "
                              f"without a versioned {COMMIT_FILE}); nothing to convert")
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)  # the explicit trust
    if not isinstance(meta, dict):
        raise CheckpointError(f"{str(path / META_FILE)!r} holds a {type(meta).__name__}, not a checkpoint's metadata")
    old_marker = {}
    if (path / COMMIT_FILE).is_file():
        old_marker = json.loads((path / COMMIT_FILE).read_text())  # a node-local copy's v1 marker
    write_fsync(path / META_FILE, encode_meta(meta, path / META_FILE))
    saved = meta.get("hotspa") or {}
    if old_marker:
        fields = {"kind": KIND_NODE_LOCAL, **{k: old_marker.get(k) for k in
                                           ("node", "ranks", "world_size", "node_map", "layouts")}}
    else:
        fields = {"kind": KIND_SHARED, "world_size": saved.get("world_size"), "layouts": saved.get("layouts")}
    fields["global_step"] = meta.get("global_step")
    names = [p.name for p in path.glob("*.distcp")] + [DCP_METADATA, META_FILE]
    write_marker(path, fields, file_entries(path, names))
    return path
