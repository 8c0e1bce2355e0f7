"""One shared checkpoint from every node's copy of a node-local one (``merge_node_copies``).

Every copy is checked against its commit marker before its DCP metadata is read (through the
allow-list of :mod:`.dcp_metadata`); the
merged folder gets shard files copied, the per-node metadata merged and a commit marker of its own.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Sequence
from pathlib import Path

from .dcp_metadata import load_dcp_metadata
from .dcp_state import resolve_checkpoint
from .trust import (
    COMMIT_FILE,
    DCP_METADATA,
    KIND_NODE_LOCAL,
    KIND_SHARED,
    META_FILE,
    CheckpointError,
    file_entries,
    read_marker,
    read_meta,
    verify_checkpoint,
    write_fsync,
    write_marker,
)

__all__ = ["merge_node_copies"]


def merge_node_copies(folders: Sequence[str | os.PathLike], output: str | os.PathLike) -> Path:
    """One shared checkpoint (loadable at any world size) from every node's copy of a node-local
    one, once they are reachable from one machine: every copy checked against its commit marker
    first, then shard files copied, per-node metadata merged, a new marker written. Runs in one
    process, without a process group.

    Args:
        folders: every node's copy of one step.
        output: the shared checkpoint folder to write (must not exist).
    """
    folders = [resolve_checkpoint(f) for f in folders]
    markers = []
    for folder in folders:
        marker = read_marker(folder)
        if marker.get("kind") != KIND_NODE_LOCAL:
            raise CheckpointError(f"{str(folder)!r}: its {COMMIT_FILE} says kind {marker.get('kind')!r}: not one "
                                  f"node's copy of a node-local checkpoint")
        markers.append(marker)
    world = markers[0]["world_size"]
    covered = sorted(r for m in markers for r in m["ranks"])
    if covered != list(range(world)) or len({m["global_step"] for m in markers}) != 1:
        raise CheckpointError(f"the copies {[str(f) for f in folders]} do not add up to one checkpoint of {world} "
                              f"ranks: they hold ranks {covered} of steps "
                              f"{sorted({m['global_step'] for m in markers})}")
    output = Path(output)
    if output.exists():
        raise CheckpointError(f"merge output {str(output)!r} already exists; choose a new folder")
    for folder, marker in zip(folders, markers):
        verify_checkpoint(folder)  # before its DCP metadata (a pickle) is read
        read_meta(folder / META_FILE, marker)  # its step is the marker's
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    merged, files = None, {}
    for folder, marker in zip(folders, markers):
        metadata = load_dcp_metadata((folder / DCP_METADATA).read_bytes(), folder / DCP_METADATA)  # allow-list
        if merged is None:
            merged = metadata
        else:
            merged.storage_data.update(metadata.storage_data)
        for shard in folder.glob("*.distcp"):
            if shard.name in marker["files"]:
                shutil.copy2(shard, tmp / shard.name)
                files[shard.name] = marker["files"][shard.name]
    shutil.copy2(folders[0] / META_FILE, tmp / META_FILE)
    write_fsync(tmp / DCP_METADATA, pickle.dumps(merged))
    files.update(file_entries(tmp, [DCP_METADATA, META_FILE]))
    write_marker(tmp, {"kind": KIND_SHARED, "global_step": markers[0]["global_step"], "world_size": world,
                       "layouts": markers[0].get("layouts")}, files)
    os.replace(tmp, output)
    return output
