"""Exact plans for tiny global batches: dynamic programming over subsets of documents.

Why: with a handful of documents the heuristic's relaxations are at their weakest (one document more
or less in a dp group is a large share of the stage), and exhaustive search is cheap. The objective is
the solver's own (``stage time = slowest dp group``, ``group = sum of document seconds + c per
micro-batch``, plus each stage's gradient reduction and the switches of the chosen stage order), and
every piece is minimized exactly:

* ``bins[S]``: fewest micro-batches holding document set ``S`` (capacity, cp padding),
* ``groups_k[S]``: best max over ``k`` dp groups, ``min_T max(group(T), groups_{k-1}[S - T])``,
* the layouts' document sets: a min-plus convolution over the used layouts, for every set of used
  layouts (its switch cost depends only on that set), activation checkpointing chosen per layout,
  or (``split_checkpointing``) split: a checkpointed and a plain stage of one layout, back to back
  (no switch, one gradient reduction), one more min-plus convolution per layout.

All tables are over the ``2^n`` subsets; the "submask" loops (``3^n`` pairs in all) are flat numpy
arrays reduced per owner with ``minimum.reduceat``. n <= 10 takes milliseconds to tens of ms.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ...layout import Layout
from ..cost.cost_model import OptionCost

__all__ = ["ExactSolution", "solve_exact"]

INF = float("inf")


@dataclass(frozen=True)
class ExactSolution:
    """Per stage (in order): its option and its dp groups' micro-batches (doc indices); a layout
    split by checkpointing has two stages, back to back."""

    objective: float
    stages: tuple[tuple[OptionCost, tuple[tuple[tuple[int, ...], ...], ...]], ...]


@lru_cache(maxsize=4)
def _submasks(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(owner, sub, starts, lowbit) over all pairs T subset-of S, grouped by S ascending."""
    owners, subs, starts = [], [], []
    pos = 0
    for s in range(1 << n):
        starts.append(pos)
        t = s
        block = []
        while True:
            block.append(t)
            if t == 0:
                break
            t = (t - 1) & s
        block.reverse()  # ascending submasks: argmin ties pick the smallest T
        owners.extend([s] * len(block))
        subs.extend(block)
        pos += len(block)
    owner = np.asarray(owners, dtype=np.int64)
    sub = np.asarray(subs, dtype=np.int64)
    low = owner & -owner
    return owner, sub, np.asarray(starts, dtype=np.int64), low


def _subset_sums(values: np.ndarray) -> np.ndarray:
    n = values.size
    out = np.zeros(1 << n, dtype=np.float64)
    for i in range(n):
        out[1 << i:1 << (i + 1)] = out[:1 << i] + values[i]
    return out


class _Option:
    """Exact tables of one option over all document subsets."""

    def __init__(self, option: OptionCost, lengths: np.ndarray, max_groups: int) -> None:
        self.option = option
        n = lengths.size
        owner, sub, starts, low = _submasks(n)
        padded = option.padded(lengths)
        size = _subset_sums(padded.astype(np.float64))
        cost = _subset_sums(option.doc_seconds(padded))
        fits = size <= option.capacity
        # fewest bins: Bellman iteration over "first bin T contains S's lowest document"
        first = ((sub & low) != 0) & fits[sub]
        bins = np.full(1 << n, INF)
        bins[0] = 0.0
        for _ in range(n + 1):
            cand = np.where(first, 1.0 + bins[owner ^ sub], INF)
            new = np.minimum(bins, np.minimum.reduceat(cand, starts))
            new[0] = 0.0
            if np.array_equal(new, bins):
                break
            bins = new
        self.bins, self.fits = bins, fits
        self.group = np.where(np.isfinite(bins), cost + option.per_micro_batch * bins, INF)
        self.group[0] = 0.0
        lead = (sub & low) != 0
        tables = [self.group]
        for _ in range(1, min(max_groups, option.layout.dp)):
            prev = tables[-1]
            cand = np.where(lead, np.maximum(self.group[sub], prev[owner ^ sub]), INF)
            cur = np.minimum.reduceat(cand, starts)
            cur[0] = 0.0
            tables.append(cur)
        self.tables = tables
        self.stage = tables[-1]

    # -- reconstruction -------------------------------------------------------------------------
    def groups_of(self, mask: int) -> list[list[list[int]]]:
        """The dp groups (each a list of micro-batches of doc indices) attaining ``stage[mask]``."""
        groups: list[int] = []
        k = len(self.tables) - 1
        while mask and k > 0:
            target = self.tables[k][mask]
            low = mask & -mask
            chosen = mask
            for t in _ascending_submasks(mask):
                if t & low and max(self.group[t], self.tables[k - 1][mask ^ t]) == target:
                    chosen = t
                    break
            groups.append(chosen)
            mask ^= chosen
            k -= 1
        if mask:
            groups.append(mask)
        return [self.bins_of(g) for g in groups]

    def bins_of(self, mask: int) -> list[list[int]]:
        out = []
        while mask:
            target = self.bins[mask]
            low = mask & -mask
            for t in _ascending_submasks(mask):
                if t & low and self.fits[t] and 1.0 + self.bins[mask ^ t] == target:
                    out.append(_members(t))
                    mask ^= t
                    break
            else:  # pragma: no cover - the table guarantees a witness
                raise AssertionError("no witness for the bin table")
        return out


