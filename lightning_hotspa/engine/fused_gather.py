"""One fused all-gather of several shards: what a switch (:mod:`.switch`) and a sharded working
copy's per-unit gathers (:mod:`.fsdp`) both send.

The pieces travel in ONE buffer over the group; each result concatenates the members' pieces along
its own ``dim`` in shard order (a multi-dim group's collective slots are not its shard order:
:class:`~lightning_hotspa.mesh.RankGroup`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..collective_names import collective
from ..mesh import RankGroup

__all__ = ["FusedGather"]


class FusedGather:
    """Started at construction (asynchronously with ``async_op``); :meth:`finish` waits and returns
    the gathered tensors. ``fresh``: each result is a tensor of its own, never a view of the receive
    buffer (fsdp's saved-tensor hooks recognise weights by their base tensor); otherwise a single
    piece already in shard order along dim 0 is returned as a view (no copy)."""

    def __init__(self, pieces: Sequence[Tensor], dims: Sequence[int], group: RankGroup, async_op: bool = False) -> None:
        self.moved = [p.movedim(d, 0) for p, d in zip(pieces, dims)]
        self.dims, self.group = list(dims), group
        flat = (self.moved[0].contiguous().view(-1) if len(self.moved) == 1
                else torch.cat([m.reshape(-1) for m in self.moved]))
        self.buffer = flat.new_empty(group.size * flat.numel())
        with collective("a weight all-gather", group):
            self.work = group.comm.all_gather_into(self.buffer, flat, async_op=async_op)
        self.width = flat.numel()

    def finish(self, fresh: bool = False) -> list[Tensor]:
        if self.work is not None:
            with collective("a weight all-gather", self.group):
                self.work.wait()
        group = self.group
        rows = self.buffer.view(group.size, self.width)
        copy = fresh or len(self.moved) > 1 or not group.in_shard_order
        results, offset = [], 0
        for m, d in zip(self.moved, self.dims):
            n = m.numel()
            shape = (group.size * m.shape[0], *m.shape[1:])
            if copy:  # the member rows into shard order, in a tensor of their own
                out = m.new_empty(shape)
                dst = out.view(group.size, n)
                if group.in_shard_order:  # slots are shards: one strided copy
                    dst.copy_(rows[:, offset:offset + n])
                else:
                    for shard, slot in enumerate(group.slot_of_shard):
                        dst[shard].copy_(rows[slot, offset:offset + n])
            else:
                out = rows[:, offset:offset + n].view(shape)
            results.append(out if d == 0 else out.movedim(0, d).contiguous())
            offset += n
        self.work = self.buffer = self.moved = None
        return results

    def discard(self) -> None:
        """Waits for the collective (every rank must complete it) and drops what it received."""
        if self.work is not None:
            with collective("a weight all-gather", self.group):
                self.work.wait()
        self.work = self.buffer = self.moved = None
