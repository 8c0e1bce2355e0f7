"""Working copies of different tp degrees at once: one uneven all-to-all each way (docs/DESIGN.md §4,
"Mixed tp at once").

In a mixed-tp stage every rank holds its REPLICATED working copy in its own block's layout (rank r
in ``layouts[r]``): a tp2 block's ranks hold half of each tp-split parameter, a tp1 block's ranks
all of it. Home shards and tp shards both split one tensor dim over a PREFIX of the mesh dims
(``placements.py``), so along that dim every working chunk is a contiguous run of whole home chunks
(tp prefix <= home prefix) or lies inside one home chunk (tp prefix > home prefix). Hence:

* **gather** (home -> working): rank r takes each home chunk of its working range from the holder
  that agrees with r on the dims home replicates (itself for its own chunk), or cuts its working
  chunk from its own home chunk when that holds it: ONE ``all_to_all_single`` over the world per
  bucket, every pair's pieces fused, each rank receiving exactly what it lacks.
* **reduce** (working gradients -> home store, fp32 at least): each rank contributes a region of
  its working gradient (a tp shard: all of it; a ``replicated`` role: its tp rank's chunk, so a
  block counts its identical copies once; ``replicated_partial``: all of it, the tp ranks' partial
  sums), cut by the home chunks it meets and sent to every holder of each, which sums the pieces
  in rank order. The runner's loss scaling (tokens over the step's tokens) already weighs each
  block by its tokens, so the sum is the exact token-mean gradient whatever the block sizes.

Both directions are world-wide collectives: a mixed-tp stage starts and ends with one. Between
them every collective is a block's own (its tp x cp groups). The routes are pure functions of the
shardings, the mesh and ``layouts``: every rank computes the same ones without communicating.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..collective_names import collective
from ..group_collectives import world_collectives
from ..layout import Layout, LayoutError, MeshShape
from ..placements import ParamSharding
from .gradients import reduce_dtype

__all__ = ["NestedExchange", "contribution", "working_interval"]

#: one piece of one parameter: (name, start, stop) along the parameter's sharded dim (absolute)
Piece = tuple[str, int, int]


#: (parameter name, working layout) -> the mesh-dim prefix its working copy is split over
Prefix = Callable[[str, Layout], int]


def working_interval(sharding: ParamSharding, layout: Layout, rank: int, prefix: int | None = None
                     ) -> tuple[int, int]:
    """[start, stop) of ``rank``'s working chunk of ``sharding`` in ``layout`` (split over
    ``prefix`` mesh dims; None: the layout's tp prefix, a replicated copy)."""
    return sharding.interval(rank, sharding.layout_prefix(layout) if prefix is None else prefix)


def contribution(sharding: ParamSharding, layout: Layout, rank: int, prefix: int | None = None
                 ) -> tuple[int, int] | None:
    """The part of ``rank``'s working gradient it adds to the joint reduction (None: nothing).

    Args:
        sharding: the parameter's shardings.
        layout: ``rank``'s working layout.
        rank: the contributing rank.
        prefix: the prefix its working copy is split over (None: the layout's tp prefix); one past
            the tp prefix is a shard of a sharded block, already reduce-scattered over the block's
            shard dims in backward: all of it.
    """
    role, mesh = sharding.role, sharding.mesh
    if prefix is not None and prefix > sharding.layout_prefix(layout):
        return sharding.interval(rank, prefix)
    if role.tp_grad != "replicate":  # a tp shard, or partial sums over tp: all of it
        return working_interval(sharding, layout, rank)
    tp = len(mesh.tp_dims(layout))
    split = min(tp, sharding.home_prefix)  # home divides the dim this far: each tp rank a chunk of it
    coords = mesh.coords(rank)
    if any(coords[d] for d in range(split, tp)):
        return None  # a copy another tp rank of the block already adds
    return sharding.interval(rank, split)


def _cut(t: Tensor, dim: int | None, start: int, length: int) -> Tensor:
    """``t`` narrowed to ``length`` rows from ``start`` along ``dim`` (all of ``t`` for no dim)."""
    return t if dim is None else t.narrow(dim, start, length)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


@dataclass
class _Routes:
    """This rank's pieces to send to / receive from every rank, in parameter order."""

    send: list[list[Piece]]
    recv: list[list[Piece]]


