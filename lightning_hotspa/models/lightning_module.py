"""LightningModule for the Llama decoder, trained on packed micro-batches.

``training_step`` returns the mean loss over its own slice's target tokens, as any
LightningModule does; the HotSPa strategy rescales it by the slice's share of the mini-batch's
target tokens (docs/DESIGN.md §4). The loss function is an attribute so a tensor-parallel wrapper
can swap in a vocab-parallel cross-entropy for vocab-sharded logits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from ..activation_checkpointing import Checkpointing
from ..checks import check_int, check_number
from ..plan import IGNORE_INDEX
from .config import LlamaConfig
from .init import build_llama, init_parameter
from .llama import Llama
from .tp_plan import TPRole, llama_tp_plan
from .vocab import check_token_ids

__all__ = ["IGNORE_INDEX", "LlamaLM", "PackedBatch", "token_mean_cross_entropy"]


class PackedBatch(Protocol):
    """What ``training_step`` reads (``lightning_hotspa.plan.MicroBatch`` has these fields)."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    num_target_tokens: int


def token_mean_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean fp32 cross-entropy over positions with ``labels != -100``.

    With no target at all it returns an exact zero that still depends on ``logits`` (the sum
    over no targets), so backward runs and yields zero gradients; no host sync is needed.
    """
    total = F.cross_entropy(
        logits if logits.dtype == torch.float64 else logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    count = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


def _as_config(config: LlamaConfig | str | Mapping[str, Any]) -> LlamaConfig:
    if isinstance(config, LlamaConfig):
        return config
    if isinstance(config, str):
        return LlamaConfig.preset(config)
    fields = dict(config)
    preset = fields.pop("preset", None)
    return LlamaConfig.preset(preset, **fields) if preset else LlamaConfig(**fields)


def _check_arguments(*, seed: Any, lr: Any, weight_decay: Any, betas: Any, warmup_steps: Any, max_steps: Any,
                     min_lr_ratio: Any, activation_checkpointing: Any, attention_backend: Any) -> None:
    """:class:`LlamaLM`'s arguments type-checked at construction (``from_pretrained(path, lr="fast")``
    and Hydra's ``model.lr=fast`` fail here, naming the value, not later inside AdamW)."""
    check_int(seed, "LlamaLM seed", minimum=0)
    check_number(lr, "LlamaLM lr")
    check_number(weight_decay, "LlamaLM weight_decay", strict=False)
    if (isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2
            or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"LlamaLM betas must be two numbers in [0, 1), got {betas!r}")
    check_int(warmup_steps, "LlamaLM warmup_steps", minimum=0)
    if max_steps is not None:  # -1 (Lightning's "no limit", via ${trainer.max_steps}): no cosine decay
        check_int(max_steps, "LlamaLM max_steps", minimum=-1, hint=" or None")
    if not (isinstance(min_lr_ratio, numbers.Real) and not isinstance(min_lr_ratio, bool) and 0 <= min_lr_ratio <= 1):
        raise ValueError(f"LlamaLM min_lr_ratio must be a number in [0, 1], got {min_lr_ratio!r}")
    Checkpointing.parse(activation_checkpointing)  # the one grammar: a mode name or a bool, named if neither
    if not isinstance(attention_backend, str):
        raise ValueError(f"LlamaLM attention_backend must be a backend name (str), got {attention_backend!r}")


