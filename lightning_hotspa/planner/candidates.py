"""``layouts="auto"``: a small set of candidate layouts for a world size, model and hardware.

1. **Enumerate** every ``dp x tp x cp`` of the world the model can split (heads over tp*cp, kv heads
   over tp, ffn and vocab over tp), with tp inside one node, whose weights and optimizer state leave
   room for activations; each cp > 1 in the kinds the cp-kind registry offers (:func:`cp_kinds`):
   Ulysses, all-gather-KV (``:kv``) and, when tp*cp crosses a node, the hybrid with Ulysses filling
   the node; each with a replicated and a sharded (``:fsdp``) working copy.
2. **Prune dominated** layouts: B dominates A when B holds every document A holds and costs no more
   world-seconds per document at every reference length (the throughput view the solver starts from)
   and no more per step: this is where a degree set keeps its replicated or its sharded working copy
   (or both: the sharded one holds longer documents, the replicated one is cheaper per micro-batch).
3. **Choose 2-4** that can share ONE world mesh (tp and tp*cp sizes nest:
   :meth:`MeshShape.for_layouts`) and hold the context, minimizing a relaxed step time of reference
   documents: each document in its cheapest layout, plus each used layout's gradient reduction and
   the switches; a smaller set wins when within ``tolerance`` of the best.
4. **Refine** (with a sample of real lengths): the most promising sets are re-scored by planning the
   sample batches with the solver itself: the best by relaxed score, the best that contain the best
   static layout, and sets of the layouts the step's lower bound uses (:mod:`.solve.oracle_bound`: it sees
   that a long document in a wide-dp layout idles the other dp groups; the relaxed score does not).

Reference documents: the caller's sample (the CLI and simulator pass a real batch), else one document
per length on a log grid up to the context.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..activation_checkpointing import Checkpointing
from ..checks import check_int
from ..cp_kinds import CP_KINDS
from ..layout import Layout, LayoutError, MeshShape
from ..model_shape import ModelShape
from .cost.cost_model import AnalyticCostModel, CostModelError, OptionCost
from .cost.hardware import HardwareProfile
from .cost.runtime_profile import RuntimeProfile
from .cost.terms import cheapest_per_kind, gradient_kind
from .solve.oracle_bound import charged_oracle
from .solve.solver import CostModelPlanner

__all__ = ["PP_DEGREES", "auto_layouts", "auto_planner", "cp_kinds", "enumerate_layouts", "layout_rates",
           "prune_dominated", "runs"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_kinds(tp: int, cp: int, devices_per_node: int) -> list[int]:
    """The ``cp_kv`` values offered for a tp x cp group: each registered kind's offer
    (:data:`~lightning_hotspa.cp_kinds.CP_KINDS`, ``CpKind.offer``), in registry order: 1 (Ulysses),
    ``cp`` (all-gather-KV) and, when the group crosses a node, the hybrid whose Ulysses part is the
    largest that stays in the node.

    Args:
        tp: the group's tp degree.
        cp: its cp degree.
        devices_per_node: the hardware's devices per node.
    """
    offered = [kind.offer(tp, cp, devices_per_node) for kind in CP_KINDS.values()]
    return [cp_kv for cp_kv in offered if cp_kv is not None]


#: pipeline degrees offered (pp takes the outermost mesh dims; each stage keeps at least a layer)
PP_DEGREES = (2, 4, 8, 16)


def enumerate_layouts(world_size: int, cost_model: AnalyticCostModel, cp_kind: bool = True,
                      fsdp: bool = True, pp: bool = True, runnable_only: bool = True) -> list[Layout]:
    """Every layout of ``world_size`` the model can split and whose weights fit (any checkpointing);
    ``cp_kind=False``: Ulysses context parallelism only (the runtime's only kind before all-gather-KV);
    ``fsdp``: each degree set (dp*cp > 1) also with a sharded working copy (``:fsdp``), and where
    the dp x cp ranks span nodes with one node's worth of them (``devices_per_node / tp``), with
    an HSDP one sharded over that node (``:fsdp<n>``), listed right after their replicated twin
    (which is left out where only a sharded one fits). ``pp``: also each of those degree sets over
    ``pp`` pipeline stages (:data:`PP_DEGREES`), listed after the pp-1 ones; ``runnable_only``: only
    the layouts the runtime runs (:meth:`Layout.check_runnable`, through the mesh check: before the
    runtime runs pp, no pp layout); False (the simulator) prices the pp ones regardless, their mesh
    checked without the pipeline dims."""
    out = []
    per_node = cost_model.hardware.devices_per_node
    for stages in (1, *(p for p in PP_DEGREES if pp and world_size % p == 0)):
        world = world_size // stages  # the ranks of one stage
        for tp in _divisors(world):
            if tp > per_node:
                continue
            for cp in _divisors(world // tp):
                dp = world // (tp * cp)
                for cp_kv in (cp_kinds(tp, cp, per_node) if cp_kind else [1]):
                    for sharded, shard in _working_copies(dp * cp, per_node // tp if fsdp else 0):
                        try:
                            lay = Layout(dp=dp, tp=tp, cp=cp, pp=stages, cp_kv=cp_kv, fsdp=sharded,
                                         fsdp_shard=shard)
                            if stages == 1 or runnable_only:  # its shard group nests with its cp groups
                                MeshShape.for_layouts([lay], world_size)
                            else:  # priced only: the stage's mesh
                                MeshShape.for_layouts([dataclasses.replace(lay, pp=1)], world)
                            cost_model.check(lay)
                        except (CostModelError, LayoutError):
                            continue
                        if cost_model.capacity(lay, True) >= 2 * cp:
                            out.append(lay)
    return out


def runs(layout: Layout) -> bool:
    """Whether the runtime runs ``layout`` (:meth:`Layout.check_runnable`): the gate between what the
    simulator prices and what the training planner offers."""
    try:
        layout.check_runnable()
    except LayoutError:
        return False
    return True


def _working_copies(group: int, node_share: int) -> list[tuple[bool, int]]:
    """(sharded, fsdp_shard) of the working copies a degree set gets: replicated; over all ``group``
    dp x cp ranks; over the ``node_share`` of them inside one node (HSDP) when that is fewer."""
    out = [(False, 0)]
    if node_share and group > 1:
        out.append((True, 0))
        if 1 < node_share < group and group % node_share == 0:
            out.append((True, node_share))
    return out


def _options(cost_model: AnalyticCostModel, lay: Layout) -> list[OptionCost]:
    """``lay``'s options that hold a token: each checkpointing mode it can run (selective: not sharded)."""
    modes = [m for m in Checkpointing if not (lay.fsdp and m is Checkpointing.SELECTIVE)]
    return [o for o in (cost_model.option(lay, m) for m in modes) if o.capacity >= 2 * lay.cp]


def _longest(cost_model: AnalyticCostModel, lay: Layout) -> int:
    """The longest document ``lay`` holds, with or without checkpointing (0: none)."""
    return max((o.max_doc_length for o in _options(cost_model, lay)), default=0)


def layout_rates(cost_model: AnalyticCostModel, layouts: Sequence[Layout], lengths: np.ndarray) -> np.ndarray:
    """[layout, doc] world-seconds of each document in each layout (best checkpointing; inf: does not fit)."""
    out = np.full((len(layouts), lengths.size), np.inf)
    for r, lay in enumerate(layouts):
        for o in _options(cost_model, lay):
            padded = o.padded(lengths)
            rate = (o.doc_seconds(padded) + o.per_micro_batch * padded / o.capacity) / lay.dp
            out[r] = np.minimum(out[r], np.where(padded <= o.capacity, rate, np.inf))
    return out


def prune_dominated(layouts: Sequence[Layout], rates: np.ndarray, fixed: Sequence[float]) -> list[int]:
    """Indices of layouts no other layout dominates: holds every document, costs no more per
    document and no more per step (``fixed``: gradient reduction + materialization); exact ties
    keep the earlier layout."""
    keep = []
    for a in range(len(layouts)):
        dominated = False
        for b in range(len(layouts)):
            if a == b:
                continue
            holds = np.all(np.isfinite(rates[b]) | ~np.isfinite(rates[a]))
            cheaper = np.all(rates[b] <= rates[a] * (1 + 1e-9)) and fixed[b] <= fixed[a] * (1 + 1e-9)
            strictly = np.any(rates[b] < rates[a] * (1 - 1e-9)) or fixed[b] < fixed[a] * (1 - 1e-9) or b < a
            if holds and cheaper and strictly:
                dominated = True
                break
        if not dominated:
            keep.append(a)
    return keep


def auto_layouts(
    world_size: int,
    model: ModelShape | str | Any,
    hardware: HardwareProfile | str,
    context: int,
    *,
    lengths: Sequence[int] | None = None,
    max_layouts: int = 4,
    min_layouts: int = 2,
    tolerance: float = 0.01,
    refine: int = 6,
    static_batches: Sequence[Sequence[int]] | None = None,
    refine_batches: Sequence[Sequence[int]] | None = None,
    static: Layout | str | None = None,
    pp: bool = True,
    runtime: RuntimeProfile | str = "hotspa",
) -> tuple[Layout, ...]:
    """2-4 candidate layouts (fewer only if fewer exist); see the module docstring.

    ``static_batches``: sample global batches on which the best static layout is picked (every set
    considered then contains it, the guard's fallback); default ``[lengths]``. Several batches make
    that pick robust where one batch holds few long documents. ``refine_batches``: the global
    batches the refinement plans one by one (default ``[lengths]``): a set is scored by the sum of
    its plans, so a set that adapts to each batch's long documents wins over one that fits their
    union (one concatenated batch balances better over dp groups than any real step does).
    ``static``: the caller's static reference (``hotspa plan`` and the simulators compare plans with
    the best static layout on the very batches they price): every set
    considered contains it instead of the pick on ``static_batches``, so the guard's fallback is the
    layout the plan is compared with and no plan is predicted slower than it (issue 54); it need not
    hold the context (another layout of the set must). ``pp``: pipeline-parallel layouts among the
    candidates where the runtime runs them (:func:`enumerate_layouts`). ``runtime``: the runtime description the
    candidates are priced on (ours, :data:`~.cost.runtime_profile.HOTSPA`, unless a comparison prices ours with
    options, ``planner/cost/peer_rows.py``'s ``ours_cost_model``)."""
    cm = AnalyticCostModel(model, hardware, world_size, runtime=runtime)
    check_int(context, "context", error=LayoutError)
    layouts = enumerate_layouts(world_size, cm, pp=pp)
    if not layouts:
        raise LayoutError(f"{cm.model.n_layers}-layer model ({cm.params / 1e9:.1f}B parameters) has no layout on "
                          f"{world_size} x {cm.hardware.name}: no split of its heads fits in memory")
    ref = (np.asarray(lengths, dtype=np.int64) if lengths is not None
           else np.unique(np.geomspace(128, context, 48).astype(np.int64)))
    ref = np.minimum(ref, context)
    if ref.max() < context:
        ref = np.append(ref, context)
    ref, counts = np.unique(ref, return_counts=True)  # each length once, weighed by how often it occurs
    rates = layout_rates(cm, layouts, ref)
    fixed = [cm.grad_reduce_seconds(lay) + cm.switch_seconds(None, lay) for lay in layouts]
    keep = prune_dominated(layouts, rates, fixed)
    star = None
    if static is not None:
        given = Layout.parse(static) if isinstance(static, str) else static
        if given not in layouts:
            raise LayoutError(f"static={given}: not a layout of {world_size} x {cm.hardware.name} the model fits")
        star = layouts.index(given)
        if star not in keep:
            keep.append(star)
    elif lengths is not None and refine > 0:  # the best static layout on the sample batches (the
        batches = [np.asarray(b, dtype=np.int64) for b in (static_batches or [lengths])]  # relaxed
        star = _best_static(cm, layouts, batches, context)  # rates above may call it dominated:
        if star is not None and star not in keep:  # they pick checkpointing per document, a real
            keep.append(star)  # stage has one setting)
    holds_context = [i for i in keep if np.isfinite(rates[i, ref == context]).all()]
    if not holds_context:
        longest = max(layouts, key=lambda lay: _longest(cm, lay))
        raise LayoutError(f"no layout of {world_size} x {cm.hardware.name} holds a {context}-token document "
                          f"(largest: {_longest(cm, longest)} tokens in {longest}); lower the context or add devices")
    scored = _relaxed_scores(cm, layouts, rates, counts, keep, set(holds_context), max_layouts)
    if not scored:
        raise LayoutError(f"no set of layouts of {world_size} ranks shares one mesh and holds {context} tokens")
    if lengths is not None and refine > 0:
        refine_on = [np.asarray(b, dtype=np.int64) for b in (refine_batches or [lengths])]
        seeded = _oracle_seeded(cm, layouts, refine_on, star, context, max_layouts, refine)
        scored = _refine(cm, layouts, scored + seeded, refine_on, refine, star, [s[2] for s in seeded])
        if star is not None:  # never worse than static by design: the set holds the best static
            scored = [s for s in scored if star in s[2]] or scored  # layout, the guard's fallback
    if static is not None:  # the caller compares with it: never a set without it
        scored = [s for s in scored if star in s[2]]
        if not scored:
            raise LayoutError(f"static={layouts[star]}: no set of at most {max_layouts} layouts holds it, shares "
                              f"one mesh with it and holds {context} tokens")
    top = min(s for s, _, _ in scored)
    floor = min(min_layouts, len(keep))
    eligible = [s for s in scored if s[1] >= floor and s[0] <= top * (1 + tolerance)]
    if not eligible:
        eligible = [s for s in scored if s[1] >= floor] or scored
        eligible = [min(eligible)]
    best = min(eligible, key=lambda s: (s[1], s[0], s[2]))
    chosen = [layouts[i] for i in best[2]]
    return tuple(sorted(chosen, key=lambda lay: (lay.tp * lay.cp, lay.tp)))


#: elements of the [subsets, size, lengths] slab :func:`_relaxed_scores` prices at once (8 B each)
_RELAXED_CHUNK = 1 << 22


def _relaxed_scores(cm: AnalyticCostModel, layouts: Sequence[Layout], rates: np.ndarray, counts: np.ndarray,
                    keep: Sequence[int], holds_context: set[int],
                    max_layouts: int) -> list[tuple[float, int, tuple[int, ...]]]:
    """(score, size, subset) of every subset of ``keep`` (at most ``max_layouts``) that shares one
    mesh, holds every length and has a layout for the context: each length in its cheapest layout
    of the subset (``counts`` times), plus one reduction per gradient kind used and the cheapest
    switch order through the layouts used. Mesh sharing is checked pairwise (the group sizes of a
    set nest iff those of every pair do) and switches come from a pairwise table: 1024 GPUs have
    ~10^6 subsets, priced as arrays a slab at a time (a Python loop per subset took 22 s of a 64-GPU
    ``auto_layouts``)."""
    pos = {i: n for n, i in enumerate(keep)}
    nest = np.eye(len(keep), dtype=bool)
    for a, b in itertools.combinations(keep, 2):
        try:
            MeshShape.for_layouts([layouts[a], layouts[b]], cm.world_size)
            nest[pos[a], pos[b]] = nest[pos[b], pos[a]] = True
        except LayoutError:
            pass
    from_home = np.zeros(len(layouts))
    switch = np.zeros((len(layouts), len(layouts)))
    for a in keep:
        from_home[a] = cm.switch_seconds(None, layouts[a])
        for b in keep:
            if a != b:
                switch[a, b] = cm.switch_seconds(layouts[a], layouts[b])
    fixed: dict[tuple[int, ...], float] = {}  # the same used set recurs across many subsets
    # cm.reductions_seconds by index (~10^5 used sets at 64 GPUs: no Layout hashed per set)
    kind_reduce = {i: (gradient_kind(layouts[i]), cm.grad_reduce_seconds(layouts[i])) for i in keep}
    scored: list[tuple[float, int, tuple[int, ...]]] = []
    keep_arr, holds = np.asarray(keep, dtype=np.int64), np.array([i in holds_context for i in keep])
    keep_rates = rates[keep_arr]
    for size in range(1, max_layouts + 1):
        combos = np.array(list(itertools.combinations(range(len(keep)), size)), dtype=np.int64).reshape(-1, size)
        ok = holds[combos].any(axis=1)
        for x, y in itertools.combinations(range(size), 2):
            ok &= nest[combos[:, x], combos[:, y]]
        combos = combos[ok]
        chunk = max(1, _RELAXED_CHUNK // (size * max(1, rates.shape[1])))
        for lo in range(0, len(combos), chunk):  # [subsets, size, lengths], a bounded slab at a time
            rows = combos[lo:lo + chunk]
            slab = keep_rates[rows]
            winner = slab.argmin(axis=1)
            best = np.take_along_axis(slab, winner[:, None], axis=1)[:, 0]
            finite = np.isfinite(best).all(axis=1)
            totals = (best * counts).sum(axis=1)[finite].tolist()
            masks = sum((winner == j).any(axis=1) << j for j in range(size))[finite].tolist()
            subsets = list(map(tuple, keep_arr[rows[finite]].tolist()))
            used = [tuple(s for j, s in enumerate(sub) if mask >> j & 1) for sub, mask in zip(subsets, masks)]
            orders = _cheapest_orders({u for u in used if u not in fixed}, from_home, switch)
            for u, order in sorted(orders.items()):
                fixed[u] = cheapest_per_kind(kind_reduce[i] for i in u) + order
            scored.extend((total + fixed[u], size, sub) for sub, u, total in zip(subsets, used, totals))
    return scored


def _cheapest_orders(used: set[tuple[int, ...]], from_home: np.ndarray, switch: np.ndarray) -> dict:
    """Per set of layout indices, the cheapest switch order through it: the switch from the home copy
    into its first layout plus each switch after, the least over its orders (priced as arrays, per set size).

    Args:
        used: sets of layout indices (tuples).
        from_home: [layout] seconds of the switch from the home copy.
        switch: [from layout, to layout] seconds of a switch."""
    out: dict[tuple[int, ...], float] = {}
    for size in sorted({len(u) for u in used}):
        group = sorted(u for u in used if len(u) == size)
        sets = np.array(group, dtype=np.int64).reshape(len(group), size)
        least = np.full(len(group), np.inf)
        for order in itertools.permutations(range(size)):
            path = np.zeros(len(group))
            for x, y in zip(order, order[1:]):
                path = path + switch[sets[:, x], sets[:, y]]
            least = np.minimum(least, from_home[sets[:, order[0]]] + path)
        out.update(zip(group, least.tolist()))
    return out


def _best_static(cm: AnalyticCostModel, layouts: Sequence[Layout], batches: Sequence[np.ndarray],
                 context: int) -> int | None:
    """Index of the layout that is fastest over ``batches`` as the only layout, among those holding a
    ``context``-token document (the static baseline must hold any batch); None if none does.

    Each batch is first priced by a bound of the single-layout plan (cheap, so many batches can be
    used): the larger of the mean dp group's work (perfect fill and balance) and the longest document
    on one dp group, plus the stage's gradient reduction, with the better checkpointing per batch;
    the 8 best by that bound (every degree set comes in two working copies) are then planned for
    real on every batch (a subset misleads: whether a batch holds 0 or 4 context-long documents
    decides which layout wins it)."""
    bounds: list[tuple[float, int]] = []
    for i, lay in enumerate(layouts):
        if _longest(cm, lay) < context:
            continue
        opts = _options(cm, lay)
        total = 0.0
        for lengths in batches:
            step = np.inf
            for o in opts:
                if o.max_doc_length < int(lengths.max()):
                    continue
                padded = o.padded(lengths)
                secs = o.doc_seconds(padded)
                # micro-batches: enough for the tokens, and one per dp group (matters for :fsdp's large d)
                mbs = max(float(padded.sum()) / o.capacity, min(lay.dp, padded.size))
                work = float(secs.sum()) + o.per_micro_batch * mbs
                step = min(step, max(work / lay.dp, float(secs.max()) + o.per_micro_batch) + o.stage_fixed)
            total += step
        if np.isfinite(total):
            bounds.append((total, i))
    if not bounds:
        return None
    from .solve.solver import CostModelPlanner

    # the bound ranks the layouts; the real solver decides among the closest few
    real = []
    for _, i in sorted(bounds)[:8]:  # 8: every degree set comes in two working copies
        planner = CostModelPlanner([layouts[i]], model=cm.model, hardware=cm.hardware, ladder=False,
                                   runtime=cm.runtime)
        real.append((sum(planner.solve(b)[0] for b in batches), i))
    return min(real)[1]


def _refine(cm: AnalyticCostModel, layouts: Sequence[Layout],
            scored: list[tuple[float, int, tuple[int, ...]]], samples: Sequence[np.ndarray], k: int,
            star: int | None, seeded: Sequence[tuple[int, ...]] = ()) -> list[tuple[float, int, tuple[int, ...]]]:
    """Re-scores the most promising sets by planning each of ``samples`` with the real solver.

    The pool: the ``k`` best sets by relaxed score, and the ``k`` best that contain ``star``, the
    best static layout on the sample (a set containing it can always fall back to it, so the
    choice is never predicted slower than the best static layout on this sample).
    """
    def real(subset: tuple[int, ...]) -> float:  # the plans' own quality: no guard (a gain below the
        planner = CostModelPlanner([layouts[i] for i in subset], model=cm.model,  # margin would score as
                                   hardware=cm.hardware, static_margin=0.0, ladder=False,  # the star's static plan)
                                   runtime=cm.runtime)
        return sum(planner.solve(sample)[0] for sample in samples)

    ranked = sorted(scored)
    pool = ranked[:k] + ([s for s in ranked if star in s[2]][:k] if star is not None else [])
    pool += [s for s in scored if s[2] in set(seeded)]
    out, seen = [], set()
    for _, size, subset in pool:
        if subset in seen:
            continue
        seen.add(subset)
        out.append((real(subset), size, subset))
    return out


def _oracle_seeded(cm: AnalyticCostModel, layouts: Sequence[Layout], batches: Sequence[np.ndarray],
                   star: int | None, context: int, max_layouts: int,
                   k: int) -> list[tuple[float, int, tuple[int, ...]]]:
    """Sets built from the layouts the step's lower bound uses (:func:`~.solve.oracle_bound.charged_oracle`
    over ALL layouts, on each sample batch): its ``k`` most used layouts, with ``star``, in every
    combination that shares a mesh and holds the context, scored by the same bound over only the
    set. Why: the relaxed score prices a long document at its world-seconds, so it prefers a wide
    dp layout in which that document leaves all but one dp group idle; the bound does not. pp layouts are
    left out of the seeding (they stay candidates of the relaxed sets): the bound is exact over subsets of
    gradient kinds (tp, pp, fsdp shard), exponential in their count, and pp multiplies them (64 ranks: 19 GB)."""
    keep = [i for i, lay in enumerate(layouts) if lay.pp == 1]
    if len(keep) < len(layouts):
        pick = (star,) if star is not None and layouts[star].pp == 1 else ()
        sub = _oracle_seeded(cm, [layouts[i] for i in keep], batches, keep.index(pick[0]) if pick else None,
                             context, max_layouts, k)
        return [(score, size, tuple(keep[i] for i in subset)) for score, size, subset in sub]
    rates = [layout_rates(cm, layouts, b) for b in batches]
    share = np.zeros(len(layouts))
    for r in rates:
        _, rows = charged_oracle(cm, r, layouts, switches=True)
        if (rows >= 0).all():
            np.add.at(share, rows, r[rows, np.arange(rows.size)])
    top = [int(i) for i in np.argsort(-share, kind="stable") if share[i] > 0][:k]
    pool = sorted(set(top) | ({star} if star is not None else set()))
    holds = {i for i in pool if _longest(cm, layouts[i]) >= context}
    out = []
    for size in range(1, max_layouts + 1):
        for subset in itertools.combinations(pool, size):
            if (star is not None and star not in subset) or not holds & set(subset):
                continue
            try:
                MeshShape.for_layouts([layouts[i] for i in subset], cm.world_size)
            except LayoutError:
                continue
            sub = [layouts[i] for i in subset]
            score = sum(charged_oracle(cm, r[list(subset)], sub, switches=True)[0] for r in rates)
            if np.isfinite(score):
                out.append((score, size, subset))
    return sorted(out)[:k]


def auto_planner(world_size: int, context: int, *, model: ModelShape | str | Any, hardware: HardwareProfile | str,
                 lengths: Sequence[int] | None = None, **planner_kwargs: Any) -> CostModelPlanner:
    """A :class:`CostModelPlanner` over :func:`auto_layouts` (the choice scores sets with the solver,
    so it lives here, above the solver; ``planner_kwargs`` go to the planner)."""
    layouts = auto_layouts(world_size, model, hardware, context, lengths=lengths)
    return CostModelPlanner(layouts, model=model, hardware=hardware, world_size=world_size, **planner_kwargs)
