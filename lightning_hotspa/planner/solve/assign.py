"""Heuristic assignment of documents to options for realistic batch sizes (hundreds of documents).

The objective is the one :mod:`.exact` minimizes; the method trades exactness for speed:

1. **Combinations.** Per layout "unused / without / with checkpointing": every combination that can
   hold every document is screened (checkpointing variants that hold nothing more than the plain
   option and price no document lower are skipped: they only add recompute; a larger capacity
   can price lower where micro-batches are dear, as in an fsdp layout's lockstep rounds). With
   ``split_checkpointing`` the best few are screened again with "both" for their checkpointed
   layouts: two stages of one layout, the documents that need checkpointing in one, the others
   without it in the next (no switch between them, same working copy; one gradient reduction, same
   tp), where one checkpointed stage would recompute every document's forward because one long
   document needs it.
2. **Relaxed stage time** ``max(W/dp, M) + F``: ``W`` the stage's total seconds (with at least one
   micro-batch per dp group that gets a document), ``M`` its costliest single document (one dp group
   must run it): a lower bound on the balanced stage. The stages of one replicated tp degree form
   a free run (:mod:`..cost.timeline`): bounded together by ``max(sum of W/dp, largest M)``.
3. **Throughput assignment.** Each document goes to the option with the least world-seconds
   ``cost/dp`` (+ its share of micro-batch overhead): separable, and right whenever stages balance.
4. **Fill.** A stage whose time is set by one long document (``M > W/dp``) leaves dp groups idle;
   short documents move in from balanced stages, best (seconds saved / idle seconds used) first.
5. **Realize** the best few combinations and the best single-layout plan of each layout: pack each
   stage in stage order (cost-balanced LPT over dp groups, from the times a free run's earlier
   stages leave each group free; first fit into micro-batches), evaluate exactly.
6. **Trim rounds.** Each realized plan's sharded stages shed a nearly empty last lockstep round
   where moving its documents to another option prices lower (:func:`_trim_rounds`); the fastest
   plan is kept.

All array work is numpy; ties break by index, so plans are deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...layout import Layout
from ..cost.cost_model import OptionCost
from ..cost.timeline import GroupBlocks, Timeline, stage_group_seconds

__all__ = ["StageGroups", "pack_in_order", "pack_lpt", "solve_heuristic", "stage_order"]

INF = float("inf")
#: Round trimming (:func:`_trim_rounds`): the fill of the rounds a trimmed stage keeps, and passes.
_TRIM_FILL = 0.95
_TRIM_TRIES = 3

StageGroups = tuple[tuple[tuple[int, ...], ...], ...]  # [dp group][micro-batch] -> doc indices


@dataclass
class _Tables:
    padded: np.ndarray  # [options, n]
    cost: np.ndarray  # doc seconds [options, n] (inf where it does not fit)
    rate: np.ndarray  # world-seconds per doc [options, n]
    cap: np.ndarray  # per option
    d: np.ndarray
    dp: np.ndarray
    fixed: np.ndarray


def _tables(lengths: np.ndarray, options: Sequence[OptionCost]) -> _Tables:
    padded = np.vstack([o.padded(lengths) for o in options])
    cost = np.vstack([o.doc_seconds(p) for o, p in zip(options, padded, strict=True)])
    cap = np.array([o.capacity for o in options], dtype=np.float64)
    fits = padded <= cap[:, None]
    cost = np.where(fits, cost, INF)
    d = np.array([o.per_micro_batch for o in options])
    dp = np.array([o.layout.dp for o in options], dtype=np.float64)
    rate = np.where(fits, (cost + d[:, None] * padded / np.maximum(cap, 1)[:, None]) / dp[:, None], INF)
    fixed = np.array([o.stage_fixed for o in options])
    return _Tables(padded, cost, rate, cap, d, dp, fixed)


def _stage_stats(choice: np.ndarray, t: _Tables) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per option: (relaxed stage seconds without F, W, M, document count) of an assignment."""
    k = t.cap.size
    cols = np.arange(choice.size)
    cs = t.cost[choice, cols]
    count = np.bincount(choice, minlength=k)
    w = np.bincount(choice, cs, minlength=k)
    # micro-batches: enough for the tokens, and at least one per dp group LPT gives a document (it
    # spreads the first dp documents over distinct groups; matters when ``d`` is large, e.g. :fsdp)
    tokens = np.bincount(choice, t.padded[choice, cols], minlength=k)
    w += t.d * np.maximum(np.ceil(tokens / t.cap), np.minimum(count, t.dp))
    m = np.zeros(k)
    np.maximum.at(m, choice, cs)
    m = np.where(count > 0, m + t.d, 0.0)
    return np.maximum(w / t.dp, m), w, m, count


