"""The all-gather-KV attention's chunk kernels: one query chunk over its gathered keys, bottom-right causal.

A chunk at document position ``first`` over keys ``[key_start, first + C)`` sees keys ``<= first + i``
for its query ``i`` (top-left ``is_causal`` is wrong once ``first > key_start``). Two kernels, each a
record of :mod:`.attention_kernels` (the KV gather asks the registry which one runs):

- ``sdpa_chunk`` (:func:`sdpa_chunks_forward` / :func:`sdpa_chunk_backward`): ONE 4-D SDPA call per
  chunk: ``is_causal`` for a square chunk, torch's ``causal_lower_right`` bias otherwise (flash on
  CUDA), ``enable_gqa``; a sliding window masks its band explicitly (SDPA's memory-efficient kernel on
  CUDA). It saves nothing: backward recomputes the chunk and back-propagates SDPA's own backward.
- ``cpu_flash_chunks`` (:func:`flash_chunks_forward` / :func:`flash_chunk_backward`): on CPU torch's
  ``causal_lower_right`` bias is materialized as a boolean ``[C, S]`` mask and the CPU flash kernel
  then visits every key block, masked or not: twice the work of the causal part (profiled: a 4K-row
  chunk over 32K keys took 1.93 s with the mask, 0.96 s split as below). So a chunk is TWO calls of
  the CPU flash kernel: the prefix keys ``[key_start, first)`` unmasked and the diagonal block
  ``[first, first + C)`` with ``is_causal`` (square: top-left is bottom-right), merged by their
  log-sum-exps (as ring attention does). Backward reuses the merged output and log-sum-exp, saved by
  the forward: each part's flash backward with the GLOBAL output and log-sum-exp yields its exact
  share of dq and its dk / dv (no forward recomputed).

A forward takes ``(q, k, v, blocks, window)`` with ``blocks`` the KV gather's per-chunk
``(q_start, q_stop, k_start, k_stop, first, key_start)`` and returns ``(out, kept)``; a backward takes
one block and returns that chunk's ``(dq, dk, dv)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..torch_compat import causal_lower_right, cpu_flash_attention, cpu_flash_attention_backward

__all__ = ["Block", "chunk_attention", "chunk_backward", "chunk_forward", "flash_chunk_backward",
           "flash_chunks_forward", "sdpa_chunk_backward", "sdpa_chunks_forward"]

#: one chunk: (q_start, q_stop, k_start, k_stop, first query position, first key position)
Block = tuple[int, int, int, int, int, int]


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, first: int, key_start: int = 0,
                    window: int | None = None) -> Tensor:
    """ONE kernel call: q [C, h, d] at positions ``first..first+C-1`` over k / v [S, hkv, d] at
    positions ``key_start..first+C-1`` (bottom-right causal, optionally a sliding window); GQA native.

    Args:
        q: the query chunk, [C, h, d].
        k, v: its keys and values, [S, hkv, d], S = first + C - key_start.
        first: the document position of the chunk's first query.
        key_start: the document position of the first key.
        window: the sliding window (query i sees keys in (i - window, i]); None: full causal.
    """
    n, s = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if window is not None and first + n - key_start > window and n > 1:
        rows = first + torch.arange(n, device=q.device)[:, None]
        keys = key_start + torch.arange(s, device=q.device)[None, :]
        mask = (keys <= rows) & (keys > rows - window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    elif n == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, s), enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def sdpa_chunks_forward(q: Tensor, k: Tensor, v: Tensor, blocks: Sequence[Block],
                        window: int | None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Every chunk by :func:`chunk_attention`; keeps nothing (backward recomputes).

    Args:
        q: this rank's query rows, [T, h, d].
        k, v: the gathered keys and values in document order, [S, hkv, d].
        blocks: the chunks (:data:`Block`).
        window: the model's sliding window, or None.
    """
    out = torch.cat([chunk_attention(q[q0:q1], k[k0:k1], v[k0:k1], first, lo, window)
                     for q0, q1, k0, k1, first, lo in blocks])
    return out, ()


