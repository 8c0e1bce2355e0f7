"""Hugging Face safetensors weights <-> :class:`Llama` parameter names, streamed one tensor at a time.

Why slices: a rank holds only its home shard of each parameter, and safetensors' ``get_slice``
reads just those rows / columns from the memory-mapped file, so loading a model never puts a full
copy of it (not even one full parameter) in one process. The tensor layouts are the same as ours
(rotary in the half-split convention, [out, in] linears), so the mapping is names only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from torch import Tensor

from ..paths import OutputError, cause_of, escapes, points_to, umask_mode

__all__ = ["HFCheckpoint", "HFWeightsError", "WEIGHT_PATTERNS", "hf_name", "in_model_folder", "our_name",
           "save_hf_folder"]

log = logging.getLogger(__name__)

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


#: files that hold weights in a Hugging Face folder (what save_hf_folder removes when it did not write them)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
                   "tf_model.h5", "flax_model.msgpack")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _roots(folder: Path) -> list[Path]:
    """Where a Hugging Face folder's files may resolve: the folder; in ``huggingface_hub``'s cache
    (``models--org--name/snapshots/<rev>/``, each file a relative symlink into ``../../blobs/``) also
    that repo's ``blobs/``."""
    root = folder.resolve()
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return [root, repo / "blobs"]
    return [root]


def in_model_folder(file: Path, folder: Path, error: type[Exception]) -> Path:
    """``file``, if it resolves inside the Hugging Face folder ``folder`` (symlinks followed as
    ``transformers`` does, but only into the folder or its hub-cache repo's ``blobs/``); else
    ``error`` naming the path and where it points.

    Args:
        file: a file of the folder (config.json, a weights file, the index).
        folder: the model folder the user gave.
        error: the exception type to raise.
    """
    target = escapes(file, _roots(folder))
    if target is not None:
        raise error(f"{points_to(file, target)}, outside the model folder {str(folder)!r}: a Hugging Face folder's "
                    f"files must lie in it (symlinks may point inside it, or, in huggingface_hub's cache, into "
                    f"the repo's blobs/); copy the file into the folder")
    return file


class HFCheckpoint:
    """The safetensors files of a local Hugging Face folder, read tensor by tensor or slice by slice.

    One index-or-file rule: with ``model.safetensors.index.json`` the folder's ``*.safetensors``
    must be exactly the shards the index maps to; without one it must hold exactly one
    ``*.safetensors`` file. Anything else (``model.safetensors`` beside a stale index, a stray
    ``old.safetensors``) is refused naming the files, never merged or picked silently.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        index = self.path / "model.safetensors.index.json"
        present = sorted(p.name for p in self.path.glob("*.safetensors"))
        if index.is_file():
            self.files = _index_files(index, self.path)
            stray = sorted(set(present) - {f.name for f in self.files.values()})
            if stray:
                raise HFWeightsError(f"{str(self.path)!r} holds {stray} beside {index.name}, which maps no tensor to "
                                     f"them: either the index or those files are stale; remove one of them (a folder "
                                     f"holds one model.safetensors or the shards of its index)")
        else:
            if not present:
                raise FileNotFoundError(f"{str(self.path)!r} holds no *.safetensors weights (.bin checkpoints "
                                        f"are not read: convert them with transformers' save_pretrained)")
            if len(present) > 1:
                raise HFWeightsError(f"{str(self.path)!r} holds {len(present)} weight files {present} and no "
                                     f"model.safetensors.index.json: which is the model? Keep one, or write the "
                                     f"index of the shards")
            self.files = {}
            file = in_model_folder(self.path / present[0], self.path, HFWeightsError)
            with _safe_open(file) as f:
                self.files.update(dict.fromkeys(f.keys(), file))
        for name, file in self.files.items():
            if not file.is_file():
                raise FileNotFoundError(f"the index maps {name!r} to {str(file)!r}, which does not exist")
        for file in set(self.files.values()):
            in_model_folder(file, self.path, HFWeightsError)

    def names(self) -> list[str]:
        return list(self.files)

    def _open(self, name: str):
        if name not in self.files:
            raise KeyError(f"{str(self.path)!r} has no tensor {name!r}")
        return _safe_open(self.files[name])

    def shape(self, name: str) -> tuple[int, ...]:
        with self._open(name) as f:
            return tuple(f.get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype of tensor ``name`` as safetensors names it (``F32``, ``BF16``, ``I64``, ...)."""
        with self._open(name) as f:
            return str(f.get_slice(name).get_dtype())

    def check_float(self, names: Iterable[str]) -> None:
        """Every named tensor is stored in a floating dtype; else an HFWeightsError naming them."""
        stored = [(n, self.dtype(n)) for n in names]
        bad = [(n, d) for n, d in stored if d not in _FLOAT_DTYPES]
        if bad:
            raise HFWeightsError(f"{str(self.path)!r}: tensors of a non-float dtype {bad[:4]}"
                                 f"{f' (and {len(bad) - 4} more)' if len(bad) > 4 else ''}: weights are floats "
                                 f"({', '.join(_FLOAT_DTYPES)}); pass strict_weights=False to cast them anyway")

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> Tensor:
        """Tensor ``name``, or only ``[start, stop)`` along ``dim`` (read from disk, nothing else)."""
        with self._open(name) as f:
            try:
                if dim is None:
                    return f.get_tensor(name)
                sl = f.get_slice(name)
                index = tuple([slice(None)] * dim + [slice(start, stop)])
                return sl[index]
            except Exception as exc:  # noqa: BLE001 - safetensors' errors do not name the file
                raise HFWeightsError(f"cannot read tensor {name!r} from {str(self.files[name])!r}: "
                                     f"{type(exc).__name__}: {exc}") from None


