"""Hopper-class packed attention kernels: ONE varlen call per micro-batch (which one runs: :mod:`.attention_kernels`).

Documents (the core attention, ``(q, k, v, cu_seqlens, max_seqlen) -> out`` over packed documents, causal):

- :func:`cudnn_varlen_attention`: cuDNN's fused attention through torch's own packed entry point
  (``aten._cudnn_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k``, the op ``torch.nn.attention.varlen``
  routes to cuDNN; its autograd keeps q, k, v, the output and an fp32 log-sum-exp). It takes no GQA
  (K / V repeated to the query heads first, and kept so) and no sliding window.
- :func:`fa3_varlen_attention`: FlashAttention-3 (``flash_attn_interface.flash_attn_varlen_func``, sm90).
- :func:`fa4_varlen_attention`: FlashAttention-4 (``flash_attn.cute.flash_attn_varlen_func`` of the
  ``flash-attn-4`` package, CUTE DSL; sm90 / sm100).

Context-parallel chunks (the all-gather-KV attention's chunk role, :mod:`.chunk_attention`'s protocol
with a backward over ALL blocks): :func:`packed_chunks_forward` / :func:`packed_chunks_backward` pack every
query chunk's key range into one K / V (``index_select``: the ranges of a document's two chunks overlap)
and run ONE varlen call with ``cu_seqlens_q`` / ``cu_seqlens_k``, causal aligned bottom-right (the
flash-attn convention: query ``i`` of a chunk sees keys ``<= i + (S - C)``), a sliding window as
``(window - 1, 0)``. Nothing is kept: backward re-packs, re-runs the call and back-propagates it once
(the chunks' attention forward re-run, as ``sdpa_chunk``).

GPU libraries are imported lazily inside the call (none has a CPU build); the tests stand them in.
Never run on a GPU in this repository's history (no GPU was lent): recipes/gpu_check.py part (k) runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .attention import repeat_kv

__all__ = ["VARLEN_CALLS", "cudnn_varlen_attention", "fa3_varlen_attention", "fa4_varlen_attention",
           "packed_chunks_backward", "packed_chunks_forward", "packed_layout"]

#: ``(q, k, v, cu_q, cu_k, max_q, max_k, window) -> out``: one packed causal call (bottom-right aligned)
VarlenCall = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, "int | None"], Tensor]


def _window_pair(window: int | None) -> tuple[int, int]:
    return (-1, 0) if window is None else (window - 1, 0)


def _cudnn_call(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                window: int | None) -> Tensor:
    if window is not None:
        raise ValueError(f"cuDNN varlen attention runs no sliding window (got {window}); use attention_backend="
                         "'fa3_varlen', 'fa4_varlen' or 'flash_varlen'")
    if cu_q is not cu_k:  # its causal mask is top-left: right for whole documents only
        raise ValueError("cuDNN varlen attention runs whole documents: queries and keys must share cu_seqlens")
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # the packed cuDNN path takes no GQA
    out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, int(max_q), int(max_k), True, 0.0,
                                                  True, False)
    return out[0]


def _fa3_call(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
              window: int | None) -> Tensor:
    from flash_attn_interface import flash_attn_varlen_func  # lazy: FlashAttention-3 (hopper/), CUDA only

    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal=True,
                                 window_size=_window_pair(window))
    return out[0] if isinstance(out, tuple) else out  # older releases return (out, lse)


def _fa4_call(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
              window: int | None) -> Tensor:
    from flash_attn.cute import flash_attn_varlen_func  # lazy: flash-attn-4 (CUTE DSL), CUDA only

    # keywords: its fourth positional parameter is ``qv`` (MLA), not cu_seqlens_q
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                                 max_seqlen_k=int(max_k), causal=True,
                                 window_size=(None, None) if window is None else (window - 1, 0))
    return out[0] if isinstance(out, tuple) else out  # (out, lse)


def _torch_flash_call(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                      window: int | None) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn  # lazy: torch's own varlen flash kernel (FA2, CUDA)

    return varlen_attn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), window_size=_window_pair(window),
                       enable_gqa=q.shape[1] != k.shape[1])


#: the packed calls by the kernel family they run (the chunk kernels' records name one)
VARLEN_CALLS: dict[str, VarlenCall] = {"cudnn": _cudnn_call, "fa3": _fa3_call, "fa4": _fa4_call,
                                       "torch_flash": _torch_flash_call}


def _documents(call: VarlenCall, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
               window: int | None) -> Tensor:
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"local q heads ({q.shape[1]}) are not a multiple of local kv heads ({k.shape[1]})")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return call(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), window)


def cudnn_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """cuDNN fused attention over packed documents in one call (CUDA, fp16 / bf16; K / V repeated for GQA)."""
    return _documents(_cudnn_call, q, k, v, cu_seqlens, max_seqlen, None)


def fa3_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                         window: int | None = None) -> Tensor:
    """FlashAttention-3's varlen kernel over packed documents (sm90, fp16 / bf16; GQA native)."""
    return _documents(_fa3_call, q, k, v, cu_seqlens, max_seqlen, window)


