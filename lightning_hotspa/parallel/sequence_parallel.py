"""Sequence parallelism inside tp (Megatron-style): the collectives at the edges of the tp regions.

Between a row-parallel layer and the next column-parallel one (norms, the residual stream) every
tp rank holds only its share of the tokens: rows ``[index*T/tp, (index+1)*T/tp)`` of the packed row
(the token dim is the second to last). Where plain tp all-reduces a row-parallel output (``g``) it
reduce-scatters along the tokens (:func:`scatter_tokens`); where it copies a column-parallel input
(``f``) it all-gathers them (:func:`gather_tokens`). Same bytes per rank as the one all-reduce,
1/tp of the residual stream and norm activations per rank (docs/DESIGN.md §11).

Column-parallel layers reading one gathered input (q, k, v; w1, w3) keep only this rank's SHARD for
backward (:func:`sequence_parallel_linear`): the input is all-gathered again once (:class:`Regather`),
in the same all-gather as the gradient of the region's row-parallel output (the region's first
collective in backward), the users share it, the last drops it; their input gradients, summed by
autograd, are reduce-scattered once by the gather's backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout import LayoutError
from ..mesh import RankGroup
from .collectives import all_gather_rows, collective_pair, reduce_scatter_rows

__all__ = ["Regather", "gather_tokens", "scatter_tokens", "sequence_parallel_linear"]


def _gather(x: Tensor, group: RankGroup) -> Tensor:
    """All-gather along the token dim (-2) in shard order."""
    rows = x.movedim(-2, 0)
    return all_gather_rows(rows, group).movedim(0, -2)


def _scatter(x: Tensor, group: RankGroup) -> Tensor:
    """Sum over the group, keeping this rank's block of tokens (dim -2)."""
    tokens = x.shape[-2]
    if tokens % group.size:
        raise LayoutError(f"sequence parallelism: {tokens} tokens on this rank are not divisible by tp="
                          f"{group.size}; build micro-batches with pack_micro_batch(..., tp_size={group.size}) "
                          f"(slice_plan does), which pads the last document (labels -100)")
    rows = x.movedim(-2, 0).contiguous()
    return reduce_scatter_rows(rows, group).movedim(0, -2)


