"""Packing one layout's documents into micro-batches and spreading them over its dp groups.

Packing is planning (docs/DESIGN.md §5): every planner (the threshold rule, the cost-model planner)
ends with "these documents run in this layout", and this module turns that into micro-batches:

1. **Capacity with cp padding.** A document in a layout with ``cp > 1`` is padded to a multiple of
   ``2*cp`` when it is cut into chunks (plan.py), so it occupies ``ceil(len / 2cp) * 2cp`` tokens of
   a micro-batch. Capacities are compared against that padded size.
2. **First-fit decreasing** into micro-batches of at most ``capacity`` tokens: few, full micro-batches.
3. **Spread by predicted cost, not tokens.** Attention is quadratic, so 8K tokens in one document cost
   more than 8K tokens in sixteen; a stage lasts as long as its costliest dp group. Two candidates
   are built and refined by moving or swapping single documents between the costliest and the
   cheapest group while capacity allows: (a) the FFD micro-batches dealt to groups
   longest-processing-time first by ``cost_fn`` (fewest micro-batches; if there are fewer than dp
   groups, the costliest is split so no group idles), and (b) documents dealt LPT to groups, each
   first-fit into its group's micro-batches (finest balance, up to one partly filled micro-batch
   more per group). (b) is taken only if it predicts a stage at least 0.5% faster.

Everything is pure numpy/Python and deterministic: ties are broken by index, never by hash order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...checks import check_int
from ...layout import Layout
from ...plan import PlanError

__all__ = [
    "DEFAULT_QUADRATIC_SCALE",
    "DocCost",
    "DocumentTooLongError",
    "PackedLayout",
    "QuadraticCost",
    "StagePlanStats",
    "cp_padded_lengths",
    "first_fit_decreasing",
    "max_doc_length",
    "pack_layout",
    "spread_over_groups",
]

#: Llama-7B-like default. Per token and layer a decoder does ~12*h^2 multiply-adds in its dense
#: matmuls and, for causal attention over a document of length L, ~h*L on average, so a document
#: costs ~ 12*h^2 * (L + L^2 / (12*h)); with h = 4096 the quadratic scale is 12*4096.
DEFAULT_QUADRATIC_SCALE = 12.0 * 4096

DocCost = Callable[[np.ndarray], np.ndarray]
"""Predicted cost of each document from its (padded) length, vectorized: lengths -> float costs."""

# Rounds of the move/swap refinement: each round moves one document between two groups; a bound
# keeps the planner's worst case predictable (it usually stops after a handful).
_MAX_REFINE_ROUNDS = 64
_BALANCE_TOLERANCE = 1e-3  # stop when (max - min) <= tolerance * mean group cost
_PREFER_FEWER = 5e-3  # accept extra micro-batches only for a >= 0.5% faster predicted stage


class DocumentTooLongError(PlanError):
    """A document no micro-batch can hold; the message names its index, length and the capacity."""


@dataclass(frozen=True)
class QuadraticCost:
    """``len + len**2 / quadratic_scale`` per document: linear layers plus causal attention.

    A small frozen class rather than a lambda so plans built in spawned loader workers pickle it.
    """

    quadratic_scale: float = DEFAULT_QUADRATIC_SCALE

    def __post_init__(self) -> None:
        if not self.quadratic_scale > 0:
            raise PlanError(f"QuadraticCost.quadratic_scale must be > 0, got {self.quadratic_scale!r}")

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        n = np.asarray(lengths, dtype=np.float64)
        return n + n * n / self.quadratic_scale


def cp_padded_lengths(lengths: Sequence[int] | np.ndarray, cp: int) -> np.ndarray:
    """Tokens each document occupies in a layout with context-parallel degree ``cp``."""
    n = np.asarray(lengths, dtype=np.int64)
    if cp <= 1:
        return n.copy()
    chunk = 2 * cp
    return -(-n // chunk) * chunk


def max_doc_length(capacity: int, cp: int) -> int:
    """Longest document that still fits in one micro-batch of ``capacity`` tokens once padded."""
    return capacity if cp <= 1 else (capacity // (2 * cp)) * (2 * cp)


def first_fit_decreasing(sizes: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of positions into ``sizes``) of total size <= ``capacity``, first-fit decreasing.

    Items are taken largest first (ties: lower position first); each goes to the first bin with room.
    One vectorized scan per item over the bins' free space keeps it ~linear for realistic batches.
    """
    s = np.asarray(sizes, dtype=np.int64)
    if s.size and (int(s.max()) > capacity or int(s.min()) < 1):
        bad = int(np.argmax(s > capacity)) if int(s.max()) > capacity else int(np.argmin(s))
        raise PlanError(f"item {bad} has size {int(s[bad])}, outside [1, capacity={capacity}]")
    order = np.argsort(-s, kind="stable")
    room = np.empty(s.size, dtype=np.int64)
    bins: list[list[int]] = []
    for i in order.tolist():
        size = s[i]
        nb = len(bins)
        j = nb
        if nb:
            fits = room[:nb] >= size
            k = int(fits.argmax())
            if fits[k]:
                j = k
        if j == nb:
            bins.append([])
            room[j] = capacity
        bins[j].append(i)
        room[j] -= size
    return bins