def sdpa_chunk_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, kept: tuple[Tensor, ...], block: Block,
                        window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's (dq, dk, dv): its SDPA call recomputed and back-propagated.

    Args:
        grad: the output's gradient, [T, h, d].
        q, k, v, window: as given to :func:`sdpa_chunks_forward`.
        kept: what it kept (nothing).
        block: the chunk.
    """
    del kept
    q0, q1, k0, k1, first, lo = block
    qb, kb, vb = (t.detach().requires_grad_() for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
    with torch.enable_grad():
        out = chunk_attention(qb, kb, vb, first, lo, window)
    return torch.autograd.grad(out, (qb, kb, vb), grad[q0:q1])


def _parts(first: int, key_start: int, rows: int) -> list[tuple[int, int, bool]]:
    """``(start, stop, is_causal)`` key ranges, relative to ``key_start``, of one chunk's calls."""
    prefix = first - key_start
    return ([(0, prefix, False)] if prefix else []) + [(prefix, prefix + rows, True)]


def _heads_first(t: Tensor) -> Tensor:
    return t.transpose(0, 1).unsqueeze(0)


def chunk_forward(q: Tensor, k: Tensor, v: Tensor, first: int, key_start: int = 0) -> tuple[Tensor, Tensor]:
    """Bottom-right causal attention of one query chunk in at most 2 CPU flash calls; ``(out [C, h, d], lse)``.

    Args:
        q: the query chunk, [C, h, d], at document positions ``first..first+C-1``.
        k, v: its keys and values, [S, hkv, d], at positions ``key_start..first+C-1``.
        first: the document position of the chunk's first query.
        key_start: the document position of the first key.
    """
    qh = _heads_first(q)
    out = lse = None
    for a, b, causal in _parts(first, key_start, q.shape[0]):
        o, s = cpu_flash_attention(qh, _heads_first(k[a:b]), _heads_first(v[a:b]), causal)
        if out is None:
            out, lse = o, s
            continue
        total = torch.logaddexp(lse, s)  # the kernel's lse is fp32 (fp64 for fp64): merge in it
        out = (out.to(total.dtype) * (lse - total).exp().unsqueeze(-1)
               + o.to(total.dtype) * (s - total).exp().unsqueeze(-1)).to(o.dtype)
        lse = total
    return out.squeeze(0).transpose(0, 1), lse


def chunk_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, first: int,
                   key_start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v of :func:`chunk_forward` from its saved output and log-sum-exp.

    Args:
        grad: the output's gradient, [C, h, d].
        q, k, v, first, key_start: as given to :func:`chunk_forward`.
        out, lse: what :func:`chunk_forward` returned.
    """
    qh, gh, oh = _heads_first(q), _heads_first(grad.contiguous()), _heads_first(out)
    dq = torch.zeros_like(qh)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for a, b, causal in _parts(first, key_start, q.shape[0]):
        gq, gk, gv = cpu_flash_attention_backward(gh, qh, _heads_first(k[a:b]), _heads_first(v[a:b]), oh, lse,
                                                  causal)
        dq += gq
        dk[a:b] = gk.squeeze(0).transpose(0, 1)
        dv[a:b] = gv.squeeze(0).transpose(0, 1)
    return dq.squeeze(0).transpose(0, 1), dk, dv


def flash_chunks_forward(q: Tensor, k: Tensor, v: Tensor, blocks: Sequence[Block],
                         window: int | None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Every chunk by :func:`chunk_forward`; keeps the merged output and log-sum-exp for backward.

    Args:
        q, k, v, blocks: as :func:`sdpa_chunks_forward`'s.
        window: must be None (the registry serves no window with this kernel).
    """
    if window is not None:
        raise ValueError(f"cpu_flash_chunks runs no sliding window (got {window}); the registry picks sdpa_chunk")
    parts = [chunk_forward(q[q0:q1], k[k0:k1], v[k0:k1], first, lo) for q0, q1, k0, k1, first, lo in blocks]
    out, lse = torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts], dim=-1)
    return out, (out, lse)


def flash_chunk_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, kept: tuple[Tensor, ...], block: Block,
                         window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's (dq, dk, dv) from the kept output and log-sum-exp (:func:`chunk_backward`).

    Args:
        grad, q, k, v, block, window: as :func:`sdpa_chunk_backward`'s.
        kept: ``(out, lse)`` of :func:`flash_chunks_forward`.
    """
    del window
    out, lse = kept
    q0, q1, k0, k1, first, lo = block
    return chunk_backward(grad[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], lse[..., q0:q1].contiguous(),
                          first, lo)
