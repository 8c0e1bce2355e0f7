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
all-gather + matmul         NCCL on CUDA: ``symm_mem`` fused op       a ring of n steps: the GEMM on the
(a tp region's input)       (the group enabled for symmetric          chunk in hand while the next chunk's
                            memory); else gather, then GEMM           ``isend`` / ``irecv`` is in flight
matmul + reduce-scatter     NCCL on CUDA: ``symm_mem`` fused op;      a ring of n steps: each step's partial
(a row-parallel output)     else GEMM, then reduce-scatter            product while the sum so far arrives
ring shift (the KV ring)    ``batch_isend_irecv`` (one NCCL group)    the same (gloo's isend / irecv)
==========================  =======================================  ===================================

The two fused operations are tensor parallelism's communication overlap (Megatron-LM's
``--tp-comm-overlap``, torchtitan's async TP); the ring carries the same math on gloo, so the CPU
tests check it, and nothing overlaps in time there. The symmetric-memory path has never run on a GPU
(``recipes/gpu_check.py``'s ``tp_overlap`` part checks it where one is lent).

The package's one door to ``torch.distributed`` collectives: besides the row collectives, thin methods
issue the plain ones (:meth:`GroupCollectives.all_reduce` ... :meth:`GroupCollectives.barrier`) on the
group, and :func:`world_collectives` on the default group (tests/unit/test_collectives_door.py
forbids them elsewhere in the package, ``testing/`` aside).

Every method works in SLOT order (the process group's rank order); the shard-order mapping is
:mod:`lightning_hotspa.parallel.collectives`' job. The ``torch.distributed`` functions are looked up
at call time, so :func:`lightning_hotspa.testing.comm_bytes.count_collective_bytes` sees every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .collective_names import collective

__all__ = ["DeviceCollectives", "GlooCollectives", "GroupCollectives", "RingShift", "collectives_for",
           "objects_to_cpu", "world_collectives"]


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

    def all_gather_matmul(self, flat: Tensor, rights: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``flat [T, K]`` -> (:meth:`all_gather` of it ``[n*T, K]``, ``[gathered @ b for b in rights]``),
        slot order; ``rights``: ``[K, N_i]`` matrices (a column region's transposed weights)."""
        gathered = self.all_gather(flat)
        return gathered, [gathered @ b for b in rights]

    def matmul_reduce_scatter(self, lefts: Sequence[Tensor], rights: Sequence[Tensor]) -> Tensor:
        """``sum_i lefts[i] @ rights[i]`` reduce-scattered: ``lefts[i] [n, T, K_i]`` (block k for slot k),
        ``rights[i] [K_i, N]`` -> ``[T, N]``, the sum over members of their products for this slot."""
        return self.reduce_scatter(_products(lefts, rights))

    def all_reduce_max(self, t: Tensor) -> Tensor:
        """The elementwise max of ``t`` over the members, in a fresh tensor (an FP8 scale's amax,
        parallel/fp8.py; a few floats, no autograd)."""
        out = t.clone(memory_format=torch.contiguous_format)
        with collective("an all-reduce (max)", self.owner):
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

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

    # -- the plain collectives: torch.distributed's own call on this group, the package's one door to them
    # (callers keep their ``collective(...)`` note; the arguments reach torch as the callers gave them)
    def all_reduce(self, t: Tensor, op: str = "sum", async_op: bool = False) -> Any:
        """``dist.all_reduce`` of ``t`` in place (``op``: ``"sum"``, ``"max"``, ``"min"``); a work with ``async_op``."""
        return dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()), group=self.group, async_op=async_op)

    def all_gather_into(self, out: Tensor, t: Tensor, async_op: bool = False) -> Any:
        """``dist.all_gather_into_tensor(out, t)``: slot k's ``t`` at ``out``'s k-th block."""
        return dist.all_gather_into_tensor(out, t, group=self.group, async_op=async_op)

    def reduce_scatter_into(self, out: Tensor, t: Tensor, async_op: bool = False) -> Any:
        """``dist.reduce_scatter_tensor(out, t)``: the sum of every member's k-th block of ``t`` at slot k."""
        return dist.reduce_scatter_tensor(out, t, group=self.group, async_op=async_op)

    def all_to_all_into(self, recv: Tensor, send: Tensor, recv_sizes: list[int] | None = None,
                        send_sizes: list[int] | None = None) -> Any:
        """``dist.all_to_all_single(recv, send, recv_sizes, send_sizes)`` (even blocks without sizes)."""
        return dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)

    def all_gather_list(self, outs: list[Tensor], t: Tensor) -> Any:
        """``dist.all_gather(outs, t)``: slot k's ``t`` into ``outs[k]``."""
        return dist.all_gather(outs, t, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's picklable ``obj``, in slot order (``dist.all_gather_object``)."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object_list(self, box: list[Any], src: int = 0) -> None:
        """``dist.broadcast_object_list(box, src)``: global rank ``src``'s objects into ``box`` on every member."""
        dist.broadcast_object_list(box, src, group=self.group)

    def barrier(self, device_index: int | None = None) -> None:
        """Waits for every member; on NCCL at ``device_index`` (the rank's CUDA device) where given."""
        if device_index is not None and dist.get_backend(self.group) == "nccl":
            dist.barrier(group=self.group, device_ids=[device_index])
        else:
            dist.barrier(group=self.group)


def _products(lefts: Sequence[Tensor], rights: Sequence[Tensor]) -> Tensor:
    """``sum_i lefts[i] @ rights[i]``."""
    out = None
    for a, b in zip(lefts, rights, strict=True):
        out = a @ b if out is None else out.add_(a @ b)
    return out


class DeviceCollectives(GroupCollectives):
    """NCCL (and the fake test backend): the native all-gather and reduce-scatter; on NCCL with CUDA
    tensors the symmetric-memory fused GEMM + collective ops (tp overlap)."""

    def _symm_mem_name(self, t: Tensor) -> str | None:
        """The group's name for ``torch.ops.symm_mem`` (enabled for symmetric memory once), or None
        where the fused ops do not apply (another backend, CPU tensors, a torch without them)."""
        if self.owner.backend != "nccl" or not t.is_cuda:
            return None
        name = self.__dict__.get("_symm_name")
        if name is None:
            from torch.distributed import _symmetric_memory as symm

            name = self.group.group_name
            if not symm.is_symm_mem_enabled_for_group(name):
                symm.enable_symm_mem_for_group(name)
            self._symm_name = name
        return name

    def all_gather_matmul(self, flat: Tensor, rights: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        name = self._symm_mem_name(flat)
        if name is None:
            return super().all_gather_matmul(flat, rights)
        with collective("a fused all-gather + matmul", self.owner):
            gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(flat, list(rights), 0, name)
        return gathered, list(outs)

    def matmul_reduce_scatter(self, lefts: Sequence[Tensor], rights: Sequence[Tensor]) -> Tensor:
        name = self._symm_mem_name(lefts[0])
        if name is None:
            return super().matmul_reduce_scatter(lefts, rights)
        a = torch.cat([x.reshape(-1, x.shape[-1]) for x in lefts], dim=-1) if len(lefts) > 1 \
            else lefts[0].reshape(-1, lefts[0].shape[-1])
        b = torch.cat(list(rights), dim=0) if len(rights) > 1 else rights[0]
        with collective("a fused matmul + reduce-scatter", self.owner):
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, name)

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
        # flat (member k's block is the k-th n-th of dim 0 either way): under compile a [n, tokens, ...] buffer's
        # stride order would be compared with the token count, a guard that adds a graph for a 1-token shard
        flat = send.contiguous().view(-1)
        recv = torch.empty_like(flat)
        with collective(what, self.owner):
            dist.all_to_all_single(recv, flat, group=self.group)
        return recv.view(send.shape)

    def all_gather(self, flat: Tensor) -> Tensor:
        # n copies by repeat, not an expanded view made contiguous: that copy's layout depends on whether the
        # token count is 1, another guard under compile
        copies = flat.contiguous().view(-1).repeat(self.size).view(self.size, *flat.shape)
        return self._all_to_all(copies, "an all-gather of rows").view(-1, *flat.shape[1:])

    def reduce_scatter(self, send: Tensor) -> Tensor:
        return self._all_to_all(send, "a reduce-scatter of rows").sum(0)

    def reduce_scatter_and_all_gather(self, send: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
        if send.dtype != flat.dtype:
            return super().reduce_scatter_and_all_gather(send, flat)
        n = self.size
        # member k's block: its share of ``send`` then a copy of ``flat``, each flattened (no view whose layout
        # depends on whether the token count is 1: a guard under compile), so the two need not share inner shapes
        sent = send.contiguous().view(n, -1)
        both = torch.cat([sent, flat.contiguous().view(1, -1).expand(n, -1)], dim=1)
        recv = self._all_to_all(both, "a reduce-scatter and an all-gather of rows")
        reduced = recv[:, :sent.shape[1]].sum(0).view(send.shape[1:])
        return reduced, recv[:, sent.shape[1]:].reshape(-1).view(-1, *flat.shape[1:])

    # -- tp overlap: rings of point-to-point steps, each step's GEMM while the next transfer is in flight
    def _ring(self, send: Tensor, recv: Tensor) -> list:
        """Starts ``send`` to the next slot and ``recv`` from the previous one (the ring's one step)."""
        me, n = self.owner.slot_of_shard[self.owner.index], self.size
        return [dist.isend(send, group=self.group, group_dst=(me + 1) % n),
                dist.irecv(recv, group=self.group, group_src=(me - 1) % n)]

    def _wait(self, works: list, what: str) -> None:
        with collective(what, self.owner):
            for work in works:
                work.wait()

    def all_gather_matmul(self, flat: Tensor, rights: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        n, rows = self.size, flat.shape[0]
        me = self.owner.slot_of_shard[self.owner.index]
        gathered = flat.new_empty((n * rows, flat.shape[-1]))
        outs = [flat.new_empty((n * rows, b.shape[-1])) for b in rights]
        chunk = flat.contiguous()
        for step in range(n):
            src = (me - step) % n  # the slot whose rows are in hand
            works, nxt = [], None
            if step < n - 1:
                nxt = torch.empty_like(chunk)
                works = self._ring(chunk, nxt)
            gathered[src * rows:(src + 1) * rows] = chunk
            for out, b in zip(outs, rights):
                torch.mm(chunk, b, out=out[src * rows:(src + 1) * rows])
            if works:
                self._wait(works, "an all-gather + matmul ring")
                chunk = nxt
        return gathered, outs

    def matmul_reduce_scatter(self, lefts: Sequence[Tensor], rights: Sequence[Tensor]) -> Tensor:
        n = self.size
        me = self.owner.slot_of_shard[self.owner.index]
        acc, sends = None, []
        for step in range(n):
            dst = (me - step - 1) % n  # whose rows this step's partial sum is for: the last step's are ours
            recv, works = None, []
            if step > 0:
                recv = torch.empty_like(acc)
                works = [dist.irecv(recv, group=self.group, group_src=(me - 1) % n)]
            part = _products([a[dst] for a in lefts], rights)
            if works:
                self._wait(works, "a matmul + reduce-scatter ring")
                part = part.add_(recv)
            if step < n - 1:
                sends.append(dist.isend(part, group=self.group, group_dst=(me + 1) % n))
            acc = part
        self._wait(sends, "a matmul + reduce-scatter ring")
        return acc


def collectives_for(owner: Any) -> GroupCollectives:
    """The collectives object of a ``RankGroup`` (made once per group, by ``RankGroup.comm``).

    Args:
        owner: the ``RankGroup`` (its ``group``, ``size`` and ``backend``, asked once).
    """
    kind = GlooCollectives if owner.backend == "gloo" else DeviceCollectives
    return kind(owner.group, owner, owner.size)


def world_collectives() -> GroupCollectives:
    """The default (world) group's collectives object: its plain collectives (:meth:`GroupCollectives.all_reduce`
    ...), for the adapter, the records and the tools, which run over every rank. Needs an initialised
    process group."""
    size = dist.get_world_size()
    return GroupCollectives(None, tuple(range(size)), size)


def objects_to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor inside dicts, lists and tuples moved to the CPU (others unchanged): an
    object collective pickles its payload, and a CUDA tensor in it is unpickled onto the same device
    index on every receiver (cuda:0 of every rank when it came from rank 0).

    Args:
        obj: the payload of an object collective.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if type(obj) is dict:
        return {k: objects_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(objects_to_cpu(v) for v in obj)
    return obj
