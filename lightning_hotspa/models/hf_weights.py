"""Hugging Face safetensors weights <-> :class:`Llama` parameter names, streamed one tensor at a time.

Why slices: a rank holds only its home shard of each parameter, and safetensors' ``get_slice``
reads just those rows / columns from the memory-mapped file, so loading a model never puts a full
copy of it (not even one full parameter) in one process. The tensor layouts are the same as ours
(rotary in the half-split convention, [out, in] linears), so the mapping is names only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from torch import Tensor

__all__ = ["HFCheckpoint", "hf_name", "our_name", "save_hf_folder"]

# ours (inside Llama) <-> Hugging Face, per layer; the {i} is the layer index
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_TO_HF = (_TOP, list(_LAYER.items()))
_FROM_HF = ({v: k for k, v in _TOP.items()}, [(v, k) for k, v in _LAYER.items()])
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+?)(\.weight|\.bias)?$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?$")


def _rename(name: str, top: dict[str, str], layer_re: re.Pattern[str], pairs: list[tuple[str, str]],
            prefix: str) -> str | None:
    """``name`` through ``top`` or, for a layer tensor matched by ``layer_re``, the first of ``pairs``
    (source body, target body) whose source is its body with or without its ``.weight`` / ``.bias``."""
    if name in top:
        return top[name]
    m = layer_re.match(name)
    if m:
        layer, body, leaf = m.group(1), m.group(2), m.group(3) or ""
        for src, dst in pairs:
            if body + leaf == src:
                return f"{prefix}{layer}.{dst}"
            if body == src:
                return f"{prefix}{layer}.{dst}{leaf}"
    return None


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of our parameter ``name`` (relative to :class:`Llama`)."""
    out = _rename(name, _TO_HF[0], _OURS_LAYER, _TO_HF[1], "model.layers.")
    if out is None:
        raise KeyError(f"parameter {name!r} has no Hugging Face counterpart")
    return out


def our_name(name: str) -> str:
    """Inverse of :func:`hf_name`."""
    out = _rename(name, _FROM_HF[0], _HF_LAYER, _FROM_HF[1], "layers.")
    if out is None:
        raise KeyError(f"Hugging Face tensor {name!r} has no counterpart in this model")
    return out


class HFCheckpoint:
    """The safetensors files of a local Hugging Face folder (``model.safetensors`` or sharded with
    ``model.safetensors.index.json``), read tensor by tensor or slice by slice."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / file for name, file in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{str(self.path)!r} holds no *.safetensors weights (.bin checkpoints "
                                        f"are not read: convert them with transformers' save_pretrained)")
            from safetensors import safe_open

            self.files = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
        for name, file in self.files.items():
            if not file.is_file():
                raise FileNotFoundError(f"the index maps {name!r} to {str(file)!r}, which does not exist")

    def names(self) -> list[str]:
        return list(self.files)

    def _open(self, name: str):
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"{str(self.path)!r} has no tensor {name!r}")
        return safe_open(str(self.files[name]), framework="pt")

    def shape(self, name: str) -> tuple[int, ...]:
        with self._open(name) as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> Tensor:
        """Tensor ``name``, or only ``[start, stop)`` along ``dim`` (read from disk, nothing else)."""
        with self._open(name) as f:
            if dim is None:
                return f.get_tensor(name)
            sl = f.get_slice(name)
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            return sl[index]


def save_hf_folder(path: str | os.PathLike[str], config_json: Mapping, tensors: Iterable[tuple[str, Tensor]],
                   max_shard_bytes: int = 4 << 30) -> list[str]:
    """Writes ``config.json`` and the tensors (Hugging Face names) as safetensors shards of at most
    ``max_shard_bytes`` each, with an index when there is more than one; returns the file names."""
    from safetensors.torch import save_file

    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(names, shards):
        save_file(shard, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(dict(config_json), indent=2))
    return names