def _distinct_layouts(used: Sequence[int], options: Sequence[OptionCost]) -> tuple[tuple[Layout, ...], list[int]]:
    """The layouts of ``used`` options once each, and the options that repeat a layout (the second
    stage of a layout run with and without checkpointing: no switch into it, no own reduction)."""
    layouts: list[Layout] = []
    repeats = []
    for j in used:
        lay = options[j].layout
        if lay in layouts:
            repeats.append(j)
        else:
            layouts.append(lay)
    return tuple(layouts), repeats


def _relaxed(choice: np.ndarray, t: _Tables, options: Sequence[OptionCost],
             switch_cost: Callable[[tuple[Layout, ...]], tuple[float, tuple[Layout, ...]]],
             free: bool = False) -> tuple[float, tuple[int, ...]]:
    """Relaxed step seconds of an assignment. ``free``: the stages of one replicated tp degree form
    one free run (:mod:`..cost.timeline`), bounded by ``max(sum of W/dp, costliest document)`` rather
    than the sum of each stage's bound: its dp groups fill each other's idle time."""
    _, w, m, count = _stage_stats(choice, t)
    used = tuple(int(j) for j in np.flatnonzero(count))
    layouts, repeats = _distinct_layouts(used, options)
    runs: dict[tuple, list[int]] = {}  # stages bounded together; without free runs, each alone
    for j in used:
        par = options[j].layout
        runs.setdefault((par.tp, par.pp) if free and not par.fsdp else ("alone", j), []).append(j)
    compute = sum(max(float((w[js] / t.dp[js]).sum()), float(m[js].max())) for js in runs.values())
    fixed = float(t.fixed[list(used)].sum() - t.fixed[repeats].sum())
    return compute + fixed + switch_cost(layouts)[0], used


def _fill(choice: np.ndarray, combo: Sequence[int], t: _Tables, fraction: float = 0.9) -> np.ndarray:
    """Moves short documents into stages whose dp groups idle behind one long document."""
    choice = choice.copy()
    stage, w, m, count = _stage_stats(choice, t)
    balanced = [p for p in combo if count[p] and w[p] / t.dp[p] >= m[p]]
    for j in sorted(combo, key=lambda j: (-(stage[j] * t.dp[j] - w[j]), j)):
        slack = (stage[j] * t.dp[j] - w[j]) * fraction
        if slack <= 0 or t.dp[j] == 1 or not count[j] or not balanced:
            continue
        cand = np.flatnonzero(np.isin(choice, balanced) & (t.cost[j] + t.d[j] <= stage[j]))
        if cand.size == 0:
            continue
        saved = t.rate[choice[cand], cand]
        used = t.cost[j, cand]
        order = np.lexsort((cand, -(saved / np.maximum(used, 1e-30))))
        take = cand[order][np.cumsum(used[order]) <= slack]
        choice[take] = j
    return choice


def pack_lpt(padded: np.ndarray, balance: np.ndarray, capacity: int, groups: int,
             release: np.ndarray | None = None) -> list[list[list[int]]]:
    """Positions into dp groups by longest-processing-time on ``balance``, then first fit into each
    group's micro-batches (a new one when none has room). ``release``: when each group is free
    (a later stage of a free run, :mod:`..cost.timeline`): LPT with release times."""
    start = np.zeros(groups) if release is None else np.asarray(release, dtype=np.float64)
    heap = [(float(start[g]), g) for g in range(groups)]
    heapq.heapify(heap)
    rooms: list[list[int]] = [[] for _ in range(groups)]
    bins: list[list[list[int]]] = [[] for _ in range(groups)]
    for i in np.lexsort((np.arange(balance.size), -balance)).tolist():
        load, g = heapq.heappop(heap)
        size = int(padded[i])
        room = rooms[g]
        for k, r in enumerate(room):
            if r >= size:
                room[k] = r - size
                bins[g][k].append(i)
                break
        else:
            room.append(capacity - size)
            bins[g].append([i])
        heapq.heappush(heap, (load + float(balance[i]), g))
    return bins


