"""Distributed checkpoints (torch DCP) of the home state, optimizer state and Lightning's metadata.

A checkpoint is a folder: DCP shards of the model and optimizer states, plus ``meta.pt`` (loops,
schedulers, callbacks, data and planner state) from rank 0. It is written into ``<path>.tmp`` and
renamed into place only when complete, so a crash mid-write leaves the previous checkpoint usable.
DTensors record their global shapes, so a checkpoint written at one world size loads at another,
into any layout set.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["save_distributed_checkpoint", "load_distributed_checkpoint", "export_consolidated", "META_FILE"]

META_FILE = "meta.pt"


def save_distributed_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike, *, is_rank_zero: bool,
                                barrier: Callable[[], None]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if is_rank_zero:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    state = {"model": checkpoint.pop("state_dict")}
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optimizer_state
    dcp.save(state, checkpoint_id=str(tmp))
    if is_rank_zero:
        torch.save(checkpoint, tmp / META_FILE)
    barrier()
    if is_rank_zero:
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old) if path.is_dir() else path.unlink()
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_distributed_checkpoint(path: str | os.PathLike, module: nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete hotspa checkpoint (no {META_FILE})")
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    state: dict[str, Any] = {"model": module.state_dict()}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer)
    dcp.load(state, checkpoint_id=str(path))
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

    checkpoint_dir, output_file = Path(checkpoint_dir), Path(output_file)
    if not (checkpoint_dir / META_FILE).is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a complete hotspa checkpoint (no {META_FILE})")
    tmp = output_file.with_name(output_file.name + ".all.tmp")
    dcp_to_torch_save(str(checkpoint_dir), str(tmp))
    state = torch.load(tmp, map_location="cpu", weights_only=False)["model"]
    tmp.unlink()
    torch.save(state, output_file)
    return state
