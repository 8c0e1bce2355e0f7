"""One of our DCP checkpoint folders as a single-file Lightning checkpoint that
``MyModule.load_from_checkpoint(path)`` and ``torch.load(path)`` read (``hotspa consolidate``).

The file holds the full (unsharded) model ``state_dict`` and what ``load_from_checkpoint`` needs
(hyper-parameters, epoch, global step, Lightning's version), all plain types, so it loads with
``torch.load(..., weights_only=True)``. It holds no optimizer state: it is for inference, export and
fine-tuning from the weights; resuming a run reads the folder itself. Runs in one process without a
process group; it reads every shard (the model and optimizer states: about 3x the model's size in fp32).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .checkpoint import META_FILE, resolve_checkpoint

__all__ = ["consolidate_checkpoint"]

#: what of the saved Lightning metadata goes into the single file
_KEPT = ("epoch", "global_step", "pytorch-lightning_version", "hparams_name")


def _plain(value: Any) -> Any:
    """Hyper-parameters as plain containers (Lightning's AttributeDict is not weights_only-loadable)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike) -> dict[str, Any]:
    """Writes the single-file checkpoint; returns it.

    Args:
        checkpoint_dir: a checkpoint folder written by ``HotSPaStrategy`` (or ``latest:<dir>``).
        output_file: the ``.ckpt`` file to write (written whole, then renamed into place).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, output_file = resolve_checkpoint(checkpoint_dir), Path(output_file)
    meta = torch.load(folder / META_FILE, map_location="cpu", weights_only=False)
    with tempfile.TemporaryDirectory(dir=output_file.parent) as scratch:
        whole = Path(scratch) / "all.pt"
        dcp_to_torch_save(str(folder), str(whole))
        model = torch.load(whole, map_location="cpu", weights_only=True)["model"]
    out: dict[str, Any] = {k: meta[k] for k in _KEPT if k in meta}
    out["state_dict"] = {k: v.contiguous() for k, v in model.items()}
    if "hyper_parameters" in meta:
        out["hyper_parameters"] = _plain(dict(meta["hyper_parameters"]))
    part = output_file.with_name(output_file.name + ".tmp")
    torch.save(out, part)
    os.replace(part, output_file)  # never a half-written file under the final name
    return out
