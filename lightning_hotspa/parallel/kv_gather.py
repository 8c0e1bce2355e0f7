"""All-gather-KV context parallelism for the PACKED chunk kernels (beside the Hopper-class documents kernels,
``models/varlen_kernels.py``; every other chunk kernel runs the KV ring, ``parallel/kv_ring.py``), alone
(``cp4:kv``) or under Ulysses (the hybrid ``cp8:kv2``).

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
document, query ``i`` seeing keys ``<= s + i`` (bottom-right causal); a sliding window narrows the keys
to ``[s - window + 1, s + C)``. The chunks run in the chunk kernel the attention-kernel registry sets
beside the model's core attention (``models.attention_kernels.chunk_kernel_for``; the kernels:
``models/chunk_attention.py``): ``sdpa_chunk`` (one SDPA call per chunk, recomputed in backward),
on CPU without a window ``cpu_flash_chunks`` (two CPU flash calls merged by log-sum-exp, backward from
the kept output and log-sum-exp), or beside a Hopper-class kernel a PACKED one (``fa3_chunks``,
``fa4_chunks``, ``torch_flash_chunks``: every chunk in ONE varlen call, ``models/varlen_kernels.py``).

Backward (:class:`_KVGatherAttention`): only q, the LOCAL k, v and what the chunk kernel keeps are
saved; K and V are re-gathered and each chunk is back-propagated by the kernel, one chunk at a time
(``sdpa_chunk``: one extra attention forward, the price of not holding ~0.5 GB per layer of gathered
K/V at 128K); dK / dV are summed in fp32 and reduce-scattered over the KV group.

Host syncs: none per micro-batch. The chunks come from the micro-batch's host-side boundaries
(:mod:`..host_facts`), the row permutations are computed on the device from ``cu_seqlens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..host_facts import recall, remember
from ..layout import LayoutError
from ..mesh import LayoutGroups, RankGroup
from ..models.attention_kernels import AttentionKernel, chunk_kernel_for
from ..plan import MicroBatch
from ..shard_rows import all_gather_rows, reduce_scatter_rows
from .collectives import all_to_all_tokens_to_heads
from .kv_ring import kv_parts, ulysses_heads
from .ulysses import chunked_bounds

__all__ = ["KVGeometry", "kv_geometry", "kv_gather_attention"]


@dataclass(frozen=True)
class KVGeometry:
    """Where this rank's query rows sit in their documents, and how gathered K/V rows map to them.

    ``perm``: document-order K/V = gathered rows ``[perm]``; ``full_index``: the inverse (gathered row
    -> document-order row). ``blocks``: one (q_start, q_stop, k_start, k_stop, first query position,
    first key position) per local query chunk, i.e. per attention-kernel call.
    """

    perm: Tensor
    full_index: Tensor
    full_tokens: int
    blocks: tuple[tuple[int, int, int, int, int, int], ...]


def _full_index(cu_seqlens: Tensor, tokens: int, cp: int, cp_ranks: list[int]) -> Tensor:
    """Document-order row of each gathered row (the local rows of ``cp_ranks``, concatenated),
    computed on ``cu_seqlens``' device from its values (no host read)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    device = cu.device
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=tokens)
    within = torch.arange(tokens, device=device) - cu[doc]
    chunk = lengths[doc] // 2
    second = within >= chunk
    full_start = torch.cumsum(lengths * cp, 0) - lengths * cp
    out = [full_start[doc] + torch.where(second, 2 * cp - 1 - r, r) * chunk + within - second.long() * chunk
           for r in cp_ranks]
    return torch.cat(out)


def _build_geometry(cu_seqlens: Tensor, cp: int, ulysses: int, kv: int, kv_index: int, window: int | None,
                    where: str) -> KVGeometry:
    bounds, local = chunked_bounds(cu_seqlens, cp, where)
    tokens = bounds[-1]
    full_cu = [0]
    for n in local:
        full_cu.append(full_cu[-1] + n * cp)
    gathered = [a * kv + b for b in range(kv) for a in range(ulysses)]
    full_index = _full_index(cu_seqlens, tokens, cp, gathered)
    perm = torch.empty_like(full_index)
    perm[full_index] = torch.arange(full_index.numel(), device=full_index.device)
    blocks = []
    for a in range(ulysses):
        r = a * kv + kv_index
        for d, n in enumerate(local):
            c, row = n // 2, a * tokens + bounds[d]
            for q0, first in ((row, r * c), (row + c, (2 * cp - 1 - r) * c)):
                lo = 0 if window is None else max(0, first - window + 1)
                blocks.append((q0, q0 + c, full_cu[d] + lo, full_cu[d] + first + c, first, lo))
    return KVGeometry(perm, full_index, full_cu[-1], tuple(blocks))


