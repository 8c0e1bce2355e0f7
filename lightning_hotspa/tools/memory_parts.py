"""The pieces of a fake-world training step both memory estimators share (``memory.py`` for one layout,
``memory_pipeline.py`` for a pipeline stage): the wrapped decoder, its roles and shardings, empty home
shards, and the live bytes of the engine's working copies."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..layout import Layout
from ..models.config import LlamaConfig

__all__ = ["LiveBytes", "Wrapped", "empty_shard", "llama_roles_and_shardings"]


class Wrapped(torch.nn.Module):
    """The Llama decoder with its loss computed as ``LlamaLM`` does by default: through the model's
    blocked loss head (``fused_loss_head``; vocab-parallel under tp). ``loss_fn`` and the opt-in
    stay for the contract's sake (without it, tp layouts would gather full-vocabulary logits)."""

    vocab_parallel_loss = True

    def __init__(self, config: LlamaConfig) -> None:
        from ..models import Llama, token_mean_cross_entropy

        super().__init__()
        self.model = Llama(config)
        self.loss_fn = token_mean_cross_entropy

    def forward(self, mb: Any) -> torch.Tensor:
        return self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels)


def llama_roles_and_shardings(module: nn.Module, config: LlamaConfig, layout: Layout, world: Any) -> tuple[dict, dict]:
    """The tensor-parallel roles and home shardings of a wrapped Llama (``model.`` prefix) in ``layout``.

    Args:
        module: the model wrapped as the estimator wraps it (its parameters under ``model.``).
        config: its configuration.
        layout: the layout it runs in (replicated roles without tp).
        world: the ``WorldMesh``.
    """
    from ..models import llama_tp_plan, param_roles
    from ..placements import build_shardings

    roles = param_roles(module, llama_tp_plan(config, layout.tp, prefix="model.")) if layout.tp > 1 \
        else {n: "replicated" for n, _ in module.named_parameters()}
    shardings = build_shardings({n: tuple(p.shape) for n, p in module.named_parameters()}, roles, world.shape)
    return roles, shardings


class LiveBytes:
    """Peak bytes of the engine's live working params (working copies and an fsdp unit's gathered
    tensors), each counted from its allocation until the tensor object dies."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def labeller(self, inner: Any) -> Any:
        def label(category: str, tensor: torch.Tensor) -> None:
            inner(category, tensor)
            if category == "params":
                # a copy another pipeline stage computes with holds no storage (switch.unmaterialized)
                nbytes = tensor.numel() * tensor.element_size() if tensor.untyped_storage().nbytes() else 0
                self.now += nbytes
                self.peak = max(self.peak, self.now)
                weakref.finalize(tensor, self._release, nbytes)
        return label

    def _release(self, nbytes: int) -> None:
        self.now -= nbytes


def empty_shard(name: str, shape: tuple[int, ...], dim: int | None, start: int, stop: int) -> torch.Tensor:
    local = list(shape)
    if dim is not None:
        local[dim] = stop - start
    return torch.empty(local)
