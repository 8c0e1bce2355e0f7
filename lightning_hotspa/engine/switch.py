"""Hot switching: home params -> working params of a layout, layout A -> layout B.

Every placement is "one tensor dim split over a prefix of the mesh dims" (see ``placements.py``), so
a move from prefix ``s`` to prefix ``t`` is either a free local slice (``t >= s``: the destination
chunk lies inside the source chunk) or an all-gather over mesh dims ``[t, s)`` of exactly the missing
part. All parameters that need the same all-gather travel in ONE fused buffer: one collective per
distinct dim range instead of one per tensor (as the HotSPa artifact fuses all slices for a peer).
A pp layout's ranks hold their own stages' parameters only: a gather into one sends each member just
the pieces it wants (:mod:`.selective_gather`), and one out of it skips what a member's stages held.

Double residency is bounded bucket by bucket: once a bucket's new working copies exist, the old
layout's copies of those params are freed (their storage is released, as FSDP2 frees unsharded
params), so a switch holds both copies of at most one bucket, not of the whole model. The model's
modules still reference the old params until ``ParallelModel.activate`` hands them the new ones.

Gradients never move between layouts (:mod:`.gradients`: accumulation in fp32, bucketed reduction
into the home-sharded store). Two layouts with the same tp dims give every parameter the same working
shard and gradient states (:meth:`SwitchEngine.shares_gradients`), so a switch between them may keep
the working gradients (``switch(layout, keep_grads=True)``) and a run of such stages reduces once.
Lightning zeroes ``.grad`` between ``training_step`` and ``backward``, so the store is handed to the
home params only on request (docs/DESIGN.md §7, trap "Lightning's closure order").

A layout with ``fsdp=True`` holds the working copy of every parameter of the model's fsdp units
(:mod:`.fsdp`) at its HOME prefix (sharded over the layout's dp and cp ranks too), or with
``fsdp_shard`` (``:fsdp8``) at the shorter prefix of the tp and shard dims (replicated beyond:
HSDP), so switches to and from it are the same slices and all-gathers; :mod:`.fsdp` gathers each
unit to the layout prefix around its forward and reduce-scatters its gradient in backward.
Exceptions stay at the layout prefix: parameters outside every unit, those the home cannot split
further, and ``replicated`` ones under tp > 1 (their gradient is a copy per tp rank, not a partial
sum to scatter).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..checks import check_int
from ..layout import Layout, LayoutError, require_member
from ..mesh import WorldMesh
from ..placements import ParamSharding
from ..torch_compat import C10D_DEPRECATION_MESSAGE  # noqa: F401  (installs the warning filter)
from .fused_gather import FusedGather
from .gradients import GradientReduction, GradReport
from .gradients import sub_chunk as _sub_chunk
from .home import build_home_parameters
from .nested_exchange import NestedExchange
from .selective_gather import SelectiveGather, unmaterialized

__all__ = ["SwitchReport", "GradReport", "SwitchEngine", "build_home_parameters"]


@dataclass(frozen=True)
class SwitchReport:
    """One switch as seen by this rank. Bytes are what this rank receives."""

    source: Layout | None  # None: the home state (a materialization)
    target: Layout
    bytes_received: int
    lower_bound_bytes: int  # bytes of this rank's destination shards it did not already hold
    collectives: int
    seconds: float


@dataclass
class _MovePlan:
    """Cached per (source, target), source None for home: which params are sliced locally, which
    gathered over which dims."""

    slices: list[tuple[str, int, int]] = field(default_factory=list)  # (name, src_prefix, dst_prefix)
    gathers: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (dst, src) prefix -> names
    lower_bound_elems: dict[str, int] = field(default_factory=dict)  # missing elements per gathered param


def _free(param: torch.Tensor) -> None:
    """Releases an old working copy's memory (its storage shrinks to 0 bytes, as FSDP2 does with
    unsharded params) and its gradient. A module still holding it must not use it: matmul raises, but
    elementwise and reduction kernels read the null storage and the process dies of SIGSEGV."""
    param.grad = None
    param.detach().untyped_storage().resize_(0)


class SwitchEngine(GradientReduction):
    """Moves a named parameter set between home and the layouts of one :class:`WorldMesh`.

    ``home`` maps names to the home parameters (DTensors or plain local shards); their identity never
    changes. ``working`` holds the active layout's compute copies as ``nn.Parameter``s in
    ``working_dtype`` (a model's modules hold these very objects while a stage runs, so their
    gradients are what :meth:`reduce_gradients` reads). All-gathers and reductions are fused into
    buckets of at most ``bucket_bytes`` per rank. ``grad_accum_dtype`` (e.g. fp32 under bf16-mixed):
    sum micro-batch gradients in that dtype (:mod:`.gradients`); ``max_buckets_in_flight``: reduction
    buckets pending at once; ``switch_buckets_in_flight``: a switch's all-gathers launched before the
    oldest is waited on (its old and new copies are both held meanwhile). The strategy sets all
    three from the backend's defaults (:mod:`.buckets`) or the user's arguments.
    """

    def __init__(
        self,
        world: WorldMesh,
        shardings: Mapping[str, ParamSharding],
        home: Mapping[str, torch.Tensor],
        working_dtype: torch.dtype | None = None,
        bucket_bytes: int = 4 * 2**20,
        grad_accum_dtype: torch.dtype | None = None,
        max_buckets_in_flight: int = 2,
        switch_buckets_in_flight: int = 1,
    ) -> None:
        missing = sorted(set(shardings) ^ set(home))
        if missing:
            raise LayoutError(f"shardings and home parameters disagree on names {missing}")
        self.world = world
        self.shardings = dict(shardings)
        self.home = dict(home)
        self.working_dtype = working_dtype
        self.bucket_bytes = bucket_bytes
        self.switch_buckets_in_flight = check_int(switch_buckets_in_flight, "switch_buckets_in_flight")
        self.active: Layout | None = None
        self.working: dict[str, torch.Tensor] = {}
        self._move_plans: dict[tuple[Layout | None, Layout], _MovePlan] = {}
        #: a mixed-tp stage's exchange while its working copy is held (:meth:`materialize_blocks`)
        self.mixed: NestedExchange | None = None
        self._exchanges: dict[tuple[Layout, ...], NestedExchange] = {}
        #: parameters inside the model's fsdp units (:meth:`set_fsdp_units`)
        self.fsdp_names: frozenset[str] = frozenset()
        #: (a pp layout, a global rank) -> the parameters that rank's pipeline stages compute with (a switch
        #: into it moves only those; the others' working copies hold no memory; :mod:`..parallel.pipeline`);
        #: None: no pp layout runs
        self.pipeline_owned: Callable[[Layout, int], frozenset[str]] | None = None
        self._init_gradients(grad_accum_dtype, max_buckets_in_flight)
        #: ``(category, tensor)`` for each buffer the engine allocates ("params", "grads",
        #: "temporaries"): how the memory estimator files them (None: nobody listens)
        self.on_buffer: Callable[[str, torch.Tensor], None] | None = None
        world.create_groups(self.needed_group_ranges())  # collective: every rank builds the same engine

    def needed_group_ranges(self) -> set[tuple[int, int]]:
        """Every ``[start, stop)`` mesh-dim range a move, a gradient reduction or an fsdp unit of this
        engine can call a collective over, for any set of fsdp units (each parameter in one or not)."""
        out: set[tuple[int, int]] = set()
        saved = self.fsdp_names
        try:
            for fsdp_names in (frozenset(), frozenset(self.shardings)):
                self.fsdp_names = fsdp_names
                for target in self.world.layouts:
                    for name in self.shardings:
                        for source in (None, *self.world.layouts):  # home -> target, every layout -> target
                            s, t = self._prefix(name, source), self._prefix(name, target)
                            if t < s:
                                out.add((t, s))
                        out.update(r for r in self._grad_ranges(name, target) if r[1] > r[0])
                        if self.fsdp_gathered(name, target):  # its unit's gathers and reduce-scatters
                            out.add((self.shardings[name].layout_prefix(target), self.fsdp_prefix(name, target)))
        finally:
            self.fsdp_names = saved
        return out

    def _label(self, category: str, tensor: torch.Tensor) -> None:
        if self.on_buffer is not None:
            self.on_buffer(category, tensor)

    # ---------------------------------------------------------------- switching
    def _home_local(self, name: str) -> torch.Tensor:
        p = self.home[name]
        return p.to_local() if isinstance(p, DTensor) else p

    def set_fsdp_units(self, names: set[str] | frozenset[str]) -> None:
        """The parameters an fsdp layout shards (those of the model's fsdp units, :mod:`.fsdp`)."""
        unknown = sorted(set(names) - set(self.shardings))
        if unknown:
            raise LayoutError(f"fsdp units name parameters {unknown[:5]} the engine does not hold")
        self.fsdp_names = frozenset(names)
        self._move_plans.clear()
        self._exchanges.clear()
        self._reduce_plans.clear()

    def fsdp_gathered(self, name: str, layout: Layout) -> bool:
        """True if ``name``'s working copy in ``layout`` is sharded beyond the layout prefix (held at
        :meth:`fsdp_prefix` and gathered per unit around its forward)."""
        if not layout.fsdp or name not in self.fsdp_names:
            return False
        sharding = self.shardings[name]
        if sharding.role.tp_grad == "replicate" and layout.tp > 1:
            return False  # its tp ranks' gradients are copies: a reduce-scatter over them would add them
        return self.fsdp_prefix(name, layout) > sharding.layout_prefix(layout)

    def fsdp_prefix(self, name: str, layout: Layout) -> int:
        """The prefix an fsdp layout's working copy of ``name`` is split over: the layout's tp and
        ``fsdp_shard`` dims (all dims for plain ``:fsdp``), no further than home splits it."""
        sharding = self.shardings[name]
        return min(sharding.home_prefix, self.world.shape.fsdp_dims(layout).stop)

    def _prefix(self, name: str, layout: Layout | None) -> int:
        """The prefix ``name`` is split over in ``layout``'s working copy (None: at home)."""
        if layout is None:
            return self.shardings[name].home_prefix
        return self._working_prefix(name, layout)

    def _working_prefix(self, name: str, layout: Layout) -> int:
        """The mesh-dim prefix ``name``'s working copy in ``layout`` is sharded over."""
        if self.fsdp_gathered(name, layout):
            return self.fsdp_prefix(name, layout)
        return self.shardings[name].layout_prefix(layout)

    def _grad_states(self, name: str, layout: Layout) -> list[str]:
        """Per mesh dim, what ``name``'s working gradient in ``layout`` is. An fsdp-gathered one was
        reduce-scattered to its working shard in backward: only the dims beyond it are partial (the
        stage end reduce-scatters those home splits and all-reduces those it replicates)."""
        sharding = self.shardings[name]
        if self.fsdp_gathered(name, layout):
            shard = self.fsdp_prefix(name, layout)
            return ["shard"] * shard + ["partial"] * (sharding.mesh.ndim - shard)
        return sharding.grad_states(layout)

    def _member(self, layout: Layout) -> Layout:
        """``layout`` if it is one of the mesh's layouts, else a :class:`LayoutError` naming it."""
        return require_member(layout, self.world.layouts)

    def _move_plan(self, source: Layout | None, target: Layout) -> _MovePlan:
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

    def _move(self, source: Layout | None, target: Layout, locals_: Mapping[str, torch.Tensor],
              keep_grads: bool = False, held: tuple[Layout, Mapping[str, torch.Tensor]] | None = None
              ) -> SwitchReport:
        """``target``'s working copy from ``locals_`` (``source``'s copy, or home for None). ``held``: the pp
        copy (layout, working) this rank leaves, from home: what a member holds there at a prefix the
        target's lies within is sliced from it, never gathered."""
        if self._overlap is not None:
            raise RuntimeError("switching layouts with gradient reductions in flight; call reduce_gradients() first")
        if self.mixed is not None:
            raise RuntimeError(f"the working copy is a mixed-tp stage's ({self.active} on this rank): "
                               f"reduce_blocks() and release() it, then materialize the next layout from home")
        if keep_grads and not self.shares_gradients(source, target):
            raise LayoutError(f"cannot keep the working gradients from {source} to {target}: their tp degrees "
                              f"differ, so the parameters' working shards or gradient states differ; call "
                              f"reduce_gradients() before switching")
        if target.fsdp and not self.fsdp_names:
            raise LayoutError(f"layout {target} shards the working copy per unit, but no fsdp units were "
                              f"registered (set_fsdp_units; the StepRunner does it from the model)")
        start = time.perf_counter()
        plan = self._move_plan(source, target)
        dtype = self.working_dtype
        rank = self.world.rank
        free_old = source is not None  # home params are never freed; old working copies are
        owned = self._owned(target)  # a pp layout: this rank computes with its stages' parameters only
        mine_held = self._held(held, target, rank)
        out: dict[str, torch.Tensor] = {}
        for name, s, t in plan.slices:
            x = locals_[name]
            if s == t and source is not None:  # same placement in both layouts: keep the working tensor
                if not keep_grads:
                    x.grad = None
                out[name] = x
                continue
            y = _sub_chunk(x.detach(), self.shardings[name], s, t, rank)
            if owned is not None and name not in owned:  # another stage's: never copied
                out[name] = nn.Parameter(unmaterialized(y.shape, y.new_empty(0, dtype=dtype or y.dtype)))
            else:
                out[name] = nn.Parameter(y.to(dtype=dtype or y.dtype, copy=True).contiguous())
            if free_old:
                _free(x)
        received = collectives = 0
        pending: deque[tuple[list[str], FusedGather, list[torch.Tensor]]] = deque()

        def from_held(name: str) -> nn.Parameter:  # this rank's chunk of the pp copy it leaves
            x = held[1][name].detach()
            y = _sub_chunk(x, self.shardings[name], self._prefix(name, held[0]), self._prefix(name, target), rank)
            return nn.Parameter(y.to(dtype=dtype or y.dtype, copy=True).contiguous())

        def land() -> None:  # the oldest bucket in flight: its shards into place, its old copies freed
            bucket_names, gather, old = pending.popleft()
            out.update((n, from_held(n) if n in mine_held else nn.Parameter(g))
                       for n, g in zip(bucket_names, gather.finish()))
            if free_old:
                for x in old:
                    _free(x)

        overlap = self.switch_buckets_in_flight > 1
        for (t, s), names in plan.gathers.items():
            group = self.world.group(range(t, s), target)
            sources = [locals_[n] for n in names]
            # into a pp layout each member wants its own stages' parameters only; out of one, none of
            # those it holds (members in shard order)
            members = None if owned is None and held is None else \
                [self._wants(target, r, self._held(held, target, r)) for r in group.ranks]
            for bucket in self._buckets(sources, dtype):
                pieces = [sources[i].detach().to(dtype=dtype or sources[i].dtype) for i in bucket]
                dims = [self.shardings[names[i]].dim for i in bucket]
                if members is None:
                    gather = FusedGather(pieces, dims, group, async_op=overlap)
                    received += sum(p.numel() * p.element_size() for p in pieces) * (group.size - 1)
                else:
                    wanted = [[j for j, i in enumerate(bucket) if m(names[i])] for m in members]
                    gather = SelectiveGather(pieces, dims, group, wanted)
                    received += gather.received_bytes
                pending.append(([names[i] for i in bucket], gather, [sources[i] for i in bucket]))
                del pieces
                collectives += 1
                while len(pending) >= self.switch_buckets_in_flight:  # at most this many buckets held twice
                    land()
        while pending:
            land()
        lower_bound = sum(n * (dtype or locals_[name].dtype).itemsize for name, n in plan.lower_bound_elems.items()
                          if (owned is None or name in owned) and name not in mine_held)
        old = dict(locals_) if source is not None else {}
        self.working = {n: out[n] for n in self.shardings}
        if owned is not None:  # a pp layout: only this rank's stages' parameters stay materialized
            for name, p in self.working.items():
                if name not in owned:
                    _free(p)
        for name, p in self.working.items():
            if old.get(name) is not p:
                self._label("params", p)
        self._track_accumulation(old, self.working, keep_grads)
        self.active = target
        return SwitchReport(source if held is None else held[0], target, received, lower_bound, collectives,
                            time.perf_counter() - start)

    def _held(self, held: tuple[Layout, Mapping[str, torch.Tensor]] | None, target: Layout,
              rank: int) -> frozenset[str]:
        """The parameters ``rank`` holds in the pp copy it leaves (``held``) at a prefix ``target``'s lies within."""
        if held is None:
            return frozenset()
        owned = self._owned(held[0], rank)
        return frozenset(n for n in owned if self._prefix(n, target) >= self._prefix(n, held[0]))

    def _wants(self, target: Layout, rank: int, holds: frozenset[str]) -> Callable[[str], bool]:
        """Whether ``rank`` needs a parameter's gathered copy in ``target``: it computes with it there and
        does not already hold it (``holds``)."""
        owned = self._owned(target, rank)
        return lambda name: (owned is None or name in owned) and name not in holds

    def _owned(self, layout: Layout, rank: int | None = None) -> frozenset[str] | None:
        """The parameters a pp ``layout``'s stages on ``rank`` (default: this rank) hold (None: every one)."""
        if layout.pp == 1:
            return None
        if self.pipeline_owned is None:
            raise LayoutError(f"layout {layout} is pipelined, but no pipeline was registered with the switch "
                              f"engine (pipeline_owned; the StepRunner sets it from its PipelineRunner)")
        return self.pipeline_owned(layout, self.world.rank if rank is None else rank)

    def _buckets(self, pieces: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[list[int]]:
        """Consecutive groups of at most ``bucket_bytes`` per rank (a larger tensor goes alone):
        gloo moves a few MB per call faster than one huge buffer, and small tensors still fuse.
        Used for the all-gathers of a switch and the reductions of gradients alike."""
        buckets: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(pieces):
            nbytes = p.numel() * (dtype or p.dtype).itemsize
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        return buckets

    def materialize(self, layout: Layout) -> SwitchReport:
        """Working params of ``layout`` (one of the mesh's) from the home state (start of a step)."""
        return self._move(None, self._member(layout), {n: self._home_local(n) for n in self.shardings})

    def switch(self, layout: Layout, keep_grads: bool = False) -> SwitchReport:
        """Working params from the active layout to ``layout`` (zero traffic if it is the same).

        ``keep_grads``: keep accumulating into the working ``.grad`` instead of dropping it (the
        caller did not reduce); only between layouts that :meth:`shares_gradients`, else it raises.
        """
        if self.active is None:
            raise RuntimeError("no active layout: call materialize() first")
        return self._move(self.active, self._member(layout), self.working, keep_grads)

    def enter_stage(self, layouts: Sequence[Layout], keep_grads: bool = False) -> SwitchReport:
        """The working copy of a stage in which rank ``r`` holds ``layouts[r]`` (one entry: the same
        layout on every rank). One layout everywhere: a switch from the active copy, or from home at
        the start of a step or after a block copy (dropped first); different layouts (a block
        stage): the active copy is dropped (already reduced) and every rank's own comes from home
        (:meth:`materialize_blocks`). ``keep_grads``: see :meth:`switch` (one layout only)."""
        key = tuple(layouts)
        if not key:
            raise LayoutError("enter_stage() needs the working layouts of the stage's ranks, got none")
        if self.mixed is not None:  # a block copy never outlives its stage: reduced, or evaluated
            self.release(free=True)
        if len(set(key)) == 1:
            if self.active is not None and self.active.pp > 1 and key[0] != self.active:
                # its other stages' parameters are gone: the next copy comes from home, except what a rank's
                # own stages held (sliced from it; the gathers skip it)
                left, working = self.active, self.working
                self.release()
                report = self._move(None, key[0], {n: self._home_local(n) for n in self.shardings},
                                    held=(left, working))
                for p in working.values():  # the new copy never shares their storage (copies, or home's)
                    _free(p)
                return report
            if self.active is None:
                return self.materialize(key[0])
            return self.switch(key[0], keep_grads=keep_grads)
        if keep_grads:
            raise LayoutError(f"cannot keep working gradients into a block stage (layouts "
                              f"{sorted({str(x) for x in key})}): reduce the previous stage first")
        if self.active is not None:
            self.release(free=True)  # one copy at a time: the blocks' come from home
        return self.materialize_blocks(key)

    def reduce_stage(self) -> GradReport:
        """The stage-end reduction into the home-sharded store: a block copy's joint exchange
        (:meth:`reduce_blocks`), else :meth:`reduce_gradients` (which finishes an overlapped one)."""
        return self.reduce_blocks() if self.mixed is not None else self.reduce_gradients()

    def stages_share_gradients(self, a: Sequence[Layout], b: Sequence[Layout]) -> bool:
        """True if a stage whose ranks hold ``a`` may leave its working gradients to the next, whose
        ranks hold ``b``: one layout on every rank in both, and :meth:`shares_gradients` (a block
        copy reduces at its stage end: the next stage's copy comes from home)."""
        return len(set(a)) == 1 and len(set(b)) == 1 and self.shares_gradients(a[0], b[0])

    def materialize_blocks(self, layouts: tuple[Layout, ...]) -> SwitchReport:
        """Working params of a block stage from the home state: every rank ``r`` in its block's
        working layout ``layouts[r]``, replicated or sharded over the block's own ranks
        (``:fsdp<n>``: its fsdp units' parameters at :meth:`fsdp_prefix`) (:mod:`.nested_exchange`,
        one world all-to-all per bucket). The engine must hold no working copy (start of a step, or
        after :meth:`release`)."""
        if self.active is not None:
            raise RuntimeError(f"materialize_blocks() while layout {self.active} is active; release() it first")
        start = time.perf_counter()
        key = tuple(self._member(x) for x in layouts)
        sharded = sorted({str(x) for x in key if x.fsdp})
        if sharded and not self.fsdp_names:
            raise LayoutError(f"block layouts {sharded} shard the working copy per unit, but no fsdp units were "
                              f"registered (set_fsdp_units; the StepRunner does it from the model)")
        if key not in self._exchanges:
            self._exchanges[key] = NestedExchange(self.shardings, self.world.shape, key, self.world.rank,
                                                  self.bucket_bytes, prefix=self._working_prefix)
        exchange = self._exchanges[key]
        out, received, collectives = exchange.gather({n: self._home_local(n) for n in self.shardings},
                                                     self.working_dtype)
        self.working = {n: nn.Parameter(out[n]) for n in self.shardings}
        for p in self.working.values():
            self._label("params", p)
        self._track_accumulation({}, self.working, False)
        self.active, self.mixed = key[self.world.rank], exchange
        return SwitchReport(None, self.active, received, received, collectives, time.perf_counter() - start)

    def reduce_blocks(self) -> GradReport:
        """Sums every rank's working gradients of a block stage (fp32 at least; a sharded block's
        already reduce-scattered inside it) into the home-sharded store (:mod:`.nested_exchange`);
        then :meth:`release` the working copy."""
        if self.mixed is None:
            raise RuntimeError("reduce_blocks() without a block stage's working copy (materialize_blocks)")
        start = time.perf_counter()
        grads = {n: self.working_grad(n) for n in self.shardings}
        self.main_grads = {}  # the exchange reads them from ``grads``; each bucket's dropped once sent
        received, collectives = self.mixed.reduce(grads, self.working, self._store)
        return GradReport(self.active, received, collectives, time.perf_counter() - start)

    def shares_gradients(self, a: Layout, b: Layout) -> bool:
        """True if every parameter has the same working shard and gradient states in ``a`` and
        ``b`` (same tp degree: tp dims are a mesh prefix), so one reduction after stages in both
        equals one after each: the working gradients of both are partial sums of the same kind. Two
        fsdp layouts of one tp degree share; an fsdp and a replicated layout do not (other shards)."""
        la, lb = self._member(a), self._member(b)
        if la != lb and (la.pp > 1 or lb.pp > 1):
            return False  # a pp layout holds only its stages' parameters: the next copy comes from home
        return all(self._working_prefix(n, la) == self._working_prefix(n, lb)
                   and self._grad_states(n, la) == self._grad_states(n, lb) for n in self.shardings)

    def release(self, free: bool = False) -> None:
        """Drops the working params (e.g. after the optimizer step, which makes them stale) and any
        gradient hooks of an unfinished :meth:`overlap_next_backward`. ``free``: also release their
        storage now (a mixed-tp stage's neighbours: the model's modules still hold the old copies
        until the next ``activate`` and must not use them before: see :func:`_free`)."""
        if free:
            for p in self.working.values():
                _free(p)
        if self._overlap is not None:
            for handle in self._overlap.handles:
                handle.remove()
            self._overlap = None
        self._drop_accumulation()
        self.working, self.active, self.mixed = {}, None, None
