"""``hotspa export CKPT_DIR OUT_DIR``: one of our DCP checkpoints as a Hugging Face folder.

Runs in ONE process, whatever world size wrote the checkpoint: every file of the folder is first
checked against its commit marker (``commit.json``: size and sha256, :mod:`.trust`),
our metadata is read weights-only, and only then DCP's metadata (through an allow-list of DCP's own
classes, :mod:`.dcp_metadata`); each parameter is read
in full through DCP's public API (``dcp.load`` of just that key), one at a time. The model config
comes from the LightningModule's hyper-parameters in the metadata (a :class:`LlamaLM` checkpoint).
The output folder must be empty or absent unless ``overwrite``, which leaves in it only what the
export writes (no stale shard or index can win over the new weights).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ...models.hf_config import config_to_hf
from ...models.hf_weights import hf_name, save_hf_folder
from ...paths import OutputError, output_problem
from .dcp_metadata import SafeFileSystemReader, safe_dcp_load
from .dcp_state import META_FILE, CheckpointError, resolve_checkpoint
from .trust import read_meta, verify_checkpoint

__all__ = ["export_hf"]

_PREFIX = "model.model."  # DCP key = "model" (the state dict) + LlamaLM's "model." + the Llama name


def _config(meta: dict[str, Any], path: Path) -> Any:
    """The LlamaConfig in the checkpoint's hyper-parameters; an error naming ``meta.pt`` without one."""
    from ...models.lightning_module import _as_config

    hparams = meta.get("hyper_parameters") or {}
    if "config" not in hparams:
        raise CheckpointError(f"{str(path / META_FILE)!r}: the hyper_parameters hold no model `config`: only "
                              f"LlamaLM checkpoints can be exported (found keys {sorted(hparams)})")
    return _as_config(hparams["config"])


def _check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuses a non-empty output folder unless ``overwrite`` (then it is replaced wholesale), and
    an output that is a symlink, a file, a device, FIFO or socket, or lies under a file."""
    problem = output_problem(out, folder=True)
    if problem:
        raise OutputError(f"export output: {problem}")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise FileExistsError(f"export output {str(out)!r} is not empty ({shown}); choose an empty folder, or pass "
                              f"--overwrite (overwrite=True) to replace it: only the exported files remain")


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike,
              dtype: torch.dtype | None = None, *, overwrite: bool = False,
              progress: Callable[[Iterable[Any], str, str], Iterable[Any]] | None = None) -> list[str]:
    """Writes ``out_dir`` (config.json + safetensors) from the DCP checkpoint folder; returns the
    Hugging Face tensor names written.

    Args:
        checkpoint_dir: a committed checkpoint folder of a :class:`LlamaLM`.
        out_dir: the Hugging Face folder to write (absent or empty unless ``overwrite``).
        dtype: cast on the way (default: as stored, fp32).
        overwrite: replace a non-empty ``out_dir``; only the exported files remain in it.
        progress: ``progress(items, what, unit)`` wraps the files while they are hashed and the
            tensors while they are read (a command's progress bar, ``tools/progress.py``); None: none.
    """
    def shown(items: list[Any], what: str, unit: str) -> Iterable[Any]:
        return progress(items, what, unit) if progress else items

    out = Path(out_dir).expanduser()
    _check_out_dir(out, overwrite)
    path = resolve_checkpoint(checkpoint_dir)
    marker = verify_checkpoint(path, progress=lambda files: shown(files, "hotspa export: checksums", "file"))
    config = _config(read_meta(path / META_FILE, marker), path)
    metadata = SafeFileSystemReader(str(path)).read_metadata()  # through the allow-list (dcp_metadata)
    keys = [k for k in metadata.state_dict_metadata if k.startswith(_PREFIX)]
    if not keys:
        raise CheckpointError(f"{str(path)!r} holds no LlamaLM parameters (keys like {_PREFIX}...)")

    def tensors():
        for key in shown(keys, "hotspa export: tensors", "tensor"):
            info = metadata.state_dict_metadata[key]
            buffer = {"model": {key.removeprefix("model."): torch.empty(info.size, dtype=info.properties.dtype)}}
            safe_dcp_load(buffer, path, no_dist=True)  # this process reads it all
            value = buffer["model"][key.removeprefix("model.")]
            yield hf_name(key.removeprefix(_PREFIX)), value if dtype is None else value.to(dtype)

    stored = dtype or next(iter(metadata.state_dict_metadata[k].properties.dtype for k in keys))
    names = []

    def recorded():
        for name, value in tensors():
            names.append(name)
            yield name, value

    save_hf_folder(out, config_to_hf(config, str(stored).removeprefix("torch.")), recorded(),
                   replace_folder=True)  # written beside, swapped in whole: a failed export leaves nothing
    return names
