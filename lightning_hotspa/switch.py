"""Hot switching: home params -> working params of a layout, layout A -> layout B, and gradients back.

Every placement is "one tensor dim split over a prefix of the mesh dims" (see ``placements.py``), so
a move from prefix ``s`` to prefix ``t`` is either a free local slice (``t >= s``: the destination
chunk lies inside the source chunk) or an all-gather over mesh dims ``[t, s)`` of exactly the missing
part. All parameters that need the same all-gather travel in ONE fused buffer: one collective per
distinct dim range instead of one per tensor (as the HotSPa artifact fuses all slices for a peer).

Gradients never move between layouts. At the end of a stage the working gradients (partial sums over
the layout's dp/cp dims, and over tp for ``replicated_partial`` params) are reduced in fp32 straight
into the engine's own store in the home sharding: a reduce-scatter over the dims home splits, an
all-reduce over the dims home replicates. Lightning zeroes ``.grad`` between ``training_step`` and
``backward``, so the store is handed to the home params only on request (DESIGN.md, closure trap).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .layout import Layout, LayoutError, RankGroup, WorldMesh
from .placements import ParamSharding

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single, which 2.11 lacks.
warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated",
                        category=FutureWarning)

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
class _ReducePlan:
    slices: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> replicated dims to slice
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]] = field(default_factory=dict)


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

    def _move(self, source: str, target: str, locals_: Mapping[str, torch.Tensor]) -> SwitchReport:
        start = time.perf_counter()
        plan = self._move_plan(source, target)
        dtype = self.working_dtype
        rank = self.world.rank
        out: dict[str, torch.Tensor] = {}
        for name, s, t in plan.slices:
            x = locals_[name]
            if s == t and source != HOME:  # same placement in both layouts: keep the working tensor
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

    def switch(self, layout: Layout | str) -> SwitchReport:
        """Working params from the active layout to ``layout`` (zero traffic if it is the same)."""
        if self.active is None:
            raise RuntimeError("no active layout: call materialize() first")
        target = Layout.parse(layout).name
        return self._move(self.active.name, target, self.working)

    def release(self) -> None:
        """Drops the working params (e.g. after the optimizer step, which makes them stale)."""
        self.working, self.active = {}, None

    # ---------------------------------------------------------------- gradients
    def _reduce_plan(self, layout: Layout) -> _ReducePlan:
        if layout.name not in self._reduce_plans:
            plan = _ReducePlan()
            for name, sharding in self.shardings.items():
                states, home = sharding.grad_states(layout), sharding.home_prefix
                rep = [d for d in range(home) if states[d] == "replicate"]
                scatter = tuple(d for d in range(home) if states[d] == "partial")
                reduce = tuple(d for d in range(home, len(states)) if states[d] == "partial")
                if rep:
                    plan.slices[name] = (rep[0], rep[-1] + 1)
                plan.groups.setdefault((scatter, reduce), []).append(name)
            self._reduce_plans[layout.name] = plan
        return self._reduce_plans[layout.name]

    def reduce_gradients(self, grads: Mapping[str, torch.Tensor] | None = None) -> GradReport:
        """Sums the active layout's working gradients (fp32) into the home-sharded store.

        ``grads`` defaults to the ``.grad`` of the working params; a param without a gradient
        contributes zeros (every rank still joins every collective).
        """
        if self.active is None:
            raise RuntimeError("no active layout to reduce gradients from")
        start = time.perf_counter()
        layout, rank = self.active, self.world.rank
        plan = self._reduce_plan(layout)
        local: dict[str, torch.Tensor] = {}
        for name, w in self.working.items():
            g = grads[name] if grads is not None else w.grad
            g = torch.zeros(w.shape, dtype=_reduce_dtype(w.dtype), device=w.device) if g is None else \
                g.detach().to(_reduce_dtype(g.dtype))
            if name in plan.slices:
                g = _sub_chunk(g, self.shardings[name], *plan.slices[name], rank)
            local[name] = g
        received = collectives = 0
        buckets = [(key, [names[i] for i in bucket]) for key, names in plan.groups.items()
                   for bucket in self._buckets([local[n] for n in names])]
        for (scatter, reduce), names in buckets:
            tensors = [local[n] for n in names]
            if scatter:
                group = self.world.group(scatter)
                tensors = self._reduce_scatter_fused(tensors, [self.shardings[n].dim for n in names], group)
                received += sum(t.numel() * t.element_size() for t in tensors) * (group.size - 1)
                collectives += 1
            if reduce:
                group = self.world.group(reduce)
                tensors = self._all_reduce_fused(tensors, group)
                received += 2 * (group.size - 1) * sum(t.numel() * t.element_size() for t in tensors) // group.size
                collectives += 1
            for name, t in zip(names, tensors):
                if name in self.grad_store:
                    self.grad_store[name].add_(t)
                else:
                    self.grad_store[name] = t.clone() if t is local.get(name) else t
        return GradReport(layout.name, received, collectives, time.perf_counter() - start)

    @staticmethod
    def _reduce_scatter_fused(tensors: list[torch.Tensor], dims: list[int], group: RankGroup) -> list[torch.Tensor]:
        moved = [t.movedim(d, 0).contiguous() for t, d in zip(tensors, dims)]
        rows = torch.cat([m.reshape(group.size, -1) for m in moved], dim=1)
        if not group.in_shard_order:
            rows = rows[_slots_to_shards(group)]
        out = rows.new_empty(rows.shape[1])
        dist.reduce_scatter_tensor(out, rows.contiguous().view(-1), group=group.group)
        results, offset = [], 0
        for m, d in zip(moved, dims):
            n = m.numel() // group.size
            shape = (m.shape[0] // group.size, *m.shape[1:])
            results.append(out[offset:offset + n].view(shape).movedim(0, d).contiguous())
            offset += n
        return results

    @staticmethod
    def _all_reduce_fused(tensors: list[torch.Tensor], group: RankGroup) -> list[torch.Tensor]:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group.group)
        results, offset = [], 0
        for t in tensors:
            results.append(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        return results

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
    model built by ``init_full`` (DESIGN.md trap "random init of sharded DTensors").
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

