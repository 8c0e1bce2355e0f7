"""The collectives of one process group, chosen ONCE from its backend (the one place that asks it).

Why one object per group (docs/DESIGN.md §9): the runtime issues the same collectives in the same
order on every backend (the schedule is the hot path's: parallel/ and engine/ hold no backend test);
only HOW a collective is carried out differs, and that lives here:

==========================  =======================================  ===================================
operation                   :class:`DeviceCollectives` (NCCL, fake)  :class:`GlooCollectives`
==========================  =======================================  ===================================
all-gather of rows          ``all_gather_into_tensor``                one ``all_to_all_single`` of n copies
                                                                      (gloo's all-gather is slower)
reduce-scatter of rows      ``reduce_scatter_tensor``                 ``all_to_all_single`` + a local sum
                                                                      (gloo has no reduce-scatter)
reduce-scatter + all-gather two calls, back to back                   ONE ``all_to_all_single`` carrying
(a region's backward)                                                 both (latency bound: one launch)
ring shift (the KV ring)    ``batch_isend_irecv`` (one NCCL group)    the same (gloo's isend / irecv)
==========================  =======================================  ===================================

Every method works in SLOT order (the process group's rank order); the shard-order mapping is
:mod:`lightning_hotspa.parallel.collectives`' job. The ``torch.distributed`` functions are looked up
at call time, so :func:`lightning_hotspa.testing.comm_bytes.count_collective_bytes` sees every call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .collective_names import collective

__all__ = ["DeviceCollectives", "GlooCollectives", "GroupCollectives", "RingShift", "collectives_for"]


class RingShift:
    """A ring shift in flight (:meth:`GroupCollectives.ring_shift`): :meth:`wait` returns what the previous
    member sent. The send buffer is held until then."""

    def __init__(self, works: list[Any], send: Tensor, recv: Tensor, owner: Any) -> None:
        self._works, self._send, self._recv, self._owner = works, send, recv, owner

    def wait(self) -> Tensor:
        """Blocks until this shift's send and receive are done; the received tensor."""
        with collective("a ring shift (send / receive)", self._owner):
            for work in self._works:
                work.wait()
        self._send = None
        return self._recv


class GroupCollectives:
    """The row collectives of one process group (``group``: the ``dist`` group; ``owner``: the
    ``RankGroup`` named in a failed collective's note; ``size``: its member count)."""

    backend = "device"

    def __init__(self, group: Any, owner: Any, size: int) -> None:
        self.group = group
        self.owner = owner
        self.size = size

    def all_gather(self, flat: Tensor) -> Tensor:
        """``[T, ...]`` -> ``[n*T, ...]``: member k's rows at rows ``k*T`` (slot order)."""
        raise NotImplementedError

    def reduce_scatter(self, send: Tensor) -> Tensor:
        """``send [n, T, ...]`` (block k for slot k) -> ``[T, ...]``: the sum of the blocks sent here."""
        raise NotImplementedError

    def reduce_scatter_and_all_gather(self, send: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`reduce_scatter` of ``send`` and :meth:`all_gather` of ``flat`` (one region's backward:
        its input gradient and its re-gathered input)."""
        return self.reduce_scatter(send), self.all_gather(flat)

    def ring_shift(self, send: Tensor) -> RingShift:
        """Posts ``send`` to the next member in SHARD order (``owner.ranks``) and a receive of the same
        shape from the previous one; returns at once (the caller computes, then waits).

        Args:
            send: what this rank passes on (every member sends the same shape).
        """
        owner, n = self.owner, self.size
        send = send.contiguous()
        recv = torch.empty_like(send)
        ahead, behind = owner.ranks[(owner.index + 1) % n], owner.ranks[(owner.index - 1) % n]
        c10d = dist.distributed_c10d  # P2POp accepts only these two functions themselves
        with collective("a ring shift (send / receive)", owner):
            works = dist.batch_isend_irecv([dist.P2POp(c10d.isend, send, ahead, self.group),
                                            dist.P2POp(c10d.irecv, recv, behind, self.group)])
        return RingShift(list(works or ()), send, recv, owner)


class DeviceCollectives(GroupCollectives):
    """NCCL (and the fake test backend): the native all-gather and reduce-scatter."""

    def all_gather(self, flat: Tensor) -> Tensor:
        buffer = flat.new_empty((self.size * flat.shape[0], *flat.shape[1:]))
        with collective("an all-gather of rows", self.owner):
            dist.all_gather_into_tensor(buffer, flat, group=self.group)
        return buffer

    def reduce_scatter(self, send: Tensor) -> Tensor:
        out = send.new_empty(send.shape[1:])
        with collective("a reduce-scatter of rows", self.owner):
            dist.reduce_scatter_tensor(out, send.reshape(-1, *send.shape[2:]).contiguous(), group=self.group)
        return out


class GlooCollectives(GroupCollectives):
    """gloo: every row collective is one all-to-all (its all-gather is slower than an all-to-all of
    n copies; it has no reduce-scatter; a region's two backward collectives share one launch)."""

    backend = "gloo"

    def _all_to_all(self, send: Tensor, what: str) -> Tensor:
        send = send.contiguous()
        recv = torch.empty_like(send)
        with collective(what, self.owner):
            dist.all_to_all_single(recv, send, group=self.group)
        return recv

    def all_gather(self, flat: Tensor) -> Tensor:
        copies = flat.unsqueeze(0).expand(self.size, *flat.shape)
        return self._all_to_all(copies, "an all-gather of rows").reshape(-1, *flat.shape[1:])

    def reduce_scatter(self, send: Tensor) -> Tensor:
        return self._all_to_all(send, "a reduce-scatter of rows").sum(0)

    def reduce_scatter_and_all_gather(self, send: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
        if send.dtype != flat.dtype or send.shape[1:-1] != flat.shape[:-1]:
            return super().reduce_scatter_and_all_gather(send, flat)
        width = send.shape[-1]
        both = torch.cat([send, flat.unsqueeze(0).expand(self.size, *flat.shape)], dim=-1)
        recv = self._all_to_all(both, "a reduce-scatter and an all-gather of rows")
        return recv[..., :width].sum(0), recv[..., width:].reshape(-1, *flat.shape[1:])


def collectives_for(owner: Any) -> GroupCollectives:
    """The collectives object of a ``RankGroup`` (made once per group, by ``RankGroup.comm``).

    Args:
        owner: the ``RankGroup`` (its ``group``, ``size`` and ``backend``, asked once).
    """
    kind = GlooCollectives if owner.backend == "gloo" else DeviceCollectives
    return kind(owner.group, owner, owner.size)
