"""Ulysses context parallelism around an ordinary varlen core attention.

Why Ulysses and not a ring: torch's ring ``context_parallel`` has no CPU SDPA rule
(docs/DESIGN.md §7, trap "context_parallel on CPU"), and an all-to-all keeps the attention kernel
untouched, so every backend (SDPA per document, flash varlen) works unchanged and documents that
straddle cp chunks stay exact.

Each cp rank holds chunks ``r`` and ``2cp-1-r`` of every document (``plan.pack_micro_batch``). One
all-to-all of the fused q/k/v scatters heads and gathers tokens; the gathered rows (rank-major) are
permuted back to the true row order, so the full documents lie contiguous at ``cp_cu_seqlens`` and
the inner attention runs on whole rows with ``cp`` times fewer heads. The output goes back the same
way. Since every local document is exactly 1/cp of its padded row, ``cp_cu_seqlens == cp *
cu_seqlens``: the wrapper needs only the local ``cu_seqlens`` (also during activation-checkpoint
recomputation, where no micro-batch is active) and checks the micro-batch against it when one is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..host import host_reads
from ..host_facts import recall, remember
from ..layout import LayoutError
from ..mesh import RankGroup
from ..plan import MicroBatch
from .collectives import all_to_all_heads_to_tokens, all_to_all_tokens_to_heads, permute_rows

__all__ = ["RowOrder", "check_micro_batch", "chunked_bounds", "exchange_qkv", "row_order", "ulysses_attention"]


@dataclass(frozen=True)
class RowOrder:
    """``full = gathered[perm]``; ``gathered = full[inverse]``; the whole rows' boundaries."""

    perm: Tensor
    inverse: Tensor
    cu_seqlens: Tensor  # int32, the padded full row's document boundaries (== cp_cu_seqlens)
    max_seqlen: int


def host_bounds(cu_seqlens: Tensor) -> list[int]:
    """``cu_seqlens`` as host ints: filed where the batch was built (:mod:`..host_facts`), else read
    (a host sync on a device; a micro-batch built by hand)."""
    known = recall(cu_seqlens, "bounds")
    if known is not None:
        return list(known)
    with host_reads():  # metadata: real values even under the memory estimator's FakeTensorMode
        return [int(b) for b in cu_seqlens.tolist()]


def chunked_bounds(cu_seqlens: Tensor, cp: int, where: str) -> tuple[list[int], list[int]]:
    """This rank's document bounds and local lengths (host values), each length two equal chunks as the
    plan packs a cp rank's documents; a clear error otherwise.

    Args:
        cu_seqlens: this rank's local document boundaries.
        cp: the cp degree (for the message).
        where: the module, for error messages.
    """
    bounds = host_bounds(cu_seqlens)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if not lengths or min(lengths) < 2 or any(n % 2 for n in lengths):
        raise LayoutError(f"{where}: with cp={cp} every local document must be two equal chunks (the plan "
                          f"splits each padded document in 2*cp), got local lengths {lengths[:8]}; was the "
                          f"micro-batch packed for this cp size?")
    return bounds, lengths


def _build_row_order(cu_seqlens: Tensor, cp: int, where: str) -> RowOrder:
    cu = cu_seqlens.to(torch.int64)
    local = cu[1:] - cu[:-1]
    bounds, lengths = chunked_bounds(cu_seqlens, cp, where)
    tokens = bounds[-1]
    chunk = local // 2
    full_len = local * cp
    full_cu = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=cu.device)
    full_cu[1:] = full_len.cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), full_len,
                                  output_size=tokens * cp)
    offset = torch.arange(tokens * cp, device=cu.device) - full_cu[doc]
    c = chunk[doc]
    piece, within = offset // c, offset % c
    second = piece >= cp
    owner = torch.where(second, 2 * cp - 1 - piece, piece)
    perm = owner * tokens + cu[doc] + second * c + within
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=cu.device)
    full_bounds = [0]
    for n in lengths:
        full_bounds.append(full_bounds[-1] + n * cp)
    order = RowOrder(perm, inverse, full_cu.to(torch.int32), max(lengths) * cp)
    remember(order.cu_seqlens, "bounds", tuple(full_bounds))  # the inner attention reads no device value
    return order