def pack_in_order(stages: Sequence[tuple[OptionCost, np.ndarray]], lengths: np.ndarray,
                  blocks: GroupBlocks | None) -> tuple[float, list[tuple[OptionCost, StageGroups]]]:
    """Packs each stage's documents (option, doc indices) in stage order: cost-balanced LPT over
    its dp groups, first fit into micro-batches; a later stage of a run from the times its groups
    become free (:class:`..cost.timeline.Timeline`). Returns (compute seconds, stages)."""
    out: list[tuple[OptionCost, StageGroups]] = []
    line = Timeline(blocks)
    for opt, idx in stages:
        padded = opt.padded(lengths[idx])
        local = pack_lpt(padded, opt.balance_cost(padded), opt.capacity, opt.layout.dp, line.release_times(opt))
        groups = tuple(tuple(tuple(int(idx[p]) for p in mb) for mb in g) for g in local)
        line.add(opt, stage_group_seconds(opt, groups, opt.doc_seconds(opt.padded(lengths)), in_order=False))
        out.append((opt, groups))
    return line.finish(), out


def _realize(choice: np.ndarray, staged: Sequence[int], options: Sequence[OptionCost],
             lengths: np.ndarray, blocks: GroupBlocks | None) -> tuple[float, list[tuple[OptionCost, StageGroups]]]:
    """Packs every stage of an assignment in stage order; returns (compute seconds, stages)."""
    parts = [(options[j], np.flatnonzero(choice == j)) for j in staged]
    return pack_in_order([(o, idx) for o, idx in parts if idx.size], lengths, blocks)


def _combinations(options: Sequence[OptionCost], t: _Tables) -> list[tuple[int, ...]]:
    by_layout: dict[Layout, list[int]] = {}
    for j, o in enumerate(options):
        by_layout.setdefault(o.layout, []).append(j)
    fits = np.isfinite(t.cost)
    choices: list[list[tuple[int, ...]]] = []
    for js in by_layout.values():
        keep = list(js)
        plain = [j for j in js if not options[j].activation_checkpointing]
        for j in js:  # a checkpointed option that holds nothing more and is nowhere cheaper per
            # document (its micro-batch overhead per token, d / capacity, included: an fsdp round's
            # gathers are paid per micro-batch, so a larger capacity can pay for the recompute)
            if options[j].activation_checkpointing and plain and _dominated(j, plain[0], t):
                keep.remove(j)
        choices.append([()] + [(j,) for j in keep])
    combos = []
    for pick in itertools.product(*choices):
        combo = tuple(j for part in pick for j in part)
        if combo and bool(np.all(fits[list(combo)].any(axis=0))):
            combos.append(combo)
    return combos


def _dominated(j: int, plain: int, t: _Tables) -> bool:
    """True if option ``j`` (checkpointed) holds no document option ``plain`` does not and prices
    none lower in world-seconds (:attr:`_Tables.rate`): using it could only add recompute."""
    fits = np.isfinite(t.cost)
    return not np.any(fits[j] & ~fits[plain]) and not np.any(t.rate[j] < t.rate[plain])


def _split_variants(used: tuple[int, ...], options: Sequence[OptionCost], t: _Tables) -> list[tuple[int, ...]]:
    """``used`` with the plain option of its checkpointed layouts added (each alone, then all):
    their documents that fit without checkpointing get a stage without it."""
    fits = np.isfinite(t.cost)
    plain_of = {}
    for j in used:
        if options[j].activation_checkpointing:
            lay = options[j].layout
            for p, o in enumerate(options):
                if o.layout == lay and not o.activation_checkpointing and p not in used \
                        and (np.any(fits[j] & ~fits[p]) or np.any(t.rate[p] < t.rate[j])):
                    plain_of[j] = p
    adds = [[p] for p in plain_of.values()]
    if len(adds) > 1:
        adds.append(list(plain_of.values()))
    return [tuple(sorted((*used, *add))) for add in adds]


