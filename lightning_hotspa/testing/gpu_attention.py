"""A shape-only stand-in for flash-attn's varlen kernel, so the memory estimator can run the GPU path
on a machine without one (``hotspa memory --attention gpu``).

Why: ``flash_attn_varlen_func`` has no CPU build, and the estimator runs under ``FakeTensorMode``
where only shapes, dtypes and lifetimes matter. This function keeps for backward exactly what
flash-attn 2's varlen autograd function keeps (q, k and v as given: GQA unrepeated, the output, an
fp32 log-sum-exp per head and token, the cu_seqlens) and allocates in backward what its backward
allocates (dq, dk, dv, an fp32 dq accumulator, fp32 row sums). It refuses real tensors: its values
are not attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .fake_world import is_fake

__all__ = ["flash_varlen_standin"]


def _require_fake(*tensors: Tensor) -> None:
    if not all(is_fake(t) for t in tensors):
        raise RuntimeError("flash_varlen_standin computes no attention: it only runs under FakeTensorMode "
                           "(the memory estimator); use models.attention's backends for real tensors")


class _FlashVarlenStandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, _ = ctx.saved_tensors
        scratch = (torch.empty(q.shape, dtype=torch.float32, device=q.device), torch.empty_like(lse))
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del scratch
        return (*grads, None)


def flash_varlen_standin(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """Core-attention signature; the tensors flash-attn's varlen kernel would hold (fake tensors only)."""
    del max_seqlen
    _require_fake(q, k, v)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"local q heads ({q.shape[1]}) are not a multiple of local kv heads ({k.shape[1]})")
    return _FlashVarlenStandIn.apply(q, k, v, cu_seqlens)


#: the registered kernel it stands in for (models.attention_kernels.kernel_of): the KV gather runs that
#: kernel's chunk kernel beside it (one SDPA call per chunk, as on CUDA)
flash_varlen_standin.attention_kernel = "flash_varlen"  # type: ignore[attr-defined]
