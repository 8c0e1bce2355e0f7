"""A context-parallel ladder of blocks: one block stage whose blocks run side by side (issue 38).

Why: the headroom of long-context steps sits in the longest document's own time on its group. In a
plan of stages in sequence, the stage holding the 512K document on cp256 idles (or under-fills)
every other dp group of that layout while it runs. A block stage (``plan.Block``, docs/DESIGN.md §4
"Blocks") lets the world split into aligned sub-meshes that each run their own layout, copy and
micro-batch stream at once: the long document's block on wide cp, medium documents on narrower cp
beside it, the short ones on plain dp, all ending together in ONE joint gradient exchange.

Priced as the runtime runs it (:func:`~.ladder_blocks.ladder_seconds`: :mod:`.ladder_blocks`).

How (deterministic, no randomness; :meth:`LadderPlanner.solve`): per compute layout and document
the cheapest option (block size, copy, checkpointing) that holds it gives a rate; for a step time
``T``, every document goes to its cheapest-rate layout in which it alone finishes within ``T``
(longest documents decide ``T``'s floor), each layout, widest first, gets the dp groups its work
needs in ``T`` (in one variant less the idle time the wider layouts' rounded-up groups leave, which
the LPT fills with narrower documents), rounded up to aligned block sizes (a divisor chain of the
world), bisection finds the smallest
``T`` whose blocks tile the world, and the spare ranks go to the busiest layouts. A class's rate is
its best block size's; a further pass re-prices each class at the block sizes that allocation gave
it (a sharded copy on a small block: fewer tokens a micro-batch, more gathers per token), bisects
again and builds that ladder (in the carry's rounding also with its small sharded blocks merged
pairwise into blocks of twice the size where that lowers their documents' estimated rank-seconds,
and a second re-pricing from the re-priced sizes: ``REPRICED`` of :mod:`.ladder_tuning`). Each block takes
its cheapest copy / checkpointing that holds its documents; then documents, longest first, go by
LPT to the dp group (over every block that holds them) that finishes them earliest on its own
clock, and are packed first-fit into micro-batches of their block's capacity. Each allocation is
also built with its lockstep blocks (a sharded block of several dp groups) split into blocks of one
dp group (:meth:`LadderPlanner._split`: no rounds that wait for the slowest group). A few ``T`` are
priced exactly and the cheapest kept. The solver tries the ladder after a head of the longest
documents in ordinary world-wide stages (:meth:`LadderPlanner.head_size`,
:meth:`LadderPlanner.round_size`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...activation_checkpointing import Checkpointing
from ...layout import Layout, LayoutError, MeshShape
from ..cost.cost_model import AnalyticCostModel, CostModelError, OptionCost
from . import ladder_blocks
from .ladder_blocks import LadderBlock, LadderGroups, block_chain, joint_exchange_seconds, working_layout
from .ladder_head import LadderHeads
from .ladder_tuning import BISECT_HALVINGS, BRACKET_GROWTH, BRACKET_MOST, REPRICED, REPRICED_TRIES, ROUNDS, T_TRIES

# the blocks' names stay importable from here (:mod:`.ladder_blocks` holds them)
__all__ = ["LadderBlock", "LadderGroups", "LadderPlanner", "block_chain", "joint_exchange_seconds", "working_layout"]

_MODE_ORDER = tuple(Checkpointing)


@dataclass(frozen=True)
class _Entry:
    compute: int  # index into LadderPlanner.computes
    size: int
    sharded: bool
    option: OptionCost


@dataclass
class _Search:
    """One :meth:`LadderPlanner.solve`: the batch, its [entry, doc] tables, the allocations built so
    far and the cheapest ladder found (``best``: (seconds, ladder), None before the first)."""

    lengths: np.ndarray
    costs: np.ndarray
    fits: np.ndarray
    seen: set[tuple[tuple[int, int], ...]] = field(default_factory=set)
    best: tuple[float, LadderGroups] | None = None


class LadderPlanner(LadderHeads):
    """Ladder plans over blocks of ``computes`` (plain layouts of one world).

    Args:
        cost_model: prices every block option.
        computes: the plain compute layouts blocks may run.
        allowed: working layouts a block may use (a real run: the mesh's layouts); None: any.
        modes: per compute layout, the checkpointing modes it may run.
        capacity: a capacity override per (working layout, mode) (the planner's
            ``tokens_per_rank`` rule); None: the memory model's.
    """

    def __init__(self, cost_model: AnalyticCostModel, computes: Sequence[Layout],
                 allowed: set[Layout] | None, modes: dict[Layout, tuple[Checkpointing, ...]],
                 capacity=None) -> None:
        self.cm = cost_model
        world = cost_model.world_size
        self.computes = tuple(c for c in computes if not c.fsdp and c.pp == 1)
        self.chain = block_chain(world)
        entries: list[_Entry] = []
        for i, comp in enumerate(self.computes):
            unit = comp.tp * comp.cp
            for size in self.chain:
                if size % unit:
                    continue
                for sharded in (False, True):
                    if sharded and size // comp.tp < 2:
                        continue
                    try:
                        work = working_layout(comp, size, sharded)
                        if allowed is not None and work not in allowed:
                            continue
                        if allowed is None:
                            MeshShape.for_layouts([comp, work], world)
                        cost_model.check(work)
                    except (CostModelError, LayoutError):
                        continue
                    for ac in modes.get(comp, (Checkpointing.NONE, Checkpointing.FULL)):
                        if sharded and ac is Checkpointing.SELECTIVE:
                            continue
                        cap = capacity(work, ac) if capacity is not None else None
                        opt = cost_model.option(work, ac, cap)
                        if opt.capacity >= 2 * comp.cp:
                            entries.append(_Entry(i, size, sharded, opt))
        self.entries = tuple(entries)
        self._units = np.array([self.computes[e.compute].tp * self.computes[e.compute].cp for e in entries],
                               dtype=np.float64)  # per entry, the ranks of one dp group
        self.options = {(e.option.layout, e.option.activation_checkpointing): e.option for e in entries}
        # a class: (compute layout, copy, checkpointing); its blocks differ in size only
        self._classes = sorted({(e.compute, e.sharded, _MODE_ORDER.index(e.option.activation_checkpointing))
                                for e in entries})
        index = {c: j for j, c in enumerate(self._classes)}
        self._class_of = [index[(e.compute, e.sharded, _MODE_ORDER.index(e.option.activation_checkpointing))]
                          for e in entries]
        self._by_class = [[k for k in range(len(entries)) if self._class_of[k] == j] for j in range(len(self._classes))]
        self._sizes = [sorted({entries[k].size for k in ks}) for ks in self._by_class]  # block sizes it can run
        self._entry_at = {(self._class_of[k], e.size): k for k, e in enumerate(entries)}  # (class, size) -> entry
        self._mesh = None
        if entries:
            lays = sorted({*self.computes, *(e.option.layout for e in entries)}, key=lambda x: x.name)
            try:
                self._mesh = MeshShape.for_layouts(lays, world)
            except LayoutError:
                self._mesh = None

    def _comp(self, cls: int) -> Layout:
        """The compute layout of class ``cls``."""
        return self.computes[self._classes[cls][0]]

    @property
    def mesh(self) -> MeshShape | None:
        """The mesh every block layout shares (None: the blocks share none: no ladder)."""
        return self._mesh

    def __bool__(self) -> bool:
        return bool(self.entries) and self._mesh is not None and len(self.computes) > 0

    # ------------------------------------------------------------------ per batch
    def solve(self, lengths: np.ndarray) -> tuple[float, LadderGroups] | None:
        """(seconds, ladder) of the cheapest ladder found for ``lengths``; None when no ladder of
        two or more blocks holds every document."""
        if not self:
            return None
        lengths = np.asarray(lengths, dtype=np.int64)
        costs, fits = self._tables(lengths)
        big = np.where(fits, costs, np.inf)
        rates = np.full((len(self._classes), lengths.size), np.inf)
        for i, ks in enumerate(self._by_class):
            rates[i] = big[ks].min(axis=0)
        alone = rates.copy()
        units = np.array([self._width(i) for i in range(len(self._classes))], dtype=np.float64)
        rates = rates * units[:, None]  # rank-seconds
        search = _Search(lengths, costs, fits)
        for round_up, carry in ROUNDS:
            hi = self._bisect(rates, alone, round_up, carry)
            if hi is None:
                continue
            self._try(search, (rates, alone), hi, (round_up, carry), T_TRIES)
            first = self._allocate(rates, alone, hi, round_up, carry)
            if first is None:
                continue
            # the classes re-priced at the block sizes this allocation gives them (a 70B copy sharded
            # over 8 ranks holds 384-3,712 tokens a micro-batch, not the 3,456-26,112 of a world-sized
            # block: 3.3-4x the rank-seconds of a 1K document), a new step time for them and its
            # ladder (as allocated, and with its small sharded blocks merged); in the carry's
            # rounding once more from the re-priced allocation's sizes
            passes = REPRICED.get((round_up, carry), ())
            for n, widens in enumerate(passes):
                re_rates, re_alone = self._repriced(big, units, rates, alone, first[0])
                re_hi = self._bisect(re_rates, re_alone, round_up, carry)
                if re_hi is None:
                    break
                for widen in widens:
                    self._try(search, (re_rates, re_alone), re_hi, (round_up, carry), REPRICED_TRIES,
                              (big, units) if widen else None)
                if n + 1 < len(passes):  # the next pass starts from this pass's allocation
                    first = self._allocate(re_rates, re_alone, re_hi, round_up, carry)
                    if first is None:
                        break
        return search.best

    def _split(self, blocks: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        """``blocks`` with each sharded block of several dp groups (lockstep rounds: each round waits
        for its slowest group's micro-batch) split into blocks of one dp group, where its class runs
        that size (a copy sharded over fewer ranks holds fewer tokens: priced by the build)."""
        out = []
        for i, size in blocks:
            unit = self._width(i)
            if self._classes[i][1] and size > unit and (i, unit) in self._entry_at:
                out += [(i, unit)] * (size // unit)
            else:
                out.append((i, size))
        return self._placed(out)

    def _bisect(self, rates: np.ndarray, alone: np.ndarray, round_up: float, carry: bool) -> float | None:
        """The smallest step time (to the bisection's precision) whose allocation tiles the world;
        None: none up to 10^4 times the lower bound (or a document no class holds)."""
        floor = float(alone.min(axis=0).max())
        if not math.isfinite(floor):
            return None
        lo = max(floor, float(rates.min(axis=0).sum()) / self.cm.world_size)
        hi = lo
        while self._allocate(rates, alone, hi, round_up, carry) is None:
            hi *= BRACKET_GROWTH
            if hi > lo * BRACKET_MOST:
                return None
        for _ in range(BISECT_HALVINGS):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if self._allocate(rates, alone, mid, round_up, carry) is not None else (mid, hi)
        return hi

    def _try(self, search: _Search, prices: tuple[np.ndarray, np.ndarray], hi: float, rounding: tuple[float, bool],
             mults: Sequence[float], widen: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Builds and prices the allocation of each step time ``hi * mult`` not built before
        (``search.seen``), keeping the cheapest in ``search.best``.

        Args:
            search: this solve's batch, tables and ladders so far.
            prices: (rates, alone) per class and document (:meth:`solve`, :meth:`_repriced`).
            hi: the smallest tiling step time (:meth:`_bisect`).
            rounding: (round_up, carry) of ``ROUNDS`` (:meth:`_allocate`).
            mults: step-time multiples to build (``T_TRIES`` or ``REPRICED_TRIES``).
            widen: (``big``, ``units``) of :meth:`_widen`: its small sharded blocks merged; None: as allocated.
        """
        rates, alone = prices
        round_up, carry = rounding
        seen = search.seen
        for mult in mults:
            alloc = self._allocate(rates, alone, hi * mult, round_up, carry)
            if alloc is not None and widen is not None:
                alloc = (self._widen(alloc[0], alloc[1], *widen), alloc[1])
            if alloc is None or alloc[0] in seen:
                continue
            seen.add(alloc[0])
            split = self._split(alloc[0])
            for blocks in (alloc[0], split) if split != alloc[0] else (alloc[0],):
                ladder = self._build(search.lengths, search.costs, search.fits, blocks, alloc[1])
                if ladder is None:
                    continue
                secs = ladder_blocks.ladder_seconds(ladder, search.lengths)
                if search.best is None or secs < search.best[0] - 1e-12:
                    search.best = (secs, ladder)

    def _widen(self, blocks: tuple[tuple[int, int], ...], rows: np.ndarray, big: np.ndarray,
               units: np.ndarray) -> tuple[tuple[int, int], ...]:
        """``blocks`` with pairs of sharded blocks of one size merged into one block of twice the
        size (of either's class) while that lowers the estimated rank-seconds of their documents
        (each block holds its class's documents in proportion to its ranks)."""
        ranks: dict[int, int] = {}
        for i, size in blocks:
            ranks[i] = ranks.get(i, 0) + size
        items = [(i, size, np.where(rows == i, size / ranks[i], 0.0)) for i, size in blocks]

        def est(i: int, size: int, w: np.ndarray) -> float:
            k = self._entry_at.get((i, size))
            if k is None:
                return math.inf
            r = big[k] * units[i]
            on = w > 0
            return float((w[on] * r[on]).sum())

        while True:
            found = None
            for a in range(len(items)):
                ia, sa, wa = items[a]
                if not self._classes[ia][1]:
                    continue
                for b in range(a + 1, len(items)):
                    ib, sb, wb = items[b]
                    if sb != sa or not self._classes[ib][1]:
                        continue
                    before = est(ia, sa, wa) + est(ib, sb, wb)
                    for c in dict.fromkeys((ia, ib)):
                        after = est(c, 2 * sa, wa + wb)
                        if after < before * (1 - 1e-9) and (found is None or before - after > found[0]):
                            found = (before - after, a, b, c)
            if found is None:
                break
            _, a, b, c = found
            merged = (c, 2 * items[a][1], items[a][2] + items[b][2])
            items = [x for j, x in enumerate(items) if j not in (a, b)] + [merged]
        return self._placed([(i, size) for i, size, _ in items])

    def _repriced(self, big: np.ndarray, units: np.ndarray, rates: np.ndarray, alone: np.ndarray,
                  blocks: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
        """(rates, alone) with every class of ``blocks`` priced at the block sizes it was given:
        per document, its rank-seconds on the class's blocks as they run it in parallel (the
        rank-weighted harmonic mean of the sizes' rates) and its least seconds alone on one of
        their dp groups; classes without a block keep their rates (their best size's)."""
        rates, alone = rates.copy(), alone.copy()
        by: dict[int, list[int]] = {}
        for i, size in blocks:
            by.setdefault(i, []).append(size)
        for i, sizes in by.items():
            ks = [self._entry_at[(i, s)] for s in sizes]
            w = np.asarray(sizes, dtype=np.float64)[:, None]
            with np.errstate(divide="ignore"):
                speed = (w / (big[ks] * units[i])).sum(axis=0)  # docs per second over the class's blocks
                rates[i] = np.where(speed > 0, float(w.sum()) / speed, np.inf)
            alone[i] = big[ks].min(axis=0)
        return rates, alone


    def _allocate(self, rates: np.ndarray, alone: np.ndarray, limit: float, round_up: float = 0.5,
                  carry_idle: bool = True) -> tuple[tuple[tuple[int, int], ...], np.ndarray] | None:
        """((compute, size) per block, largest first; per doc its compute) for step time ``limit``;
        None when the blocks it needs exceed the world or fewer than two blocks result. Each layout
        gets its work's share of ranks rounded to whole dp groups (to the nearest: the LPT moves the
        remainder between blocks), at least one group for the layout of the longest documents
        (no other holds them within ``limit``), in aligned chain sizes; spare ranks go to the
        busiest layouts per rank."""
        masked = np.where(alone <= limit, rates, np.inf)
        cols = np.arange(alone.shape[1])
        world = self.cm.world_size
        live = np.ones(len(self._classes), dtype=bool)
        while True:  # classes whose work rounds to no dp group give their documents to the others
            sub = np.where(live[:, None], masked, np.inf)
            rows = sub.argmin(axis=0)
            if not np.isfinite(sub[rows, cols]).all():
                return None
            work = np.bincount(rows, weights=sub[rows, cols], minlength=len(self._classes))
            groups = {}
            # widest classes first; the time their rounded-up groups leave idle within ``limit``
            # (rank-seconds) is carried to the narrower classes, whose documents the LPT may put
            # there: a 175K document alone on a cp64 block no longer forces every narrower class
            # to round up on top of it
            carry, absorbed = 0.0, set()
            for i in sorted(np.flatnonzero(work > 0).tolist(), key=lambda j: (-self._width(j), j)):
                unit = self._width(i)
                need = float(work[i])
                use = min(carry, need) if carry_idle else 0.0
                need, carry = need - use, carry - use
                groups[i] = int(math.floor(need / limit / unit + round_up))
                if groups[i] == 0 and need <= 1e-12 * float(work[i]):
                    absorbed.add(i)  # all of its work fits in the wider blocks' idle time
                carry += max(0.0, groups[i] * unit * limit - need)
            empty = [i for i, g in groups.items() if g == 0 and i not in absorbed]
            if not empty:
                break
            only = np.isfinite(sub).sum(axis=0) == 1  # documents no other live class holds in time
            drop = [i for i in empty if not np.any(only & (rows == i))]
            if not drop:
                for i in empty:
                    groups[i] = 1
                break
            live[drop] = False
        blocks: list[tuple[int, int]] = []
        for i, g in sorted(groups.items()):
            if g == 0:
                continue
            sizes = ladder_blocks.chain_pieces(g * self._width(i), self._sizes[i])
            if sizes is None:
                return None
            blocks += [(i, s) for s in sizes]
        used = sum(s for _, s in blocks)
        if used > world or not blocks:
            return None
        spare = world - used
        ranks = {i: sum(s for j, s in blocks if j == i) for i in {j for j, _ in blocks}}
        while spare > 0:  # spare ranks to the busiest layouts (per rank), largest pieces first
            piece = max(s for s in self.chain if s <= spare)
            fit = [i for i in ranks if piece in self._sizes[i]]
            if fit:
                i = max(fit, key=lambda j: (work[j] / ranks[j], -j))
            else:  # a piece no used class runs: a new block of the cheapest class that does
                other = [j for j in range(len(self._classes)) if piece in self._sizes[j]]
                if not other:
                    return None
                cost = np.where(np.isfinite(masked), masked, 0.0).sum(axis=1)
                i = min(other, key=lambda j: (-np.isfinite(masked[j]).sum(), cost[j], j))
                ranks[i] = 0
            blocks.append((i, piece))
            spare -= piece
            ranks[i] += piece
        if len(blocks) < 2:
            return None
        return self._placed(blocks), rows

    def _placed(self, blocks: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """``blocks`` (class, size) in placement order: largest first (chain sizes placed so tile
        the world aligned), then the widest compute (the longest documents' blocks at the low
        ranks), then the class."""
        return tuple(sorted(blocks, key=lambda b: (-b[1], -self._comp(b[0]).cp, b[0])))

    def _width(self, cls: int) -> int:
        """Ranks of one dp group of class ``cls`` (tp x cp)."""
        comp = self._comp(cls)
        return comp.tp * comp.cp

    def _build(self, lengths: np.ndarray, costs: np.ndarray, fits: np.ndarray,
               blocks: tuple[tuple[int, int], ...], rows: np.ndarray) -> LadderGroups | None:
        """Options per block, LPT of the documents over every block's dp groups, first-fit packing."""
        chosen: list[int] = []
        for i, size in blocks:
            mine = np.flatnonzero(rows == i)
            best = None
            for k in self._by_class[i]:
                e = self.entries[k]
                if e.size != size:
                    continue
                held = int(fits[k, mine].sum())
                cost = float(np.where(fits[k, mine], costs[k, mine], 0.0).sum())
                key = (-held, cost, k)
                if best is None or key < best[0]:
                    best = (key, k)
            if best is None:
                return None
            chosen.append(best[1])
        # dp groups of every block, in rank order; LPT on each group's own clock: its documents'
        # seconds plus its micro-batches' fixed cost (a sharded block spanning its dp groups: the
        # block's rounds, every group pays each round)
        group_entry, group_block = [], []
        for b, k in enumerate(chosen):
            comp = self.computes[self.entries[k].compute]
            for _ in range(blocks[b][1] // (comp.tp * comp.cp)):
                group_entry.append(k)
                group_block.append(b)
        ge, gb = np.asarray(group_entry), np.asarray(group_block)
        opts = [self.entries[k].option for k in group_entry]
        cap = np.array([o.capacity for o in opts], dtype=np.float64)
        fixed = np.array([o.per_micro_batch for o in opts])
        lock = np.array([o.layout.lockstep for o in opts])
        padded = {}
        secs = np.empty((ge.size, lengths.size))
        toks = np.empty((ge.size, lengths.size))
        for k in sorted(set(group_entry)):
            opt = self.entries[k].option
            cp = opt.layout.cp
            if cp not in padded:
                padded[cp] = opt.padded(lengths)
            rows_k = ge == k
            secs[rows_k] = np.where(fits[k], opt.doc_seconds(padded[cp]), np.inf)
            toks[rows_k] = padded[cp]
        # [doc, group] rows (contiguous per document) and in-place arithmetic: the same operations
        # in the same order as a plain loop, a few times faster at hundreds of groups
        secs_t, toks_t = np.ascontiguousarray(secs.T), np.ascontiguousarray(toks.T)
        bounds = np.searchsorted(gb, np.arange(len(blocks) + 1))  # groups of block b: bounds[b]:bounds[b + 1]
        lock_block = [bool(lock[bounds[b]]) if bounds[b] < bounds[b + 1] else False for b in range(len(blocks))]
        floor = np.zeros(ge.size)  # a lockstep group's least micro-batches: its block's rounds so far
        busy = np.zeros(ge.size)
        tokens = np.zeros(ge.size)
        mbs = np.empty(ge.size)
        finish = np.empty(ge.size)
        extra = np.empty(ge.size)
        rounds = np.zeros(len(blocks))
        owner = np.full(lengths.size, -1)
        for d in np.lexsort((np.arange(lengths.size), -lengths)):  # longest first, index ties
            np.add(tokens, toks_t[d], out=mbs)
            np.divide(mbs, cap, out=mbs)
            np.ceil(mbs, out=mbs)
            np.maximum(mbs, floor, out=mbs)
            np.add(busy, secs_t[d], out=finish)
            np.multiply(fixed, mbs, out=extra)
            finish += extra
            g = int(np.argmin(finish))
            if not math.isfinite(finish[g]):
                return None
            owner[d] = g
            busy[g] += secs_t[d, g]
            tokens[g] += toks_t[d, g]
            b = int(gb[g])
            if mbs[g] > rounds[b]:
                rounds[b] = mbs[g]
                if lock_block[b]:
                    floor[bounds[b]:bounds[b + 1]] = mbs[g]
        by_owner = np.argsort(owner, kind="stable")  # documents by group, index order within one
        cuts = np.searchsorted(owner[by_owner], np.arange(ge.size + 1))
        out, start = [], 0
        for b, k in enumerate(chosen):
            e = self.entries[k]
            opt = e.option
            pad = padded[opt.layout.cp]
            cost = opt.doc_seconds(pad)
            least = int(rounds[b]) if opt.layout.lockstep else 0
            groups = tuple(ladder_blocks.balanced_groups(by_owner[cuts[g]:cuts[g + 1]], pad, cost, opt.capacity, least)
                           for g in range(bounds[b], bounds[b + 1]))
            out.append(LadderBlock(opt, self.computes[e.compute], start, e.size, e.sharded, groups))
            start += e.size
        trio = [(blk.compute, blk.size, blk.sharded) for blk in out]
        switch_in = max(self.cm.switch_seconds(None, blk.option.layout) for blk in out)
        return LadderGroups(tuple(out), switch_in, joint_exchange_seconds(self.cm, trio))

