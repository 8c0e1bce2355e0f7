"""Sequence parallelism inside tp (Megatron-style): the collectives at the edges of the tp regions.

Between a row-parallel layer and the next column-parallel one (norms, the residual stream) every
tp rank holds only its share of the tokens: rows ``[index*T/tp, (index+1)*T/tp)`` of the packed row
(the token dim is the second to last). Where plain tp all-reduces a row-parallel output (``g``) it
reduce-scatters along the tokens (:func:`scatter_tokens`); where it copies a column-parallel input
(``f``) it all-gathers them (:func:`gather_tokens`). Same bytes per rank as the one all-reduce,
1/tp of the residual stream and norm activations per rank (docs/DESIGN.md §11).

Column-parallel layers reading one gathered input (q, k, v; w1, w3) keep only this rank's SHARD for
backward (:func:`sequence_parallel_linear`): the first of them to run backward gathers the input
again, the others reuse it, the last drops it (:class:`Regather`), and their input gradients, summed
by autograd, are reduce-scattered once by the gather's backward.
"""

from __future__ import annotations

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


_ScatterTokens = collective_pair("_ScatterTokens", _scatter, _gather,
                                 "Reduce-scatter forward, all-gather backward (output of a row-parallel op / the "
                                 "embedding).")
_GatherTokens = collective_pair("_GatherTokens", _gather, _scatter,
                                "All-gather forward, reduce-scatter backward (input of column-parallel ops).")


def scatter_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """Partial sums ``[..., T, H]`` -> this rank's summed tokens ``[..., T/tp, H]`` (backward: all-gather)."""
    return x if group.size == 1 else _ScatterTokens.apply(x, group)


def gather_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """This rank's tokens ``[..., T/tp, H]`` -> all of them in shard order (backward: reduce-scatter)."""
    return x if group.size == 1 else _GatherTokens.apply(x, group)


class Regather:
    """The gathered input of the column-parallel layers sharing one :func:`gather_tokens`, rebuilt
    once in backward from the shard they saved and dropped after its last user."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.users = 0
        self._full: Tensor | None = None

    def take(self, shard: Tensor) -> Tensor:
        """The gathered input (all-gathered on the first call of a backward)."""
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
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        shard, weight = ctx.saved_tensors
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