def solve_heuristic(
    lengths: np.ndarray,
    options: Sequence[OptionCost],
    switch_cost: Callable[[tuple[Layout, ...]], tuple[float, tuple[Layout, ...]]],
    fill: int = 8,
    realize: int = 2,
    split_checkpointing: bool = True,
    blocks: GroupBlocks | None = None,
) -> tuple[float, list[tuple[OptionCost, StageGroups]]]:
    """(predicted seconds, stages in order) of a good plan; see the module docstring.

    Every combination is scored with the throughput assignment; the best ``fill`` are re-scored
    after filling idle dp groups; the best ``realize`` (and each layout's best single-layout plan,
    and the best plan without a checkpointing split) are packed.
    ``split_checkpointing``: False allows one option per layout (one stage per layout).
    ``blocks``: the world mesh's dp groups (:class:`..cost.timeline.GroupBlocks`): the stages of a run
    of one replicated tp degree run free and are scored and packed so; None: every stage in step.
    """
    t = _tables(lengths, options)
    first: list[tuple[float, int, tuple[int, ...], np.ndarray]] = []
    def screen(combo: tuple[int, ...]) -> None:
        choice = np.asarray(combo)[np.argmin(t.rate[list(combo)], axis=0)]
        score, used = _relaxed(choice, t, options, switch_cost, blocks is not None)
        first.append((score, len(first), used, choice))

    for combo in _combinations(options, t):
        screen(combo)
    if not first:
        raise ValueError("no combination of options holds every document")
    first.sort(key=lambda s: (s[0], s[1]))
    if split_checkpointing:  # the best few, each checkpointed layout also with a plain stage
        seen = {s[2] for s in first}
        for variant in [v for s in first[:fill] for v in _split_variants(s[2], options, t)]:
            if variant not in seen:
                seen.add(variant)
                screen(variant)
        first.sort(key=lambda s: (s[0], s[1]))
    scored = list(first)
    for _, _, used, choice in first[:fill]:
        filled = _fill(choice, used, t)
        score, used2 = _relaxed(filled, t, options, switch_cost, blocks is not None)
        scored.append((score, len(scored), used2, filled))
    scored.sort(key=lambda s: (s[0], s[1]))
    picks = scored[:realize]
    singles: dict[Layout, tuple] = {}  # the best single-layout plan of each layout: the relaxed
    for s in scored:  # score misses lockstep rounds (:fsdp) and packing, so realize one per layout
        layouts = _distinct_layouts(s[2], options)[0]
        if len(layouts) == 1:
            singles.setdefault(layouts[0], s)
    whole = next((s for s in scored if not _distinct_layouts(s[2], options)[1]), None)  # no split
    for extra in [*singles.values(), whole]:  # the relaxed score flatters a split (two stages, each
        if extra is not None and all(extra[1] != p[1] for p in picks):  # balanced alone): pack the
            picks.append(extra)  # best plan without one too
    best: tuple[float, list[tuple[OptionCost, StageGroups]]] | None = None
    for *_, ch in picks:
        total, stages = _trim_rounds(ch, t, options, lengths, blocks, switch_cost, split_checkpointing)
        if best is None or total < best[0]:
            best = (total, stages)
    assert best is not None
    return best


def _priced(choice: np.ndarray, t: _Tables, options: Sequence[OptionCost], lengths: np.ndarray,
            blocks: GroupBlocks | None, switch_cost: Callable[[tuple[Layout, ...]], tuple[float, tuple[Layout, ...]]],
            ) -> tuple[float, list[tuple[OptionCost, StageGroups]]]:
    """(step seconds, stages) of an assignment: packed in stage order, switches and reductions added."""
    used = tuple(int(j) for j in np.unique(choice))
    layouts, repeats = _distinct_layouts(used, options)
    seconds, order = switch_cost(layouts)
    compute, stages = _realize(choice, stage_order(used, order, options), options, lengths, blocks)
    return compute + seconds + float(t.fixed[list(used)].sum() - t.fixed[repeats].sum()), stages


