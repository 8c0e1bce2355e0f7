"""Distributed checkpoints (torch DCP) of the home state, optimizer state and Lightning's metadata.

A checkpoint is a folder: DCP shards of the model and optimizer states (DCP's ``.metadata`` is
written last, after every rank's shards), plus ``meta.pt`` (loops, schedulers, callbacks, data and
planner state) from rank 0. It is written into ``<path>.tmp`` and renamed into place only when
complete, so a crash mid-write leaves the previous checkpoint usable; :func:`latest_checkpoint`
finds the newest complete one and skips (and names) what an interrupted save left behind.
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
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from .reliability import is_collective_failure

__all__ = ["save_distributed_checkpoint", "load_distributed_checkpoint", "export_consolidated", "latest_checkpoint",
           "is_complete_checkpoint", "resolve_checkpoint", "check_checkpoint_dirs", "CheckpointError", "META_FILE",
           "DCP_METADATA"]

log = logging.getLogger(__name__)

META_FILE = "meta.pt"
DCP_METADATA = ".metadata"
_PARTIAL_SUFFIXES = (".tmp", ".old")


class CheckpointError(OSError):
    """A checkpoint that cannot be written or read; the message names the path."""


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """A folder with both rank 0's ``meta.pt`` and DCP's ``.metadata`` (written after all shards)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / DCP_METADATA).is_file()


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


def save_distributed_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike, *, is_rank_zero: bool,
                                barrier: Callable[[], None],
                                broadcast: Callable[[Any], Any] = lambda x: x) -> None:
    """Every rank calls this. ``broadcast(obj)`` returns rank 0's ``obj`` on every rank: a folder
    rank 0 cannot create fails on all ranks at once instead of leaving the others in a barrier."""
    path = Path(path)
    if path.name.endswith(_PARTIAL_SUFFIXES):
        raise CheckpointError(f"checkpoint path {str(path)!r} ends in {path.suffix!r}, a name reserved for "
                              f"checkpoints being written or replaced; choose another name")
    tmp = path.with_name(path.name + ".tmp")
    problem = broadcast(_prepare(tmp) if is_rank_zero else None)
    if problem is not None:
        raise CheckpointError(f"cannot write a checkpoint to {str(path)!r}: {problem}")
    state = {"model": checkpoint.pop("state_dict")}
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optimizer_state
    dcp.save(state, checkpoint_id=str(tmp))
    if is_rank_zero:
        torch.save(checkpoint, tmp / META_FILE)
        _fsync(tmp / META_FILE)
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
    """``path`` if it is a complete checkpoint; else ``path.old`` when a save that was replacing
    ``path`` died between its two renames; else a clear error."""
    path = Path(path)
    if is_complete_checkpoint(path):
        return path
    old = path.with_name(path.name + ".old")
    if not path.exists() and is_complete_checkpoint(old):
        log.warning("hotspa: %s is missing but %s is complete (a save replacing it was interrupted); using it",
                    path, old)
        return old
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_file():
        raise CheckpointError(f"{str(path)!r} is a file, not a hotspa checkpoint (a folder written by HotSPaStrategy)")
    missing = [n for n in (META_FILE, DCP_METADATA) if not (path / n).is_file()]
    raise CheckpointError(f"{str(path)!r} is not a complete hotspa checkpoint (no {' and no '.join(missing)}); "
                          f"its save was interrupted: resume from an earlier one (see latest_checkpoint)")


def _saved_step(path: Path) -> tuple[int, float]:
    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        step = int(meta.get("global_step", -1))
    except Exception:  # noqa: BLE001 - an unreadable meta file makes the checkpoint a poor candidate, not fatal
        step = -1
    return step, (path / META_FILE).stat().st_mtime


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint in ``directory`` with the highest saved global step (newest on a tie),
    or None. Folders an interrupted save left (``*.tmp``, incomplete ones) are skipped and named in
    a warning; a ``*.old`` counts only when its replacement never arrived."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    complete, skipped = [], []
    for entry in sorted(directory.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.endswith(".old"):
            base = entry.with_name(entry.name[:-4])
            if not base.exists() and is_complete_checkpoint(entry):
                complete.append(entry)
            continue
        if entry.name.endswith(".tmp"):
            skipped.append(entry.name)  # only ever written into: its save did not finish
        elif is_complete_checkpoint(entry):
            complete.append(entry)
    if skipped:
        log.warning("hotspa: skipping incomplete checkpoint(s) in %s left by an interrupted save: %s",
                    directory, ", ".join(skipped))
    if not complete:
        return None
    return max(complete, key=_saved_step)


def load_distributed_checkpoint(path: str | os.PathLike, module: nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    path = resolve_checkpoint(path)
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    state: dict[str, Any] = {"model": module.state_dict()}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (RuntimeError, ValueError, KeyError, CheckpointException) as exc:
        if isinstance(exc, CheckpointException) and exc.failures:  # DCP wraps every rank's error
            exc = next(iter(exc.failures.values()))[0]
        if is_collective_failure(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit {type(module).__name__} "
                              f"(a different model or optimizer?): {type(exc).__name__}: {first[:600]}") from exc
    module.load_state_dict(state["model"])
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"])
    return meta


def export_consolidated(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One ``torch.save`` file with the full (unsharded) model state dict, for inference.

    Runs in a single process without a process group; loads every shard, so it needs the memory of
    one full model.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir, output_file = resolve_checkpoint(checkpoint_dir), Path(output_file)
    tmp = output_file.with_name(output_file.name + ".all.tmp")
    dcp_to_torch_save(str(checkpoint_dir), str(tmp))
    state = torch.load(tmp, map_location="cpu", weights_only=False)["model"]
    tmp.unlink()
    part = output_file.with_name(output_file.name + ".tmp")
    torch.save(state, part)
    os.replace(part, output_file)  # never a half-written export under the final name
    return state
