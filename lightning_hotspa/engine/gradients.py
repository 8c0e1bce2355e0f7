"""Gradient side of the switch engine: accumulation across micro-batches and the bucketed reduction.

Accumulation (Megatron's ``main_grad`` idea): with low-precision working params (bf16), autograd would
sum the micro-batches' gradients in bf16. With ``grad_accum_dtype=torch.float32`` (the default under
bf16-mixed) a post-accumulate hook adds each fresh ``.grad`` into an fp32 buffer owned by the engine
and drops the bf16 one, so the sum is fp32 (+4 bytes per working parameter, counted by the memory
model); ``None`` keeps autograd's own ``.grad`` (bf16 under bf16-mixed: the memory-tight option).

Reduction: working gradients (partial sums over the layout's dp/cp dims, and over tp for
``replicated_partial`` params) are reduced in fp32 straight into the engine's store in the home
sharding: a reduce-scatter over the dims home splits, an all-reduce over the dims home replicates.
Like DDP, buckets follow reverse parameter order and can start during the stage's last backward
(:meth:`GradientReduction.overlap_next_backward`). Each bucket's fp32 input buffer lives only until
its collective lands: at most ``max_buckets_in_flight`` are pending at once (a new launch first
finishes the oldest), and a finished bucket keeps nothing but its slice of the store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from ..collective_names import collective
from ..layout import Layout
from ..mesh import RankGroup
from ..placements import ParamSharding
from ..shard_rows import shard_of_slot
from .selective_reduce import selective_reduce_scatter

__all__ = ["GradReport", "GradientReduction", "sub_chunk", "reduce_dtype"]


@dataclass(frozen=True)
class GradReport:
    layout: Layout
    bytes_received: int  # reduce-scatter: (g-1)/g of its input; all-reduce: 2(g-1)/g (ring)
    collectives: int
    seconds: float
    waits_in_backward: int = 0  # collectives waited on from the backward's hooks (a stream wait on NCCL)
    waits_at_end: int = 0  # those waited on by reduce_gradients, after the backward


def sub_chunk(t: torch.Tensor, sharding: ParamSharding, start: int, stop: int, rank: int) -> torch.Tensor:
    """This rank's chunk of ``t`` after additionally splitting over mesh dims [start, stop)."""
    if start == stop or sharding.dim is None:
        return t
    dims = range(start, stop)
    count = math.prod(sharding.mesh.sizes[d] for d in dims)
    index = sharding.mesh.shard_index(rank, dims)
    return t.chunk(count, dim=sharding.dim)[index]