def row_order(cu_seqlens: Tensor, cp: int, where: str = "context parallel") -> RowOrder:
    """The permutation for one micro-batch, filed with its ``cu_seqlens`` tensor (:mod:`..host_facts`:
    every layer, and checkpoint recomputation, passes the same object; it goes with the tensor)."""
    name = f"ulysses_row_order:{cp}"
    order = recall(cu_seqlens, name)
    if order is None:
        order = _build_row_order(cu_seqlens, cp, where)
        remember(cu_seqlens, name, order)
    return order


def check_micro_batch(mb: MicroBatch | None, cu_seqlens: Tensor, tokens: int, group: RankGroup, where: str) -> None:
    if mb is None:
        return
    if mb.cp_size != group.size or mb.cp_rank != group.index:
        raise LayoutError(f"{where}: the micro-batch was sliced for cp_size={mb.cp_size}, cp_rank={mb.cp_rank}, "
                          f"but the active layout has cp={group.size} and this rank is cp rank {group.index}")
    if mb.num_tokens != tokens:
        raise LayoutError(f"{where}: attention got {tokens} tokens but the micro-batch has {mb.num_tokens}")
    if mb.cu_seqlens is not cu_seqlens and not torch.equal(mb.cu_seqlens.cpu().long(), cu_seqlens.cpu().long()):
        raise LayoutError(f"{where}: cu_seqlens passed to attention differ from the micro-batch's")


def ulysses_attention(
    inner: object,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    group: RankGroup,
    micro_batch: MicroBatch | None = None,
    where: str = "context parallel",
) -> Tensor:
    """``inner`` run on the whole rows of the cp group; q [T, h, d], k / v [T, hkv, d] local."""
    del max_seqlen  # the whole rows' maximum is derived from cu_seqlens
    cp, tokens = group.size, q.shape[0]
    q_heads = q.shape[1]
    if q_heads % cp:
        raise LayoutError(f"{where}: cp={cp} does not divide the {q_heads} local query heads")
    check_micro_batch(micro_batch, cu_seqlens, tokens, group, where)
    order = row_order(cu_seqlens, cp, where)
    qf, kf, vf = exchange_qkv(q, k, v, group, order)
    out = inner(qf, kf, vf, order.cu_seqlens, order.max_seqlen)
    return all_to_all_tokens_to_heads(permute_rows(out, order.inverse, order.perm), group)


def exchange_qkv(q: Tensor, k: Tensor, v: Tensor, group: RankGroup,
                 order: RowOrder | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The Ulysses exchange: ``1/n`` of the heads, every member's rows (member-major, or permuted by
    ``order``). kv heads are repeated just enough that ``n`` divides them (GQA groups stay intact);
    the caller has checked that ``n`` divides the query heads."""
    cp, tokens = group.size, q.shape[0]
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads % cp:
        repeat = cp // math.gcd(kv_heads, cp)
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        kv_heads *= repeat

    def gather(t: Tensor) -> Tensor:
        t = all_to_all_heads_to_tokens(t, group)
        return t if order is None else permute_rows(t, order.perm, order.inverse)

    if k.shape[2] == q.shape[2] == v.shape[2]:  # one exchange for q, k and v
        parts = [t.reshape(tokens, cp, t.shape[1] // cp, t.shape[2]) for t in (q, k, v)]
        fused = torch.cat(parts, dim=2).reshape(tokens, q_heads + 2 * kv_heads, q.shape[2])
        qf, kf, vf = gather(fused).split([q_heads // cp, kv_heads // cp, kv_heads // cp], dim=1)
        return qf, kf, vf
    return gather(q), gather(k), gather(v)
