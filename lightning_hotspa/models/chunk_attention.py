"""The cp ring's block kernels: one query chunk over one key chunk, returning its log-sum-exp.

The KV ring (``parallel/kv_ring.py``) splits every rank's attention into blocks: a query chunk of
``C`` rows against a key chunk of ``C`` rows of the same document that travelled to it. A block is
one of three kinds: ``full`` (every key precedes every query and lies inside the window), ``causal``
(the diagonal block: square, so top-left causal is bottom-right causal) or ``band`` (a sliding
window cuts it: an additive ``[C, C]`` mask of 0 / -inf, rows that see no key of the block get a
log-sum-exp of -inf so the merge ignores them). The blocks' outputs are merged by their
log-sum-exps (as ring attention does), and backward runs each block's kernel backward from the
MERGED output and log-sum-exp: its exact share of dq and its dk / dv, no forward recomputed.

Two kernels, each a record of :mod:`.attention_kernels` (the ring asks the registry which one runs):

- ``cpu_flash_chunks``: the CPU flash kernel SDPA dispatches to (GQA native);
- ``sdpa_chunk``: SDPA's memory-efficient CUDA kernel (the one that takes a mask and returns its
  log-sum-exp; no GQA, so k / v are repeated per block, a transient of one block). Never run on a GPU
  yet (recipes/gpu_check_cp.py part (r)).

The KV gather's packed chunk kernels (``models/varlen_kernels.py``, beside the Hopper-class documents
kernels) are checked against :func:`chunk_attention` / :func:`sdpa_chunks_forward`: one query chunk
over its gathered keys in one SDPA call, bottom-right causal (``causal_lower_right``), a window's band.

A forward takes ``(q [C, h, d], k, v [C, hkv, d], causal, mask)`` and returns ``(out [C, h, d], lse
[h, C])`` (lse fp32, fp64 for fp64); a backward takes ``(grad, q, k, v, out, lse, causal, mask)`` with
the merged ``out`` / ``lse`` of the block's rows and returns ``(dq, dk, dv)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..torch_compat import (
    causal_lower_right,
    cpu_flash_attention,
    cpu_flash_attention_backward,
    cuda_efficient_attention,
    cuda_efficient_attention_backward,
)

__all__ = ["Block", "band_mask", "chunk_attention", "cpu_block_backward", "cpu_block_forward", "cuda_block_backward",
           "cuda_block_forward", "sdpa_chunks_forward"]


def band_mask(rows: int, offset: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The additive ``[rows, rows]`` mask of a block whose queries sit ``offset`` positions after its keys
    (query i at ``offset + i`` sees key j iff ``j <= offset + i`` and ``j > offset + i - window``).

    Args:
        rows: the chunk length.
        offset: query position minus key position of the block's first rows (>= 0).
        window: the sliding window.
        dtype, device: the mask's (the queries').
    """
    q = offset + torch.arange(rows, device=device)[:, None]
    k = torch.arange(rows, device=device)[None, :]
    seen = (k <= q) & (k > q - window)
    return torch.zeros((rows, rows), dtype=dtype, device=device).masked_fill(~seen, float("-inf"))


def _heads_first(t: Tensor) -> Tensor:
    return t.transpose(0, 1).unsqueeze(0)


def _rows_first(t: Tensor) -> Tensor:
    return t.squeeze(0).transpose(0, 1)


def _unseen_rows(lse: Tensor, mask: Tensor | None) -> Tensor:
    """``lse`` with -inf where a row sees no key of the block (the kernels return 0 or NaN there)."""
    if mask is None:
        return lse
    return lse.masked_fill(torch.isinf(mask).all(-1), float("-inf"))


def cpu_block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """One block by the CPU flash kernel; ``(out [C, h, d], lse [h, C])``.

    Args:
        q: the query chunk, [C, h, d].
        k, v: the key chunk, [C, hkv, d] (hkv divides h).
        causal: the diagonal block.
        mask: a band mask (:func:`band_mask`) or None.
    """
    out, lse = cpu_flash_attention(_heads_first(q), _heads_first(k), _heads_first(v), causal, mask)
    return _rows_first(out), _unseen_rows(lse.squeeze(0), mask)


def cpu_block_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """One block's ``(dq, dk, dv)`` from the merged output and log-sum-exp of its query rows.

    Args:
        grad: the output's gradient, [C, h, d].
        q, k, v, causal, mask: as given to :func:`cpu_block_forward`.
        out, lse: the merged output [C, h, d] and log-sum-exp [h, C] of these query rows.
    """
    dq, dk, dv = cpu_flash_attention_backward(_heads_first(grad.contiguous()), _heads_first(q), _heads_first(k),
                                              _heads_first(v), _heads_first(out), lse.unsqueeze(0).contiguous(),
                                              causal, mask)
    return _rows_first(dq), _rows_first(dk), _rows_first(dv)


def _repeated(t: Tensor, heads: int) -> Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def cuda_block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                       mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """One block by SDPA's memory-efficient CUDA kernel (k / v repeated to q's heads for the call).

    Args:
        q, k, v, causal, mask: as :func:`cpu_block_forward`'s.
    """
    h = q.shape[1]
    out, lse = cuda_efficient_attention(_heads_first(q), _heads_first(_repeated(k, h)), _heads_first(_repeated(v, h)),
                                        causal, mask)
    out = _rows_first(out)
    lse = _unseen_rows(lse.squeeze(0), mask)
    return (out if mask is None else out.masked_fill(torch.isinf(lse).T[:, :, None], 0.0)), lse


def cuda_block_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                        mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`cpu_block_backward` on the memory-efficient CUDA kernel; dk / dv summed back over the
    repeated heads.

    Args:
        grad, q, k, v, out, lse, causal, mask: as :func:`cpu_block_backward`'s.
    """
    h, hkv = q.shape[1], k.shape[1]
    dq, dk, dv = cuda_efficient_attention_backward(
        _heads_first(grad.contiguous()), _heads_first(q), _heads_first(_repeated(k, h)),
        _heads_first(_repeated(v, h)), _heads_first(out), lse.unsqueeze(0).contiguous(), causal, mask)
    dk, dv = _rows_first(dk), _rows_first(dv)
    if hkv != h:
        dk = dk.unflatten(1, (hkv, h // hkv)).sum(2)
        dv = dv.unflatten(1, (hkv, h // hkv)).sum(2)
    return _rows_first(dq), dk, dv


# -- the reference over gathered keys (the KV gather's packed chunk kernels are checked against it) --

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
