"""A context-parallel ladder of blocks: one block stage whose blocks run side by side (issue 38).

Why: the headroom of long-context steps sits in the longest document's own time on its group. In a
plan of stages in sequence, the stage holding the 512K document on cp256 idles (or under-fills)
every other dp group of that layout while it runs. A block stage (``plan.Block``, docs/DESIGN.md §4
"Blocks") lets the world split into aligned sub-meshes that each run their own layout, copy and
micro-batch stream at once: the long document's block on wide cp, medium documents on narrower cp
beside it, the short ones on plain dp, all ending together in ONE joint gradient exchange.

Priced as the runtime runs it (:func:`ladder_seconds`): each block on its own clock over its own
working copy (a sharded copy: its option is the ``:fsdp<n>`` working layout's, whose per-micro-batch
gathers and reduce-scatters span the block only and whose capacity holds parameters / block ranks;
a replicated one: the plain layout's), the stage's compute is its slowest block, plus the copy's
materialization from home (the slowest block's gather) and the joint exchange (each rank's share
of its block's fp32 gradient sent to the home holders, one all-to-all at the per-rank inter-node
bandwidth once the world spans nodes).

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
and a second re-pricing from the re-priced sizes: ``_REPRICED``). Each block takes
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

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...activation_checkpointing import Checkpointing
from ...layout import Layout, LayoutError, MeshShape
from ..cost.cost_model import AnalyticCostModel, CostModelError, OptionCost
from ..cost.timeline import stage_group_seconds
from .mixed_rounds import BlockGroups

__all__ = ["LadderBlock", "LadderGroups", "LadderPlanner", "block_chain", "joint_exchange_seconds", "ladder_seconds",
           "remap", "working_layout"]

StageGroups = tuple[tuple[tuple[int, ...], ...], ...]  # [dp group][micro-batch] -> doc indices
#: step-time multiples of the smallest tiling ``T`` that are priced exactly (larger ``T``: fewer,
#: cheaper-rate blocks)
_T_TRIES = (1.0, 1.1, 1.25)
_BISECT = 14
#: the most documents a ladder's head may hold (:meth:`LadderPlanner.head_size`)
_HEAD_MOST = 32
#: (round_up, carry): a class keeps a dp group its work fills to 1 - round_up (the rest: spare
#: ranks, given by load), with or without the wider classes' idle time carried to it
#: (:meth:`LadderPlanner._allocate`); both are tried (the carry fills a long document's wide
#: block, but sometimes leaves the narrower classes too few groups). The first ladder's second
#: pass, round_up 0.25 without the carry, gave way to the carry's pass to keep the planner's time
#: (benchmarks/2026-12-04-ladder-2.md).
_ROUNDS = ((0.5, True), (0.5, False))
_MODE_ORDER = tuple(Checkpointing)
#: per rounding of ``_ROUNDS``, its re-pricing passes (:meth:`LadderPlanner._repriced`), each from
#: the previous pass's allocation, and per pass its ladders: as allocated (False) and with its small
#: sharded blocks merged (True, :meth:`LadderPlanner._widen`), at its step time only
#: (``_REPRICED_TRIES``). The carry's rounding gets two passes, the other one pass of one ladder: on
#: the long cells, more passes, more ladders per pass or 1.1 / 1.25 of the step time gained nothing
#: more, and fewer lost (benchmarks/2026-12-04-ladder-3.md; the planner's time)
_REPRICED: dict[tuple[float, bool], tuple[tuple[bool, ...], ...]] = {(0.5, True): ((False, True), (False,)),
                                                                     (0.5, False): ((False,),)}
_REPRICED_TRIES = (1.0,)


def block_chain(world: int) -> tuple[int, ...]:
    """Block sizes that tile ``world`` aligned when placed largest first: ``world / 2^j``."""
    out, n = [], world
    while True:
        out.append(n)
        if n % 2:
            return tuple(out)
        n //= 2


def working_layout(compute: Layout, ranks: int, sharded: bool) -> Layout:
    """The working layout of a block of ``ranks`` ranks computing in ``compute``: ``compute`` itself
    (replicated copy) or ``compute`` sharded over the block's dp x cp ranks (``plan.Block.working_layout``)."""
    if not sharded:
        return compute
    shard = ranks // compute.tp
    return Layout(dp=compute.dp, tp=compute.tp, cp=compute.cp, cp_kv=compute.cp_kv, fsdp=True,
                  fsdp_shard=0 if shard == compute.dp * compute.cp else shard)


@dataclass(frozen=True)
class LadderBlock:
    """One block of a ladder as the solver holds it.

    Args:
        option: the working copy's option (its layout is the working layout).
        compute: the plain compute layout (tp, cp, cp kind).
        start: the block's first rank (its ranks: ``start .. start + size - 1``).
        size: how many ranks.
        sharded: the working copy is sharded over the block's ranks.
        groups: per dp group of the block, in rank order, its micro-batches.
    """

    option: OptionCost
    compute: Layout
    start: int
    size: int
    sharded: bool
    groups: StageGroups