def _members(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _ascending_submasks(mask: int) -> list[int]:
    out, t = [], mask
    while True:
        out.append(t)
        if t == 0:
            break
        t = (t - 1) & mask
    out.reverse()
    return out


def solve_exact(
    lengths: Sequence[int],
    options: Sequence[OptionCost],
    switch_cost: Callable[[tuple[Layout, ...]], tuple[float, tuple[Layout, ...]]],
    split_checkpointing: bool = True,
) -> ExactSolution:
    """The optimal plan of ``lengths`` over ``options`` (per layout one option, or with
    ``split_checkpointing`` its checkpointed and plain options as two stages).

    ``switch_cost(layouts)`` returns (seconds, stage order) for a set of used layouts: its switches,
    and any stage-order-dependent correction of the per-stage ``stage_fixed`` charged here
    (``CostModelPlanner.stage_order``: the reductions that runs of same-tp stages share).
    """
    arr = np.asarray(lengths, dtype=np.int64)
    n = arr.size
    if n == 0:
        raise ValueError("solve_exact needs at least one document")
    full = (1 << n) - 1
    owner, sub, starts, _ = _submasks(n)
    by_layout: dict[Layout, list[_Option]] = {}
    for opt in options:
        tab = _Option(opt, arr, n)
        by_layout.setdefault(opt.layout, []).append(tab)
    layouts = list(by_layout)
    best_stage: dict[Layout, np.ndarray] = {}
    best_choice: dict[Layout, np.ndarray] = {}
    splits: dict[Layout, list[tuple[_Option, _Option]]] = {}
    for lay, tabs in by_layout.items():
        stack = np.vstack([t.stage + t.option.stage_fixed for t in tabs])
        plain = next((t for t in tabs if not t.option.activation_checkpointing), None)
        # both stages (the plain one and a checkpointed one): one reduction, no switch
        splits[lay] = [(plain, b) for b in tabs if b is not plain] if split_checkpointing and plain else []
        for a, b in splits[lay]:
            pair = np.minimum.reduceat(a.stage[sub] + b.stage[owner ^ sub], starts) + a.option.stage_fixed
            stack = np.vstack([stack, pair])
        best_choice[lay] = np.argmin(stack, axis=0)
        best = stack.min(axis=0)
        best[0] = INF  # a used layout runs at least one document
        best_stage[lay] = best

    best_total, best_parts = INF, None
    for r in range(1, len(layouts) + 1):
        for used in itertools.combinations(layouts, r):
            seconds, order = switch_cost(tuple(used))
            h = best_stage[used[0]]
            for lay in used[1:-1]:
                cand = best_stage[lay][sub] + h[owner ^ sub]
                h = np.minimum.reduceat(cand, starts)
            if len(used) > 1:
                tail = best_stage[used[-1]]
                every = np.arange(1 << n)
                total_vec = tail[every] + h[full ^ every]
                value = float(total_vec.min())
            else:
                value = float(h[full])
            total = value + seconds
            if total < best_total:
                best_total, best_parts = total, (used, order)
    if best_parts is None:
        raise ValueError("no option holds every document")
    used, order = best_parts
    # walk back the convolution: which documents each used layout got
    masks: dict[Layout, int] = {}
    remaining = full
    tables = [best_stage[used[0]]]
    for lay in used[1:-1]:
        cand = best_stage[lay][sub] + tables[-1][owner ^ sub]
        tables.append(np.minimum.reduceat(cand, starts))
    for j in range(len(used) - 1, 0, -1):
        lay, prev = used[j], tables[j - 1]
        target = (tables[j][remaining] if j < len(used) - 1
                  else min(best_stage[lay][t] + prev[remaining ^ t] for t in _ascending_submasks(remaining)))
        for t in _ascending_submasks(remaining):
            if best_stage[lay][t] + prev[remaining ^ t] == target:
                masks[lay] = t
                remaining ^= t
                break
    masks[used[0]] = remaining
    stages = []
    for lay in order:
        tabs, pick = by_layout[lay], int(best_choice[lay][masks[lay]])
        parts = [(tabs[pick], masks[lay])] if pick < len(tabs) else _split(splits[lay][pick - len(tabs)], masks[lay])
        for tab, mask in parts:
            if not mask:
                continue
            groups = tab.groups_of(mask)
            groups += [[] for _ in range(lay.dp - len(groups))]
            stages.append((tab.option, tuple(tuple(tuple(mb) for mb in g) for g in groups)))
    return ExactSolution(best_total, tuple(stages))


def _split(tabs: Sequence[_Option], mask: int) -> list[tuple[_Option, int]]:
    """The documents of ``mask`` for each of a layout's two options (the plain one, then a
    checkpointed one), attaining the split minimum."""
    a, b = tabs
    best, cut = INF, 0
    for t in _ascending_submasks(mask):
        value = a.stage[t] + b.stage[mask ^ t]
        if value < best:
            best, cut = value, t
    return [(a, cut), (b, mask ^ cut)]
