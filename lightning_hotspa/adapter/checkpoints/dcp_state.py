"""Distributed checkpoints (torch DCP) of the home state, optimizer state and Lightning's metadata.

A checkpoint is a folder: DCP shards of the model and optimizer states (DCP's ``.metadata`` is
written last, after every rank's shards), ``meta.pt`` (loops, schedulers, callbacks, data and
planner state, read weights-only) from rank 0, and last the commit marker ``commit.json`` (every
file's size and sha256, :mod:`.trust`), checked before anything in the folder is
unpickled. It is written into ``<path>.tmp`` and renamed into place only when complete, so a
crash mid-write leaves the previous checkpoint usable; :func:`latest_checkpoint` finds the newest
committed one from the markers alone and skips (and names) what an interrupted save left behind.
DTensors record their global shapes, so a checkpoint written at one world size loads at another,
into any layout set.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ...collective_names import is_collective_failure
from ...paths import output_problem, write_output
from .dcp_metadata import SafeFileSystemReader, safe_dcp_load, safe_dcp_save
from .trust import (
    COMMIT_FILE,
    DCP_METADATA,
    KIND_SHARED,
    LEGACY_HINT,
    META_FILE,
    CheckpointError,
    LegacyCheckpointError,
    encode_meta,
    file_entries,
    has_legacy_layout,
    outside_folder,
    read_marker,
    read_meta,
    save_via_file,
    verify_checkpoint,
    write_fsync,
    write_marker,
)

__all__ = ["save_distributed_checkpoint", "load_distributed_checkpoint", "export_consolidated", "latest_checkpoint",
           "is_complete_checkpoint", "resolve_checkpoint", "check_checkpoint_dirs", "CheckpointError", "META_FILE",
           "DCP_METADATA", "COMMIT_FILE", "LATEST_PREFIX", "all_gather_objects", "scan_checkpoints", "RecordingWriter"]

log = logging.getLogger(__name__)

_PARTIAL_SUFFIXES = (".tmp", ".old")
LATEST_PREFIX = "latest:"  # "latest:<dir>": the newest committed checkpoint in <dir> (none: an error)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (one all-gather); ``[obj]`` without a process group.

    Args:
        obj: this rank's picklable value (our own, never a file's content).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    from ...group_collectives import objects_to_cpu, world_collectives

    out = world_collectives().all_gather_object(objects_to_cpu(obj))  # no CUDA tensor in a pickle (it lands on cuda:0)
    return out


class RecordingWriter(FileSystemWriter):
    """DCP's file writer, noting the files this rank wrote (their checksums go into the commit marker).

    Args:
        path: the folder DCP writes into.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan, planner):  # noqa: ANN001, ANN201 - torch's types
        """Writes as DCP does, then records the relative paths of this rank's files."""
        future = super().write_data(plan, planner)
        results = future.wait()
        self.written = sorted({wr.storage_data.relative_path for wr in results})
        return future


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """A folder with its commit marker (written last), ``meta.pt`` and DCP's ``.metadata``.

    Args:
        path: a candidate folder (nothing in it is read).
    """
    path = Path(path)
    return path.is_dir() and all((path / n).is_file() for n in (COMMIT_FILE, META_FILE, DCP_METADATA))


def _prepare(tmp: Path) -> str | None:
    """Rank 0 empties ``tmp``; returns the problem as text (so every rank can raise it alike)."""
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        probe = tmp / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def check_checkpoint_dirs(trainer: Any, *, is_rank_zero: bool, broadcast: Callable[[Any], Any],
                          probe: Callable[[str], Any] | None = None,
                          local: Callable[[str], Path] = Path) -> None:
    """Fail at the start of a fit, not after hours of training, when a ``ModelCheckpoint`` folder
    cannot be written (every rank raises the same error; rank 0 probes). ``probe(dirpath)``, a
    collective, then runs on every rank for every folder (``local`` maps it to this rank's path)."""
    problems = []
    dirpaths = [str(d) for d in (getattr(c, "dirpath", None) for c in getattr(trainer, "checkpoint_callbacks", []))
                if d and "://" not in str(d)]
    if is_rank_zero:
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            dirpath = getattr(callback, "dirpath", None)
            if not dirpath or "://" in str(dirpath):
                continue
            try:
                local(dirpath).mkdir(parents=True, exist_ok=True)
                probe_file = local(dirpath) / f".hotspa-write-probe-{os.getpid()}"
                probe_file.write_bytes(b"")
                probe_file.unlink()
            except OSError as exc:
                problems.append(f"{type(callback).__name__}(dirpath={str(dirpath)!r}) cannot write there: "
                                f"{type(exc).__name__}: {exc}")
    problems = broadcast(problems)
    if problems:
        raise CheckpointError("; ".join(problems))
    for dirpath in dirpaths if probe is not None else []:
        probe(dirpath)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encoded_meta_or_problem(checkpoint: dict[str, Any], path: Path) -> tuple[bytes | None, str | None]:
    """``meta.pt``'s bytes for the checkpoint dict less its states, or the reason it cannot be stored.

    Args:
        checkpoint: Lightning's dict (``state_dict`` and ``optimizer_states`` are left out).
        path: the folder being written (named in the reason).
    """
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    try:
        return encode_meta(meta, path / META_FILE), None
    except CheckpointError as exc:
        return None, str(exc)


