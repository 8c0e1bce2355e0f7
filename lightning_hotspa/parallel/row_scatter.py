"""A row-parallel layer's output reduce-scattered over the tokens with its GEMM (tp overlap).

Under sequence parallelism a row-parallel layer (``wo``, ``w2``) computes partial sums of every
token and reduce-scatters them along the tokens. :class:`_RowScatter` does both in one autograd node
through the group's collectives object (``group.comm.matmul_reduce_scatter``: torch's symmetric-memory
fused op on NCCL, a ring on gloo), and its backward is the conjugate: the output gradient all-gathered
with the input-gradient GEMM (``all_gather_matmul``), whose gathered rows also give the weight
gradient. A ``tp_linear_forward`` module whose GEMM's left operand is an elementwise function of its
inputs declares it as ``tp_row_input`` (``SwiGLUDown``: ``silu(a) * b``); that operand is recomputed
in backward, never saved, as the module's own kernel does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..mesh import RankGroup
from ..shard_rows import all_gather_matmul_rows, matmul_reduce_scatter_rows
from .sequence_parallel import check_token_split

__all__ = ["row_scatter"]


def _identity(x: Tensor) -> Tensor:
    return x


class _RowScatter(torch.autograd.Function):
    """``reduce_scatter_tokens(F.linear(left(*inputs), weight))`` with the GEMM inside the collective."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, group: RankGroup, left: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        with torch.no_grad():
            h = left(*inputs)
        check_token_split(h.shape[-2], group)
        out = matmul_reduce_scatter_rows([h.movedim(-2, 0)], [weight.t()], group)
        del h
        ctx.save_for_backward(weight, *inputs)
        ctx.group, ctx.left = group, left
        return out.movedim(0, -2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        weight, *inputs = ctx.saved_tensors
        gathered, (grad_h,) = all_gather_matmul_rows(grad.movedim(-2, 0), [weight], ctx.group)
        gathered, grad_h = gathered.movedim(0, -2), grad_h.movedim(0, -2)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(need) for x, need in zip(inputs, ctx.needs_input_grad[3:])]
            h = ctx.left(*leaves)
        grad_weight = None
        if ctx.needs_input_grad[0]:
            rows = h.detach().reshape(-1, h.shape[-1])
            grad_weight = gathered.reshape(-1, gathered.shape[-1]).t().mm(rows)
            del rows
        wanted = [x for x in leaves if x.requires_grad]
        grads = iter(torch.autograd.grad(h, wanted, grad_h) if wanted else ())
        return (grad_weight, None, None, *(next(grads) if x.requires_grad else None for x in leaves))


def row_scatter(weight: Tensor, group: RankGroup, *inputs: Tensor, left: Callable[..., Tensor] | None = None) -> Tensor:
    """This rank's tokens of the summed row-parallel output ``left(*inputs) @ weight.T``.

    Args:
        weight: the row-parallel shard ``[N, K/tp]``.
        group: the tp group.
        inputs: the layer's inputs ``[..., T, *]`` (all tokens of the tp group, this rank's features).
        left: the GEMM's left operand from the inputs (default: the one input itself).
    """
    return _RowScatter.apply(weight, group, left or _identity, *inputs)