_GatherTokens = collective_pair("_GatherTokens", _gather, _scatter,
                                "All-gather forward, reduce-scatter backward (input of column-parallel ops).")


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter forward, all-gather backward (output of a row-parallel op / the embedding); the
    backward's all-gather also brings the region's input again for its :class:`Regather` when given."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: RankGroup, regather: Regather | None) -> Tensor:
        ctx.group, ctx.regather = group, regather
        return _scatter(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        regather, ctx.regather = ctx.regather, None
        shard = regather.prefetch_shard(grad) if regather is not None else None
        if shard is None:
            return _gather(grad, ctx.group), None, None
        width = grad.shape[-1]
        both = _gather(torch.cat([grad, shard], dim=-1), ctx.group)  # [gradient | input] along the features
        regather.prefetched(both[..., width:])
        return both[..., :width], None, None


def scatter_tokens(x: Tensor, group: RankGroup, regather: Regather | None = None) -> Tensor:
    """Partial sums ``[..., T, H]`` -> this rank's summed tokens ``[..., T/tp, H]`` (backward: all-gather).

    Args:
        x: the partial sums (a row-parallel output).
        group: the tp group.
        regather: the :class:`Regather` of the region this output closes. On a gloo group (latency
            bound) the backward all-gather brings the region's input again with the gradient, one
            collective instead of two; elsewhere the input waits for its first user's backward, as
            the early copy would stay alive through the region's backward (the attention kernel's,
            where all-gather-KV and fsdp layouts peak; docs/DESIGN.md §11).
    """
    if group.size == 1:
        return x
    return _ScatterTokens.apply(x, group, regather if group.backend == "gloo" else None)


def gather_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """This rank's tokens ``[..., T/tp, H]`` -> all of them in shard order (backward: reduce-scatter)."""
    return x if group.size == 1 else _GatherTokens.apply(x, group)


class Regather:
    """The gathered input of the column-parallel layers sharing one :func:`gather_tokens`, rebuilt
    once in backward from the shard they saved and dropped after its last user.

    The region's closing :func:`scatter_tokens` brings it early when it can, in the all-gather of its
    output gradient (:meth:`prefetch_shard`, :meth:`prefetched`); otherwise the first user's backward
    gathers it. The shard is read from the first user's saved tensors through a weak reference to its
    backward node, so the Regather keeps no activation alive; that user's backward then takes the
    tensors read for it (:meth:`saved_tensors`: activation checkpointing allows one read, and
    recomputes them on it).

    Args:
        group: the tp group.
        on_backward: called when a backward first reaches the region (the forward is done with
            its gathered input; :class:`~.tensor_parallel._SharedInputCopy` lets go of it).
    """

    def __init__(self, group: RankGroup, on_backward: Callable[[], None] | None = None) -> None:
        self.group = group
        self.users = 0
        self.on_backward = on_backward
        self._first: weakref.ref | None = None  # the first user's backward node
        self._shard_meta: tuple | None = None  # its shard's (dtype, device, shape[:-1])
        self._read: tuple[Tensor, ...] | None = None  # its saved tensors, read by the prefetch
        self._taken = False
        self._full: Tensor | None = None

    def _backward_reached(self) -> None:
        if self.on_backward is not None:
            self.on_backward()
            self.on_backward = None

    def register(self, node: Any, shard: Tensor) -> None:
        """Notes a user's backward node (``node.saved_tensors[0]`` is ``shard``)."""
        if self._first is None:
            self._first = weakref.ref(node)
            self._shard_meta = (shard.dtype, shard.device, shard.shape[:-1])

    def prefetch_shard(self, grad: Tensor) -> Tensor | None:
        """The input shard if it can travel with ``grad`` (same dtype, device and leading shape, before
        any user's backward), else None."""
        self._backward_reached()
        node = self._first() if self._first is not None else None
        if node is None or self._taken or self._full is not None or self.users <= 0:
            return None
        if self._shard_meta != (grad.dtype, grad.device, grad.shape[:-1]):
            return None
        self._read = tuple(node.saved_tensors)
        return self._read[0]

    def prefetched(self, full: Tensor) -> None:
        """Keeps ``full`` (the gathered input) for the users' backward."""
        self._full = full

    def saved_tensors(self, ctx: Any) -> tuple[Tensor, ...]:
        """``ctx.saved_tensors`` of a user, or what the prefetch read of them (once)."""
        if self._read is not None and self._first is not None and self._first() is ctx:
            read, self._read = self._read, None
            return read
        return ctx.saved_tensors

    def take(self, shard: Tensor) -> Tensor:
        """The gathered input (all-gathered on the first call of a backward unless prefetched)."""
        self._taken = True
        self._backward_reached()
        if self._full is None:
            with torch.no_grad():
                self._full = _gather(shard.contiguous(), self.group)
        full = self._full
        self.users -= 1
        if self.users <= 0:
            self._full = None
        return full


class _SequenceParallelLinear(torch.autograd.Function):
    """``F.linear`` of the gathered input that saves this rank's shard instead of the gathered rows."""

    @staticmethod
    def forward(ctx: Any, full: Tensor, shard: Tensor, weight: Tensor, bias: Tensor | None,
                regather: Regather) -> Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.regather, ctx.has_bias = regather, bias is not None
        regather.register(ctx, shard)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        shard, weight = ctx.regather.saved_tensors(ctx)
        full = ctx.regather.take(shard)
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = rows.t().mm(full.reshape(-1, full.shape[-1])) if ctx.needs_input_grad[2] else None
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_input, None, grad_weight, grad_bias, None


def sequence_parallel_linear(full: Tensor, shard: Tensor, weight: Tensor, bias: Tensor | None,
                             regather: Regather) -> Tensor:
    """``F.linear(full, weight, bias)`` where ``full = gather_tokens(shard)``; keeps ``shard`` (not
    ``full``) for backward and counts itself as one of ``regather``'s users."""
    regather.users += 1
    return _SequenceParallelLinear.apply(full, shard, weight, bias, regather)
