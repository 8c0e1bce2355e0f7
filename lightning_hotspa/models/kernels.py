"""Autograd functions that save only what their backward needs (docs/DESIGN.md §11).

- :func:`rms_norm`: saves the input in the working dtype and an fp32 inverse rms per token (autograd
  on the plain expression keeps an fp32 copy of the input and the normed value besides).
- :class:`SwiGLUDown`: ``w2(silu(a) * b)`` as one linear module that saves ``a`` and ``b`` (the w1 and
  w3 outputs) and recomputes ``silu(a) * b`` in backward (autograd keeps silu(a) and the product too).

Both compute exactly the ops of the plain expressions in the same dtypes, so forward values are
bit-identical and gradients equal up to float reassociation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SwiGLUDown", "rms_norm"]


def _wide(t: Tensor) -> Tensor:
    """``t`` in at least fp32 (fp64 stays fp64)."""
    return t if t.dtype == torch.float64 else t.float()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = _wide(x)
        inv = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv)
        return (x32 * inv).type_as(x) * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, inv = ctx.saved_tensors
        n32 = _wide(x) * inv
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * n32.type_as(x)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        g32 = _wide(grad * weight)
        grad_x = inv * (g32 - n32 * (g32 * n32).mean(dim=-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``(x / rms(x)).type_as(x) * weight``, the rms in at least fp32; saves ``x`` and 1/rms only."""
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(a, b, weight)
        return F.linear(F.silu(a) * b, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, b, weight = ctx.saved_tensors
        silu = F.silu(a)
        grad_weight = None
        if ctx.needs_input_grad[2]:
            product = silu * b
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ product.reshape(-1, product.shape[-1])
            del product
        grad_product = grad @ weight
        grad_b = grad_product * silu
        del silu
        grad_a = torch.ops.aten.silu_backward(grad_product * b, a)
        return grad_a, grad_b, grad_weight


class SwiGLUDown(nn.Linear):
    """SwiGLU's down projection with the gate inside: ``forward(a, b) = silu(a) * b @ weight.T``.

    An ``nn.Linear`` (no bias) whose forward is linear in its weight as ``F.linear`` is: the
    tensor-parallel installer runs it on a ``rowwise`` shard and reduces the output
    (``tp_linear_forward``, parallel/tensor_parallel.py), like a plain row-parallel Linear.
    """

    tp_linear_forward = True

    @staticmethod
    def tp_row_input(a: Tensor, b: Tensor) -> Tensor:
        """The GEMM's left operand, ``silu(a) * b`` (a tp-overlapped row-parallel forward recomputes it)."""
        return F.silu(a) * b

    def __init__(self, in_features: int, out_features: int, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias=False, **kwargs)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:  # type: ignore[override]
        """``w2(silu(a) * b)``; saves ``a`` and ``b`` (and the weight) for backward."""
        return _SwiGLUDown.apply(a, b, self.weight)
