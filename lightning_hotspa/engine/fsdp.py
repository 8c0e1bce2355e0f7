"""Working copies sharded inside a layout (ZeRO-3 / FSDP semantics), gathered unit by unit.

In a layout with ``fsdp=True`` the switch engine holds each parameter of the model's fsdp units at
its home prefix (:meth:`SwitchEngine.fsdp_gathered`): sharded over the layout's dp and cp ranks as
well, torchtitan's ``dp_shard_cp`` choice; with ``fsdp_shard`` (``dp64:fsdp8``) only over that many
of the most local dp x cp ranks and replicated over the rest (HSDP), so the per-unit traffic stays
inside a node (:meth:`SwitchEngine.fsdp_prefix`). Around each unit's forward (a transformer block,
the embedding, the LM head) this module

* gathers the unit's shards to the layout prefix: ONE fused all-gather per mesh-dim range
  ``[layout prefix, fsdp prefix)`` (one per unit for the usual case, where every parameter of the
  unit has the same range) inside an autograd function, and installs the gathered tensors in the
  unit's modules;
* after the forward puts shape-only ``meta`` placeholders there, so nothing keeps the gathered
  tensors alive: inside the unit's forward saved-tensor hooks pack every saved weight (or view of
  one) as a handle, and the first unpack in backward gathers the unit again (re-gather, not keep);
  under activation checkpointing (whose own hooks own the saved tensors) ours stay out and the
  recomputation gathers again;
* in backward, the autograd function receives the unit's full gradients and reduce-scatters them
  in fp32 (the reduce dtype) over the same dims straight into the engine's accumulators at the
  sharded size (:meth:`GradientReduction.add_main_grad`); the stage-end reduction then only
  reduces over the dims beyond the fsdp prefix (none to scatter for plain ``:fsdp``; the HSDP
  replicas' reduce-scatter into home otherwise), all-reducing those home replicates, and stores.

Within :meth:`ShardedUnits.forward_prefetch` (the step runner wraps each micro-batch's forward in
it) a unit's forward starts the NEXT unit's all-gather asynchronously (declaration order is call
order), and each unit notes whether it packed a weight. In backward, the units re-gather in reverse
order of those that did (the embedding's backward needs no weight: it never re-gathers), so a
unit's re-gather, once finished, starts the one of the weight-saving unit before it asynchronously
and that unit's first unpack finishes it: gather(k), start(k-1), reduce-scatter(k), finish(k-1),
start(k-2), ... on every rank alike (the same graph, idle rounds included). At most one is in
flight (the current unit and the next: two gathered units, as the memory model budgets); one that
no unit consumed is finished and dropped by :meth:`ShardedUnits.end_backward` (the step runner calls
it after every backward) or by the next forward. A checkpointed unit's recomputation gathers
synchronously (not prefetched: telling a recomputation apart needs torch's private checkpoint
state). Not built: keeping the gathered weights for backward.

A dp group with fewer micro-batches than the busiest runs idle rounds (``RankStage.rounds``) so the
gathers, which span dp groups, line up (not where the shard lies inside the cp group,
``Layout.lockstep`` False: every rank of a shard group computes the same micro-batches);
evaluation does the same with :meth:`ShardedUnits.idle_forward`, which assumes units are called
once each, in declaration order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..layout import Layout, LayoutError
from ..torch_compat import outer_saved_tensor_hooks
from .fused_gather import FusedGather
from .gradients import _reduce_scatter_start, reduce_dtype

__all__ = ["ShardedUnits", "find_fsdp_units"]


def find_fsdp_units(module: nn.Module) -> list[str]:
    """Names of the units of ``module``: what a submodule's ``fsdp_units()`` declares (names relative
    to it, in call order), else every child of every ``nn.ModuleList``."""
    for path, sub in module.named_modules():
        declare = getattr(sub, "fsdp_units", None)
        if callable(declare):
            return [f"{path}.{u}" if path else u for u in declare()]
    return [f"{path}.{child}" if path else child for path, sub in module.named_modules()
            if isinstance(sub, nn.ModuleList) for child, _ in sub.named_children()]


@dataclass(frozen=True)
class _Saved:
    """A weight (or a view of one) a unit's forward saved for backward: re-gathered on unpack."""

    name: str
    whole: bool
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _discard(started: dict[tuple[int, int], FusedGather]) -> None:
    """Completes gathers nobody will use (every rank issued them) without building their results."""
    for gather in started.values():
        gather.discard()


