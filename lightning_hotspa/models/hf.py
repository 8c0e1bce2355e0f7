"""Loading a :class:`LlamaLM` from a local Hugging Face folder and writing one back.

Loading never builds the model twice: the module is constructed on the meta device and each
parameter is then read from the checkpoint, either whole (a single process) or, inside the HotSPa
strategy, as this rank's home slice only (``init_parameter(name, dim=, start=, stop=)``; the strategy asks for it when
the module was built under ``trainer.init_module(empty_init=True)``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .config import LlamaConfig
from .hf_config import HFConfigError, config_from_hf, config_to_hf, read_hf_config
from .hf_weights import HFCheckpoint, HFWeightsError, hf_name, save_hf_folder

__all__ = ["PretrainedSource", "load_pretrained", "hf_tensors", "save_pretrained"]


class PretrainedSource:
    """Where a module's initial weights come from: names inside :class:`Llama` -> checkpoint reads.

    ``strict_weights`` (the default) refuses tensors of a non-float dtype (at :meth:`check`) and
    non-finite values (each tensor or slice as it is read); False casts and loads them anyway.
    """

    def __init__(self, path: str | os.PathLike[str], config: LlamaConfig, strict_weights: bool = True) -> None:
        self.path = str(path)
        self.checkpoint = HFCheckpoint(path)
        self.config = config
        self.strict_weights = strict_weights
        available = set(self.checkpoint.names())
        if config.tie_embeddings:
            available.discard("lm_head.weight")  # tied checkpoints may or may not store the copy
        self._available = available

    def check(self, names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
        """Every parameter present with its shape, no checkpoint tensor left over (both named)."""
        wanted = {hf_name(n): n for n in names}
        missing = sorted(set(wanted) - self._available)
        extra = sorted(n for n in self._available - set(wanted) if not n.endswith("rotary_emb.inv_freq"))
        if missing or extra:
            raise HFConfigError(f"{self.path!r}: checkpoint tensors missing {missing[:6]}, unexpected {extra[:6]}")
        if self.strict_weights:
            self.checkpoint.check_float(wanted)
        for hf, ours in wanted.items():
            found = self.checkpoint.shape(hf)
            if found != shapes[ours]:
                raise HFConfigError(f"{self.path!r}: {hf} has shape {found}, the config implies {shapes[ours]}")

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> Tensor:
        """Parameter ``name`` (inside :class:`Llama`) in fp32, whole or ``[start, stop)`` along ``dim``."""
        value = self.checkpoint.read(hf_name(name), dim, start, stop).float()
        if self.strict_weights:
            bad = int((~torch.isfinite(value)).sum())  # once per tensor at load, not on the hot path
            if bad:
                raise HFWeightsError(f"{self.path!r}: tensor {hf_name(name)} holds {bad} non-finite value(s) (NaN or "
                                     f"Inf) of {value.numel()}; pass strict_weights=False to load it anyway")
        return value


def _split_overrides(cls: type, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    module_args = set(inspect.signature(cls.__init__).parameters) - {"self", "config"}
    return ({k: v for k, v in overrides.items() if k not in module_args},
            {k: v for k, v in overrides.items() if k in module_args})


def load_pretrained(cls: type, path: str | os.PathLike[str], *, strict_weights: bool = True, **overrides: Any) -> Any:
    """``cls(config_from_hf(...), **module_args)`` with the checkpoint's weights (see module doc).

    Args:
        cls: the LightningModule class.
        path: the Hugging Face folder.
        strict_weights: refuse non-float and non-finite weights (False: load them).
        overrides: LlamaConfig fields or ``cls`` arguments.
    """
    if not isinstance(strict_weights, bool):
        raise HFConfigError(f"strict_weights must be a bool, got {strict_weights!r}")
    config_fields, module_args = _split_overrides(cls, overrides)
    config = config_from_hf(read_hf_config(path), where=repr(str(Path(path).expanduser() / "config.json")),
                            **config_fields)
    if config.padded_vocab_size != config.vocab_size:
        raise HFConfigError(f"vocab_multiple={config.vocab_multiple} would pad the checkpoint's {config.vocab_size} "
                            f"ids to {config.padded_vocab_size} rows: logits the released model does not have; "
                            f"keep vocab_multiple=1 (the default for Hugging Face checkpoints)")
    target = torch.empty(0).device  # the caller's default device: meta under init_module(empty_init=True)
    with torch.device("meta"):
        module = cls(config, **module_args)
    source = PretrainedSource(path, config, strict_weights)
    names = [n for n, _ in module.model.named_parameters()]
    source.check(names, {n: tuple(p.shape) for n, p in module.model.named_parameters()})
    module.pretrained = source
    module.hparams["pretrained"] = source.path
    if target.type != "meta":
        _materialize(module.model, source, target)
    return module


@torch.no_grad()
def _materialize(model: nn.Module, source: PretrainedSource, device: torch.device) -> None:
    """Each meta parameter replaced by its checkpoint value, one tensor at a time."""
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, leaf, nn.Parameter(source.read(name).to(device), requires_grad=param.requires_grad))


def hf_tensors(state: Iterator[tuple[str, Tensor]], dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) for (our name inside Llama, tensor) pairs."""
    for name, tensor in state:
        yield hf_name(name), tensor if dtype is None else tensor.to(dtype)


def _full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def save_pretrained(module: Any, path: str | os.PathLike[str], dtype: torch.dtype | None = None,
                    is_writer: bool | None = None) -> None:
    """A folder ``transformers`` loads: config.json + safetensors. On a sharded (strategy) module
    EVERY rank must call it (each parameter is gathered, one at a time); rank 0 writes."""
    import torch.distributed as dist

    if is_writer is None:
        is_writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    config: LlamaConfig = module.config
    names = dict(module.model.named_parameters())
    tensors = []
    for name, param in names.items():
        full = _full(param.detach()).cpu()  # a collective for a DTensor: all ranks, same order
        if is_writer:
            tensors.append((name, full if dtype is None else full.to(dtype)))
        else:
            del full
    if is_writer:
        dtype_name = str(dtype or next(iter(names.values())).dtype).removeprefix("torch.")
        save_hf_folder(path, config_to_hf(config, dtype_name), hf_tensors(iter(tensors)))
