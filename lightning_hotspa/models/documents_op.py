"""The per-document SDPA kernel as ONE opaque op, for compiled blocks (``strategy.runtime.compile_blocks``).

Why: :func:`.attention.sdpa_attention` reads the document bounds on the host and loops over them.
Traced by dynamo, that read is a graph break (``aten._local_scalar_dense``) and the loop bakes the
lengths into the graph, so every new mix of lengths recompiles until dynamo's recompile limit, after
which the block silently runs eager. As a custom op (``hotspa::sdpa_documents_v2``) the graph holds one
node whose output shapes follow ``q``'s (the token dim stays symbolic); the bounds are read when the
op runs, from :mod:`lightning_hotspa.host_facts` (filed where the batch was built) or the tensor. Its
log-sum-exp is kept tokens first, ``[T, h]``: as ``[h, T]`` its row stride is the token count, which inductor
fixed to the first call's value in the backward graph under ``backed_size_oblivious`` (a stride assertion on the
next micro-batch of another length).

Same kernel as eager: torch's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``,
GQA native), one causal call per document, its log-sum-exp kept for the backward kernel. CPU only:
on GPU the compiled blocks run the varlen kernels (flash-attn, torch's ``varlen_attn``), which take
``cu_seqlens`` and ``max_seqlen`` themselves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..host import host_reads
from ..host_facts import recall

__all__ = ["document_bounds", "sdpa_documents", "window_mask"]


def document_bounds(cu_seqlens: Tensor, total: int) -> list[int]:
    """The bounds of ``cu_seqlens`` as host ints (filed facts first, else one read), checked against ``total``."""
    known = recall(cu_seqlens, "bounds")  # filed where the batch was built: no read of the device
    if known is not None:
        bounds = list(known)
    else:
        with host_reads():  # metadata: real values even under the memory estimator's FakeTensorMode
            bounds = [int(b) for b in cu_seqlens.tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the token count {total}, got {bounds}"
        )
    if any(b > e for b, e in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return bounds


def window_mask(length: int, window: int, device: torch.device) -> Tensor:
    """[L, L] bool: query i sees keys j with i - window < j <= i (Mistral's sliding window)."""
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def _lengths(cu_seqlens: Tensor, total: int) -> list[int]:
    bounds = document_bounds(cu_seqlens, total)
    return [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def _heads_first(t: Tensor, lengths: list[int]) -> tuple[Tensor, ...]:
    """[T, h, d] -> per document [1, h, s, d] (views, as eager SDPA takes them)."""
    return t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2)


def _mask(length: int, window: int, like: Tensor) -> Tensor | None:
    """The sliding window's additive mask for a document longer than the window (None: plain causal)."""
    if window <= 0 or length <= window:
        return None
    allowed = window_mask(length, window, like.device)
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, float("-inf"))


def _tokens_first(pieces: list[Tensor], like: Tensor) -> Tensor:
    """Per document [1, h, s, d] -> one contiguous [T, h, d]."""
    if not pieces:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return torch.cat([p.squeeze(0).transpose(0, 1) for p in pieces], dim=0).contiguous()


#: the ops' version, in their names: inductor's FX graph cache keys on a graph's code, which names the op, not on
#: its fake kernel, so a change of an output's layout must come with a new name, or a warm cache runs old code
#: against the new op (v2: the log-sum-exp tokens first, [T, h], no stride depending on the token count)
_VERSION = "v2"


@torch.library.custom_op(f"hotspa::sdpa_documents_{_VERSION}", mutates_args=())
def _sdpa_documents(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int) -> tuple[Tensor, Tensor]:
    lengths = _lengths(cu_seqlens, q.shape[0])
    outs, lses = [], []
    for qd, kd, vd in zip(_heads_first(q, lengths), _heads_first(k, lengths), _heads_first(v, lengths), strict=True):
        if not qd.shape[2]:
            continue
        mask = _mask(qd.shape[2], window, qd)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qd, kd, vd, 0.0, mask is None, attn_mask=mask)
        outs.append(out)
        lses.append(lse.squeeze(0))
    lse = torch.cat(lses, dim=-1) if lses else q.new_zeros((q.shape[1], 0), dtype=torch.float32)
    return _tokens_first(outs, q), lse.t().contiguous()  # [T, h]: no stride depends on the token count


@_sdpa_documents.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op(f"hotspa::sdpa_documents_backward_{_VERSION}", mutates_args=())
def _sdpa_documents_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             cu_seqlens: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    lengths = _lengths(cu_seqlens, q.shape[0])
    grads: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
    lses = lse.t().split(lengths, dim=-1)  # [T, h] -> per document [h, s]
    per_doc = zip(*(_heads_first(t, lengths) for t in (grad, q, k, v, out)), lses, strict=True)
    for gd, qd, kd, vd, od, ld in per_doc:
        if not qd.shape[2]:
            continue
        mask = _mask(qd.shape[2], window, qd)
        for acc, g in zip(grads, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gd, qd, kd, vd, od, ld.unsqueeze(0).contiguous(), 0.0, mask is None, attn_mask=mask), strict=True):
            acc.append(g)
    return _tokens_first(grads[0], q), _tokens_first(grads[1], k), _tokens_first(grads[2], v)


@_sdpa_documents_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
      window: int) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    q, k, v, cu_seqlens, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.window = window


def _backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):  # noqa: ANN001, ANN202
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _sdpa_documents_backward(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.window)
    return dq, dk, dv, None, None


_sdpa_documents.register_autograd(_backward, setup_context=_setup)


def sdpa_documents(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int | None = None) -> Tensor:
    """Causal attention over the packed documents of ``cu_seqlens``, one opaque op (forward and backward).

    Args:
        q: queries [T, h, d].
        k: keys [T, hkv, d] (h a multiple of hkv).
        v: values [T, hkv, d].
        cu_seqlens: the document bounds (int tensor, 0 ... T).
        window: Mistral's sliding window (None: full causal).
    """
    return _sdpa_documents(q, k, v, cu_seqlens, 0 if window is None else int(window))[0]