class _GatherUnit(torch.autograd.Function):
    """Forward: the unit's shards -> gathered tensors. Backward: their gradients reduce-scattered
    into the engine's accumulators (the shards get no ``.grad``: the engine owns the sum)."""

    @staticmethod
    def forward(ctx: Any, unit: _Unit, names: tuple[str, ...], *shards: Tensor) -> tuple[Tensor, ...]:
        ctx.unit, ctx.names = unit, names
        return tuple(unit.gather(names, shards, "forward"))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        unit = ctx.unit
        unit.cache = None  # the re-gathered weights are used up: free them
        unit.reduce_scatter(ctx.names, grads)
        return (None, None) + (None,) * len(grads)


class _Unit:
    """One unit's hooks and state."""

    def __init__(self, owner: ShardedUnits, path: str, module: nn.Module, names: list[str],
                 slots: dict[str, tuple[nn.Module, str]]) -> None:
        self.owner, self.path, self.module, self.names, self.slots = owner, path, module, names, slots
        self.live: dict[str, Tensor] = {}  # gathered tensors installed for the running forward
        self.live_ids: dict[int, str] = {}
        self.cache: dict[str, Tensor] | None = None  # re-gathered in backward
        self.hooks_ctx: Any = None
        self.prefetched: dict[tuple[int, int], FusedGather] | None = None  # started by the previous unit
        self.saved_weight = False  # this call's forward packed a weight (its backward re-gathers)
        # per layout: the names it gathers and their rank ranges (the shardings never change, and
        # every micro-batch asks again, forward and backward)
        self._names: dict[Layout, list[str]] = {}
        self._range_memo: dict[tuple[Layout, tuple[str, ...]], dict[tuple[int, int], list[int]]] = {}

    # -------------------------------------------------------------- collectives
    def _ranges(self, names: Sequence[str], layout: Layout) -> dict[tuple[int, int], list[int]]:
        key = (layout, tuple(names))
        out = self._range_memo.get(key)
        if out is None:
            engine, out = self.owner.engine, {}
            for i, n in enumerate(names):
                sh = engine.shardings[n]
                out.setdefault((sh.layout_prefix(layout), engine.fsdp_prefix(n, layout)), []).append(i)
            self._range_memo[key] = out
        return out

    def _start(self, names: Sequence[str], shards: Sequence[Tensor], phase: str,
               async_op: bool) -> dict[tuple[int, int], FusedGather]:
        engine, out = self.owner.engine, {}
        for key, idx in self._ranges(names, engine.active).items():
            group = engine.world.group(range(*key), engine.active)
            pieces = [shards[i].detach() for i in idx]
            out[key] = FusedGather(pieces, [engine.shardings[names[i]].dim for i in idx], group, async_op)
            engine._label("temporaries", out[key].buffer)
            self.owner.count(phase, sum(p.numel() * p.element_size() for p in pieces) * (group.size - 1))
        return out

    def gather(self, names: Sequence[str], shards: Sequence[Tensor], phase: str,
               started: dict[tuple[int, int], FusedGather] | None = None) -> list[Tensor]:
        """The unit's gathered tensors: ``started`` (a backward prefetch), the prefetched ones in
        forward if the previous unit started them (same layout and shards: both happen inside one
        forward), else gathered now."""
        engine = self.owner.engine
        if started is None and phase == "forward" and self.prefetched is not None:
            started, self.prefetched = self.prefetched, None
        if started is None:
            started = self._start(names, shards, phase, async_op=False)
        results: list[Tensor | None] = [None] * len(names)
        for key, idx in self._ranges(names, engine.active).items():
            for i, g in zip(idx, started[key].finish(fresh=True)):
                results[i] = g
                engine._label("params", g)
        return results

    def prefetch(self) -> None:
        """Starts this unit's forward gather now, asynchronously (the previous unit is running)."""
        names = self.gathered_names()
        if names and self.prefetched is None:
            self.prefetched = self._start(names, [self.owner.engine.working[n] for n in names], "forward",
                                          async_op=True)
            self.owner.prefetches += 1

    def drop_prefetch(self) -> None:
        if self.prefetched is not None:
            _discard(self.prefetched)
            self.prefetched = None

    def reduce_scatter(self, names: Sequence[str], grads: Sequence[Tensor]) -> None:
        """Starts this unit's gradient reduce-scatters asynchronously; the previous unit's land first
        (one unit in flight, as FSDP2: backward goes on while it runs)."""
        owner = self.owner
        owner.land_reduce_scatter()
        engine = owner.engine
        for (lo, hi), idx in self._ranges(names, engine.active).items():
            group = engine.world.group(range(lo, hi), engine.active)
            local = [grads[i] for i in idx]
            dtype = owner.reduce_dtype or reduce_dtype(local[0].dtype)
            pending = _reduce_scatter_start(local, [engine.shardings[names[i]].dim for i in idx], group, dtype)
            engine._label("temporaries", pending.buffer)
            nbytes = sum(g.numel() for g in local) * dtype.itemsize * (group.size - 1) // group.size
            owner.count("reduce_scatter", nbytes)
            owner.reducing.append(([names[i] for i in idx], pending))

    # -------------------------------------------------------------- module hooks
    def gathered_names(self) -> list[str]:
        engine, layout = self.owner.engine, self.owner.engine.active
        if layout is None or not layout.fsdp:
            return []
        if layout not in self._names:
            self._names[layout] = [n for n in self.names if engine.fsdp_gathered(n, layout)]
        return self._names[layout]

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self.saved_weight = False
        names = self.gathered_names()
        if not names:
            return
        engine = self.owner.engine
        shards = [engine.working[n] for n in names]
        if torch.is_grad_enabled():
            outs = _GatherUnit.apply(self, tuple(names), *shards)
        else:
            outs = self.gather(names, shards, "forward")
        outs = (outs,) if isinstance(outs, Tensor) else outs
        for name, t in zip(names, outs):
            owner, leaf = self.slots[name]
            owner._parameters[leaf] = t
        self.live = dict(zip(names, outs))
        self.live_ids = {id(t): n for n, t in self.live.items()}
        following = self.owner.next_unit.get(self)
        if self.owner.prefetching and following is not None:
            following.prefetch()
        if torch.is_grad_enabled() and not outer_saved_tensor_hooks():
            self.hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.hooks_ctx.__enter__()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.hooks_ctx is not None:
            self.hooks_ctx.__exit__(None, None, None)
            self.hooks_ctx = None
        for name, t in self.live.items():  # shape-only stand-ins: nothing keeps the gathered copy
            owner, leaf = self.slots[name]
            owner._parameters[leaf] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        self.live, self.live_ids = {}, {}

    def pack(self, t: Tensor) -> Any:
        base = t._base if t._base is not None else t
        name = self.live_ids.get(id(base))
        if name is None or self.live[name] is not base:
            return t
        if not self.saved_weight:
            self.saved_weight = True
            self.owner.note_saver(self)
        return _Saved(name, t is base, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if self.cache is None:
            names, owner = self.gathered_names(), self.owner
            with torch.no_grad():
                full = self.gather(names, [owner.engine.working[n] for n in names], "backward",
                                   owner.take_backward_prefetch(self))
            self.cache = dict(zip(names, full))
            owner.prefetch_backward(after=self)
        full = self.cache[saved.name]
        return full if saved.whole else full.as_strided(saved.size, saved.stride, saved.offset)


class ShardedUnits:
    """The fsdp units of ``module`` (names from :func:`find_fsdp_units` unless given), their hooks
    installed once; tells ``engine`` which parameters fsdp layouts shard. ``bytes`` and
    ``collectives`` count what this rank received per phase (``forward`` / ``backward`` gathers,
    ``reduce_scatter``), prefetched ones included; ``prefetches`` and ``backward_prefetches`` how
    many gathers of each phase were started ahead."""

    def __init__(self, engine: Any, module: nn.Module, units: Sequence[str] | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.engine = engine
        #: the dtype gradients are reduce-scattered in (None: fp32, or fp64 for fp64 gradients); bf16
        #: halves the bytes and sums in bf16 (main grads still accumulate in their own dtype)
        self.reduce_dtype = reduce_dtype
        self.reducing: list[tuple[list[str], Any]] = []  # one unit's reduce-scatters in flight
        paths = list(find_fsdp_units(module) if units is None else units)
        fsdp_layouts = [str(x) for x in engine.world.layouts if x.fsdp]
        if not paths:
            raise LayoutError(f"layouts {fsdp_layouts} shard the working copy per unit, but "
                              f"{type(module).__name__} has no units: give a submodule fsdp_units() "
                              f"(module names in call order) or hold its blocks in an nn.ModuleList")
        canonical = {id(p): n for n, p in module.named_parameters()}
        self.units: list[_Unit] = []
        taken: dict[str, str] = {}
        for path in paths:
            try:
                sub = module.get_submodule(path)
            except AttributeError as err:
                raise LayoutError(f"fsdp unit {path!r} is not a submodule of {type(module).__name__}") from err
            names, slots = [], {}
            for owner_path, owner in sub.named_modules(prefix=path):
                for leaf, p in owner._parameters.items():
                    if p is None:
                        continue
                    name = canonical.get(id(p))
                    if name != f"{owner_path}.{leaf}" or name in taken or name not in engine.shardings:
                        raise LayoutError(f"fsdp unit {path!r}: parameter {owner_path}.{leaf} is shared "
                                          f"(also {name!r}) or not one the engine holds; a shared parameter "
                                          f"cannot be sharded per unit")
                    taken[name] = path
                    names.append(name)
                    slots[name] = (owner, leaf)
            unit = _Unit(self, path, sub, names, slots)
            sub.register_forward_pre_hook(unit.pre_forward)
            sub.register_forward_hook(unit.post_forward, always_call=True)
            self.units.append(unit)
        self.next_unit = dict(zip(self.units, self.units[1:]))  # declaration order: call order
        self.prefetching, self.prefetches = False, 0
        # backward: the unit that saved a weight before each saver in this forward (the next to
        # re-gather), the last saver so far, the one re-gather in flight (unit, layout, gathers)
        self.previous_saver: dict[_Unit, _Unit | None] = {}
        self.last_saver: _Unit | None = None
        self.regather: tuple[_Unit, Layout, dict[tuple[int, int], FusedGather]] | None = None
        self.backward_prefetches = 0
        self.bytes = {"forward": 0, "backward": 0, "reduce_scatter": 0}
        self.collectives = {"forward": 0, "backward": 0, "reduce_scatter": 0}
        engine.set_fsdp_units(set(taken))

    def count(self, phase: str, nbytes: int) -> None:
        self.bytes[phase] += nbytes
        self.collectives[phase] += 1

    @contextlib.contextmanager
    def forward_prefetch(self) -> Iterator[None]:
        """Within the block (a micro-batch's forward, never backward or its recomputation), each
        unit's forward starts the next unit's gather; what no unit used is finished and dropped.
        The units that save weights in it are noted for the backward's prefetches."""
        self.end_backward()  # a new forward: the previous backward's chain is over
        self.prefetching = True
        try:
            yield
        finally:
            self.prefetching = False
            for unit in self.units:
                unit.drop_prefetch()

    # -------------------------------------------------------------- backward prefetch
    def note_saver(self, unit: _Unit) -> None:
        """``unit``'s forward packed its first weight: in backward it re-gathers right after the
        unit noted now (reverse call order), and before the one noted last."""
        if self.prefetching:
            self.previous_saver[unit] = self.last_saver
            self.last_saver = unit

    def take_backward_prefetch(self, unit: _Unit) -> dict[tuple[int, int], FusedGather] | None:
        """``unit``'s re-gather if the previous re-gather started it (in this layout), else None."""
        if self.regather is None or self.regather[0] is not unit:
            return None
        _, layout, started = self.regather
        self.regather = None
        if layout != self.engine.active:  # cannot happen inside one backward; never a stale copy
            _discard(started)
            return None
        return started

    def prefetch_backward(self, after: _Unit) -> None:
        """``after`` just re-gathered: start the re-gather of the unit that saved a weight before it
        in this forward (the next to re-gather), asynchronously; at most one is in flight."""
        target = self.previous_saver.pop(after, None)
        if target is None or target.cache is not None:
            return
        names = target.gathered_names()
        if not names:
            return
        self.drop_backward_prefetch()  # one not consumed (unexpected order): finished, dropped
        started = target._start(names, [self.engine.working[n] for n in names], "backward", async_op=True)
        self.regather = (target, self.engine.active, started)
        self.backward_prefetches += 1

    def drop_backward_prefetch(self) -> None:
        if self.regather is not None:
            _discard(self.regather[2])
            self.regather = None

    def land_reduce_scatter(self) -> None:
        """Waits for the reduce-scatters in flight and adds their shards to the main grads."""
        reducing, self.reducing = self.reducing, []
        for names, pending in reducing:
            for name, g in zip(names, pending.result()):
                self.engine.add_main_grad(name, g)

    def end_backward(self) -> None:
        """After a micro-batch's backward (the step runner calls it, idle rounds too): the last unit's
        reduce-scatters land and a re-gather no unit consumed is finished and dropped, so no async
        work outlives the backward."""
        self.land_reduce_scatter()
        self.drop_backward_prefetch()
        self.previous_saver, self.last_saver = {}, None

    def idle_forward(self) -> None:
        """The gathers of one forward without computing (an idle evaluation round)."""
        with torch.no_grad():
            for unit in self.units:
                names = unit.gathered_names()
                if names:
                    unit.gather(names, [self.engine.working[n] for n in names], "forward")