def kv_geometry(cu_seqlens: Tensor, cp: int, ulysses: int, kv: int, kv_index: int, window: int | None = None,
                where: str = "context parallel") -> KVGeometry:
    """The geometry of one micro-batch, filed with its ``cu_seqlens`` tensor (:mod:`..host_facts`: every
    layer and checkpoint recomputation pass the same tensor; it goes with the tensor).

    Args:
        cu_seqlens: this rank's local document boundaries (as packed for cp rank ``ulysses index * kv
            + kv_index``).
        cp, ulysses, kv: the cp degree and its Ulysses and KV parts.
        kv_index: this rank's index in the KV group.
        window: the model's sliding window (None: full causal).
        where: the module, for error messages.
    """
    name = f"kv_geometry:{cp}:{ulysses}:{kv}:{kv_index}:{window}"
    geometry = recall(cu_seqlens, name)
    if geometry is None:
        geometry = _build_geometry(cu_seqlens, cp, ulysses, kv, kv_index, window, where)
        remember(cu_seqlens, name, geometry)
    return geometry


def _gather_kv(k: Tensor, v: Tensor, geometry: KVGeometry, group: RankGroup) -> tuple[Tensor, Tensor]:
    both = all_gather_rows(torch.cat([k, v], dim=1), group).index_select(0, geometry.perm)
    return both.split([k.shape[1], v.shape[1]], dim=1)


class _KVGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, geometry: KVGeometry, group: RankGroup,
                window: int | None, chunks: AttentionKernel) -> Tensor:
        kf, vf = _gather_kv(k, v, geometry, group)
        ctx.geometry, ctx.group, ctx.window, ctx.chunks = geometry, group, window, chunks
        out, kept = chunks.call(q, kf, vf, geometry.blocks, window)
        ctx.save_for_backward(q, k, v, *kept)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, *kept = ctx.saved_tensors
        geometry, group = ctx.geometry, ctx.group
        kf, vf = _gather_kv(k, v, geometry, group)  # re-gathered, never saved
        dq = torch.empty_like(q)
        width = kf.shape[1]
        acc = torch.promote_types(kf.dtype, torch.float32)  # fp32 at least: fp64 stays fp64
        dkv = torch.zeros((kf.shape[0], width + vf.shape[1], kf.shape[2]), dtype=acc, device=kf.device)
        if ctx.chunks.packed:  # one packed call over every chunk (models/varlen_kernels.py)
            dq, gk, gv = ctx.chunks.backward(grad, q, kf, vf, tuple(kept), geometry.blocks, ctx.window)
            dkv[:, :width] += gk
            dkv[:, width:] += gv
        for block in () if ctx.chunks.packed else geometry.blocks:  # one chunk's graph alive at a time
            q0, q1, k0, k1, _, _ = block
            gq, gk, gv = ctx.chunks.backward(grad, q, kf, vf, tuple(kept), block, ctx.window)
            dq[q0:q1] = gq
            dkv[k0:k1, :width] += gk
            dkv[k0:k1, width:] += gv
        # summed in fp32 (fp64) here, reduced in the K/V dtype (bf16 under mixed precision: half the bytes)
        local = reduce_scatter_rows(dkv.index_select(0, geometry.full_index).to(k.dtype), group)
        dk, dv = local.split([width, vf.shape[1]], dim=1)
        return dq, dk.contiguous(), dv.contiguous(), None, None, None, None


def kv_gather_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, groups: LayoutGroups,
                        micro_batch: MicroBatch | None = None, where: str = "context parallel",
                        window: int | None = None, core: object = None) -> Tensor:
    """Causal document attention for ``groups.layout``'s KV / hybrid cp by all-gather, with a packed chunk kernel.

    Args:
        q, k, v, cu_seqlens, groups, micro_batch, where, window: as :func:`.kv_ring.kv_ring_attention`'s.
        core: the model's core attention, beside which the registry sets a PACKED chunk kernel.
    """
    ulysses, kv = kv_parts(q, cu_seqlens, groups, micro_batch, where, window)
    # validated before any collective: a bad micro-batch fails on every rank alike
    geometry = kv_geometry(cu_seqlens, groups.cp.size, ulysses.size, kv.size, kv.index, window, where)
    q, k, v = ulysses_heads(q, k, v, ulysses, where)
    kernel = chunk_kernel_for(core, q, window)
    if not kernel.packed:
        raise LayoutError(f"{where}: the KV gather runs the packed chunk kernels only (got {kernel.name!r}); "
                          f"the KV ring (parallel/kv_ring.py) runs the others")
    out = _KVGatherAttention.apply(q, k, v, geometry, kv, window, kernel)
    return all_to_all_tokens_to_heads(out, ulysses) if ulysses.size > 1 else out
