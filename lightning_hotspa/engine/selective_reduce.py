"""The gradient reduce-scatter of a pp layout: each parameter's gradient lives on its own stage's ranks
only, so the members that do not hold it send nothing (a plain reduce-scatter would have every other
stage send zeros for it: about pp times the bytes). Used by :mod:`.gradients`."""

from __future__ import annotations

import math

import torch

from ..collective_names import collective
from ..mesh import RankGroup
from ..shard_rows import shard_of_slot

__all__ = ["selective_reduce_scatter"]


def selective_reduce_scatter(tensors: list[torch.Tensor | None], shapes: list[tuple[int, ...]], dims: list[int],
                             group: RankGroup, dtype: torch.dtype, owners: list[list[int]],
                             device: torch.device) -> tuple[list[torch.Tensor], int]:
    """A reduce-scatter where only some members hold each gradient (a pp layout: a parameter's own
    stage): ONE all-to-all sends each owner's chunk ``j`` of its gradients to member ``j``, and each
    member sums the chunks it receives in shard order; nobody sends zeros for another stage's
    parameters. Returns this member's reduced chunk per parameter and the bytes it received.

    Args:
        tensors: this rank's gradient per parameter, None where it does not own it.
        shapes: each parameter's working shape.
        dims: each parameter's sharded dim.
        group: the reduce-scatter's group.
        dtype: the reduction dtype.
        owners: per parameter, the shard indices of the members that hold its gradient.
        device: where the buffers live (the working parameters'; a rank may hold none of the bucket).
    """
    me, size = group.index, group.size
    chunks = [None if t is None else t.movedim(d, 0).to(dtype).unflatten(0, (size, t.shape[d] // size))
              for t, d in zip(tensors, dims)]
    piece = [math.prod(shape) // size for shape in shapes]
    shards = shard_of_slot(group)  # the member in each collective slot
    send, send_sizes, recv_sizes = [], [0] * size, [0] * size
    for slot, shard in enumerate(shards):
        if shard == me:
            continue
        for k, c in enumerate(chunks):
            if c is not None:
                send.append(c[shard].reshape(-1))
                send_sizes[slot] += piece[k]
            if shard in owners[k]:
                recv_sizes[slot] += piece[k]
    flat = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    with collective("a gradient reduce-scatter (each stage's own parameters)", group):
        group.comm.all_to_all_into(recv, flat, recv_sizes, send_sizes)
    starts, offset = {}, 0
    for slot, shard in enumerate(shards):
        starts[shard] = offset
        offset += recv_sizes[slot]
    results = []
    for k, (shape, d) in enumerate(zip(shapes, dims)):
        moved = (shape[d] // size, *shape[:d], *shape[d + 1:])
        out = torch.zeros(moved, dtype=dtype, device=device)
        for shard in owners[k]:  # shard order: the same sum on every member
            if shard == me:
                out += chunks[k][me]
            else:
                out += recv[starts[shard]:starts[shard] + piece[k]].view(moved)
                starts[shard] += piece[k]
        results.append(out.movedim(0, d).contiguous())
    return results, recv.numel() * recv.element_size()
