"""A row-parallel layer's output reduce-scattered over the tokens with its GEMM (tp overlap).

Under sequence parallelism a row-parallel layer (``wo``, ``w2``) computes partial sums of every
token and reduce-scatters them along the tokens. :class:`_RowScatter` does both in one autograd node
through the group's collectives object (``group.comm.matmul_reduce_scatter``: torch's symmetric-memory
fused op on NCCL, a ring on gloo), and its backward is the conjugate: the output gradient all-gathered
with the input-gradient GEMM (``all_gather_matmul``), whose gathered rows also give the weight
gradient. A ``tp_linear_forward`` module whose GEMM's left operand is an elementwise function of its
inputs declares it as ``tp_row_input`` (``SwiGLUDown``: ``silu(a) * b``); that operand is recomputed
in backward, never saved, as the module's own kernel does.

Under ``torch.compile`` (``strategy.runtime.compile_blocks``) the same computation is ONE custom op,
``hotspa::row_scatter`` with its backward ``hotspa::row_scatter_backward``: dynamo cannot trace the
gloo ring's send / receive nor the ``torch.autograd.grad`` that recomputes the left operand's
gradient, and an opaque op keeps both out of the graph (no graph break). The op names its group by
``(dims, ranks)`` (filed by :func:`file_group` when a layout is applied, as dynamo replays a traced
side effect only after the graph ran) and its left operand by module and qualified name.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..mesh import RankGroup
from ..shard_rows import all_gather_matmul_rows, matmul_reduce_scatter_rows
from .sequence_parallel import check_token_split

__all__ = ["file_group", "row_scatter"]

#: the groups the custom op can name, by (dims, ranks)
_GROUPS: dict[tuple[tuple[int, ...], tuple[int, ...]], RankGroup] = {}


def file_group(group: RankGroup) -> None:
    """Files ``group`` for the compiled op (``ParallelModel.apply_layout`` files each layout's tp group).

    Args:
        group: a tp group.
    """
    _GROUPS.setdefault((group.dims, group.ranks), group)


@torch._dynamo.assume_constant_result
def _left_name(left: Callable[..., Tensor]) -> str:
    """``module:qualname`` of ``left``, worked out by dynamo while tracing (a constant of the graph)."""
    return f"{left.__module__}:{left.__qualname__}"


@functools.cache
def _left(name: str) -> Callable[..., Tensor]:
    """The left operand ``module:qualname`` names."""
    module, qualname = name.split(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


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


def _op_group(dims: list[int], ranks: list[int]) -> RankGroup:
    key = (tuple(dims), tuple(ranks))
    if key not in _GROUPS:
        raise LookupError(f"row_scatter: group over dims {key[0]}, ranks {key[1]} was never filed (file_group)")
    return _GROUPS[key]


@torch.library.custom_op("hotspa::row_scatter", mutates_args=())
def _row_scatter_op(weight: Tensor, inputs: list[Tensor], dims: list[int], ranks: list[int], left: str) -> Tensor:
    return _RowScatter.forward(_NoContext(), weight, _op_group(dims, ranks), _left(left), *inputs).contiguous()


@_row_scatter_op.register_fake
def _(weight: Tensor, inputs: list[Tensor], dims: list[int], ranks: list[int], left: str) -> Tensor:
    x = inputs[0]
    return x.new_empty((*x.shape[:-2], x.shape[-2] // len(ranks), weight.shape[0]))


@torch.library.custom_op("hotspa::row_scatter_backward", mutates_args=())
def _row_scatter_backward_op(grad: Tensor, weight: Tensor, inputs: list[Tensor], dims: list[int], ranks: list[int],
                             left: str) -> list[Tensor]:
    # a custom op runs below autograd: the left operand's gradient through torch.func.vjp
    gathered, (grad_h,) = all_gather_matmul_rows(grad.movedim(-2, 0), [weight], _op_group(dims, ranks))
    gathered, grad_h = gathered.movedim(0, -2), grad_h.movedim(0, -2)
    h, vjp = torch.func.vjp(_left(left), *inputs)
    grad_weight = gathered.reshape(-1, gathered.shape[-1]).t().mm(h.reshape(-1, h.shape[-1]))
    return [g.contiguous() for g in (grad_weight, *vjp(grad_h))]


@_row_scatter_backward_op.register_fake
def _(grad: Tensor, weight: Tensor, inputs: list[Tensor], dims: list[int], ranks: list[int],
      left: str) -> list[Tensor]:
    return [weight.new_empty(weight.shape), *(x.new_empty(x.shape) for x in inputs)]


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    weight, tensors, dims, ranks, left = inputs
    ctx.save_for_backward(weight, *tensors)
    ctx.dims, ctx.ranks, ctx.left = dims, ranks, left


def _backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    weight, *inputs = ctx.saved_tensors
    grad_weight, *grad_inputs = _row_scatter_backward_op(grad.contiguous(), weight, inputs, ctx.dims, ctx.ranks,
                                                         ctx.left)
    return grad_weight, grad_inputs, None, None, None


_row_scatter_op.register_autograd(_backward, setup_context=_setup)


class _NoContext:
    """The context :class:`_RowScatter`'s forward writes, outside autograd (the custom op)."""

    def save_for_backward(self, *tensors: Tensor) -> None:
        pass


def row_scatter(weight: Tensor, group: RankGroup, *inputs: Tensor, left: Callable[..., Tensor] | None = None) -> Tensor:
    """This rank's tokens of the summed row-parallel output ``left(*inputs) @ weight.T``.

    Args:
        weight: the row-parallel shard ``[N, K/tp]``.
        group: the tp group.
        inputs: the layer's inputs ``[..., T, *]`` (all tokens of the tp group, this rank's features).
        left: the GEMM's left operand from the inputs (default: the one input itself).
    """
    left = left or _identity
    if torch.compiler.is_compiling():  # one opaque op (module docstring); the filing is replayed by dynamo
        name = _left_name(left)
        return _row_scatter_op(weight, list(inputs), list(group.dims), list(group.ranks), name)
    return _RowScatter.apply(weight, group, left, *inputs)