def _trim_rounds(choice: np.ndarray, t: _Tables,
                 options: Sequence[OptionCost], lengths: np.ndarray, blocks: GroupBlocks | None,
                 switch_cost: Callable[[tuple[Layout, ...]], tuple[float, tuple[Layout, ...]]],
                 split_checkpointing: bool) -> tuple[float, list[tuple[OptionCost, StageGroups]]]:
    """(step seconds, stages) of an assignment, each sharded stage's last lockstep round shed where
    that pays. A ``:fsdp`` stage runs in rounds of one micro-batch per dp group, and every round
    pays the unit gathers of a whole micro-batch (``per_micro_batch``: about 12 s for 70B across 8
    nodes) however few tokens it holds; the throughput assignment prices micro-batches by the token
    (full ones), so a stage whose tokens need 2.1 rounds of capacity pays 3. Moves the documents
    over ``rounds - 1`` full rounds
    (:data:`_TRIM_FILL` of them, for packing slack) to their next-best option, cheapest extra
    seconds per token first, and keeps the plan when its exact price is lower. Without
    ``split_checkpointing`` a layout keeps one option (stage)."""
    total, stages = _priced(choice, t, options, lengths, blocks, switch_cost)
    for _ in range(_TRIM_TRIES):
        trial = None
        for opt, groups in stages:
            rounds = max((len(g) for g in groups), default=0)
            # a sharded copy without lockstep rounds (HSDP inside cp) still pays a gather round per
            # micro-batch in its busiest group: it is trimmed too
            if not opt.layout.fsdp or rounds < 2:
                continue
            j = next(k for k, o in enumerate(options) if o is opt)
            ids = np.flatnonzero(choice == j)
            need = float(t.padded[j, ids].sum()) - _TRIM_FILL * (rounds - 1) * opt.layout.dp * opt.capacity
            if need <= 0:
                continue
            others = _alternatives(j, choice, ids, t, options, split_checkpointing)
            if others.size == 0:
                continue
            alt = others[np.argmin(t.rate[np.ix_(others, ids)], axis=0)]
            movable = np.isfinite(t.rate[alt, ids])
            if t.padded[j, ids[movable]].sum() < need:
                continue
            extra = (t.rate[alt, ids] - t.rate[j, ids]) / t.padded[j, ids]
            order = np.lexsort((ids, np.where(movable, extra, INF)))
            take = order[: int(np.searchsorted(np.cumsum(t.padded[j, ids[order]]), need)) + 1]
            moved = choice.copy()
            moved[ids[take]] = alt[take]
            seconds, packed = _priced(moved, t, options, lengths, blocks, switch_cost)
            if seconds < total and (trial is None or seconds < trial[0]):
                trial = (seconds, packed, moved)
        if trial is None:
            break
        total, stages, choice = trial
    return total, stages


def _alternatives(j: int, choice: np.ndarray, ids: np.ndarray, t: _Tables, options: Sequence[OptionCost],
                  split_checkpointing: bool) -> np.ndarray:
    """The options documents of option ``j`` may move to. Without ``split_checkpointing`` a layout
    runs one option: its option in use, or for an unused layout the one that holds most of ``ids``
    at the least world-seconds."""
    others = [k for k in range(len(options)) if k != j]
    if split_checkpointing:
        return np.asarray(others, dtype=np.int64)
    taken = {options[k].layout: k for k in np.unique(choice).tolist()}
    free: dict[Layout, list[int]] = {}
    keep = []
    for k in others:
        lay = options[k].layout
        if lay not in taken:
            free.setdefault(lay, []).append(k)
        elif taken[lay] == k:
            keep.append(k)
    for ks in free.values():
        rates = t.rate[np.ix_(ks, ids)]
        fits = np.isfinite(rates)
        held, secs = fits.sum(axis=1), np.where(fits, rates, 0.0).sum(axis=1)
        keep.append(ks[min(range(len(ks)), key=lambda r: (-held[r], secs[r], ks[r]))])
    return np.asarray(sorted(keep), dtype=np.int64)


def stage_order(used: Sequence[int], order: Sequence[Layout], options: Sequence[OptionCost]) -> list[int]:
    """``used`` options in stage order: by layout as ``order`` says; a layout's two stages (with and
    without checkpointing) back to back, the checkpointed one first (it holds the long documents,
    around which a free run's later stages pack, :mod:`..cost.timeline`)."""
    by_layout: dict[Layout, list[int]] = {}
    for j in sorted(used, key=lambda j: (not options[j].activation_checkpointing, j)):
        by_layout.setdefault(options[j].layout, []).append(j)
    return [j for lay in order for j in by_layout.get(lay, [])]
