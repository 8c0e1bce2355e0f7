"""Lower bounds of a step over a set of layouts, from per-document rates: what no plan beats.

``rates[layout, doc]`` are world-seconds (a document's seconds over the layout's dp groups, best
checkpointing: :func:`~..candidates.layout_rates`). The step ``T`` must let every document finish
alone on one dp group of its layout, and the documents' balanced work fit in ``T``
(:func:`oracle_assignment`). :func:`charged_oracle` adds what a real plan pays outside compute:
one gradient reduction per tp degree and working copy used (a run of such stages reduces once), and optionally
the cheapest switch order between those degrees. The long grid's oracles (``tools/oracles.py``)
and the candidate choice (:mod:`..candidates`, which seeds candidate sets with the layouts this
bound uses) share it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...layout import Layout
from ..cost.cost_model import AnalyticCostModel
from ..cost.terms import gradient_kind

#: the exact bound's limit: subsets of gradient kinds are enumerated (2^k compute bisections, 2^k x k switch
#: orders); beyond it a caller must pass fewer layouts (the candidates' seeding leaves pp layouts out)
MAX_GRADIENT_KINDS = 16

__all__ = ["MAX_GRADIENT_KINDS", "charged_oracle", "charged_oracles", "exclusive_seconds", "oracle_assignment",
           "oracle_from_rates"]


def oracle_assignment(rates: np.ndarray, dp: np.ndarray, fixed: float = 0.0) -> tuple[float, np.ndarray]:
    """(``T``, per document the row it goes to): the smallest ``T`` such that each document goes to
    its least world-seconds row among those where it alone takes at most ``T`` on one dp group, and
    that work plus ``fixed`` seconds sums to at most ``T``. ``T`` is inf (rows -1) when some
    document fits no row."""
    if rates.shape[0] == 0:
        return math.inf, np.full(rates.shape[1], -1)
    alone = rates * dp[:, None]  # a document's seconds on one dp group

    def pick(limit: float) -> tuple[np.ndarray, float]:
        masked = np.where(alone <= limit, rates, np.inf)
        rows = masked.argmin(axis=0)
        return rows, float(masked[rows, np.arange(rows.size)].sum()) + fixed

    lo = float(np.min(alone, axis=0).max())
    if not math.isfinite(lo):
        return math.inf, np.full(rates.shape[1], -1)
    rows, work = pick(lo)
    if work <= lo:
        return lo, rows
    hi = max(lo, pick(math.inf)[1], work)
    for _ in range(60):  # work(T) falls as T grows: bisect for the smallest T with work(T) <= T
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if pick(mid)[1] <= mid else (mid, hi)
    return hi, pick(hi)[0]


def exclusive_seconds(rates: np.ndarray, dp: np.ndarray, fixed: float = 0.0) -> float:
    """:func:`oracle_assignment`'s ``T`` tightened by what a world-wide group excludes: a document
    on a layout of one dp group (``dp == 1``: its group is the whole world) runs while nothing else
    does, so those documents' seconds add up, and every other document must finish within what is
    left (``T`` minus them) on a narrower group or join them. For a step ``T``: the documents that
    no narrower group finishes within ``T`` must run world-wide; their seconds shrink what is left,
    which may force more (repeated until none joins); then ``T`` must hold those seconds plus each
    other document's least share (its world-wide seconds, or its world-seconds on a narrower group
    that finishes it within what is left) plus ``fixed``. Every plan of stages and blocks has its
    world-wide documents in stages of their own, so no plan beats it (a 491K document that only
    the world finishes in time and a 320K one that takes 5.4 s there or 10.5 s on half the world:
    the oracle lets the 320K one overlap the first, a plan cannot). Without a one-group layout it
    is :func:`oracle_assignment`'s ``T``; inf when a document fits no layout."""
    return _tightened(rates, dp, oracle_assignment(rates, dp, fixed)[0], fixed)


def _tightened(rates: np.ndarray, dp: np.ndarray, base: float, fixed: float = 0.0) -> float:
    """:func:`exclusive_seconds` from ``base``, :func:`oracle_assignment`'s ``T`` of the same
    arguments (a caller that has it already does not bisect it again)."""
    wide = dp == 1
    if not math.isfinite(base) or not wide.any() or wide.all():
        return base
    alone = rates * dp[:, None]
    exclusive = rates[wide].min(axis=0)  # a document's seconds on a world-wide group (inf: none holds it)
    narrow_alone, narrow = alone[~wide], rates[~wide]

    def fits(limit: float) -> bool:
        forced = ~(narrow_alone <= limit).any(axis=0)
        while True:
            if not np.isfinite(exclusive[forced]).all():
                return False
            left = limit - float(exclusive[forced].sum())
            if left < 0:
                return False
            more = ~(narrow_alone <= left).any(axis=0)
            if not (more & ~forced).any():
                break
            forced |= more
        share = np.minimum(exclusive, np.where(narrow_alone <= left, narrow, np.inf).min(axis=0))
        return float(exclusive[forced].sum()) + float(share[~forced].sum()) + fixed <= limit

    lo, hi = base, base
    while not fits(hi):
        lo, hi = hi, hi * 1.5
        if hi > base * 1e6:
            return math.inf
    if hi == base:
        return base
    for _ in range(60):  # the forced set only shrinks and every share only falls as T grows: bisect
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def oracle_from_rates(rates: np.ndarray, dp: np.ndarray, fixed: float) -> float:
    """The ``T`` of :func:`oracle_assignment` with ``fixed`` seconds added to the work (the long
    grid's loosest oracle: the reduction may hide in the longest document's idle groups)."""
    return oracle_assignment(rates, dp, fixed)[0]


