"""``hotspa export CKPT_DIR OUT_DIR``: one of our DCP checkpoints as a Hugging Face folder.

Runs in ONE process, whatever world size wrote the checkpoint: DCP records every tensor's global
shape, so each parameter is read in full through DCP's public API (``FileSystemReader`` metadata,
``dcp.load`` of just that key), one at a time. The model config comes from the LightningModule's
hyper-parameters in the checkpoint's metadata file (a :class:`LlamaLM` checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..models.hf_config import config_to_hf
from ..models.hf_weights import hf_name, save_hf_folder

__all__ = ["export_hf"]

_PREFIX = "model.model."  # DCP key = "model" (the state dict) + LlamaLM's "model." + the Llama name


def _config(meta: dict[str, Any]) -> Any:
    from ..models.lightning_module import _as_config

    hparams = meta.get("hyper_parameters") or {}
    if "config" not in hparams:
        raise ValueError("the checkpoint's hyper_parameters hold no model `config`: only LlamaLM "
                         f"checkpoints can be exported (found keys {sorted(hparams)})")
    return _as_config(hparams["config"])


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike,
              dtype: torch.dtype | None = None) -> list[str]:
    """Writes ``out_dir`` (config.json + safetensors) from the DCP checkpoint folder; returns the
    Hugging Face tensor names written. ``dtype``: cast on the way (default: as stored, fp32)."""
    from .checkpoint import META_FILE

    path = Path(checkpoint_dir)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not one of our checkpoints (no {META_FILE})")
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    config = _config(meta)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    keys = [k for k in metadata.state_dict_metadata if k.startswith(_PREFIX)]
    if not keys:
        raise ValueError(f"{str(path)!r} holds no LlamaLM parameters (keys like {_PREFIX}...)")

    def tensors():
        for key in keys:
            info = metadata.state_dict_metadata[key]
            buffer = {"model": {key.removeprefix("model."): torch.empty(info.size, dtype=info.properties.dtype)}}
            dcp.load(buffer, checkpoint_id=str(path), no_dist=True)  # this process reads it all
            value = buffer["model"][key.removeprefix("model.")]
            yield hf_name(key.removeprefix(_PREFIX)), value if dtype is None else value.to(dtype)

    stored = dtype or next(iter(metadata.state_dict_metadata[k].properties.dtype for k in keys))
    names = []

    def recorded():
        for name, value in tensors():
            names.append(name)
            yield name, value

    save_hf_folder(out_dir, config_to_hf(config, str(stored).removeprefix("torch.")), recorded())
    return names