def spread_over_groups(costs: Sequence[float] | np.ndarray, groups: int) -> list[list[int]]:
    """Longest-processing-time assignment of items (by cost) to ``groups`` groups.

    Costliest item first, each to the currently cheapest group (ties: lowest group index).
    """
    c = np.asarray(costs, dtype=np.float64)
    heap = [(0.0, g) for g in range(groups)]
    out: list[list[int]] = [[] for _ in range(groups)]
    for i in np.argsort(-c, kind="stable").tolist():
        load, g = heapq.heappop(heap)
        out[g].append(i)
        heapq.heappush(heap, (load + float(c[i]), g))
    return out


@dataclass(frozen=True)
class StagePlanStats:
    """What one stage's packing achieved (all token counts over the whole stage, all dp groups)."""

    layout: Layout
    label: str
    documents: int
    tokens: int  # real tokens
    padded_tokens: int  # tokens incl. cp padding
    micro_batches: int
    capacity: int
    group_costs: tuple[float, ...]  # predicted cost per dp group

    @property
    def fill(self) -> float:
        """tokens / (micro-batches x capacity): how much of the activation budget is used."""
        return self.tokens / (self.micro_batches * self.capacity) if self.micro_batches else 1.0

    @property
    def padding_fraction(self) -> float:
        return (self.padded_tokens - self.tokens) / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean predicted cost over dp groups (1.0 = perfectly balanced)."""
        mean = sum(self.group_costs) / len(self.group_costs) if self.group_costs else 0.0
        return max(self.group_costs) / mean if mean > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "layout": self.layout.name,
            "documents": self.documents,
            "tokens": self.tokens,
            "micro_batches": self.micro_batches,
            "fill": self.fill,
            "padding": self.padding_fraction,
            "imbalance": self.imbalance,
        }


@dataclass(frozen=True)
class PackedLayout:
    """``micro_batches[dp_rank][k]``: document ids of one micro-batch (ready for :class:`Stage`)."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    stats: StagePlanStats


def _split_by_cost(members: list[int], cost: np.ndarray) -> tuple[list[int], list[int]]:
    """Two halves of a micro-batch with similar cost (greedy, costliest document first)."""
    a: list[int] = []
    b: list[int] = []
    ca = cb = 0.0
    for m in sorted(members, key=lambda m: (-cost[m], m)):
        if ca <= cb:
            a.append(m)
            ca += float(cost[m])
        else:
            b.append(m)
            cb += float(cost[m])
    return a, b


