"""Causal core attention over packed documents: the kernels (which one runs: :mod:`.attention_kernels`).

Every backend has the signature ``(q, k, v, cu_seqlens, max_seqlen) -> out`` with q [T, h, d],
k and v [T, hkv, d], out [T, h, d], and masks attention at the ``cu_seqlens`` document
boundaries. Grouped-query attention maps q head i to kv head ``i // (h // hkv)`` (kv groups
contiguous, as flash-attn does), which stays right when tensor parallelism hands each rank a
contiguous block of q heads and the matching contiguous block of kv heads.

GPU kernels are imported lazily inside the call: flash-attn has no CPU wheel, and importing
this module must never need it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .documents_op import document_bounds, sdpa_documents, window_mask

__all__ = [
    "CoreAttention",
    "flash_varlen_attention",
    "repeat_kv",
    "sdpa_attention",
    "torch_varlen_attention",
    "with_sliding_window",
]

CoreAttention = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]


def repeat_kv(kv: Tensor, n_q_heads: int) -> Tensor:
    """Repeat kv heads [T, hkv, d] to [T, n_q_heads, d], each kv head over a contiguous group."""
    n_kv_heads = kv.shape[1]
    _check_groups(n_q_heads, n_kv_heads)
    if n_q_heads == n_kv_heads:
        return kv
    return kv.repeat_interleave(n_q_heads // n_kv_heads, dim=1)


def _check_groups(n_q_heads: int, n_kv_heads: int) -> None:
    """Raises unless the local kv heads divide the local q heads."""
    if n_q_heads % n_kv_heads:
        raise ValueError(
            f"local q heads ({n_q_heads}) are not a multiple of local kv heads ({n_kv_heads})"
        )


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                   window: int | None = None) -> Tensor:
    """Torch SDPA, one causal call per document (the CPU backend and universal fallback).

    Inputs go in 4-D (``[1, h, s, d]``) so that CPU SDPA takes its flash kernel (gradient function
    ``ScaledDotProductFlashAttentionForCpuBackward0``), whose memory is linear in ``s``; 3-D inputs
    fall back to the math kernel, which materializes the s x s scores (s=8192, 4 heads x 64, fp32
    forward+backward: 3120 MiB vs 49 MiB). Per document rather than one call with a [T, T]
    block-diagonal causal mask, which does T^2 work whatever the documents. Measured forward+backward,
    fp32, 8 heads x 64, T=4096, one thread (CPU seconds, min of 2; both 4-D): per-document 0.96 s vs
    mask 1.74 s for one document of 4096 (1.8x), 0.31 vs 1.79 for 4 of 1024 (5.9x), 0.12 vs 1.80
    for 16 of 256 (15x), 0.046 vs 1.81 for 64 of 64 (40x), 0.036 vs 1.80 for 256 of 16 (50x). (The
    earlier 3-D math path took 5.4 s for one document of 4096.) Documents are cut with ``split``,
    whose backward is one concatenation: slicing each one costs a full-size zero gradient per document.
    """
    del max_seqlen  # per-document calls need no padding bound
    if torch.compiler.is_compiling():  # one opaque op: no host read traced, no lengths baked into the graph
        _check_groups(q.shape[1], k.shape[1])
        return sdpa_documents(q, k, v, cu_seqlens, window)
    bounds = document_bounds(cu_seqlens, q.shape[0])
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    if not lengths:  # no documents, no tokens
        return q.new_zeros(q.shape)
    _check_groups(q.shape[1], k.shape[1])
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}  # K/V saved unrepeated
    # [T, h, d] -> [1, h, T, d]: 4-D inputs take the memory-bounded CPU flash kernel (3-D ones fall
    # back to the math kernel and materialize each document's s x s scores); documents split along T.
    pieces = zip(*(t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q, k, v)), strict=True)
    outs = [
        qd if not qd.shape[2] else
        F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, **gqa) if window is None or qd.shape[2] <= window
        else F.scaled_dot_product_attention(qd, kd, vd, attn_mask=window_mask(qd.shape[2], window, qd.device),
                                            **gqa)
        for qd, kd, vd in pieces
    ]
    # the kernel's output is [1, h, s, d] over [s, h, d] memory: back to [s, h, d] is a view, so one
    # document's output IS what the output projection saves (no second copy); several are joined once
    outs = [o.squeeze(0).transpose(0, 1) for o in outs]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def flash_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int | None = None
) -> Tensor:
    """flash-attn's varlen kernel (CUDA, fp16/bf16); handles GQA natively."""
    from flash_attn import flash_attn_varlen_func  # lazy: no CPU wheel exists

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    kwargs = {} if window is None else {"window_size": (window - 1, 0)}
    return flash_attn_varlen_func(
        q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), dropout_p=0.0, causal=True, **kwargs
    )


@functools.cache
def _parameter_names(fn: Callable[..., object]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def torch_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int | None = None
) -> Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` (CUDA flash kernel shipped with torch)."""
    from torch.nn.attention.varlen import varlen_attn  # lazy: absent from older torch

    params = _parameter_names(varlen_attn)
    kwargs: dict[str, object] = {}
    if "window_size" in params:  # newer torch spells causal as a (-1, 0) window
        kwargs["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif window is not None:
        raise ValueError(f"torch {torch.__version__}'s varlen_attn has no window_size: it cannot run a "
                         f"sliding window of {window}; use attention_backend='sdpa' or 'flash_varlen'")
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)


def with_sliding_window(fn: CoreAttention, window: int | None) -> CoreAttention:
    """``fn`` with its ``window`` bound (a core attention of the usual 5 arguments); ``fn`` for None."""
    if window is None:
        return fn
    if isinstance(fn, functools.partial) and "window" in fn.keywords:
        fn = fn.func
    if "window" not in _parameter_names(fn):
        raise ValueError(f"core attention {getattr(fn, '__name__', fn)!r} takes no window argument: it "
                         f"cannot run the model's sliding window of {window}")
    return functools.partial(fn, window=window)
