"""Gradient norms of a module whose gradients are DTensors sharded over the world.

Under ``HotSPaStrategy`` a home parameter's ``.grad`` is a DTensor sharded like the parameter (as
under FSDP2): ``p.grad.to_local()`` is this rank's shard, ``p.grad.full_tensor()`` the whole
gradient (a collective), and ``float(p.grad.norm())`` only this rank's part (the norm is a pending
``Partial`` DTensor). Lightning's ``lightning.pytorch.utilities.grad_norm`` cannot stack DTensor
norms; :func:`grad_norm` is a drop-in with the same keys and the true norms, one all-reduce in all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ...group_collectives import world_collectives

__all__ = ["grad_norm", "naming_our_grad_norm"]

#: the end of torch's error when Lightning's ``grad_norm`` reads ``p.grad.data`` of a DTensor gradient
_UNALLOCATED = "data is not allocated yet"


@contextlib.contextmanager
def naming_our_grad_norm() -> Iterator[None]:
    """Re-raise torch's "data is not allocated yet" (what Lightning's ``grad_norm`` raises on our
    DTensor gradients, in ``on_before_optimizer_step``) with the replacement named."""
    try:
        yield
    except RuntimeError as exc:
        if _UNALLOCATED not in str(exc):
            raise
        raise RuntimeError(f"use lightning_hotspa.grad_norm(module, norm_type) under HotSPaStrategy (the same keys, "
                           f"the whole gradients' norms; call it on every rank): gradients are DTensors sharded over "
                           f"the world, which lightning.pytorch.utilities.grad_norm cannot read. torch said: "
                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def _counted_here(g: Tensor, rank: int) -> Tensor | None:
    """This rank's part of a gradient, or None where another rank already counts it (a replica)."""
    if isinstance(g, DTensor):
        coords = g.device_mesh.get_coordinate()
        if coords is None or any(pl.is_replicate() and c != 0 for pl, c in zip(g.placements, coords)):
            return None
        return g.to_local()
    return g if rank == 0 else None  # a plain tensor is the same on every rank


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient p-norm and their total, over the whole gradients (every rank gets
    the same values; call it on every rank, e.g. in ``on_before_optimizer_step``).

    Args:
        module: the LightningModule (or any module) whose parameters' ``.grad`` to measure.
        norm_type: the p of the p-norm, a positive number or ``"inf"``.
        group_separator: between ``grad_{p}_norm`` and the parameter name, as in Lightning.
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    named = [(n, q.grad) for n, q in module.named_parameters() if q.grad is not None]
    if not named:
        return {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    parts = []
    for _, g in named:
        local = _counted_here(g, rank)
        if local is None or local.numel() == 0:
            parts.append(torch.zeros((), dtype=torch.float64, device=g.device))
        else:
            x = local.detach().double().abs()
            parts.append(x.max() if p == float("inf") else x.pow(p).sum())
    stacked = torch.stack(parts)
    if dist.is_initialized():
        world_collectives().all_reduce(stacked, op="max" if p == float("inf") else "sum")
    if p == float("inf"):
        norms, total = stacked, stacked.max()
    else:
        norms, total = stacked.pow(1.0 / p), stacked.sum().pow(1.0 / p)
    dtype = named[0][1].dtype if named[0][1].is_floating_point() else torch.float32
    out = {f"grad_{p}_norm{group_separator}{name}": norms[i].to(dtype) for i, (name, _) in enumerate(named)}
    out[f"grad_{p}_norm_total"] = total.to(dtype)
    return out