class _Balancer:
    """Moves or swaps single documents between the costliest and the cheapest dp group."""

    def __init__(
        self, bins: list[list[int]], group_of_bin: list[int], size: np.ndarray, cost: np.ndarray,
        capacity: int, groups: int,
    ) -> None:
        self.bins, self.size, self.cost = bins, size, cost
        self.group_of_bin = np.asarray(group_of_bin, dtype=np.int64)
        self.bin_of = np.empty(size.size, dtype=np.int64)
        for b, members in enumerate(bins):
            self.bin_of[members] = b
        self.room = np.array([capacity - int(size[m].sum()) for m in bins], dtype=np.int64)
        self.load = np.zeros(groups, dtype=np.float64)
        np.add.at(self.load, self.group_of_bin[self.bin_of], cost)

    def run(self) -> None:
        mean = float(self.load.mean())
        for _ in range(_MAX_REFINE_ROUNDS):
            hi, lo = int(self.load.argmax()), int(self.load.argmin())
            gap = float(self.load[hi] - self.load[lo])
            if gap <= _BALANCE_TOLERANCE * mean or not self._improve(hi, lo, gap):
                return

    def _improve(self, hi: int, lo: int, gap: float) -> bool:
        doc_group = self.group_of_bin[self.bin_of]
        a = np.flatnonzero(doc_group == hi)
        lo_bins = np.flatnonzero(self.group_of_bin == lo)
        best = (gap, -1, -1, -1)  # (resulting |gap - 2d|, doc a, doc b or -1, destination bin)
        # moves: a -> first bin of the cheap group with room (a move costlier than the gap would
        # only flip the imbalance)
        if lo_bins.size:
            max_room = int(self.room[lo_bins].max())
            ok = a[(self.size[a] <= max_room) & (self.cost[a] < gap)]
            if ok.size:
                score = np.abs(gap - 2 * self.cost[ok])
                k = int(score.argmin())
                if score[k] < best[0]:
                    doc = int(ok[k])
                    dest = int(lo_bins[int(np.argmax(self.room[lo_bins] >= self.size[doc]))])
                    best = (float(score[k]), doc, -1, dest)
        # swaps: a <-> b with 0 < cost[a] - cost[b] < gap, both bins keeping within capacity
        b = np.flatnonzero(doc_group == lo)
        if b.size:
            d = self.cost[a][:, None] - self.cost[b][None, :]
            grow = self.size[a][:, None] - self.size[b][None, :]  # tokens the cheap bin gains
            feasible = (d > 0) & (grow <= self.room[self.bin_of[b]][None, :]) & (
                -grow <= self.room[self.bin_of[a]][:, None]
            )
            if feasible.any():
                score = np.where(feasible, np.abs(gap - 2 * d), np.inf)
                k = int(score.argmin())
                if score.flat[k] < best[0]:
                    i, j = divmod(k, b.size)
                    best = (float(score.flat[k]), int(a[i]), int(b[j]), -1)
        if best[1] < 0:
            return False
        _, doc_a, doc_b, dest = best
        if doc_b < 0:
            self._move(doc_a, dest)
        else:
            bin_a, bin_b = int(self.bin_of[doc_a]), int(self.bin_of[doc_b])
            self._move(doc_a, bin_b)
            self._move(doc_b, bin_a)
        return True

    def _move(self, doc: int, dest: int) -> None:
        src = int(self.bin_of[doc])
        self.bins[src].remove(doc)
        self.bins[dest].append(doc)
        self.bin_of[doc] = dest
        self.room[src] += self.size[doc]
        self.room[dest] -= self.size[doc]
        self.load[self.group_of_bin[src]] -= self.cost[doc]
        self.load[self.group_of_bin[dest]] += self.cost[doc]


def _bins_first(size: np.ndarray, cost: np.ndarray, capacity: int, groups: int) -> _Balancer:
    """FFD over all documents, then micro-batches to groups by LPT: fewest micro-batches."""
    bins = first_fit_decreasing(size, capacity)
    wanted = min(groups, size.size)
    while len(bins) < wanted:  # give every dp group work: split the costliest splittable bin
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        worst = max(splittable, key=lambda b: (float(cost[bins[b]].sum()), -b))
        bins[worst], extra = _split_by_cost(bins[worst], cost)
        bins.append(extra)
    bin_cost = np.array([float(cost[m].sum()) for m in bins], dtype=np.float64)
    group_of_bin = [0] * len(bins)
    for g, members in enumerate(spread_over_groups(bin_cost, groups)):
        for b in members:
            group_of_bin[b] = g
    return _Balancer(bins, group_of_bin, size, cost, capacity, groups)


