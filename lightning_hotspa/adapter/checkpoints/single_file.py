"""One of our DCP checkpoint folders as a single-file Lightning checkpoint that
``MyModule.load_from_checkpoint(path)`` and ``torch.load(path)`` read (``hotspa consolidate``).

The file holds the full (unsharded) model ``state_dict`` and what ``load_from_checkpoint`` needs
(hyper-parameters, epoch, global step, Lightning's version), all plain types, so it loads with
``torch.load(..., weights_only=True)``. It holds no optimizer state: it is for inference, export and
fine-tuning from the weights; resuming a run reads the folder itself. Runs in one process without a
process group; it checks every file against the folder's commit marker, then reads the model's
tensors only (the model's size in fp32).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ...paths import output_problem, write_output
from .dcp_state import CheckpointError, read_model_tensors, resolve_checkpoint
from .trust import META_FILE, read_meta, save_via_file, verify_checkpoint

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


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike, *,
                           progress: Callable[[list[str]], Iterable[str]] | None = None) -> dict[str, Any]:
    """Writes the single-file checkpoint; returns it.

    Args:
        checkpoint_dir: a checkpoint folder written by ``HotSPaStrategy`` (or ``latest:<dir>``).
        output_file: the ``.ckpt`` file to write (written whole, then renamed into place).
        progress: wraps the folder's files while their checksums are checked (a command's progress
            bar, the slow part of a large folder); None: nothing shown.
    """
    folder, output_file = resolve_checkpoint(checkpoint_dir), Path(output_file)
    if output_problem(output_file):  # before the checksums of a large folder are read
        raise CheckpointError(f"consolidate output: {output_problem(output_file)}")
    # checksums before anything in the folder is unpickled (docs/checkpoint-trust.md)
    marker = verify_checkpoint(folder, progress=progress)
    meta = read_meta(folder / META_FILE, marker)  # weights-only, with the allow-list
    model = read_model_tensors(folder)
    out: dict[str, Any] = {k: meta[k] for k in _KEPT if k in meta}
    out["state_dict"] = {k: v.contiguous() for k, v in model.items()}
    if "hyper_parameters" in meta:
        out["hyper_parameters"] = _plain(dict(meta["hyper_parameters"]))
    write_output(output_file, lambda part: save_via_file(out, part), "consolidate output")  # via .tmp, renamed
    return out