def save_distributed_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike, *, is_rank_zero: bool,
                                barrier: Callable[[], None],
                                broadcast: Callable[[Any], Any] = lambda x: x,
                                gather: Callable[[Any], list[Any]] = all_gather_objects) -> None:
    """Every rank calls this; the folder appears complete (commit marker last) or not at all.

    Args:
        checkpoint: Lightning's checkpoint dict (its ``state_dict`` and ``optimizer_states`` go to DCP).
        path: the checkpoint folder.
        is_rank_zero: this rank writes ``meta.pt``, the marker and renames.
        barrier: waits for every rank.
        broadcast: returns rank 0's ``obj`` on every rank, so a folder rank 0 cannot create (or
            metadata it cannot store) fails on all ranks at once instead of leaving the others in a barrier.
        gather: every rank's value (the files each rank wrote and their checksums).
    """
    path = Path(path)
    if path.name.endswith(_PARTIAL_SUFFIXES):
        raise CheckpointError(f"checkpoint path {str(path)!r} ends in {path.suffix!r}, a name reserved for "
                              f"checkpoints being written or replaced; choose another name")
    tmp = path.with_name(path.name + ".tmp")
    meta_bytes, problem = encoded_meta_or_problem(checkpoint, path) if is_rank_zero else (None, None)
    if is_rank_zero and not problem and (path.exists() or path.is_symlink()):  # never replace a device or a link
        problem = output_problem(path, folder=True)
    problem = broadcast(problem or (_prepare(tmp) if is_rank_zero else None))
    if problem is not None:
        raise CheckpointError(problem if problem.startswith("cannot write") else
                              f"cannot write a checkpoint to {str(path)!r}: {problem}")
    state = {"model": checkpoint.pop("state_dict")}
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optimizer_state
    writer = RecordingWriter(str(tmp))
    safe_dcp_save(state, path, storage_writer=writer)  # a failed write: one line naming the folder
    everyone = gather(file_entries(tmp, writer.written))  # each rank hashes the shards it wrote
    if is_rank_zero:
        assert meta_bytes is not None
        write_fsync(tmp / META_FILE, meta_bytes)
        files = {name: entry for entries in everyone for name, entry in entries.items()}
        files.update(file_entries(tmp, [DCP_METADATA, META_FILE]))
        write_marker(tmp, {"kind": KIND_SHARED, "global_step": checkpoint.get("global_step"),
                           "world_size": len(everyone), "layouts": (checkpoint.get("hotspa") or {}).get("layouts")},
                     files)
    barrier()
    if is_rank_zero:
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old) if path.is_dir() else path.unlink()
        os.replace(tmp, path)  # the moment the new checkpoint exists; until here the previous one stands
        _fsync(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` if it is a committed checkpoint; else ``path.old`` when a save that was replacing
    ``path`` died between its two renames; ``latest:<dir>``: the newest committed checkpoint in
    ``<dir>`` (:func:`latest_checkpoint`); else a clear error (nothing in the folder is read).

    Args:
        path: the checkpoint folder asked for, or ``latest:<dir>``.
    """
    if str(path).startswith(LATEST_PREFIX):
        directory = str(path)[len(LATEST_PREFIX):]
        if not directory:
            raise CheckpointError(f"{str(path)!r}: give the folder after {LATEST_PREFIX!r}")
        found = latest_checkpoint(directory)
        if found is None:
            skipped = scan_checkpoints(Path(directory))[1]
            raise CheckpointError(f"{str(path)!r}: no complete checkpoint in {directory!r}"
                                  + (f" (skipped: {'; '.join(skipped)})" if skipped else ""))
        return resolve_checkpoint(found)
    path = Path(path)
    if is_complete_checkpoint(path) and not has_legacy_layout(path):
        return path
    old = path.with_name(path.name + ".old")
    if not path.exists() and is_complete_checkpoint(old) and not has_legacy_layout(old):
        log.warning("hotspa: %s is missing but %s is complete (a save replacing it was interrupted); using it",
                    path, old)
        return old
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_file():
        raise CheckpointError(f"{str(path)!r} is a file, not a hotspa checkpoint (a folder written by HotSPaStrategy)")
    if has_legacy_layout(path):
        raise LegacyCheckpointError(f"cannot load {str(path)!r}: {LEGACY_HINT}")
    missing = [n for n in (META_FILE, DCP_METADATA, COMMIT_FILE) if not (path / n).is_file()]
    raise CheckpointError(f"{str(path)!r} is not a complete hotspa checkpoint (no {' and no '.join(missing)}); "
                          f"its save was interrupted: resume from an earlier one (see latest_checkpoint)")


def scan_checkpoints(directory: Path) -> tuple[dict[str, tuple[int, float]], list[str]]:
    """The committed checkpoints in ``directory`` by name -> (step, marker mtime), and what was
    skipped, each with its reason; reads only the JSON commit markers, never a pickle.

    Args:
        directory: a folder of checkpoint folders.
    """
    found: dict[str, tuple[int, float]] = {}
    skipped: list[str] = []
    for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
        if not entry.is_dir() or entry.name.startswith(".hotspa-probe"):
            continue
        if outside_folder(directory, entry.name):  # latest: never leaves its folder
            skipped.append(f"{entry.name} ({outside_folder(directory, entry.name)})")
            continue
        if entry.name.endswith(".tmp"):
            skipped.append(f"{entry.name} (an interrupted save)")  # only ever written into
            continue
        if entry.name.endswith(".old") and entry.with_name(entry.name[:-4]).exists():
            continue  # its replacement arrived
        if has_legacy_layout(entry):
            skipped.append(f"{entry.name} (older format without checksums: convert it with "
                           f"`hotspa upgrade-checkpoint` if you trust it)")
            continue
        if not (entry / COMMIT_FILE).is_file():
            if (entry / DCP_METADATA).exists() or any(entry.glob("*.distcp")):
                skipped.append(f"{entry.name} (no {COMMIT_FILE}: never committed)")
            continue
        try:
            marker = read_marker(entry)
        except CheckpointError as exc:
            skipped.append(f"{entry.name} ({exc})")
            continue
        step = marker.get("global_step")
        found[entry.name] = (-1 if step is None else step, (entry / COMMIT_FILE).stat().st_mtime)
    return found, skipped


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The committed checkpoint in ``directory`` with the highest saved global step (newest on a tie),
    or None when it holds none. Folders an interrupted save left (``*.tmp``, uncommitted ones) and
    unreadable markers are skipped and named in a warning; a ``*.old`` counts only when its
    replacement never arrived. Reads the JSON commit markers only.

    Args:
        directory: a folder of checkpoint folders (it must exist).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint folder {str(directory)!r} "
                              f"{'is not a folder' if directory.exists() else 'does not exist'}")
    found, skipped = scan_checkpoints(directory)
    if skipped:
        log.warning("hotspa: skipping checkpoint folder(s) in %s: %s", directory, "; ".join(skipped))
    if not found:
        return None
    return directory / max(found, key=lambda name: found[name])


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")


def check_key_sets(path: Path, metadata: Any, state: dict[str, Any]) -> None:
    """The checkpoint's model keys are exactly the module's, and its optimizers are this run's (when
    the run has any: a run without one, e.g. ``trainer.validate``, reads the weights only): anything
    missing or left over is a CheckpointError naming the keys (DCP would drop extra ones).

    Args:
        path: the checkpoint folder (named in the error).
        metadata: its DCP metadata (read through the allow-list).
        state: what is about to be loaded (``model`` and ``optimizer_<i>`` entries).
    """
    saved = set(metadata.state_dict_metadata)
    ours = {f"model.{k}" for k in state["model"]}
    theirs = {k for k in saved if k.startswith("model.")}

    def within(key: str, keys: set[str]) -> bool:  # DCP flattens a nested item: "k" is stored as "k.<field>"
        return key in keys or any(key.startswith(k + ".") for k in keys)

    missing = sorted(k for k in ours if not (k in theirs or any(t.startswith(k + ".") for t in theirs)))
    unexpected = sorted(k for k in theirs if not within(k, ours))
    problems = []
    if missing:
        problems.append(f"missing parameters {_names([k.removeprefix('model.') for k in missing])}")
    if unexpected:
        problems.append(f"unexpected parameters {_names([k.removeprefix('model.') for k in unexpected])}")
    saved_opts = sorted({k.split(".", 1)[0] for k in saved if k.startswith("optimizer_")})
    our_opts = sorted(k for k in state if k.startswith("optimizer_"))
    if our_opts and saved_opts != our_opts:  # no optimizer (validate / test / predict): the weights only
        problems.append(f"it holds optimizer states {saved_opts}, this run has {our_opts}")
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: {'; '.join(problems)} (a "
                              f"different model config, e.g. n_layers? Nothing was loaded)")


def load_distributed_checkpoint(path: str | os.PathLike, module: nn.Module, optimizers: Sequence[Any], *,
                                share: tuple[int, int] = (0, 1),
                                gather: Callable[[Any], list[Any]] = lambda x: [x]) -> dict[str, Any]:
    """Checks the folder against its commit marker, then loads the states into ``module`` and
    ``optimizers`` (resharded) and returns our metadata (read weights-only).

    Args:
        path: the checkpoint folder.
        module: the LightningModule (its state dict holds DTensors at any world size).
        optimizers: its optimizers.
        share: ``(index, count)`` of this rank among the ranks checking this folder's files.
        gather: every such rank's value (one all-gather per check; single process: ``[x]``).
    """
    path = resolve_checkpoint(path)
    marker = verify_checkpoint(path, share=share, gather=gather)
    meta = read_meta(path / META_FILE, marker)
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    state: dict[str, Any] = {"model": module.state_dict()}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer)
    check_key_sets(path, SafeFileSystemReader(str(path)).read_metadata(), state)
    try:
        safe_dcp_load(state, path)
    except (RuntimeError, ValueError, KeyError, CheckpointException) as exc:
        if isinstance(exc, CheckpointException) and exc.failures:  # DCP wraps every rank's error
            exc = next(iter(exc.failures.values()))[0]
        if is_collective_failure(exc):
            raise
        if isinstance(exc, CheckpointError):  # a refused item or an unreadable rank file (dcp_metadata), named
            raise (exc if str(path) in str(exc) else CheckpointError(f"checkpoint {str(path)!r}: {exc}")) from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint {str(path)!r} (its files intact) does not fit {type(module).__name__} "
                              f"(a different model or optimizer?): {type(exc).__name__}: {first[:600]}") from exc
    module.load_state_dict(state["model"])
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"])
    return meta


def read_model_tensors(path: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of a VERIFIED checkpoint, in full, in this process (no process group).

    Args:
        path: a folder that passed :func:`verify_checkpoint`.
        prefix: the DCP key prefix (``model.``: the LightningModule's state dict); stripped in the result.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(str(path)).read_metadata()
    keys = [k for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)]
    if not keys:
        raise CheckpointError(f"{str(path)!r} holds no tensors under {prefix!r}")
    buffer = {k.removeprefix(prefix): torch.empty(metadata.state_dict_metadata[k].size,
                                                  dtype=metadata.state_dict_metadata[k].properties.dtype)
              for k in keys}
    safe_dcp_load({prefix.rstrip("."): buffer}, path, no_dist=True)
    return buffer


def export_consolidated(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One ``torch.save`` file with the full (unsharded) model state dict (its tensors), for inference.

    Runs in a single process without a process group; checks every file's checksum first, then
    loads every shard, so it needs the memory of one full model.

    Args:
        checkpoint_dir: the checkpoint folder.
        output_file: the file to write (atomically: never half-written under this name).
    """
    checkpoint_dir, output_file = resolve_checkpoint(checkpoint_dir), Path(output_file)
    read_meta(checkpoint_dir / META_FILE, verify_checkpoint(checkpoint_dir))  # the marker's step is the metadata's
    state = read_model_tensors(checkpoint_dir)
    write_output(output_file, lambda part: save_via_file(state, part), "export output")  # via .tmp, renamed
    return state
