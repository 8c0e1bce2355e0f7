"""Hot switching: home params -> working params of a layout, layout A -> layout B, and gradients back.

Every placement is "one tensor dim split over a prefix of the mesh dims" (see ``placements.py``), so
a move from prefix ``s`` to prefix ``t`` is either a free local slice (``t >= s``: the destination
chunk lies inside the source chunk) or an all-gather over mesh dims ``[t, s)`` of exactly the missing
part. All parameters that need the same all-gather travel in ONE fused buffer: one collective per
distinct dim range instead of one per tensor (as the HotSPa artifact fuses all slices for a peer).

Gradients never move between layouts. Two layouts with the same tp dims give every parameter the
same working shard and the same gradient states (:meth:`SwitchEngine.shares_gradients`), so a switch
between them may keep the working ``.grad`` (``switch(layout, keep_grads=True)``) and a run of such
stages reduces once. The working gradients (partial sums over the layout's dp/cp dims, and over tp for
``replicated_partial`` params) are reduced in fp32 straight into the engine's own store in the home
sharding: a reduce-scatter over the dims home splits, an all-reduce
over the dims home replicates. Like DDP, the reductions are bucketed in reverse parameter order and
can start during the stage's last backward (:meth:`SwitchEngine.overlap_next_backward`): a bucket is
launched asynchronously once autograd has accumulated all its gradients, and the stage end only
waits. Lightning zeroes ``.grad`` between ``training_step`` and ``backward``, so the store is handed
to the home params only on request (docs/DESIGN.md §7, trap "Lightning's closure order").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..layout import Layout, LayoutError, RankGroup, WorldMesh
from ..placements import ParamSharding
from ..torch_compat import C10D_DEPRECATION_MESSAGE  # noqa: F401  (installs the warning filter)

__all__ = ["SwitchReport", "GradReport", "SwitchEngine", "build_home_parameters", "HOME"]

HOME = "home"


@dataclass(frozen=True)
class SwitchReport:
    """One switch as seen by this rank. Bytes are what this rank receives."""

    source: str
    target: str
    bytes_received: int
    lower_bound_bytes: int  # bytes of this rank's destination shards it did not already hold
    collectives: int
    seconds: float


@dataclass(frozen=True)
class GradReport:
    layout: str
    bytes_received: int  # reduce-scatter: (g-1)/g of its input; all-reduce: 2(g-1)/g (ring)
    collectives: int
    seconds: float


@dataclass
class _MovePlan:
    """Cached per (source, target): which params are sliced locally, which gathered over which dims."""

    slices: list[tuple[str, int, int]] = field(default_factory=list)  # (name, src_prefix, dst_prefix)
    gathers: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (dst, src) prefix -> names
    lower_bound_elems: dict[str, int] = field(default_factory=dict)  # missing elements per gathered param


@dataclass
class _GradBucket:
    """Gradients reduced by one fused collective: a reduce-scatter over ``scatter`` then an
    all-reduce over ``reduce`` (either may be empty)."""

    scatter: tuple[int, ...]
    reduce: tuple[int, ...]
    names: list[str] = field(default_factory=list)


@dataclass
class _ReducePlan:
    slices: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> replicated dims to slice
    buckets: list[_GradBucket] = field(default_factory=list)  # launch order: reverse parameter order
    bucket_of: dict[str, int] = field(default_factory=dict)


class _Pending:
    """One launched asynchronous collective and how to unpack its result."""

    def __init__(self, work, unpack: Callable[[], list[torch.Tensor]]) -> None:
        self.work, self.unpack = work, unpack

    def result(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        return self.unpack()


@dataclass
class _Overlap:
    """Reductions started from gradient hooks during one backward."""

    remaining: list[int]  # per bucket: gradients still to be accumulated
    handles: list = field(default_factory=list)
    ready: set[str] = field(default_factory=set)
    launched: list[tuple[_GradBucket, _Pending]] = field(default_factory=list)
    received: int = 0


def _sub_chunk(t: torch.Tensor, sharding: ParamSharding, start: int, stop: int, rank: int) -> torch.Tensor:
    """This rank's chunk of ``t`` after additionally splitting over mesh dims [start, stop)."""
    if start == stop or sharding.dim is None:
        return t
    dims = range(start, stop)
    count = math.prod(sharding.mesh.sizes[d] for d in dims)
    index = sharding.mesh.shard_index(rank, dims)
    return t.chunk(count, dim=sharding.dim)[index]


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients are summed in fp32 at least (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _slots_to_shards(group: RankGroup) -> list[int]:
    """shard index held by each collective output slot (inverse of ``slot_of_shard``)."""
    out = [0] * group.size
    for shard, slot in enumerate(group.slot_of_shard):
        out[slot] = shard
    return out


class SwitchEngine:
    """Moves a named parameter set between home and the layouts of one :class:`WorldMesh`.

    ``home`` maps names to the home parameters (DTensors or plain local shards); their identity never
    changes. ``working`` holds the active layout's compute copies as ``nn.Parameter``s in
    ``working_dtype`` (a model's modules hold these very objects while a stage runs, so their
    ``.grad`` is what :meth:`reduce_gradients` reads). All-gathers are fused into buckets of at most
    ``bucket_bytes`` per rank.
    """

    def __init__(
        self,
        world: WorldMesh,
        shardings: Mapping[str, ParamSharding],
        home: Mapping[str, torch.Tensor],
        working_dtype: torch.dtype | None = None,
        bucket_bytes: int = 4 * 2**20,
    ) -> None:
        missing = sorted(set(shardings) ^ set(home))
        if missing:
            raise LayoutError(f"shardings and home parameters disagree on names {missing}")
        self.world = world
        self.shardings = dict(shardings)
        self.home = dict(home)
        self.working_dtype = working_dtype
        self.bucket_bytes = bucket_bytes
        self.active: Layout | None = None
        self.working: dict[str, torch.Tensor] = {}
        self.grad_store: dict[str, torch.Tensor] = {}
        self._move_plans: dict[tuple[str, str], _MovePlan] = {}
        self._reduce_plans: dict[str, _ReducePlan] = {}
        self._overlap: _Overlap | None = None

    # ---------------------------------------------------------------- switching
    def _home_local(self, name: str) -> torch.Tensor:
        p = self.home[name]
        return p.to_local() if isinstance(p, DTensor) else p

    def _prefix(self, name: str, key: str) -> int:
        sharding = self.shardings[name]
        return sharding.home_prefix if key == HOME else sharding.layout_prefix(self._layout(key))

    def _layout(self, key: str) -> Layout:
        for layout in self.world.layouts:
            if layout.name == key:
                return layout
        raise LayoutError(f"layout {key!r} is not among {[str(x) for x in self.world.layouts]}")

    def _move_plan(self, source: str, target: str) -> _MovePlan:
        key = (source, target)
        if key not in self._move_plans:
            plan = _MovePlan()
            rank = self.world.rank
            for name, sharding in self.shardings.items():
                s, t = self._prefix(name, source), self._prefix(name, target)
                if t >= s:
                    plan.slices.append((name, s, t))
                else:
                    plan.gathers.setdefault((t, s), []).append(name)
                    src, dst = sharding.interval(rank, s), sharding.interval(rank, t)
                    held = max(0, min(src[1], dst[1]) - max(src[0], dst[0]))
                    other = math.prod(sharding.local_shape(t)) // (dst[1] - dst[0])
                    plan.lower_bound_elems[name] = (dst[1] - dst[0] - held) * other
            self._move_plans[key] = plan
        return self._move_plans[key]

    def _move(self, source: str, target: str, locals_: Mapping[str, torch.Tensor],
              keep_grads: bool = False) -> SwitchReport:
        if self._overlap is not None:
            raise RuntimeError("switching layouts with gradient reductions in flight; call reduce_gradients() first")
        if keep_grads and not self.shares_gradients(source, target):
            raise LayoutError(f"cannot keep the working gradients from {source} to {target}: their tp degrees "
                              f"differ, so the parameters' working shards or gradient states differ; call "
                              f"reduce_gradients() before switching")
        start = time.perf_counter()
        plan = self._move_plan(source, target)
        dtype = self.working_dtype
        rank = self.world.rank
        out: dict[str, torch.Tensor] = {}
        for name, s, t in plan.slices:
            x = locals_[name]
            if s == t and source != HOME:  # same placement in both layouts: keep the working tensor
                if not keep_grads:
                    x.grad = None
                out[name] = x
                continue
            x = _sub_chunk(x.detach(), self.shardings[name], s, t, rank)
            out[name] = nn.Parameter(x.to(dtype=dtype or x.dtype, copy=True).contiguous())
        received = collectives = 0
        for (t, s), names in plan.gathers.items():
            group = self.world.group(range(t, s))
            pieces = [locals_[n].detach().to(dtype=dtype or locals_[n].dtype) for n in names]
            for bucket in self._buckets(pieces):
                gathered = self._all_gather_fused([pieces[i] for i in bucket],
                                                  [self.shardings[names[i]].dim for i in bucket], group)
                out.update((names[i], nn.Parameter(g)) for i, g in zip(bucket, gathered))
                collectives += 1
            received += sum(p.numel() * p.element_size() for p in pieces) * (group.size - 1)
        lower_bound = sum(n * (dtype or locals_[name].dtype).itemsize for name, n in plan.lower_bound_elems.items())
        self.working = {n: out[n] for n in self.shardings}
        self.active = self._layout(target)
        return SwitchReport(source, target, received, lower_bound, collectives, time.perf_counter() - start)

    def _buckets(self, pieces: list[torch.Tensor]) -> list[list[int]]:
        """Consecutive groups of at most ``bucket_bytes`` per rank (a larger tensor goes alone):
        gloo moves a few MB per call faster than one huge buffer, and small tensors still fuse.
        Used for the all-gathers of a switch and the reductions of gradients alike."""
        buckets: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(pieces):
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        return buckets

    @staticmethod
    def _all_gather_fused(pieces: list[torch.Tensor], dims: list[int], group: RankGroup) -> list[torch.Tensor]:
        """All-gather several tensors in one buffer; each result concatenates the members' pieces
        along its own ``dim`` in shard order."""
        moved = [p.movedim(d, 0) for p, d in zip(pieces, dims)]
        flat = moved[0].contiguous().view(-1) if len(moved) == 1 else torch.cat([m.reshape(-1) for m in moved])
        buffer = flat.new_empty(group.size * flat.numel())
        dist.all_gather_into_tensor(buffer, flat, group=group.group)
        rows = buffer.view(group.size, flat.numel())
        results, offset = [], 0
        for m, d in zip(moved, dims):
            n = m.numel()
            part = rows[:, offset:offset + n]
            if len(moved) > 1 or not group.in_shard_order:  # copy the member rows into shard order
                ordered = part.new_empty(part.shape)
                for shard, slot in enumerate(group.slot_of_shard):
                    ordered[shard].copy_(part[slot])
                part = ordered
            result = part.view(group.size * m.shape[0], *m.shape[1:]).movedim(0, d)
            results.append(result.contiguous() if d != 0 else result)
            offset += n
        return results

    def materialize(self, layout: Layout | str) -> SwitchReport:
        """Working params of ``layout`` from the home state (start of a step)."""
        target = Layout.parse(layout).name
        return self._move(HOME, target, {n: self._home_local(n) for n in self.shardings})

    def switch(self, layout: Layout | str, keep_grads: bool = False) -> SwitchReport:
        """Working params from the active layout to ``layout`` (zero traffic if it is the same).

        ``keep_grads``: keep accumulating into the working ``.grad`` instead of dropping it (the
        caller did not reduce); only between layouts that :meth:`shares_gradients`, else it raises.
        """
        if self.active is None:
            raise RuntimeError("no active layout: call materialize() first")
        target = Layout.parse(layout).name
        return self._move(self.active.name, target, self.working, keep_grads)

    def shares_gradients(self, a: Layout | str, b: Layout | str) -> bool:
        """True if every parameter has the same working shard and gradient states in ``a`` and
        ``b`` (same tp degree: tp dims are a mesh prefix), so one reduction after stages in both
        equals one after each: the working gradients of both are partial sums of the same kind."""
        la, lb = self._layout(Layout.parse(a).name), self._layout(Layout.parse(b).name)
        return all(sh.layout_prefix(la) == sh.layout_prefix(lb) and sh.grad_states(la) == sh.grad_states(lb)
                   for sh in self.shardings.values())

    def release(self) -> None:
        """Drops the working params (e.g. after the optimizer step, which makes them stale) and any
        gradient hooks of an unfinished :meth:`overlap_next_backward`."""
        if self._overlap is not None:
            for handle in self._overlap.handles:
                handle.remove()
            self._overlap = None
        self.working, self.active = {}, None

    # ---------------------------------------------------------------- gradients
    def _reduce_plan(self, layout: Layout) -> _ReducePlan:
        """Buckets of at most ``bucket_bytes`` (fp32) per (scatter, reduce) kind, filled in reverse
        parameter order, which is roughly the order backward produces gradients in (as DDP)."""
        if layout.name not in self._reduce_plans:
            plan = _ReducePlan()
            open_: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[_GradBucket, int]] = {}
            for name in reversed(list(self.shardings)):
                sharding = self.shardings[name]
                states, home = sharding.grad_states(layout), sharding.home_prefix
                rep = [d for d in range(home) if states[d] == "replicate"]
                key = (tuple(d for d in range(home) if states[d] == "partial"),
                       tuple(d for d in range(home, len(states)) if states[d] == "partial"))
                if rep:
                    plan.slices[name] = (rep[0], rep[-1] + 1)
                w = self.working[name]
                nbytes = _sub_chunk(w.detach(), sharding, *plan.slices.get(name, (0, 0)), self.world.rank).numel() \
                    * _reduce_dtype(w.dtype).itemsize
                bucket, size = open_.get(key, (None, 0))
                if bucket is None or size + nbytes > self.bucket_bytes:
                    bucket, size = _GradBucket(*key), 0
                    plan.buckets.append(bucket)
                bucket.names.append(name)
                open_[key] = (bucket, size + nbytes)
            plan.bucket_of = {n: i for i, b in enumerate(plan.buckets) for n in b.names}
            self._reduce_plans[layout.name] = plan
        return self._reduce_plans[layout.name]

    def overlap_next_backward(self) -> None:
        """Reduces each gradient bucket as soon as the coming backward has accumulated all of it.

        Call right before the LAST backward of a stage (earlier ones would reduce partial sums),
        then :meth:`reduce_gradients` at the stage end launches what is left and waits. Buckets are
        launched strictly in plan order, so every rank issues the same collectives in the same order.
        """
        if self.active is None:
            raise RuntimeError("no active layout to reduce gradients from")
        if self._overlap is not None:
            raise RuntimeError("overlap_next_backward() called twice in one stage")
        plan = self._reduce_plan(self.active)
        overlap = _Overlap([len(b.names) for b in plan.buckets])
        for name, w in self.working.items():
            if w.requires_grad:
                overlap.handles.append(w.register_post_accumulate_grad_hook(
                    lambda _, name=name: self._grad_ready(name)))
        self._overlap = overlap

    def _grad_ready(self, name: str) -> None:
        overlap, plan = self._overlap, self._reduce_plan(self.active)
        if name in overlap.ready:
            if plan.bucket_of[name] < len(overlap.launched):
                raise RuntimeError(f"the gradient of {name!r} was accumulated again after its bucket was "
                                   f"reduced; call overlap_next_backward() only before a stage's last backward")
            return
        overlap.ready.add(name)
        overlap.remaining[plan.bucket_of[name]] -= 1
        while len(overlap.launched) < len(plan.buckets) and overlap.remaining[len(overlap.launched)] == 0:
            self._launch(plan, plan.buckets[len(overlap.launched)], None, overlap)

    def _launch(self, plan: _ReducePlan, bucket: _GradBucket, grads: Mapping[str, torch.Tensor] | None,
                into: _Overlap) -> None:
        """Starts the first collective of ``bucket`` (reduce-scatter, else all-reduce)."""
        rank = self.world.rank
        local = []
        for name in bucket.names:
            w = self.working[name]
            g = grads[name] if grads is not None else w.grad
            g = torch.zeros(w.shape, dtype=_reduce_dtype(w.dtype), device=w.device) if g is None else \
                g.detach().to(_reduce_dtype(g.dtype))
            if name in plan.slices:
                g = _sub_chunk(g, self.shardings[name], *plan.slices[name], rank)
            local.append(g)
        if bucket.scatter:
            group = self.world.group(bucket.scatter)
            pending = self._reduce_scatter_start(local, [self.shardings[n].dim for n in bucket.names], group)
            into.received += sum(t.numel() * t.element_size() for t in local) * (group.size - 1) // group.size
        elif bucket.reduce:
            pending = self._all_reduce_start(local, self.world.group(bucket.reduce), into)
        else:  # nothing to sum: keep a copy (the working grad may change or be freed)
            pending = _Pending(None, lambda local=local: [t.clone() for t in local])
        into.launched.append((bucket, pending))

    def reduce_gradients(self, grads: Mapping[str, torch.Tensor] | None = None) -> GradReport:
        """Sums the active layout's working gradients (fp32) into the home-sharded store.

        ``grads`` defaults to the ``.grad`` of the working params; a param without a gradient
        contributes zeros (every rank still joins every collective). After
        :meth:`overlap_next_backward` this launches the buckets not started yet and waits for all.
        """
        if self.active is None:
            raise RuntimeError("no active layout to reduce gradients from")
        start = time.perf_counter()
        layout = self.active
        plan = self._reduce_plan(layout)
        overlap, self._overlap = self._overlap, None
        if overlap is None:
            overlap = _Overlap([])
        else:
            for handle in overlap.handles:
                handle.remove()
            if grads is not None:
                raise RuntimeError("reduce_gradients(grads) after overlap_next_backward(): the hooks read .grad")
        for bucket in plan.buckets[len(overlap.launched):]:
            self._launch(plan, bucket, grads, overlap)
        second: list[tuple[_GradBucket, _Pending]] = []
        for bucket, pending in overlap.launched:
            tensors = pending.result()
            if bucket.scatter and bucket.reduce:
                second.append((bucket, self._all_reduce_start(tensors, self.world.group(bucket.reduce), overlap)))
            else:
                self._store(bucket.names, tensors)
        for bucket, pending in second:
            self._store(bucket.names, pending.result())
        collectives = sum(bool(b.scatter) + bool(b.reduce) for b in plan.buckets)
        return GradReport(layout.name, overlap.received, collectives, time.perf_counter() - start)

    def _store(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        for name, t in zip(names, tensors):
            if name in self.grad_store:
                self.grad_store[name].add_(t)
            else:
                self.grad_store[name] = t

    @staticmethod
    def _reduce_scatter_start(tensors: list[torch.Tensor], dims: list[int], group: RankGroup) -> _Pending:
        moved = [t.movedim(d, 0).contiguous() for t, d in zip(tensors, dims)]
        rows = torch.cat([m.reshape(group.size, -1) for m in moved], dim=1)
        if not group.in_shard_order:
            rows = rows[_slots_to_shards(group)]
        out = rows.new_empty(rows.shape[1])
        work = dist.reduce_scatter_tensor(out, rows.contiguous().view(-1), group=group.group, async_op=True)
        shapes = [(m.shape[0] // group.size, *m.shape[1:]) for m in moved]

        def unpack() -> list[torch.Tensor]:
            results, offset = [], 0
            for shape, d in zip(shapes, dims):
                n = math.prod(shape)
                results.append(out[offset:offset + n].view(shape).movedim(0, d).contiguous())
                offset += n
            return results

        return _Pending(work, unpack)

    @staticmethod
    def _all_reduce_start(tensors: list[torch.Tensor], group: RankGroup, into: _Overlap) -> _Pending:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = dist.all_reduce(flat, group=group.group, async_op=True)
        into.received += 2 * (group.size - 1) * flat.numel() * flat.element_size() // group.size
        shapes = [t.shape for t in tensors]

        def unpack() -> list[torch.Tensor]:
            results, offset = [], 0
            for shape in shapes:
                n = math.prod(shape)
                results.append(flat[offset:offset + n].view(shape))
                offset += n
            return results

        return _Pending(work, unpack)

    def assign_home_grads(self) -> None:
        """Hands the store to the home params' ``.grad`` (as DTensors where the params are)."""
        for name, p in self.home.items():
            g = self.grad_store.get(name)
            if g is None:
                g = torch.zeros_like(self._home_local(name), dtype=_reduce_dtype(p.dtype))
            if isinstance(p, DTensor):
                g = DTensor.from_local(g.to(p.dtype), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            else:
                g = g.to(p.dtype)
            p.grad = g

    def clear_grad_store(self) -> None:
        self.grad_store = {}


def build_home_parameters(
    world: WorldMesh,
    shardings: Mapping[str, ParamSharding],
    init_full: Callable[[str, tuple[int, ...]], torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, nn.Parameter]:
    """Home params as DTensor ``nn.Parameter``s, each initialized IN FULL and cut to this rank's shard.

    One parameter at a time, so peak memory is one full tensor; the result equals the single-process
    model built by ``init_full`` (docs/DESIGN.md §7, trap "random init of sharded DTensors").
    """
    out: dict[str, nn.Parameter] = {}
    rank = world.rank
    for name, sharding in shardings.items():
        full = init_full(name, sharding.shape)
        if tuple(full.shape) != sharding.shape:
            raise LayoutError(f"init for {name!r} returned shape {tuple(full.shape)}, expected {sharding.shape}")
        local = _sub_chunk(full, sharding, 0, sharding.home_prefix, rank).to(device, dtype).contiguous().clone()
        del full
        dt = DTensor.from_local(local, world.device_mesh, sharding.home_placements(), run_check=False,
                                shape=torch.Size(sharding.shape),
                                stride=torch.empty(sharding.shape, device="meta").stride())
        out[name] = nn.Parameter(dt)
    return out