class HFWeightsError(ValueError):
    """A Hugging Face weights file or index that cannot be read; the message names the file."""


def _index_files(index: Path, folder: Path) -> dict[str, Path]:
    """The index's ``weight_map`` as tensor name -> file, refusing entries that leave ``folder``.

    Args:
        index: ``model.safetensors.index.json``.
        folder: the model folder every shard must lie in.
    """
    in_model_folder(index, folder, HFWeightsError)
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise HFWeightsError(f"{str(index)!r} is not a JSON object: {type(exc).__name__}: {exc}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFWeightsError(f"{str(index)!r}: field 'weight_map' must be a non-empty object, got {weight_map!r:.200}")
    files = {}
    for name, file in weight_map.items():  # the name lies in the folder; where a symlink points: in_model_folder
        if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise HFWeightsError(f"{str(index)!r}: weight_map[{name!r}] = {file!r} leaves the model folder "
                                 f"{str(folder)!r}; shards must be files inside it")
        files[name] = folder / file
    return files


def _safe_open(file: Path):
    """``safetensors.safe_open`` of one file; a truncated or garbage file is an error naming it."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors' errors do not name the file
        raise HFWeightsError(f"{str(file)!r} is not a readable safetensors file (truncated or not safetensors?): "
                             f"{type(exc).__name__}: {exc}") from None


class _Source(Exception):
    """An error raised while the tensors were produced (not while writing), carried through unchanged."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error

    @staticmethod
    def guard(tensors: Iterable[tuple[str, Tensor]]) -> Iterable[tuple[str, Tensor]]:
        """``tensors``, with an error of the producer wrapped as a :class:`_Source`."""
        it = iter(tensors)
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - re-raised as it was by save_hf_folder
                raise _Source(exc) from exc
            yield item


def _write_folder(out: Path, config_json: Mapping, tensors: Iterable[tuple[str, Tensor]], max_shard_bytes: int,
                  fresh: bool) -> tuple[list[str], list[str]]:
    """Writes the shards, their index and config.json into ``out`` (emptied first when ``fresh``);
    returns the shard names and every file written."""
    from safetensors.torch import save_file

    if fresh:
        shutil.rmtree(out, ignore_errors=True)
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
    written = [*names, "config.json"]
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append("model.safetensors.index.json")
    (out / "config.json").write_text(json.dumps(dict(config_json), indent=2))
    for file in written:
        os.chmod(out / file, umask_mode())  # as open() creates them (safetensors writes 0600)
    return names, written


def save_hf_folder(path: str | os.PathLike[str], config_json: Mapping, tensors: Iterable[tuple[str, Tensor]],
                   max_shard_bytes: int = 4 << 30, *, replace_folder: bool = False) -> list[str]:
    """Writes ``config.json`` and the tensors (Hugging Face names) as safetensors shards; returns the file names.

    Args:
        path: the model folder.
        config_json: the config.
        tensors: (Hugging Face name, tensor) pairs.
        max_shard_bytes: at most this many bytes per shard, with an index when there is more than one.
        replace_folder: the folder ends up holding only these files (written beside it, then swapped
            in); else they are written into it and every weight file it did not write
            (:data:`WEIGHT_PATTERNS`: any other ``*.safetensors``, an index, ``pytorch_model*.bin``) is
            removed, named in a warning, so no loader can pick old weights.
    """
    final = Path(path).expanduser()
    out = final.with_name(f".{final.name}.hotspa-export.tmp") if replace_folder else final
    try:
        names, written = _write_folder(out, config_json, _Source.guard(tensors), max_shard_bytes, replace_folder)
    except Exception as exc:  # noqa: BLE001 - a failed write is one line naming the folder and the cause
        if replace_folder:
            shutil.rmtree(out, ignore_errors=True)  # nothing half-written is left beside the folder
        if isinstance(exc, _Source):
            raise exc.error from None  # the tensors' own error (a checkpoint that cannot be read), as it was
        raise OutputError(f"cannot write {str(final)!r}: {cause_of(exc)}") from None
    if replace_folder:
        old = final.with_name(f".{final.name}.hotspa-export.old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(out, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        stale = sorted({p for pattern in WEIGHT_PATTERNS for p in out.glob(pattern) if p.name not in written})
        for file in stale:
            file.unlink()
        if stale:
            log.warning("hotspa: save_pretrained removed weight files it did not write from %s: %s", out,
                        ", ".join(p.name for p in stale))
    return names
