"""All-gather-KV chunk attention on CPU: no materialized mask, no forward recomputed in backward.

On CUDA a bottom-right causal chunk is one flash call (``kv_gather.chunk_attention``). On CPU,
torch's ``causal_lower_right`` bias is materialized as a boolean ``[C, S]`` mask per chunk and the
CPU flash kernel then visits every key block, masked or not: twice the work of the causal part
(profiled: a 4K-row chunk over 32K keys took 1.93 s with the mask, 0.96 s split as below). So on
CPU a chunk at document position ``first`` over keys ``[key_start, first + C)`` is TWO kernel calls:
the prefix keys ``[key_start, first)`` unmasked and the diagonal block ``[first, first + C)`` with
``is_causal`` (square: top-left is bottom-right), merged by their log-sum-exps (as ring attention
does). Backward reuses the merged output and log-sum-exp, saved by the forward: each part's flash
backward with the GLOBAL output and log-sum-exp yields its exact share of dq and its dk / dv.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from ..torch_compat import cpu_flash_attention, cpu_flash_attention_backward

__all__ = ["cpu_chunks_apply", "chunk_forward", "chunk_backward", "cuda_chunk_path"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_OFF = [False]


@contextlib.contextmanager
def cuda_chunk_path() -> Iterator[None]:
    """Inside it the CPU chunk path is off: chunks take the single call CUDA runs (the memory
    estimator's GPU path measures what CUDA would save: no out / log-sum-exp kept for backward)."""
    previous, _OFF[0] = _OFF[0], True
    try:
        yield
    finally:
        _OFF[0] = previous


def cpu_chunks_apply(q: Tensor, window: int | None) -> bool:
    """Whether :func:`chunk_forward` serves ``q``: a CPU tensor of a CPU-flash dtype, no sliding window.

    Args:
        q: the query rows.
        window: the model's sliding window (a windowed chunk keeps its band mask).
    """
    return q.device.type == "cpu" and window is None and q.dtype in _DTYPES and not _OFF[0]


def _parts(first: int, key_start: int, rows: int) -> list[tuple[int, int, bool]]:
    """``(start, stop, is_causal)`` key ranges, relative to ``key_start``, of one chunk's calls."""
    prefix = first - key_start
    return ([(0, prefix, False)] if prefix else []) + [(prefix, prefix + rows, True)]


def _heads_first(t: Tensor) -> Tensor:
    return t.transpose(0, 1).unsqueeze(0)


def chunk_forward(q: Tensor, k: Tensor, v: Tensor, first: int, key_start: int = 0) -> tuple[Tensor, Tensor]:
    """Bottom-right causal attention of one query chunk in at most 2 calls; ``(out [C, h, d], lse)``.

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
