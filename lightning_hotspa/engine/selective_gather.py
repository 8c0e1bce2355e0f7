"""A switch's gather when the members of its group want different parameters.

Into a pp layout every rank materializes only its own stages' parameters (:mod:`..parallel.pipeline`),
so the members of one gather group, which sit in different pipeline stages, want different subsets
of a bucket. An all-gather would hand every member every piece (it did: 1.0-4.4x the bytes a rank
was missing). Here ONE all-to-all of variable splits sends each member exactly the pieces of the
parameters it wants; a member's own piece never travels. The result, per wanted parameter, is the
members' pieces concatenated along its ``dim`` in shard order, as :class:`.FusedGather` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..collective_names import collective
from ..mesh import RankGroup
from ..shard_rows import shard_of_slot

__all__ = ["SelectiveGather", "unmaterialized"]


def unmaterialized(shape: Sequence[int], like: Tensor) -> Tensor:
    """A tensor of ``shape`` (``like``'s dtype and device) whose storage holds 0 bytes: the working copy
    of a parameter this rank does not compute with (never read: see ``switch._free``)."""
    out = like.new_empty(tuple(shape))  # address space only: released before any page is touched
    out.untyped_storage().resize_(0)
    return out


class SelectiveGather:
    """Runs at construction (synchronously); :meth:`finish` returns one tensor per piece: the gathered
    parameter where this rank wants it, else an :func:`unmaterialized` one of the gathered shape.

    Args:
        pieces: this rank's shard of each parameter of the bucket (one dtype).
        dims: each parameter's sharded dim.
        group: the group over the mesh dims the parameters are gathered over.
        wanted: per member, in shard-index order, the indices of ``pieces`` it needs (the same lists
            on every member).
    """

    def __init__(self, pieces: Sequence[Tensor], dims: Sequence[int], group: RankGroup,
                 wanted: Sequence[Sequence[int]]) -> None:
        if len(wanted) != group.size:
            raise ValueError(f"wanted names {len(wanted)} members, the group {group.desc} has {group.size}")
        self.moved = [p.movedim(d, 0).contiguous() for p, d in zip(pieces, dims)]
        self.dims, self.group = list(dims), group
        me = group.index
        self.mine = list(wanted[me])
        mine_elems = sum(self.moved[k].numel() for k in self.mine)
        send_parts: list[Tensor] = []
        self.send_sizes, self.recv_sizes = [0] * group.size, [0] * group.size
        for slot, shard in enumerate(shard_of_slot(group)):
            if shard == me:  # this rank's own piece stays where it is
                continue
            send_parts.extend(self.moved[k].reshape(-1) for k in wanted[shard])
            self.send_sizes[slot] = sum(self.moved[k].numel() for k in wanted[shard])
            self.recv_sizes[slot] = mine_elems
        template = self.moved[0]
        send = torch.cat(send_parts) if send_parts else template.new_empty(0)
        self.recv = template.new_empty(sum(self.recv_sizes))
        if any(wanted):  # every member knows every list: all call it, or none does
            with collective("a weight all-to-all (only the stages' own parameters)", group):
                group.comm.all_to_all_into(self.recv, send, self.recv_sizes, self.send_sizes)
        #: bytes this rank received
        self.received_bytes = self.recv.numel() * self.recv.element_size()

    def finish(self) -> list[Tensor]:
        group, me = self.group, self.group.index
        starts, offset = [0] * group.size, 0
        for slot, size in enumerate(self.recv_sizes):
            starts[slot] = offset
            offset += size
        results: list[Tensor] = []
        for k, (m, d) in enumerate(zip(self.moved, self.dims)):
            shape = (group.size * m.shape[0], *m.shape[1:])
            if k not in self.mine:  # in the parameter's own dim order: a freed tensor is never permuted
                final = [*shape[1:]]
                final.insert(d, shape[0])
                results.append(unmaterialized(final, m))
                continue
            out = m.new_empty(shape)
            rows = out.view(group.size, m.numel())
            within = sum(self.moved[j].numel() for j in self.mine[:self.mine.index(k)])
            for shard in range(group.size):
                if shard == me:
                    rows[shard].copy_(m.reshape(-1))
                else:
                    start = starts[group.slot_of_shard[shard]] + within
                    rows[shard].copy_(self.recv[start:start + m.numel()])
            results.append(out if d == 0 else out.movedim(0, d).contiguous())
        self.recv = self.moved = None
        return results