class LlamaLM(L.LightningModule):
    """Causal LM over packed documents.

    ``config`` is a :class:`LlamaConfig`, a preset name, or a mapping of fields (with an
    optional ``preset`` key to start from), which is how Hydra configs pass it. Weights are
    seeded per parameter from ``seed``; built under ``torch.device("meta")`` (as a strategy's
    init context may do) they stay empty and the strategy fills them, shard by shard, from
    :meth:`init_parameter`.
    """

    #: opts in to a vocab-parallel loss under tp: the logits are consumed ONLY through ``loss_fn``,
    #: so the strategy may keep them vocab-sharded and wrap ``loss_fn`` (a subclass that reads the
    #: logits elsewhere sets this to False and gets gathered logits).
    vocab_parallel_loss = True
    #: the loss goes through the model's blocked head (``Llama.forward(..., labels)``, models/loss_head.py:
    #: no fp32 [tokens, vocab] is ever held, vocab-parallel under tp); False: ``loss_fn(logits, labels)``
    fused_loss_head = True

    def __init__(
        self,
        config: LlamaConfig | str | Mapping[str, Any] = "tiny",
        *,
        seed: int = 0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        activation_checkpointing: bool = False,
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        _check_arguments(seed=seed, lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps,
                         max_steps=max_steps, min_lr_ratio=min_lr_ratio,
                         activation_checkpointing=activation_checkpointing, attention_backend=attention_backend)
        self.config = _as_config(config)
        # what save_hyperparameters records (it reads this frame's arguments): the config's fields as plain
        # values, rope scaling a mapping. Lightning's CSV and TensorBoard loggers write hparams as YAML
        # through apply_to_collection, which refuses a frozen dataclass
        config = dataclasses.asdict(self.config)
        self.save_hyperparameters()
        self.model: Llama = build_llama(self.config, seed)
        self.model.set_activation_checkpointing(activation_checkpointing)
        self.model.set_attention_backend(attention_backend)
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] = token_mean_cross_entropy
        self.pretrained: Any = None  # a models.hf.PretrainedSource after from_pretrained

    @classmethod
    def from_pretrained(cls, path: str, *, strict_weights: bool = True, **overrides: Any) -> LlamaLM:
        """A local Hugging Face Llama / Mistral / Qwen2 folder (config.json + safetensors).

        ``overrides`` are LlamaConfig fields (e.g. ``max_seq_len``) or this class's arguments (``lr``),
        type-checked. ``strict_weights=False`` loads non-float (cast) and non-finite weights, refused by default.
        Under ``trainer.init_module(empty_init=True)`` nothing is read here: the HotSPa strategy reads
        each rank's home slices at setup. Otherwise the weights are read here, one tensor at a time.
        """
        from .hf import load_pretrained

        return load_pretrained(cls, path, strict_weights=strict_weights, **overrides)

    def save_pretrained(self, path: str, dtype: torch.dtype | None = None) -> None:
        """Writes a folder ``transformers`` loads; with the strategy's sharded parameters every rank
        must call it (each parameter is gathered in turn, rank 0 writes)."""
        from .hf import save_pretrained

        save_pretrained(self, path, dtype)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int
    ) -> Tensor:
        return self.model(input_ids, position_ids, cu_seqlens, max_seqlen)

    def _loss(self, batch: PackedBatch) -> Tensor:
        # before the forward: the check's host read then waits for the copy in, not for the forward
        check_token_ids(batch.labels, self.config.vocab_size, "labels", ignore_index=IGNORE_INDEX)
        if self.fused_loss_head:
            return self.model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen,
                              labels=batch.labels)
        logits = self(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
        return self.loss_fn(logits, batch.labels)

    def training_step(self, batch: PackedBatch, batch_idx: int = 0) -> Tensor:
        loss = self._loss(batch)
        if batch.num_target_tokens:  # a slice without targets (an fsdp idle round) has no loss to log
            self.log("train/loss", loss.detach(), prog_bar=True, batch_size=int(batch.num_target_tokens))
        return loss

    def validation_step(self, batch: PackedBatch, batch_idx: int = 0) -> Tensor:
        """Token-mean loss of the slice, logged weighted by its target tokens."""
        loss = self._loss(batch)
        self.log("val/loss", loss.detach(), prog_bar=True, sync_dist=True,
                 batch_size=max(int(batch.num_target_tokens), 1))
        return loss

    def test_step(self, batch: PackedBatch, batch_idx: int = 0) -> Tensor:
        """Token-mean loss of the slice, logged as ``test/loss`` weighted by its target tokens."""
        loss = self._loss(batch)
        self.log("test/loss", loss.detach(), sync_dist=True, batch_size=max(int(batch.num_target_tokens), 1))
        return loss

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint`` of a single-file checkpoint; a checkpoint folder that
        ``HotSPaStrategy`` wrote (DCP shards) is refused with the command that makes one file of it.

        Args:
            checkpoint_path: a ``.ckpt`` file (e.g. from ``hotspa consolidate``).
            args: Lightning's further arguments.
            kwargs: Lightning's further keyword arguments.
        """
        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isdir(checkpoint_path):
            raise IsADirectoryError(
                f"{str(checkpoint_path)!r} is a checkpoint folder (one shard per rank, as HotSPaStrategy writes); "
                f"load_from_checkpoint reads one file: make it with `hotspa consolidate {checkpoint_path} "
                f"model.ckpt` and load model.ckpt (or resume training with trainer.fit(ckpt_path=...))")
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def init_parameter(self, name: str, *, dim: int | None = None, start: int = 0,
                       stop: int | None = None) -> Tensor:
        """fp32 initial value of parameter ``name`` of this module (``model.`` prefix), or only its
        slice ``[start, stop)`` along ``dim`` (a rank's home shard: generated alone, models/init.py)."""
        inner = name.removeprefix("model.")
        if inner == name:
            raise ValueError(f"{type(self).__name__} has no parameter {name!r}")
        if self.pretrained is not None:  # a Hugging Face checkpoint: only this slice is read from disk
            return self.pretrained.read(inner, dim, start, stop)
        shape = self.get_parameter(name).shape
        return init_parameter(inner, shape, self.hparams.seed, n_layers=self.config.n_layers,
                              dim=dim, start=start, stop=stop)

    def tp_plan(self, tp: int, sequence_parallel: bool = True) -> dict[str, TPRole]:
        """The declarative TP plan with names relative to this module.

        Args:
            tp: the largest tp degree.
            sequence_parallel: split the residual stream over tp along the tokens (the default).
        """
        return llama_tp_plan(self.config, tp, prefix="model.", sequence_parallel=sequence_parallel)

    def configure_optimizers(self) -> Any:
        """AdamW (no decay on 1-D params such as norms), optional linear warmup + cosine decay."""
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas),
        )
        if hp.warmup_steps <= 0 and hp.max_steps is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda=_warmup_cosine(hp.warmup_steps, hp.max_steps, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _warmup_cosine(
    warmup_steps: int, max_steps: int | None, min_ratio: float
) -> Callable[[int], float]:
    """LR multiplier: linear warmup, then cosine down to ``min_ratio`` at ``max_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if max_steps is None or max_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
