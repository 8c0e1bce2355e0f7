"""Row collectives over one :class:`~lightning_hotspa.mesh.RankGroup` in SHARD order, without autograd.

``dist.new_group`` orders members by global rank while shard indices nest across mesh dims, so the
output slot of a member is ``group.slot_of_shard[shard]``, not ``shard``: this module maps slots to
shards, once (:func:`order`; ``parallel/collectives.py``'s all-to-alls use it too). How each
collective is carried out on the group's backend is ``group.comm``'s (``group_collectives.py``).
On the ground floor: the model's loss head (``models/loss_head.py``) and the parallel runtime both
gather rows with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .mesh import RankGroup

__all__ = ["all_gather_matmul_rows", "all_gather_rows", "matmul_reduce_scatter_rows", "order",
           "reduce_scatter_and_gather_rows", "reduce_scatter_rows", "shard_of_slot"]


def shard_of_slot(group: RankGroup) -> list[int]:
    """Inverse of ``slot_of_shard``: the shard index held by each collective slot.

    Args:
        group: the group.
    """
    out = [0] * group.size
    for shard, slot in enumerate(group.slot_of_shard):
        out[slot] = shard
    return out


def order(group: RankGroup, kind: str, device: torch.device) -> Tensor:
    """The slot<->shard permutation (``kind``: "slot_of_shard" or "shard_of_slot") as an index tensor
    on ``device``, built once per group and device: indexing with a Python list would copy the list
    from the host on every call (a host-to-device copy that waits, docs/DESIGN.md §4).

    Args:
        group: the group.
        kind: "slot_of_shard" or "shard_of_slot".
        device: where the index tensor lives.
    """
    cache = group.__dict__.setdefault("_index_tensors", {})
    key = (kind, str(device))
    if key not in cache:
        slots = group.slot_of_shard if kind == "slot_of_shard" else shard_of_slot(group)
        cache[key] = torch.tensor(slots, dtype=torch.int64, device=device)
    return cache[key]


def _to_shard_order(buffer: Tensor, group: RankGroup, rows: int) -> Tensor:
    """``[n*rows, ...]`` in slot order -> shard order."""
    if group.in_shard_order:
        return buffer
    index = order(group, "slot_of_shard", buffer.device)
    return buffer.view(group.size, rows, *buffer.shape[1:]).index_select(0, index).reshape(buffer.shape)


def _blocks_by_slot(x: Tensor, group: RankGroup) -> Tensor:
    """``[n*T, ...]`` (block s for shard s) -> ``[n, T, ...]`` with block k for slot k."""
    n = group.size
    send = x.reshape(n, x.shape[0] // n, *x.shape[1:])
    if not group.in_shard_order:
        send = send.index_select(0, order(group, "shard_of_slot", send.device))
    return send


def all_gather_rows(x: Tensor, group: RankGroup) -> Tensor:
    """[T, ...] -> [n*T, ...]: every member's rows, member s at rows s*T (shard order); no autograd
    (the all-gather-KV attention re-gathers in its own backward). How: ``group.comm``.

    Args:
        x: this rank's rows.
        group: the group.
    """
    flat = x.contiguous()
    return _to_shard_order(group.comm.all_gather(flat), group, flat.shape[0])


def reduce_scatter_rows(x: Tensor, group: RankGroup) -> Tensor:
    """[n*T, ...] -> [T, ...]: the sum over members of their rows block ``index`` (the backward of
    :func:`all_gather_rows`). How: ``group.comm``.

    Args:
        x: ``[n*T, ...]``, block s for shard s.
        group: the group.
    """
    return group.comm.reduce_scatter(_blocks_by_slot(x, group))


def reduce_scatter_and_gather_rows(x: Tensor, shard: Tensor, group: RankGroup) -> tuple[Tensor, Tensor]:
    """:func:`reduce_scatter_rows` of ``x`` and :func:`all_gather_rows` of ``shard`` together (a
    sequence-parallel region's backward: its input gradient and its input again), one collective
    where the group's backend allows it (``group.comm``).

    Args:
        x: ``[n*T, ...]``, block s for shard s (the gradient to sum).
        shard: ``[T, ...]``, this rank's rows to gather.
        group: the group.
    """
    flat = shard.contiguous()
    summed, gathered = group.comm.reduce_scatter_and_all_gather(_blocks_by_slot(x, group), flat)
    return summed, _to_shard_order(gathered, group, flat.shape[0])


def all_gather_matmul_rows(x: Tensor, rights: list[Tensor], group: RankGroup) -> tuple[Tensor, list[Tensor]]:
    """(``all_gather_rows(x)``, ``[that @ b for b in rights]``), the GEMMs overlapped with the gather
    where the group's backend allows it (``group.comm.all_gather_matmul``); rows in shard order.

    Args:
        x: this rank's rows ``[T, ..., K]``.
        rights: ``[K, N_i]`` matrices.
        group: the group.
    """
    flat = x.reshape(-1, x.shape[-1])
    gathered, outs = group.comm.all_gather_matmul(flat, rights)
    rows = (group.size * x.shape[0], *x.shape[1:-1])
    return (_to_shard_order(gathered, group, flat.shape[0]).view(*rows, x.shape[-1]),
            [_to_shard_order(o, group, flat.shape[0]).view(*rows, o.shape[-1]) for o in outs])


def matmul_reduce_scatter_rows(lefts: list[Tensor], rights: list[Tensor], group: RankGroup) -> Tensor:
    """:func:`reduce_scatter_rows` of ``sum_i lefts[i] @ rights[i]``, the GEMMs overlapped with the
    reduction where the group's backend allows it (``group.comm.matmul_reduce_scatter``).

    Args:
        lefts: ``[n*T, ..., K_i]``, block s for shard s.
        rights: ``[K_i, N]`` matrices.
        group: the group.
    """
    shape = lefts[0].shape
    blocks = [_blocks_by_slot(a, group).reshape(group.size, -1, a.shape[-1]) for a in lefts]
    out = group.comm.matmul_reduce_scatter(blocks, rights)
    return out.view(shape[0] // group.size, *shape[1:-1], out.shape[-1])