def sub_shape(shape: tuple[int, ...], sharding: ParamSharding, start: int, stop: int) -> tuple[int, ...]:
    """The shape :func:`sub_chunk` gives a tensor of ``shape`` (computed: no view of the tensor itself,
    which may be another pipeline stage's copy that holds no storage)."""
    if start == stop or sharding.dim is None:
        return tuple(shape)
    out = list(shape)
    out[sharding.dim] //= math.prod(sharding.mesh.sizes[d] for d in range(start, stop))
    return tuple(out)


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients are summed in fp32 at least (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """One launched asynchronous collective. It holds its input buffer (an async backend may read
    it until the collective lands) and drops it in :meth:`result`."""

    def __init__(self, work, unpack: Callable[[], list[torch.Tensor]], inputs: torch.Tensor | None,
                 buffer: torch.Tensor | None = None, group: RankGroup | None = None) -> None:
        self.work, self.unpack, self.inputs = work, unpack, inputs
        self.group = group  # names the group should the wait fail (collective_names)
        self.buffer = inputs if buffer is None else buffer  # what the bucket allocated (for labels)

    def result(self) -> list[torch.Tensor]:
        if self.work is not None:
            with collective("a gradient reduction", self.group if self.group is not None else ()):
                self.work.wait()
        self.work = self.inputs = self.buffer = None
        return self.unpack()


@dataclass
class _Overlap:
    """Reductions of one stage: hooks of an overlapped backward, buckets launched and in flight."""

    remaining: list[int]  # per bucket: gradients still to be accumulated
    handles: list = field(default_factory=list)
    ready: set[str] = field(default_factory=set)
    launched: int = 0
    in_flight: list[tuple[_GradBucket, _Pending]] = field(default_factory=list)
    # all-reduce phases of two-phase buckets: their buffer is the bucket's result (kept anyway), so
    # they do not count against max_buckets_in_flight and land at the stage end
    finishing: list[tuple[_GradBucket, _Pending]] = field(default_factory=list)
    received: int = 0
    waits: dict[str, int] = field(default_factory=lambda: {"backward": 0, "end": 0})


def _reduce_scatter_start(tensors: list[torch.Tensor], dims: list[int], group: RankGroup,
                          dtype: torch.dtype) -> _Pending:
    """Copies (and casts) the tensors straight into one ``[group, n]`` fp32 buffer in slot order."""
    moved = [t.movedim(d, 0) for t, d in zip(tensors, dims)]
    widths = [m.numel() // group.size for m in moved]
    rows = torch.empty(group.size, sum(widths), dtype=dtype, device=tensors[0].device)
    order = None if group.in_shard_order else shard_of_slot(group)
    offset = 0
    for m, n in zip(moved, widths):
        src = m.unflatten(0, (group.size, m.shape[0] // group.size))
        dst = rows[:, offset:offset + n].unflatten(1, src.shape[1:])
        if order is None:
            dst.copy_(src)
        else:
            for slot, shard in enumerate(order):
                dst[slot].copy_(src[shard])
        offset += n
    out = rows.new_empty(rows.shape[1])
    with collective("a gradient reduce-scatter", group):
        work = group.comm.reduce_scatter_into(out, rows.view(-1), async_op=True)
    shapes = [(m.shape[0] // group.size, *m.shape[1:]) for m in moved]

    def unpack() -> list[torch.Tensor]:
        results, offset = [], 0
        for shape, d in zip(shapes, dims):
            n = math.prod(shape)
            results.append(out[offset:offset + n].view(shape).movedim(0, d).contiguous())
            offset += n
        return results

    return _Pending(work, unpack, rows, group=group)


def _all_reduce_start(tensors: list[torch.Tensor], group: RankGroup, into: _Overlap,
                      dtype: torch.dtype) -> _Pending:
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    with collective("a gradient all-reduce", group):
        work = group.comm.all_reduce(flat, async_op=True)
    into.received += 2 * (group.size - 1) * flat.numel() * flat.element_size() // group.size
    shapes = [t.shape for t in tensors]

    def unpack() -> list[torch.Tensor]:
        results, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            results.append(flat[offset:offset + n].view(shape))
            offset += n
        return results

    return _Pending(work, unpack, None, flat, group)  # the output is the buffer: the store keeps it


class GradientReduction:
    """Mixin of :class:`~lightning_hotspa.engine.switch.SwitchEngine`: its gradient methods.

    Reads ``world``, ``shardings``, ``home``, ``working``, ``active`` and ``bucket_bytes`` of the engine.
    """

    grad_accum_dtype: torch.dtype | None
    max_buckets_in_flight: int
    _label: Callable[[str, torch.Tensor], None]
    _grad_states: Callable[[str, Layout], list[str]]
    fsdp_gathered: Callable[[str, Layout], bool]

    def _init_gradients(self, grad_accum_dtype: torch.dtype | None, max_buckets_in_flight: int) -> None:
        if max_buckets_in_flight < 1:
            raise ValueError(f"max_buckets_in_flight must be >= 1, got {max_buckets_in_flight!r}")
        self.grad_accum_dtype = grad_accum_dtype
        self.max_buckets_in_flight = max_buckets_in_flight
        self.grad_store: dict[str, torch.Tensor] = {}
        self.main_grads: dict[str, torch.Tensor] = {}  # fp32 accumulators (grad_accum_dtype set)
        self._accum_hooks: dict[str, object] = {}
        self._reduce_plans: dict[Layout, _ReducePlan] = {}
        self._overlap: _Overlap | None = None

    # ---------------------------------------------------------------- accumulation
    def _accumulates(self, p: torch.Tensor) -> bool:
        """True if ``p``'s gradients are summed in the engine's own (wider) buffer."""
        acc = self.grad_accum_dtype
        return acc is not None and p.dtype != acc and acc.itemsize > p.dtype.itemsize

    def _track_accumulation(self, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                            keep_grads: bool) -> None:
        """Re-points the accumulation hooks after a switch from ``old`` to ``new`` working params."""
        for name, p in new.items():
            if old.get(name) is p:
                if not keep_grads:
                    self.main_grads.pop(name, None)
                continue
            handle = self._accum_hooks.pop(name, None)
            if handle is not None:
                handle.remove()
            self.main_grads.pop(name, None)
            if self._accumulates(p) and p.requires_grad:
                self._accum_hooks[name] = p.register_post_accumulate_grad_hook(
                    lambda q, name=name: self._accumulate(name, q))

    def _accumulate(self, name: str, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        acc = self.main_grads.get(name)
        if acc is None:
            self.main_grads[name] = g.detach().to(self.grad_accum_dtype)
            self._label("grads", self.main_grads[name])
        else:
            acc.add_(g.detach())
        p.grad = None

    def add_main_grad(self, name: str, grad: torch.Tensor) -> None:
        """Adds an already reduced gradient shard of working param ``name`` (an fsdp unit's
        reduce-scatter, :mod:`.fsdp`) into its accumulator, and tells an overlapped reduction."""
        acc = self.main_grads.get(name)
        if acc is None:
            self.main_grads[name] = grad
            self._label("grads", grad)
        else:
            acc.add_(grad)
        if self._overlap is not None:
            self._grad_ready(name)

    def _drop_accumulation(self) -> None:
        for handle in self._accum_hooks.values():
            handle.remove()
        self._accum_hooks, self.main_grads = {}, {}

    def working_grad(self, name: str) -> torch.Tensor | None:
        """The accumulated gradient of working param ``name`` (fp32 main grad or ``.grad``)."""
        return self.main_grads[name] if name in self.main_grads else self.working[name].grad

    # ---------------------------------------------------------------- reduction
    def _reduce_plan(self, layout: Layout) -> _ReducePlan:
        """Buckets of at most ``bucket_bytes`` (fp32) per (scatter, reduce) kind, filled in reverse
        parameter order, which is roughly the order backward produces gradients in (as DDP), and
        launched in the order they fill up (their last gradient's place): a small kind's bucket (the
        norms under tp, partial over tp) gathers gradients from every layer and fills only at the
        end, so launching by opening order would hold every later bucket back until the backward
        ends (the fake world showed it: planner/cost/grad_exposure.py)."""
        if layout not in self._reduce_plans:
            plan = _ReducePlan()
            open_: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[_GradBucket, int]] = {}
            filled: dict[int, int] = {}  # id(bucket) -> place of its last gradient in reverse order
            for place, name in enumerate(reversed(list(self.shardings))):
                sharding = self.shardings[name]
                states = self._grad_states(name, layout)
                rep = [d for d in range(sharding.home_prefix) if states[d] == "replicate"]
                key = tuple(tuple(range(*r)) for r in self._grad_ranges(name, layout))
                if rep:
                    plan.slices[name] = (rep[0], rep[-1] + 1)
                w = self.working[name]
                nbytes = math.prod(sub_shape(w.shape, sharding, *plan.slices.get(name, (0, 0)))) \
                    * reduce_dtype(w.dtype).itemsize
                bucket, size = open_.get(key, (None, 0))
                if bucket is None or size + nbytes > self.bucket_bytes:
                    bucket, size = _GradBucket(*key), 0
                    plan.buckets.append(bucket)
                bucket.names.append(name)
                filled[id(bucket)] = place
                open_[key] = (bucket, size + nbytes)
            plan.buckets.sort(key=lambda b: filled[id(b)])  # stable; the same order on every rank
            plan.bucket_of = {n: i for i, b in enumerate(plan.buckets) for n in b.names}
            self._reduce_plans[layout] = plan
        return self._reduce_plans[layout]

    def _grad_ranges(self, name: str, layout: Layout) -> tuple[tuple[int, int], tuple[int, int]]:
        """The ``[start, stop)`` mesh dims ``name``'s gradient in ``layout`` is reduce-scattered over
        (partial dims home splits), then all-reduced over (partial dims home replicates); either may
        be empty. Both are contiguous: the partial dims are a suffix of the home ones and beyond."""
        states, home = self._grad_states(name, layout), self.shardings[name].home_prefix
        scatter = [d for d in range(home) if states[d] == "partial"]
        reduce = [d for d in range(home, len(states)) if states[d] == "partial"]
        out = []
        for dims in (scatter, reduce):
            if dims and dims != list(range(dims[0], dims[-1] + 1)):
                raise AssertionError(f"partial gradient dims {dims} of {name!r} in {layout} are not contiguous")
            out.append((dims[0], dims[-1] + 1) if dims else (0, 0))
        return out[0], out[1]

    def overlap_next_backward(self) -> None:
        """Reduces each gradient bucket as soon as the coming backward has accumulated all of it.

        Call right before the LAST backward of a stage (earlier ones would reduce partial sums),
        then :meth:`reduce_gradients` at the stage end launches what is left and waits. Buckets are
        launched strictly in plan order, so every rank issues the same collectives in the same order.
        On a block stage's copy it does nothing: the joint reduction is not overlapped.
        """
        if self.active is None:
            raise RuntimeError("no active layout to reduce gradients from")
        if self._overlap is not None:
            raise RuntimeError("overlap_next_backward() called twice in one stage")
        if getattr(self, "mixed", None) is not None:
            return  # a block copy: its joint reduction runs after the backward (not overlapped)
        plan = self._reduce_plan(self.active)
        overlap = _Overlap([len(b.names) for b in plan.buckets])
        for name, w in self.working.items():
            # registered after the accumulation hook, so it runs after it; an fsdp-gathered shard gets
            # no .grad (its unit's reduce-scatter calls add_main_grad, which reports it ready)
            if w.requires_grad and not self.fsdp_gathered(name, self.active):
                overlap.handles.append(w.register_post_accumulate_grad_hook(
                    lambda _, name=name: self._grad_ready(name)))
        self._overlap = overlap

    def _refuse_mixed(self, what: str) -> None:
        if getattr(self, "mixed", None) is not None:  # ranks hold different layouts: reduce_blocks() joins them
            raise RuntimeError(f"{what}() on a block stage's working copy ({self.active} on this rank); "
                               f"use reduce_blocks()")

    def _grad_ready(self, name: str) -> None:
        overlap, plan = self._overlap, self._reduce_plan(self.active)
        if name in overlap.ready:
            if plan.bucket_of[name] < overlap.launched:
                raise RuntimeError(f"the gradient of {name!r} was accumulated again after its bucket was "
                                   f"reduced; call overlap_next_backward() only before a stage's last backward")
            return
        overlap.ready.add(name)
        overlap.remaining[plan.bucket_of[name]] -= 1
        while overlap.launched < len(plan.buckets) and overlap.remaining[overlap.launched] == 0:
            self._launch(plan, plan.buckets[overlap.launched], None, overlap, "backward")

    def _launch(self, plan: _ReducePlan, bucket: _GradBucket, grads: Mapping[str, torch.Tensor] | None,
                into: _Overlap, where: str) -> None:
        """Starts the first collective of ``bucket`` (reduce-scatter, else all-reduce), first landing
        the oldest pending bucket if ``max_buckets_in_flight`` are already out (``where``: "backward"
        from a gradient hook, "end" from :meth:`reduce_gradients`)."""
        while len(into.in_flight) >= self.max_buckets_in_flight:
            self._land(*into.in_flight.pop(0), into, where)
        rank = self.world.rank
        owners = self._grad_owners(bucket) if bucket.scatter else None
        me = self.world.group(bucket.scatter, self.active).index if owners is not None else None
        local, dtype = [], None
        for k, name in enumerate(bucket.names):
            w = self.working[name]
            dtype = reduce_dtype(w.dtype)
            if owners is not None and me not in owners[k]:
                local.append(None)  # another stage's parameter: nothing to send
                continue
            g = grads[name] if grads is not None else self.working_grad(name)
            g = torch.zeros(w.shape, dtype=dtype, device=w.device) if g is None else g.detach()
            if name in plan.slices:
                g = sub_chunk(g, self.shardings[name], *plan.slices[name], rank)
            local.append(g)
        if owners is not None:
            group = self.world.group(bucket.scatter, self.active)
            shapes = [sub_shape(self.working[n].shape, self.shardings[n], *plan.slices.get(n, (0, 0)))
                      for n in bucket.names]
            results, received = selective_reduce_scatter(local, shapes, [self.shardings[n].dim for n in bucket.names],
                                                         group, dtype, owners, self.working[bucket.names[0]].device)
            pending = _Pending(None, lambda results=results: results, None)
            into.received += received
        elif bucket.scatter:
            group = self.world.group(bucket.scatter, self.active)
            pending = _reduce_scatter_start(local, [self.shardings[n].dim for n in bucket.names], group, dtype)
            into.received += sum(t.numel() for t in local) * dtype.itemsize * (group.size - 1) // group.size
        elif bucket.reduce:
            pending = _all_reduce_start(local, self.world.group(bucket.reduce, self.active), into, dtype)
        else:  # nothing to sum: keep a copy (the working grad may change or be freed)
            copies = [t.to(dtype, copy=True) for t in local]
            pending = _Pending(None, lambda copies=copies: copies, None)
        if pending.buffer is not None:
            self._label("temporaries", pending.buffer)
        for name in bucket.names:  # copied into the bucket: the engine's accumulator is done
            self.main_grads.pop(name, None)
        into.launched += 1
        into.in_flight.append((bucket, pending))

    def _grad_owners(self, bucket: _GradBucket) -> list[list[int]] | None:
        """In a pp layout, per parameter of ``bucket``, the shard indices of its scatter group's members
        whose stages hold it (None outside pp: every member holds every gradient)."""
        layout = self.active
        if layout is None or layout.pp == 1:
            return None
        group = self.world.group(bucket.scatter, layout)
        held = [self._owned(layout, r) for r in group.ranks]
        return [[i for i, names in enumerate(held) if n in names] for n in bucket.names]

    def _land(self, bucket: _GradBucket, pending: _Pending, into: _Overlap, where: str) -> None:
        """Waits for ``bucket``'s first collective and stores the result, or, for a two-phase bucket,
        starts its all-reduce phase (landed at the stage end: nothing waits for it mid-backward).
        ``where``: "backward" (from a gradient hook) or "end" (counted in the report)."""
        into.waits[where] += pending.work is not None
        tensors = pending.result()
        if bucket.scatter and bucket.reduce:
            into.finishing.append((_GradBucket((), bucket.reduce, bucket.names),
                                   _all_reduce_start(tensors, self.world.group(bucket.reduce, self.active), into,
                                                     tensors[0].dtype)))
            return
        self._store(bucket.names, tensors)

    def reduce_gradients(self, grads: Mapping[str, torch.Tensor] | None = None) -> GradReport:
        """Sums the active layout's working gradients (fp32) into the home-sharded store.

        ``grads`` defaults to the working params' accumulated gradients (:meth:`working_grad`); a
        param without one contributes zeros (every rank still joins every collective). After
        :meth:`overlap_next_backward` this launches the buckets not started yet and waits for all.
        """
        if self.active is None:
            raise RuntimeError("no active layout to reduce gradients from")
        self._refuse_mixed("reduce_gradients")
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
        for bucket in plan.buckets[overlap.launched:]:
            self._launch(plan, bucket, grads, overlap, "end")
        while overlap.in_flight:
            self._land(*overlap.in_flight.pop(0), overlap, "end")
        for bucket, pending in overlap.finishing:  # launch order: every rank waits alike
            self._land(bucket, pending, overlap, "end")
        collectives = sum(bool(b.scatter) + bool(b.reduce) for b in plan.buckets)
        return GradReport(layout, overlap.received, collectives, time.perf_counter() - start,
                          overlap.waits["backward"], overlap.waits["end"])

    def _store(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        for name, t in zip(names, tensors):
            if name in self.grad_store:
                self.grad_store[name].add_(t)
            else:
                self.grad_store[name] = t
                self._label("grads", t)

    def assign_home_grads(self) -> None:
        """Hands the store to the home params' ``.grad`` (as DTensors where the params are)."""
        for name, p in self.home.items():
            g = self.grad_store.get(name)
            if g is None:
                local = p.to_local() if isinstance(p, DTensor) else p
                g = torch.zeros_like(local, dtype=reduce_dtype(p.dtype))
            if isinstance(p, DTensor):
                g = DTensor.from_local(g.to(p.dtype), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            else:
                g = g.to(p.dtype)
            self._label("grads", g)
            p.grad = g

    def clear_grad_store(self) -> None:
        self.grad_store = {}