@dataclass(frozen=True)
class LadderGroups(BlockGroups):
    """A block stage's blocks (the solver's stand-in for a stage's groups of micro-batches).

    Args:
        blocks: the blocks, tiling the world.
        switch_in: seconds to materialize every block's copy from home (the slowest block).
        exchange: seconds of the joint gradient exchange at the stage's end.
    """

    blocks: tuple[LadderBlock, ...]
    switch_in: float
    exchange: float

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """The blocks' compute layouts."""
        return tuple(b.compute for b in self.blocks)

    def block_seconds(self, lengths: np.ndarray, in_order: bool = False) -> np.ndarray:
        """Each block's compute seconds on its own clock (its slowest dp group; lockstep rounds when
        its sharded copy spans its dp groups)."""
        out = []
        for b in self.blocks:
            opt = b.option
            secs = stage_group_seconds(opt, b.groups, opt.doc_seconds(opt.padded(lengths)), in_order)
            out.append(float(secs.max(initial=0.0)))
        return np.asarray(out)


def ladder_seconds(ladder: LadderGroups, lengths: np.ndarray, in_order: bool = False) -> float:
    """The block stage's seconds: materialization + slowest block + joint exchange."""
    return ladder.switch_in + float(ladder.block_seconds(lengths, in_order).max(initial=0.0)) + ladder.exchange


def joint_exchange_seconds(cm: AnalyticCostModel, blocks: Sequence[tuple[Layout, int, bool]]) -> float:
    """The joint exchange of blocks ``(compute, ranks, sharded)``: each rank sends its block's fp32
    gradient share (all of a sharded block's shard; a replicated block's tp shard) and each home
    holder receives one contribution per block; one all-to-all at the per-rank bandwidth."""
    hw = cm.hardware
    send = max(cm.params * cm.grad_bytes / (n if sharded else lay.tp) for lay, n, sharded in blocks)
    recv = len(blocks) * cm.params * cm.grad_bytes / cm.world_size
    span = cm.world_size
    bw = hw.intra_node_bw if span <= hw.devices_per_node else hw.inter_node_bw
    return max(send, recv) / bw + hw.latency(span)


@dataclass(frozen=True)
class _Entry:
    compute: int  # index into LadderPlanner.computes
    size: int
    sharded: bool
    option: OptionCost


