"""All-gather-KV context parallelism, alone (``cp4:kv``) or under Ulysses (the hybrid ``cp8:kv2``).

Why: Ulysses needs cp to divide the heads, repeats kv heads under GQA and runs an all-to-all of
q, k, v and the output across every cp rank, across nodes when cp spans them. All-gather-KV (the
Llama 3 training report's choice for long context) keeps each rank's queries where they are and
all-gathers only K and V, small under GQA. The hybrid runs Ulysses over the most local cp ranks
(``layout.cp_ulysses``, inside a node) and the KV gather over the rest (``layout.cp_kv``, across).

Rows. ``plan.pack_micro_batch`` gives cp rank ``r`` chunks ``r`` and ``2cp-1-r`` of every document
(equal causal work per rank). cp index ``r = a * cp_kv + b`` (``a`` the Ulysses index, ``b`` the KV
index, nested shard order). After the Ulysses all-to-all, rank ``(a, b)`` holds ``1/cp_ulysses`` of
the heads for the rows of cp ranks ``a' * cp_kv + b`` (``a'`` in order, not permuted); the KV gather
over ``b'`` then yields every row of every document, permuted here into document order.

Attention. A query chunk at offset ``s`` of its document attends keys ``[0, s + C)`` of that
document, query ``i`` seeing keys ``<= s + i`` (bottom-right causal; top-left ``is_causal`` is wrong
for ``s > 0``). One SDPA call per block of query rows with an explicit document-and-offset mask;
blocks hold at most :data:`BLOCK_ELEMENTS` mask / score entries, so memory stays bounded whatever
the document length (no full score matrix, even on the math kernel).

Backward (:class:`_KVGatherAttention`): only q and the LOCAL k, v are saved; K and V are re-gathered,
each block's attention is recomputed under autograd and back-propagated block by block (one extra
attention forward, the price of not holding ~0.5 GB per layer of gathered K/V at 128K), and dK / dV
are reduce-scattered over the KV group: every rank contributes part of every rank's gradient.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..host import host_reads
from ..layout import LayoutError
from ..mesh import LayoutGroups, RankGroup
from ..plan import MicroBatch
from .collectives import (
    all_gather_rows,
    all_to_all_tokens_to_heads,
    reduce_scatter_rows,
)
from .ulysses import check_micro_batch, exchange_qkv

__all__ = ["BLOCK_ELEMENTS", "KVGeometry", "kv_geometry", "kv_gather_attention"]

#: Most (query rows x keys x heads) entries one SDPA call holds (mask and, on the math kernel, scores).
BLOCK_ELEMENTS = 2**24


@dataclass(frozen=True)
class KVGeometry:
    """Where this rank's query rows sit in their documents, and how gathered K/V rows map to them.

    ``perm``: document-order K/V = gathered rows ``[perm]``; ``full_index``: the inverse (gathered row
    -> document-order row). ``blocks``: (q_start, q_stop, k_start, k_stop, first query position) per
    SDPA call; keys are the document's first ``k_stop - k_start`` rows.
    """

    perm: Tensor
    full_index: Tensor
    full_tokens: int
    blocks: tuple[tuple[int, int, int, int, int], ...]


def _chunk_positions(cu: Tensor, cp: int, cp_ranks: list[int]) -> tuple[Tensor, Tensor]:
    """(document, position in its padded document) of the concatenated local rows of ``cp_ranks``."""
    lengths = cu[1:] - cu[:-1]
    tokens = int(cu[-1])
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=tokens)
    within = torch.arange(tokens) - cu[doc]
    chunk = lengths[doc] // 2
    second = within >= chunk
    positions = [torch.where(second, 2 * cp - 1 - r, r) * chunk + within - second.long() * chunk for r in cp_ranks]
    return doc.repeat(len(cp_ranks)), torch.cat(positions)


def _build_geometry(cu_seqlens: Tensor, cp: int, ulysses: int, kv: int, kv_index: int, heads: int,
                    where: str) -> KVGeometry:
    cu = cu_seqlens.detach().cpu().to(torch.int64)
    local = (cu[1:] - cu[:-1]).tolist()
    if not local or min(local) < 2 or any(n % 2 for n in local):
        raise LayoutError(f"{where}: with cp={cp} every local document must be two equal chunks (the plan "
                          f"splits each padded document in 2*cp), got local lengths {local[:8]}; was the "
                          f"micro-batch packed for this cp size?")
    tokens = int(cu[-1])
    full_cu = [0]
    for n in local:
        full_cu.append(full_cu[-1] + n * cp)
    gathered = [a * kv + b for b in range(kv) for a in range(ulysses)]
    doc, pos = _chunk_positions(cu, cp, gathered)
    full_index = torch.tensor(full_cu[:-1], dtype=torch.int64)[doc] + pos
    perm = torch.empty_like(full_index)
    perm[full_index] = torch.arange(full_index.numel())
    blocks = []
    for a in range(ulysses):
        r = a * kv + kv_index
        for d, n in enumerate(local):
            c = n // 2
            for row, start in ((a * tokens + int(cu[d]), r * c), (a * tokens + int(cu[d]) + c, (2 * cp - 1 - r) * c)):
                rows_per = max(1, BLOCK_ELEMENTS // (heads * (start + c)))
                for i in range(0, c, rows_per):
                    m = min(rows_per, c - i)
                    blocks.append((row + i, row + i + m, full_cu[d], full_cu[d] + start + i + m, start + i))
    device = cu_seqlens.device
    return KVGeometry(perm.to(device), full_index.to(device), full_cu[-1], tuple(blocks))


_CACHE: OrderedDict[tuple, tuple[weakref.ref, KVGeometry]] = OrderedDict()
_CACHE_SIZE = 8


def kv_geometry(cu_seqlens: Tensor, cp: int, ulysses: int, kv: int, kv_index: int, heads: int,
                where: str = "context parallel") -> KVGeometry:
    """The geometry of one micro-batch, cached by the identity of its ``cu_seqlens`` (every layer and
    checkpoint recomputation pass the same tensor)."""
    key = (id(cu_seqlens), cp, ulysses, kv, kv_index, heads, str(cu_seqlens.device))
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        _CACHE.move_to_end(key)
        return hit[1]
    with host_reads():  # metadata: real values even under the memory estimator's FakeTensorMode
        geometry = _build_geometry(cu_seqlens, cp, ulysses, kv, kv_index, heads, where)
    _CACHE[key] = (weakref.ref(cu_seqlens), geometry)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return geometry


def _block_attention(q: Tensor, k: Tensor, v: Tensor, first: int) -> Tensor:
    """q [n, h, d] at positions ``first..first+n-1`` over keys [first+n, hkv, d] at 0.. (bottom-right causal)."""
    heads, n = q.shape[1], q.shape[0]
    if heads != k.shape[1]:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    if first == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        keys = torch.arange(k.shape[0], device=q.device)
        mask = keys[None, :] <= (first + torch.arange(n, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out.transpose(0, 1)


def _gather_kv(k: Tensor, v: Tensor, geometry: KVGeometry, group: RankGroup) -> tuple[Tensor, Tensor]:
    both = all_gather_rows(torch.cat([k, v], dim=1), group).index_select(0, geometry.perm)
    return both.split([k.shape[1], v.shape[1]], dim=1)


class _KVGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, geometry: KVGeometry, group: RankGroup) -> Tensor:
        kf, vf = _gather_kv(k, v, geometry, group)
        out = q.new_empty(q.shape)
        for q0, q1, k0, k1, first in geometry.blocks:
            out[q0:q1] = _block_attention(q[q0:q1], kf[k0:k1], vf[k0:k1], first)
        ctx.save_for_backward(q, k, v)
        ctx.geometry, ctx.group = geometry, group
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        geometry, group = ctx.geometry, ctx.group
        kf, vf = _gather_kv(k, v, geometry, group)  # re-gathered, never saved
        dq = torch.zeros_like(q)
        dkv = torch.zeros((kf.shape[0], kf.shape[1] + vf.shape[1], kf.shape[2]), dtype=torch.float32,
                          device=kf.device)
        width = kf.shape[1]
        for q0, q1, k0, k1, first in geometry.blocks:
            qb, kb, vb = (t.detach().requires_grad_() for t in (q[q0:q1], kf[k0:k1], vf[k0:k1]))
            with torch.enable_grad():
                out = _block_attention(qb, kb, vb, first)
            gq, gk, gv = torch.autograd.grad(out, (qb, kb, vb), grad[q0:q1])
            dq[q0:q1] = gq
            dkv[k0:k1, :width] += gk
            dkv[k0:k1, width:] += gv
        # summed in fp32 here, reduced in the K/V dtype (bf16 under mixed precision: half the bytes)
        local = reduce_scatter_rows(dkv.index_select(0, geometry.full_index).to(k.dtype), group)
        dk, dv = local.split([width, vf.shape[1]], dim=1)
        return dq, dk.contiguous(), dv.contiguous(), None, None


def kv_gather_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, groups: LayoutGroups,
                        micro_batch: MicroBatch | None = None, where: str = "context parallel") -> Tensor:
    """Causal document attention for ``groups.layout``'s all-gather-KV / hybrid cp; q [T, h, d] and
    k / v [T, hkv, d] local rows, as packed for this cp rank."""
    ulysses, kv = groups.cp_ulysses, groups.cp_kv
    if ulysses is None or kv is None or ulysses.size * kv.size != groups.cp.size:
        raise LayoutError(f"{where}: layout {groups.layout} needs its Ulysses and KV sub-groups of cp "
                          f"(build LayoutGroups with WorldMesh.layout_groups)")
    check_micro_batch(micro_batch, cu_seqlens, q.shape[0], groups.cp, where)
    if q.shape[1] % ulysses.size:
        raise LayoutError(f"{where}: the Ulysses part of cp ({ulysses.size}) does not divide the "
                          f"{q.shape[1]} local query heads")
    # validated before any collective: a bad micro-batch fails on every rank alike
    geometry = kv_geometry(cu_seqlens, groups.cp.size, ulysses.size, kv.size, kv.index,
                           q.shape[1] // ulysses.size, where)
    if ulysses.size > 1:
        q, k, v = exchange_qkv(q, k, v, ulysses)
    out = _KVGatherAttention.apply(q, k, v, geometry, kv)
    return all_to_all_tokens_to_heads(out, ulysses) if ulysses.size > 1 else out

