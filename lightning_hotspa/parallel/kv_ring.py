"""KV context parallelism as a ring, alone (``cp4:kv``) or under Ulysses (the hybrid ``cp8:kv2``).

Why: Ulysses needs cp to divide the heads, repeats kv heads under GQA and runs an all-to-all of q, k,
v and the output across every cp rank. The KV kinds keep each rank's queries where they are and move
only K and V, small under GQA. They used to all-gather K / V, re-gather them in backward and re-run
each chunk's attention forward; the ring moves the same bytes (cp_kv - 1 local K/V slices forward,
as many K/V plus dK/dV slices backward), each step's transfer posted before the step's attention
and waited after it (overlapped on NCCL: the ring attention of Liu et al. 2023 and Transformer
Engine's ``AttnFuncWithCP``), and backward runs from the saved output and log-sum-exp: no attention
forward again, two local K/V slices in flight instead of the whole micro-batch's (docs/DESIGN.md §4).

Rows. ``plan.pack_micro_batch`` gives cp rank ``r`` chunks ``r`` and ``2cp-1-r`` of every document
(equal causal work per rank). cp index ``r = a * cp_kv + b`` (``a`` the Ulysses index, ``b`` the KV
index). After the Ulysses all-to-all, rank ``(a, b)`` holds ``1/cp_ulysses`` of the heads for the
rows of cp ranks ``a' * cp_kv + b`` (``a'`` in order); every rank of the KV group holds the same row
layout, so a buffer of K/V received from KV rank ``b'`` holds the rows of cp ranks ``a' * cp_kv + b'``.

Ring. At step ``s`` rank ``b`` holds the K/V of KV rank ``(b - s) mod cp_kv`` and attends each of its
query chunks to each key chunk of the same document at or before it (``models/chunk_attention.py``
blocks: full, the causal diagonal, or a sliding window's band), merging block outputs by their
log-sum-exps (fp32 at least). Backward walks the ring again: dq stays, each step's dK/dV partial sum
for the K/V in hand is added to the one the previous rank passed on and sent ahead, so after
``cp_kv`` shifts each rank holds its own dK/dV (summed in fp32, sent in the K/V dtype).

Host syncs: none per micro-batch. The blocks come from the micro-batch's host-side boundaries
(:mod:`..host_facts`); band masks are built on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..host_facts import recall, remember
from ..layout import LayoutError
from ..mesh import LayoutGroups, RankGroup
from ..models.attention_kernels import AttentionKernel, chunk_kernel_for
from ..models.chunk_attention import band_mask
from ..plan import MicroBatch
from .collectives import all_to_all_tokens_to_heads
from .ulysses import check_micro_batch, chunked_bounds, exchange_qkv

__all__ = ["RingBlock", "RingGeometry", "kv_parts", "kv_ring_attention", "ring_geometry"]


@dataclass(frozen=True)
class RingBlock:
    """One kernel call: query rows ``[q0, q1)`` over rows ``[k0, k1)`` of the K/V in hand; ``causal``: the
    diagonal block; ``offset``: query minus key position when a window cuts it (a band mask), else None;
    ``first``: the first block of its query rows (always a diagonal one: every row sees itself)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    offset: int | None
    first: bool