class LadderPlanner:
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
        best: tuple[float, LadderGroups] | None = None
        seen: set[tuple[tuple[int, int], ...]] = set()
        for round_up, carry in _ROUNDS:
            hi = self._bisect(rates, alone, round_up, carry)
            if hi is None:
                continue
            best = self._try(lengths, costs, fits, rates, alone, hi, round_up, carry, seen, best, _T_TRIES)
            first = self._allocate(rates, alone, hi, round_up, carry)
            if first is None:
                continue
            # the classes re-priced at the block sizes this allocation gives them (a 70B copy sharded
            # over 8 ranks holds 384-3,712 tokens a micro-batch, not the 3,456-26,112 of a world-sized
            # block: 3.3-4x the rank-seconds of a 1K document), a new step time for them and its
            # ladder (as allocated, and with its small sharded blocks merged); in the carry's
            # rounding once more from the re-priced allocation's sizes
            passes = _REPRICED.get((round_up, carry), ())
            for n, widens in enumerate(passes):
                re_rates, re_alone = self._repriced(big, units, rates, alone, first[0])
                re_hi = self._bisect(re_rates, re_alone, round_up, carry)
                if re_hi is None:
                    break
                for widen in widens:
                    best = self._try(lengths, costs, fits, re_rates, re_alone, re_hi, round_up, carry, seen, best,
                                     _REPRICED_TRIES, (big, units) if widen else None)
                if n + 1 < len(passes):  # the next pass starts from this pass's allocation
                    first = self._allocate(re_rates, re_alone, re_hi, round_up, carry)
                    if first is None:
                        break
        return best

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
            hi *= 1.5
            if hi > lo * 1e4:
                return None
        for _ in range(_BISECT):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if self._allocate(rates, alone, mid, round_up, carry) is not None else (mid, hi)
        return hi

    def _try(self, lengths: np.ndarray, costs: np.ndarray, fits: np.ndarray, rates: np.ndarray, alone: np.ndarray,
             hi: float, round_up: float, carry: bool, seen: set, best: tuple[float, LadderGroups] | None,
             mults: Sequence[float], widen: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[float, LadderGroups] | None:
        """Builds and prices the allocation of each step time ``hi * mult`` (``widen``: (``big``,
        ``units``) of :meth:`_widen`, its small sharded blocks merged) not built before (``seen``);
        the cheapest of them and ``best``."""
        for mult in mults:
            alloc = self._allocate(rates, alone, hi * mult, round_up, carry)
            if alloc is not None and widen is not None:
                alloc = (self._widen(alloc[0], alloc[1], *widen), alloc[1])
            if alloc is None or alloc[0] in seen:
                continue
            seen.add(alloc[0])
            split = self._split(alloc[0])
            for blocks in (alloc[0], split) if split != alloc[0] else (alloc[0],):
                ladder = self._build(lengths, costs, fits, blocks, alloc[1])
                if ladder is None:
                    continue
                secs = ladder_seconds(ladder, lengths)
                if best is None or secs < best[0] - 1e-12:
                    best = (secs, ladder)
        return best

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

    def tables(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[option, doc] balance cost and whether the option holds the document (``tables`` of
        :meth:`head_size` and :meth:`round_size`, computed once for both)."""
        return self._tables(np.asarray(lengths, dtype=np.int64))

    def head_size(self, lengths: np.ndarray, most: int = _HEAD_MOST,
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
        groups and ``_HEAD_MOST``) each take at least half the longest's time there, so that they
        run side by side in about that time (4 documents of 512K on ``dp4xtp2xcp128``: the ladder
        has no block of the world's size, and 3 groups of 256 ranks would take two rounds); 0:
        none, one document (``head_size`` weighs a head of one), or a longest document under a
        quarter of the step's least work (short documents gain nothing from a head)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        whole = [k for k, e in enumerate(self.entries) if e.size == self.cm.world_size]
        if not whole or lengths.size < 2:
            return 0
        costs, fits = self.tables(lengths) if tables is None else tables
        order = np.lexsort((np.arange(lengths.size), -lengths))[:_HEAD_MOST]
        big = np.where(fits[whole][:, order], costs[whole][:, order], np.inf)
        r = int(np.argmin(big[:, 0]))
        first = float(big[r, 0])
        work = float(self._least_work(np.where(fits, costs, np.inf)).sum())
        if not math.isfinite(first) or first < 0.25 * work:
            return 0
        comp = self.computes[self.entries[whole[r]].compute]
        groups = self.cm.world_size // (comp.tp * comp.cp)
        k = int(np.argmin(np.append(big[r] >= 0.5 * first, False)))  # the first that takes less than half
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
            sizes = self._decompose(g * self._width(i), self._sizes[i])
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

    def _decompose(self, need: int, sizes: Sequence[int]) -> list[int] | None:
        """Block sizes of ``sizes`` (chain members a layout can run) summing to at least ``need``."""
        out, rest = [], need
        if not sizes:
            return None
        while rest > 0:
            fit = [s for s in sizes if s <= rest]
            s = max(fit) if fit else min(sizes)
            out.append(s)
            rest -= s
        return out

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
            groups = tuple(_balanced(by_owner[cuts[g]:cuts[g + 1]], pad, cost, opt.capacity, least)
                           for g in range(bounds[b], bounds[b + 1]))
            out.append(LadderBlock(opt, self.computes[e.compute], start, e.size, e.sharded, groups))
            start += e.size
        trio = [(blk.compute, blk.size, blk.sharded) for blk in out]
        switch_in = max(self.cm.switch_seconds(None, blk.option.layout) for blk in out)
        return LadderGroups(tuple(out), switch_in, joint_exchange_seconds(self.cm, trio))


def remap(ladder: LadderGroups, ids: np.ndarray) -> LadderGroups:
    """``ladder`` planned over ``lengths[ids]`` with its document indices mapped back to ``ids``."""
    def back(groups: StageGroups) -> StageGroups:
        return tuple(tuple(tuple(sorted(int(ids[d]) for d in mb)) for mb in g) for g in groups)

    blocks = tuple(dataclasses.replace(b, groups=back(b.groups)) for b in ladder.blocks)
    return dataclasses.replace(ladder, blocks=blocks)


def _balanced(docs: np.ndarray, padded: np.ndarray, cost: np.ndarray, capacity: int,
              least: int) -> tuple[tuple[int, ...], ...]:
    """``docs`` packed into micro-batches of ``capacity`` tokens with even seconds: at least
    ``least`` (a lockstep block's rounds: each round lasts its slowest group's micro-batch) and as
    many as the tokens need; LPT by seconds into the least loaded one that has room (a new one if none)."""
    if docs.size == 0:
        return ()
    n = max(least, int(math.ceil(float(padded[docs].sum()) / capacity)), 1)
    n = min(n, int(docs.size))
    bins: list[list[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    room = [int(capacity)] * n
    for d in docs[np.lexsort((docs, -cost[docs]))].tolist():  # costliest first, index ties
        need = int(padded[d])
        j = -1
        for i in range(len(bins)):  # the least loaded bin with room (the first of equals)
            if room[i] >= need and (j < 0 or load[i] < load[j]):
                j = i
        if j < 0:
            bins.append([])
            load.append(0.0)
            room.append(int(capacity))
            j = len(bins) - 1
        bins[j].append(d)
        load[j] += float(cost[d])
        room[j] -= need
    return tuple(tuple(sorted(b)) for b in bins if b)