def _groups_first(size: np.ndarray, cost: np.ndarray, capacity: int, groups: int) -> _Balancer:
    """LPT over single documents, each first-fit into its group's micro-batches: finest balance,
    at the price of up to one partly filled micro-batch per group."""
    room = np.empty(size.size, dtype=np.int64)
    owner = np.empty(size.size, dtype=np.int64)
    bins: list[list[int]] = []
    heap = [(0.0, g) for g in range(groups)]
    for i in np.argsort(-cost, kind="stable").tolist():
        load, g = heapq.heappop(heap)
        nb = len(bins)
        fits = (room[:nb] >= size[i]) & (owner[:nb] == g)
        k = int(fits.argmax()) if nb else 0
        if not nb or not fits[k]:
            k = nb
            bins.append([])
            room[k], owner[k] = capacity, g
        bins[k].append(i)
        room[k] -= size[i]
        heapq.heappush(heap, (load + float(cost[i]), g))
    return _Balancer(bins, owner[: len(bins)].tolist(), size, cost, capacity, groups)


def _pack_candidates(size: np.ndarray, cost: np.ndarray, capacity: int, groups: int) -> _Balancer:
    """Both packings, each refined; the groups-first one only if it predicts a faster stage.

    Bins-first fills micro-batches best but balances at micro-batch granularity; groups-first
    balances at document granularity. Stage time is the costliest group's, so balance wins unless
    it gains less than ``_PREFER_FEWER`` (then fewer, fuller micro-batches win).
    """
    first = _bins_first(size, cost, capacity, groups)
    if groups == 1 or size.size <= 1:
        return first
    first.run()
    second = _groups_first(size, cost, capacity, groups)
    second.run()
    if float(second.load.max()) < float(first.load.max()) * (1 - _PREFER_FEWER):
        return second
    return first


def pack_layout(
    doc_ids: Sequence[int],
    lengths: Sequence[int] | np.ndarray,
    layout: Layout,
    capacity: int,
    cost_fn: DocCost | None = None,
    label: str = "",
) -> PackedLayout:
    """Micro-batches of ``doc_ids`` (with ``lengths``) for every dp group of ``layout``, each within
    ``capacity`` tokens once padded (cp and sequence parallelism: capacity is rounded down to the
    layout's ``token_granule``).

    Raises :class:`DocumentTooLongError` naming the document if one cannot fit, cp padding included.
    """
    ids = np.asarray(doc_ids, dtype=np.int64)
    raw = np.asarray(lengths, dtype=np.int64)
    if ids.shape != raw.shape or ids.ndim != 1:
        raise PlanError(f"pack_layout: {ids.size} doc ids but {raw.size} lengths")
    check_int(capacity, "pack_layout: capacity", error=PlanError)
    if raw.size and int(raw.min()) < 1:
        i = int(raw.argmin())
        raise PlanError(f"document {int(ids[i])} has length {int(raw[i])}; documents must be non-empty")
    # what a micro-batch may hold so that sequence parallelism's padding (pack_micro_batch) stays within capacity
    capacity -= capacity % layout.token_granule
    size = cp_padded_lengths(raw, layout.cp)
    if size.size and int(size.max()) > capacity:
        i = int(np.argmax(size > capacity))
        padded = f" (padded to {int(size[i])} for cp={layout.cp})" if size[i] != raw[i] else ""
        raise DocumentTooLongError(
            f"document {int(ids[i])} has {int(raw[i])} tokens{padded}, more than the micro-batch "
            f"capacity of layout {layout} ({capacity} tokens)"
        )
    cost = np.asarray((cost_fn or QuadraticCost())(size), dtype=np.float64)
    if cost.shape != size.shape or not np.all(np.isfinite(cost)) or (cost.size and cost.min() < 0):
        raise PlanError(f"cost_fn must map {size.size} lengths to as many finite costs >= 0")

    balancer = _pack_candidates(size, cost, capacity, layout.dp)
    bins = balancer.bins
    groups: list[list[tuple[float, tuple[int, ...]]]] = [[] for _ in range(layout.dp)]
    for b, members in enumerate(bins):
        if members:  # a move may have emptied a micro-batch
            mb = tuple(sorted(int(ids[m]) for m in members))
            groups[int(balancer.group_of_bin[b])].append((-float(cost[members].sum()), mb))
    micro_batches = tuple(tuple(mb for _, mb in sorted(g)) for g in groups)
    stats = StagePlanStats(
        layout=layout,
        label=label,
        documents=int(size.size),
        tokens=int(raw.sum()),
        padded_tokens=int(size.sum()),
        micro_batches=sum(len(g) for g in micro_batches),
        capacity=int(capacity),
        group_costs=tuple(float(x) for x in balancer.load),
    )
    return PackedLayout(micro_batches, stats)