def fa4_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                         window: int | None = None) -> Tensor:
    """FlashAttention-4's varlen kernel over packed documents (sm90 / sm100, fp16 / bf16; GQA native)."""
    return _documents(_fa4_call, q, k, v, cu_seqlens, max_seqlen, window)


# ---------------------------------------------------------------------------------------------- chunks

Block = tuple[int, int, int, int, int, int]


@functools.lru_cache(maxsize=64)
def _layout(blocks: tuple[Block, ...], device: str) -> tuple[Tensor, Tensor, Tensor, int, int]:
    cu_q, cu_k = [0], [0]
    for q0, q1, k0, k1, _, _ in blocks:
        if q0 != cu_q[-1]:
            raise ValueError(f"packed chunks need the query chunks in row order from row 0, back to back; "
                             f"got {blocks[:4]}")
        cu_q.append(q1)
        cu_k.append(cu_k[-1] + k1 - k0)
    # the packed key rows, built on the host in one C++ pass and copied once per micro-batch geometry
    rows = torch.cat([torch.arange(k0, k1) for _, _, k0, k1, _, _ in blocks]) if blocks else torch.zeros(0)
    max_q = max((b[1] - b[0] for b in blocks), default=0)
    max_k = max((b[3] - b[2] for b in blocks), default=0)
    return (rows.to(torch.int64).to(device, non_blocking=True),
            torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
            torch.tensor(cu_k, dtype=torch.int32).to(device, non_blocking=True), max_q, max_k)


def packed_layout(blocks: Sequence[Block], device: torch.device) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """``(key_rows, cu_q, cu_k, max_q, max_k)`` of ONE packed call over ``blocks``: the gathered K / V rows
    packed chunk after chunk (``index_select``), and int32 cumulative lengths, built on the host from the
    blocks' host-side bounds (no device read) and kept per geometry (every layer, forward and backward, of a
    micro-batch reuses them).

    Args:
        blocks: the KV gather's chunks, ``(q_start, q_stop, k_start, k_stop, first, key_start)``.
        device: the inputs' device.
    """
    return _layout(tuple(tuple(b) for b in blocks), str(device))


def _packed(call: VarlenCall, q: Tensor, k: Tensor, v: Tensor, blocks: Sequence[Block], window: int | None) -> Tensor:
    rows, cu_q, cu_k, max_q, max_k = packed_layout(blocks, q.device)
    return call(q, k.index_select(0, rows), v.index_select(0, rows), cu_q, cu_k, max_q, max_k, window)


def packed_chunks_forward(family: str, q: Tensor, k: Tensor, v: Tensor, blocks: Sequence[Block],
                          window: int | None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Every chunk in ONE varlen call of ``family`` (:data:`VARLEN_CALLS`); keeps nothing.

    Args:
        family: the packed call's kernel family.
        q: this rank's query rows, [T, h, d] (the chunks back to back).
        k, v: the gathered keys and values in document order, [S, hkv, d].
        blocks: the chunks.
        window: the model's sliding window, or None.
    """
    return _packed(VARLEN_CALLS[family], q, k, v, blocks, window), ()


def packed_chunks_backward(family: str, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, kept: tuple[Tensor, ...],
                           blocks: Sequence[Block], window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq [T, h, d], dk [S, hkv, d], dv [S, hkv, d])`` of every chunk: the one call re-run and
    back-propagated (the packing's backward sums each key's gradient over the chunks that saw it).

    Args:
        family, q, k, v, blocks, window: as given to :func:`packed_chunks_forward`.
        grad: the output's gradient, [T, h, d].
        kept: what it kept (nothing).
    """
    del kept
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = _packed(VARLEN_CALLS[family], qd, kd, vd, blocks, window)
    return torch.autograd.grad(out, (qd, kd, vd), grad)