def charged_oracle(cm: AnalyticCostModel, rates: np.ndarray, layouts: Sequence[Layout], *,
                   switches: bool) -> tuple[float, np.ndarray]:
    """(seconds, per document the index into ``layouts`` it goes to) of the best subset of gradient
    kinds (tp degree and working copy: the runs of stages that share one reduction,
    ``shares_gradients``): compute as :func:`oracle_assignment` over those kinds' layouts, then one
    gradient reduction per kind and, with ``switches``, the cheapest switch order visiting the kinds
    (switch bytes depend on the tp degree and the working copy only: one layout per kind stands in)."""
    return charged_oracles(cm, rates, layouts)[switches]


def _switch_orders(cm: AnalyticCostModel, reps: Sequence[Layout]) -> list[float]:
    """Per bitmask of ``reps``, the cheapest switch sequence from home visiting exactly those
    (Held-Karp over subsets: exact, 2^k k^2 steps where trying every order of every subset took
    sum k! ~ 10^9 for the 12 gradient kinds HSDP copies bring)."""
    k = len(reps)
    pair = [[cm.switch_seconds(a, b) for b in reps] for a in reps]
    path = [[math.inf] * k for _ in range(1 << k)]  # [mask][last]: cheapest order ending at last
    for j in range(k):
        path[1 << j][j] = cm.switch_seconds(None, reps[j])
    for mask in range(1, 1 << k):
        row = path[mask]
        for last in range(k):
            here = row[last]
            if here == math.inf:
                continue
            for nxt in range(k):
                if not mask >> nxt & 1:
                    ext = path[mask | 1 << nxt]
                    cost = here + pair[last][nxt]
                    if cost < ext[nxt]:
                        ext[nxt] = cost
    return [min(row) if mask else 0.0 for mask, row in enumerate(path)]


def charged_oracles(cm: AnalyticCostModel, rates: np.ndarray, layouts: Sequence[Layout],
                    exclusive: bool = False) -> dict[bool, tuple[float, np.ndarray]]:
    """:func:`charged_oracle` without and with switches (keys False, True): each subset's compute
    (the bisection, the costly part) is the same for both, so it runs once. A subset whose
    reductions (and switches) plus the compute with EVERY kind available (no subset computes
    less) cannot beat the best found so far is skipped unpriced: the result is exact.
    ``exclusive``: each subset's compute is :func:`exclusive_seconds` (world-wide groups run
    alone); the rows are then the looser :func:`oracle_assignment`'s."""
    layouts = list(layouts)
    dp = np.array([lay.dp for lay in layouts], dtype=np.float64)
    by_kind: dict[tuple[int, int, int], list[int]] = {}
    for i, lay in enumerate(layouts):
        by_kind.setdefault(gradient_kind(lay), []).append(i)
    kinds = sorted(by_kind)
    if len(kinds) > MAX_GRADIENT_KINDS:
        raise ValueError(f"charged_oracles: {len(kinds)} gradient kinds (tp, pp, fsdp shard) {kinds}; the exact bound "
                         f"enumerates every subset (2^k) and handles at most {MAX_GRADIENT_KINDS}: pass fewer layouts")
    reduction = [cm.reductions_seconds([layouts[i] for i in by_kind[k]]) for k in kinds]
    switching = _switch_orders(cm, [layouts[by_kind[k][0]] for k in kinds])
    floor = oracle_assignment(rates, dp)[0] if kinds else math.inf
    best = {flag: (math.inf, np.full(rates.shape[1], -1)) for flag in (False, True)}
    masks = sorted(range(1, 1 << len(kinds)), key=lambda m: (bin(m).count("1"), m))  # small subsets first
    for mask in masks:
        members = [j for j in range(len(kinds)) if mask >> j & 1]
        reductions = sum(reduction[j] for j in members)
        fixed = {False: reductions, True: reductions + switching[mask]}
        if all(floor + fixed[flag] >= best[flag][0] for flag in fixed):
            continue
        idx = [i for j in members for i in by_kind[kinds[j]]]
        compute, rows = oracle_assignment(rates[idx], dp[idx])
        if exclusive:
            compute = _tightened(rates[idx], dp[idx], compute)
        for flag in (False, True):
            if compute + fixed[flag] < best[flag][0]:  # reductions and switches run outside compute (the
                best[flag] = (compute + fixed[flag], np.asarray(idx)[rows])  # cost model overlaps neither)
    return best