class NestedExchange:
    """The routes of one block stage on this rank and the two collectives that use them.

    Args:
        shardings: every parameter's shardings (the switch engine's), in the engine's order.
        mesh: the world mesh's shape.
        layouts: each rank's working layout (one of the mesh's), ``layouts[r]`` for rank r.
        rank: this rank.
        bucket_bytes: the parameters of one collective, by their full size in the sent dtype
            (the same split on every rank; one larger parameter goes alone).
        prefix: the prefix a parameter's working copy is split over in a layout (the switch
            engine's: a sharded block's copy lies past its tp prefix); None: the tp prefix, and
            every layout must be replicated.
    """

    def __init__(self, shardings: Mapping[str, ParamSharding], mesh: MeshShape, layouts: Sequence[Layout],
                 rank: int, bucket_bytes: int = 4 * 2**20, prefix: Prefix | None = None) -> None:
        layouts = tuple(layouts)
        if len(layouts) != mesh.world_size:
            raise LayoutError(f"a block stage's exchange needs one layout per rank ({mesh.world_size}), got "
                              f"{len(layouts)}")
        for r, layout in enumerate(layouts):
            if layout not in mesh.layouts or (layout.fsdp and prefix is None):
                raise LayoutError(f"rank {r}'s working layout {layout} in a block stage's exchange must be a "
                                  f"{'' if prefix else 'replicated '}layout among the mesh's "
                                  f"{[str(x) for x in mesh.layouts]}")
        self.shardings, self.mesh, self.layouts, self.rank = dict(shardings), mesh, layouts, rank
        self.bucket_bytes = bucket_bytes
        self.prefix: Prefix = prefix or (lambda name, layout: self.shardings[name].layout_prefix(layout))
        self.gather_routes = self._gather_routes()
        self.reduce_routes = self._reduce_routes()

    # ---------------------------------------------------------------- routes
    def _working(self, name: str, rank: int) -> tuple[int, int]:
        """[start, stop) of ``rank``'s working chunk of ``name``."""
        return self.shardings[name].interval(rank, self.prefix(name, self.layouts[rank]))

    def _home(self, name: str, rank: int) -> tuple[int, int]:
        sharding = self.shardings[name]
        return sharding.interval(rank, sharding.home_prefix)

    def _source(self, name: str, receiver: int, sender: int) -> tuple[int, int] | None:
        """The piece of ``name`` that ``sender`` gives ``receiver``'s working chunk (None: none)."""
        sharding = self.shardings[name]
        home = sharding.home_prefix
        want = self._working(name, receiver)
        if self.prefix(name, self.layouts[receiver]) >= home:  # inside its own home chunk
            return want if sender == receiver else None
        if self.mesh.coords(sender)[home:] != self.mesh.coords(receiver)[home:]:
            return None  # another holder of the same chunk serves it
        have = self._home(name, sender)
        return have if _overlap(have, want) == have else None

    def _gather_routes(self) -> _Routes:
        me, world = self.rank, range(self.mesh.world_size)
        send = [[(n, *p) for n in self.shardings if (p := self._source(n, r, me)) is not None] for r in world]
        recv = [[(n, *p) for n in self.shardings if (p := self._source(n, me, r)) is not None] for r in world]
        return _Routes(send, recv)

    def _given(self, name: str, sender: int, receiver: int) -> tuple[int, int] | None:
        """The part of ``sender``'s gradient contribution to ``name`` that lands in ``receiver``'s home chunk."""
        layout = self.layouts[sender]
        part = contribution(self.shardings[name], layout, sender, self.prefix(name, layout))
        return None if part is None else _overlap(part, self._home(name, receiver))

    def _reduce_routes(self) -> _Routes:
        me, world = self.rank, range(self.mesh.world_size)
        send = [[(n, *p) for n in self.shardings if (p := self._given(n, me, r)) is not None] for r in world]
        recv = [[(n, *p) for n in self.shardings if (p := self._given(n, r, me)) is not None] for r in world]
        return _Routes(send, recv)

    def _buckets(self, itemsize: int) -> list[set[str]]:
        """Consecutive parameters of at most ``bucket_bytes`` in full size (rank-independent)."""
        out: list[set[str]] = [set()]
        size = 0
        for name, sharding in self.shardings.items():
            nbytes = math.prod(sharding.shape) * itemsize
            if out[-1] and size + nbytes > self.bucket_bytes:
                out.append(set())
                size = 0
            out[-1].add(name)
            size += nbytes
        return out

    def _piece_shape(self, name: str, start: int, stop: int) -> tuple[int, ...]:
        sharding = self.shardings[name]
        if sharding.dim is None:
            return sharding.shape
        shape = list(sharding.shape)
        shape[sharding.dim] = stop - start
        return tuple(shape)

    # ---------------------------------------------------------------- collectives
    def _exchange(self, routes: _Routes, bucket: set[str], source: Mapping[str, Tensor],
                  base: Mapping[str, int], dtype: torch.dtype, device: torch.device
                  ) -> tuple[list[list[tuple[Piece, Tensor]]], int]:
        """One ``all_to_all_single`` of ``bucket``'s pieces: what each rank receives, and the bytes
        this rank received from the others."""
        sends = [[p for p in pieces if p[0] in bucket] for pieces in routes.send]
        recvs = [[p for p in pieces if p[0] in bucket] for pieces in routes.recv]
        numel = lambda p: math.prod(self._piece_shape(*p))  # noqa: E731
        out_sizes = [sum(numel(p) for p in pieces) for pieces in sends]
        in_sizes = [sum(numel(p) for p in pieces) for pieces in recvs]
        flat = torch.empty(sum(out_sizes), dtype=dtype, device=device)
        offset = 0
        for pieces in sends:
            for name, start, stop in pieces:
                dim = self.shardings[name].dim
                part = _cut(source[name], dim, start - base[name], stop - start)
                flat[offset:offset + part.numel()].view(part.shape).copy_(part)
                offset += part.numel()
        received = torch.empty(sum(in_sizes), dtype=dtype, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with collective("the block stage's joint exchange", range(dist.get_world_size())):
                world_collectives().all_to_all_into(received, flat, in_sizes, out_sizes)
        else:
            received.copy_(flat)
        del flat  # the send buffer: only the receive buffer outlives the collective
        out, offset = [], 0
        for pieces in recvs:
            got = []
            for piece in pieces:
                n = numel(piece)
                got.append((piece, received[offset:offset + n].view(self._piece_shape(*piece))))
                offset += n
            out.append(got)
        others = sum(size for r, size in enumerate(in_sizes) if r != self.rank)
        return out, others * dtype.itemsize

    def gather(
        self, home: Mapping[str, Tensor], dtype: torch.dtype | None = None
    ) -> tuple[dict[str, Tensor], int, int]:
        """This rank's working copy of every parameter from the home shards (``home[name]``: this
        rank's home-local tensor), in ``dtype`` (None: the home dtype). Returns the copies, the bytes
        received from other ranks and the number of collectives."""
        any_home = next(iter(home.values()))
        dtype = dtype or any_home.dtype
        out: dict[str, Tensor] = {}
        base = {n: self._home(n, self.rank)[0] for n in self.shardings}
        received = 0
        buckets = self._buckets(dtype.itemsize)
        for bucket in buckets:
            got, nbytes = self._exchange(self.gather_routes, bucket, home, base, dtype, any_home.device)
            received += nbytes
            for pieces in got:
                for (name, start, stop), piece in pieces:
                    sharding = self.shardings[name]
                    if name not in out:
                        shape = sharding.local_shape(self.prefix(name, self.layouts[self.rank]))
                        out[name] = torch.empty(shape, dtype=dtype, device=any_home.device)
                    lo = self._working(name, self.rank)[0]
                    _cut(out[name], sharding.dim, start - lo, stop - start).copy_(piece)
        return out, received, len(buckets)

    def reduce(self, grads: dict[str, Tensor | None], working: Mapping[str, Tensor],
               into: Callable[[list[str], list[Tensor]], None]) -> tuple[int, int]:
        """The sum over all ranks of their gradient contributions, as this rank's home-local shards
        (fp32 at least), handed bucket by bucket to ``into(names, shards)`` (so only one bucket's
        shards and buffers are alive at once). ``grads[name]``: this rank's accumulated working
        gradient (None: zeros), popped once its bucket is sent; ``working``: the working params
        (shapes, dtype, device). Returns the bytes received from other ranks and the number of
        collectives."""
        any_w = next(iter(working.values()))
        dtype = reduce_dtype(any_w.dtype)
        base = {n: self._working(n, self.rank)[0] for n in working}
        received = 0
        buckets = self._buckets(dtype.itemsize)
        for bucket in buckets:
            source = {}
            for name in bucket:
                g, w = grads.pop(name, None), working[name]
                source[name] = torch.zeros(w.shape, dtype=dtype, device=w.device) if g is None else g.detach()
            got, nbytes = self._exchange(self.reduce_routes, bucket, source, base, dtype, any_w.device)
            del source
            received += nbytes
            names = [n for n in self.shardings if n in bucket]
            out = {n: torch.zeros(self.shardings[n].local_shape(self.shardings[n].home_prefix), dtype=dtype,
                                  device=any_w.device) for n in names}
            for pieces in got:  # rank order: the same sum on every holder of a home chunk
                for (name, start, stop), piece in pieces:
                    sharding = self.shardings[name]
                    lo = self._home(name, self.rank)[0]
                    _cut(out[name], sharding.dim, start - lo, stop - start).add_(piece)
            del got
            into(names, [out.pop(n) for n in names])
        return received, len(buckets)