@dataclass
class RingGeometry:
    """The blocks of each ring step of one micro-batch (``steps[s]``: with the K/V of KV rank ``b - s``)
    and the band masks, built once per (rows, offset) on the device that first asks."""

    steps: tuple[tuple[RingBlock, ...], ...]
    window: int | None
    masks: dict[tuple[int, int, torch.dtype, torch.device], Tensor] = field(default_factory=dict)

    def mask(self, block: RingBlock, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """The block's band mask, or None."""
        if block.offset is None:
            return None
        key = (block.q1 - block.q0, block.offset, dtype, device)
        if key not in self.masks:
            self.masks[key] = band_mask(key[0], block.offset, self.window, dtype, device)
        return self.masks[key]


def _chunks(bounds: list[int], cp: int, ulysses: int, kv: int, tokens: int, b: int) -> list[list[tuple]]:
    """Per document: ``(row, rows, chunk index)`` of every chunk held for KV rank ``b`` (each Ulysses index)."""
    out = []
    for d in range(len(bounds) - 1):
        c, held = (bounds[d + 1] - bounds[d]) // 2, []
        for a in range(ulysses):
            r, row = a * kv + b, a * tokens + bounds[d]
            held += [(row, c, r), (row + c, c, 2 * cp - 1 - r)]
        out.append(held)
    return out


def _block(q: tuple, k: tuple, window: int | None) -> RingBlock | None:
    """The block of query chunk ``q`` over key chunk ``k`` (``(row, rows, chunk index)``), None if it sees nothing."""
    (q0, c, cq), (k0, _, ck) = q, k
    if ck > cq:
        return None
    offset = (cq - ck) * c
    if window is not None and offset - c + 1 >= window:  # even the closest pair lies outside the window
        return None
    banded = window is not None and offset + c - 1 >= window  # some pair falls out of the window
    return RingBlock(q0, q0 + c, k0, k0 + c, ck == cq and not banded, offset if banded else None, False)


def _build_geometry(cu_seqlens: Tensor, cp: int, ulysses: int, kv: int, kv_index: int, window: int | None,
                    where: str) -> RingGeometry:
    bounds, _ = chunked_bounds(cu_seqlens, cp, where)
    tokens = bounds[-1]
    queries = _chunks(bounds, cp, ulysses, kv, tokens, kv_index)
    steps = []
    for s in range(kv):
        keys = _chunks(bounds, cp, ulysses, kv, tokens, (kv_index - s) % kv)
        blocks = [blk for qs, ks in zip(queries, keys) for q in qs for k in ks if (blk := _block(q, k, window))]
        if s == 0:  # each query chunk's diagonal first: it starts the merge (every row sees itself there)
            blocks = sorted((dataclasses.replace(blk, first=blk.k0 == blk.q0) for blk in blocks),
                            key=lambda blk: not blk.first)
        steps.append(tuple(blocks))
    return RingGeometry(tuple(steps), window)


def ring_geometry(cu_seqlens: Tensor, cp: int, ulysses: int, kv: int, kv_index: int, window: int | None = None,
                  where: str = "context parallel") -> RingGeometry:
    """The ring blocks of one micro-batch, filed with its ``cu_seqlens`` tensor (:mod:`..host_facts`: every
    layer and checkpoint recomputation pass the same tensor).

    Args:
        cu_seqlens, cp, ulysses, kv, kv_index, window, where: as ``parallel/kv_gather.py``'s ``kv_geometry``
            (the local boundaries as packed for cp rank ``ulysses index * kv + kv_index``).
    """
    name = f"ring_geometry:{cp}:{ulysses}:{kv}:{kv_index}:{window}"
    geometry = recall(cu_seqlens, name)
    if geometry is None:
        geometry = _build_geometry(cu_seqlens, cp, ulysses, kv, kv_index, window, where)
        remember(cu_seqlens, name, geometry)
    return geometry


def _merge(out: Tensor, lse: Tensor, block: RingBlock, o: Tensor, s: Tensor) -> None:
    """Folds one block's ``(o, s)`` into the running ``out`` / ``lse`` of its query rows (in place)."""
    rows = slice(block.q0, block.q1)
    if block.first:
        out[rows], lse[:, rows] = o, s
        return
    old = lse[:, rows]
    total = torch.logaddexp(old, s.to(old.dtype))
    out[rows] = (out[rows] * (old - total).exp().T.unsqueeze(-1)
                 + o.to(out.dtype) * (s.to(old.dtype) - total).exp().T.unsqueeze(-1))
    lse[:, rows] = total


class _KVRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, geometry: RingGeometry, group: RankGroup,
                kernel: AttentionKernel) -> Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 at least: fp64 stays fp64
        out = torch.empty(q.shape, dtype=acc, device=q.device)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=acc, device=q.device)
        width, held = k.shape[1], torch.cat([k, v], dim=1)
        for s, blocks in enumerate(geometry.steps):
            shift = group.comm.ring_shift(held) if s + 1 < len(geometry.steps) else None  # next K/V in flight
            for blk in blocks:
                o, m = kernel.call(q[blk.q0:blk.q1], held[blk.k0:blk.k1, :width], held[blk.k0:blk.k1, width:],
                                   blk.causal, geometry.mask(blk, q.dtype, q.device))
                _merge(out, lse, blk, o, m)
            if shift is not None:
                held = shift.wait()
        out = out.to(q.dtype)
        ctx.geometry, ctx.group, ctx.kernel = geometry, group, kernel
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        geometry, comm, kernel = ctx.geometry, ctx.group.comm, ctx.kernel
        acc = torch.promote_types(k.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        width, held = k.shape[1], torch.cat([k, v], dim=1)
        passed = None  # the dK/dV partial sum the previous rank sent, for the K/V now in hand
        steps = len(geometry.steps)
        for s, blocks in enumerate(geometry.steps):
            shift = comm.ring_shift(held) if s + 1 < steps else None
            part = torch.zeros(held.shape, dtype=acc, device=held.device)
            for blk in blocks:
                rows = slice(blk.q0, blk.q1)
                gq, gk, gv = kernel.backward(grad[rows], q[rows], held[blk.k0:blk.k1, :width],
                                             held[blk.k0:blk.k1, width:], out[rows], lse[:, rows], blk.causal,
                                             geometry.mask(blk, q.dtype, q.device))
                dq[rows] += gq
                part[blk.k0:blk.k1, :width] += gk
                part[blk.k0:blk.k1, width:] += gv
            if passed is not None:
                part += passed.wait()
            # summed in fp32 (fp64) here, passed on in the K/V dtype (bf16 under mixed precision: half the bytes)
            passed = comm.ring_shift(part.to(k.dtype)) if steps > 1 else None
            if shift is not None:
                held = shift.wait()
        mine = passed.wait() if passed is not None else part.to(k.dtype)
        dk, dv = mine.split([width, v.shape[1]], dim=1)
        return dq.to(q.dtype), dk.contiguous(), dv.contiguous(), None, None, None


def kv_parts(q: Tensor, cu_seqlens: Tensor, groups: LayoutGroups, micro_batch: MicroBatch | None, where: str,
             window: int | None) -> tuple[RankGroup, RankGroup]:
    """The layout's Ulysses and KV sub-groups of cp, after checking what the KV kinds need (the KV ring's
    and the KV gather's: the micro-batch packed for this cp, heads the Ulysses part divides, a window >= 1).

    Args:
        q: the local query rows [T, h, d].
        cu_seqlens, groups, micro_batch, where, window: as :func:`kv_ring_attention`'s.
    """
    ulysses, kv = groups.cp_ulysses, groups.cp_kv
    if ulysses is None or kv is None or ulysses.size * kv.size != groups.cp.size:
        raise LayoutError(f"{where}: layout {groups.layout} needs its Ulysses and KV sub-groups of cp "
                          f"(build LayoutGroups with WorldMesh.layout_groups)")
    check_micro_batch(micro_batch, cu_seqlens, q.shape[0], groups.cp, where)
    if q.shape[1] % ulysses.size:
        raise LayoutError(f"{where}: the Ulysses part of cp ({ulysses.size}) does not divide the "
                          f"{q.shape[1]} local query heads")
    if window is not None and window < 1:
        raise LayoutError(f"{where}: sliding window must be >= 1, got {window}")
    return ulysses, kv


def ulysses_heads(q: Tensor, k: Tensor, v: Tensor, ulysses: RankGroup, where: str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with heads scattered over the Ulysses part (a hybrid's all-to-all; as they are for cp_kv == cp),
    after which the kv heads must divide the query heads (both KV kinds' entry).

    Args:
        q, k, v: the local rows [T, h, d]; ulysses: the layout's Ulysses sub-group of cp; where: for errors.
    """
    if ulysses.size > 1:
        q, k, v = exchange_qkv(q, k, v, ulysses)
    if q.shape[1] % k.shape[1]:
        raise LayoutError(f"{where}: {k.shape[1]} kv heads do not divide the {q.shape[1]} query heads")
    return q, k, v


def kv_ring_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, groups: LayoutGroups,
                      micro_batch: MicroBatch | None = None, where: str = "context parallel",
                      window: int | None = None, core: object = None) -> Tensor:
    """Causal document attention for ``groups.layout``'s KV / hybrid cp, K/V around the KV group's ring.

    Args:
        q, k, v: q [T, h, d] and k / v [T, hkv, d] local rows, as packed for this cp rank.
        cu_seqlens: this rank's local document boundaries.
        groups: the active layout's groups (its Ulysses and KV sub-groups of cp).
        micro_batch: the micro-batch, checked against ``cu_seqlens``.
        where: the module, for error messages.
        window: the model's sliding window (None: full causal).
        core: the model's core attention: the registry's chunk kernel beside it runs the blocks
            (``models.attention_kernels.chunk_kernel_for``; None: as "auto").
    """
    ulysses, kv = kv_parts(q, cu_seqlens, groups, micro_batch, where, window)
    # validated before any collective: a bad micro-batch fails on every rank alike
    geometry = ring_geometry(cu_seqlens, groups.cp.size, ulysses.size, kv.size, kv.index, window, where)
    q, k, v = ulysses_heads(q, k, v, ulysses, where)
    out = _KVRingAttention.apply(q, k, v, geometry, kv, chunk_kernel_for(core, q, window))
    return all_to_all_tokens_to_heads(out, ulysses) if ulysses.size > 1 else out
