"""The pieces of a fake-world training step the memory estimators (``memory.py`` for one layout,
``memory_pipeline.py`` for a pipeline stage) and ``fake_llama.py`` share: the wrapped decoder, its roles
and shardings, empty home shards, a one-document micro-batch, and the live bytes of the engine's working
copies."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..layout import Layout
from ..models.config import LlamaConfig

__all__ = ["LiveBytes", "Wrapped", "empty_shard", "fill_grad_store", "llama_roles_and_shardings",
           "one_document_micro_batch", "reduce_and_step", "track_home_and_engine", "warm_optimizer"]


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


def one_document_micro_batch(layout: Layout, world: Any, tokens: int, rank: int = 0) -> Any:
    """Rank ``rank``'s slice of a plan with one document of ``tokens`` per dp group (real tensors).

    Args:
        layout: the layout of the plan's one stage.
        world: the world mesh (its ``shape``).
        tokens: each dp group's document.
        rank: whose slice.
    """
    from ..plan import Stage, StepPlan, slice_plan

    docs = [torch.zeros(tokens, dtype=torch.int64) for _ in range(layout.dp)]
    plan = StepPlan(0, tuple([tokens] * layout.dp), (Stage(layout, tuple(((i,),) for i in range(layout.dp))),))
    return slice_plan(plan, docs, world.shape, rank).stages[0].micro_batches[0]


def empty_shard(name: str, shape: tuple[int, ...], dim: int | None, start: int, stop: int) -> torch.Tensor:
    local = list(shape)
    if dim is not None:
        local[dim] = stop - start
    return torch.empty(local)


def warm_optimizer(home: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW over the home parameters with its state already created (it exists from step 1 on): one
    untracked step on zero gradients, run before the memory tracker starts.

    Args:
        home: the home parameters.
    """
    optimizer = torch.optim.AdamW(list(home.values()), lr=1e-4, foreach=False)
    for p in home.values():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def track_home_and_engine(mem: Any, home: dict[str, torch.Tensor], optimizer: Any, engine: Any) -> LiveBytes:
    """Files the home parameters and the optimizer's state with ``mem`` and the engine's buffers as it
    makes them; returns the live bytes of the engine's working copies.

    Args:
        mem: the fake world's ``MemoryTracker``, entered.
        home: the home parameters.
        optimizer: their optimizer.
        engine: the ``SwitchEngine``.
    """
    for p in home.values():
        mem.label("params", p)
    mem.track(optimizer)
    working = LiveBytes()
    engine.on_buffer = working.labeller(mem.label)
    return working


def reduce_and_step(mem: Any, engine: Any, parallel: Any, home: dict[str, torch.Tensor], optimizer: Any,
                    reduce: Any) -> tuple[dict[str, int], dict[str, int]]:
    """The step's end as the strategy runs it, after the compute: ``reduce()`` (peak measured from here
    on alone), the home parameters back, the optimizer step. Returns (the reduction's peak, the peak by
    the end).

    Args:
        mem: the ``MemoryTracker``.
        engine: the ``SwitchEngine``.
        parallel: the ``ParallelModel``.
        home: the home parameters.
        optimizer: their optimizer.
        reduce: the engine's reduction to run (a bound method).
    """
    mem.reset_peak()
    reduce()
    reduce_peak = mem.peak()
    parallel.restore(home)
    engine.release()
    engine.assign_home_grads()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    engine.clear_grad_store()
    return reduce_peak, mem.peak()


def fill_grad_store(engine: Any, home: dict[str, torch.Tensor]) -> None:
    """The fp32 gradient store as an earlier stage of the step left it (every home shard), filed as grads.

    Args:
        engine: the ``SwitchEngine``.
        home: the home parameters.
    """
    for name, p in home.items():
        engine.grad_store[name] = torch.zeros_like(p.to_local(), dtype=torch.float32)
        engine._label("grads", engine.grad_store[name])
