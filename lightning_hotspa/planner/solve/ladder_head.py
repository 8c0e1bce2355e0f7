"""How many of the longest documents run before a ladder, in ordinary stages over the world (issue 38).

:class:`LadderHeads` is the head-sizing half of :class:`~.ladder.LadderPlanner` (which inherits it):
:meth:`~LadderHeads.head_size` weighs heads of up to ``HEAD_MOST`` documents, :meth:`~LadderHeads.round_size`
one round of the world's widest groups (benchmarks/2026-12-06-ladder-4.md). It reads the planner's
``entries`` (block options), ``computes``, ``cm`` (the cost model) and ``_units`` (ranks per dp group).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from .ladder_tuning import HEAD_MOST, ROUND_HEAD_LEAST_WORK, ROUND_HEAD_SHARE

__all__ = ["LadderHeads"]


class LadderHeads:
    """The ladder planner's head sizes (a mixin of :class:`~.ladder.LadderPlanner`)."""

    def tables(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[option, doc] balance cost and whether the option holds the document (``tables`` of
        :meth:`head_size` and :meth:`round_size`, computed once for both)."""
        return self._tables(np.asarray(lengths, dtype=np.int64))

    def head_size(self, lengths: np.ndarray, most: int = HEAD_MOST,
                  tables: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """How many of the longest documents (longest first, index ties) to run before the ladder in
        ordinary stages over the world: the ``k <= most`` that minimizes the estimate "the head's
        seconds (:meth:`_head_seconds`) + max(the rest's largest least time alone on a smaller
        block, the rest's least rank-seconds / world)" (a ladder of two or more blocks has no block
        of the world's size); 0: no head."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if not self.entries or lengths.size < 2:
            return 0
        costs, fits = self.tables(lengths) if tables is None else tables
        big = np.where(fits, costs, np.inf)
        world = self.cm.world_size
        sizes = np.array([e.size for e in self.entries])
        order = np.lexsort((np.arange(lengths.size), -lengths))
        none = np.full(lengths.size, np.inf)
        part = big[sizes < world].min(axis=0)[order] if (sizes < world).any() else none
        work = self._least_work(big)[order]
        k = np.arange(min(most, lengths.size - 1) + 1)
        head = self._head_seconds(big[:, order], sizes == world, k.size - 1)
        rest_floor = np.maximum.accumulate(part[::-1])[::-1][k]
        rest_work = np.cumsum(work[::-1])[::-1][k]
        est = head + np.maximum(rest_floor, rest_work)
        if not np.isfinite(est).any():
            return 0
        return int(k[np.flatnonzero(est <= float(est.min()) * (1 + 1e-9))[0]])  # ties (rounding): the smaller head

    def round_size(self, lengths: np.ndarray, tables: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """A head of one round of the world's widest groups: on the world-sized entry where the
        longest document runs fastest alone, how many of the longest documents (at most its dp
        groups and ``HEAD_MOST``) each take at least half the longest's time there, so that they
        run side by side in about that time (4 documents of 512K on ``dp4xtp2xcp128``: the ladder
        has no block of the world's size, and 3 groups of 256 ranks would take two rounds); 0:
        none, one document (``head_size`` weighs a head of one), or a longest document under a
        quarter of the step's least work (short documents gain nothing from a head)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        whole = [k for k, e in enumerate(self.entries) if e.size == self.cm.world_size]
        if not whole or lengths.size < 2:
            return 0
        costs, fits = self.tables(lengths) if tables is None else tables
        order = np.lexsort((np.arange(lengths.size), -lengths))[:HEAD_MOST]
        big = np.where(fits[whole][:, order], costs[whole][:, order], np.inf)
        r = int(np.argmin(big[:, 0]))
        first = float(big[r, 0])
        work = float(self._least_work(np.where(fits, costs, np.inf)).sum())
        if not math.isfinite(first) or first < ROUND_HEAD_LEAST_WORK * work:
            return 0
        comp = self.computes[self.entries[whole[r]].compute]
        groups = self.cm.world_size // (comp.tp * comp.cp)
        k = int(np.argmin(np.append(big[r] >= ROUND_HEAD_SHARE * first, False)))  # the first that takes less than half
        k = min(k, groups)
        return k if k >= 2 else 0

    def _least_work(self, big: np.ndarray) -> np.ndarray:
        """Per document, its least rank-seconds over the entries (``big``: [entry, doc] seconds alone
        on one dp group, inf where it does not fit) over the world's ranks."""
        return (big * self._units[:, None]).min(axis=0) / self.cm.world_size

    def _head_seconds(self, big: np.ndarray, whole: np.ndarray, most: int) -> np.ndarray:
        """Per ``k = 0 .. most``, an estimate of the seconds of a head of the ``k`` first documents
        (``big``'s columns, longest first) in world-wide stages: the least over the world-sized
        entries of the head run LPT over that entry's dp groups side by side (4 documents of 512K
        on ``dp4xcp256`` take one document's time, not four), and the documents one after another
        on their best world-sized entry each (a head of several stages)."""
        world = self.cm.world_size
        rows = np.flatnonzero(whole)
        out = np.full(most + 1, np.inf)
        out[0] = 0.0
        if rows.size == 0 or most == 0:
            return out
        cols = big[rows, :most]
        out[1:] = np.cumsum(cols.min(axis=0))  # one after another, each on its best entry
        for r, row in zip(rows.tolist(), cols):
            groups = int(world // self._units[r])
            if groups < 2 or not math.isfinite(float(row[0])):
                continue
            loads: list[float] = []  # a heap of the busy groups' loads (the others are idle)
            span = 0.0
            for j, secs in enumerate(row.tolist()):  # longest first: LPT onto the least loaded group
                if not math.isfinite(secs):
                    break
                load = secs + (heapq.heappop(loads) if len(loads) == groups else 0.0)
                heapq.heappush(loads, load)
                span = max(span, load)
                out[j + 1] = min(out[j + 1], span)
        return out

    def _tables(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[entry, doc] balance cost (seconds + micro-batch share) and whether the entry holds it."""
        padded_by_cp: dict[int, np.ndarray] = {}
        costs = np.empty((len(self.entries), lengths.size))
        fits = np.empty((len(self.entries), lengths.size), dtype=bool)
        for k, e in enumerate(self.entries):
            opt = e.option
            cp = opt.layout.cp
            if cp not in padded_by_cp:
                padded_by_cp[cp] = opt.padded(lengths)
            padded = padded_by_cp[cp]
            costs[k] = opt.balance_cost(padded)
            fits[k] = padded <= opt.capacity
        return costs, fits
