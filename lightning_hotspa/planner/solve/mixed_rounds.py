"""Mixed-cp lockstep rounds in the plan: one sharded stage whose dp blocks compute at different cp
degrees at once (issue 31 step 3; the runtime is ``plan.Block``, docs/DESIGN.md §4).

Why: a sharded working copy (``:fsdp``, or HSDP whose shard spans dp groups) runs its dp groups in
lockstep rounds, one micro-batch per group per round, and every round pays the per-unit gathers and
reduce-scatters (``per_micro_batch``) whatever it holds. A long document needs a wide cp layout, so
in separate stages it costs a round of the wide layout in which every other dp group idles, and the
short documents pay their own rounds after it. In one MIXED stage the long documents' block and the
short documents' block share the rounds: a round lasts as long as its slowest micro-batch, on
whichever block, plus the gathers it pays once.

How (deterministic, no search over time limits): for each pair of candidate options of one sharded
working copy (same gradient kind, same checkpointing flag, whose dp groups nest: the narrower
layout's dp groups lie inside the wider one's, :func:`nesting`), the wider one ``L`` takes the
documents only it holds (and, in a second variant, those it runs at fewer world-seconds), the
narrower one ``S`` the rest. ``L`` gets ``n`` of its own dp groups (slots), ``S`` its dp groups in
the other ``L.dp - n`` slots; each block's documents are LPT-balanced (by cost) into as many
micro-batches as its groups times its rounds, dealt costliest first so each round holds the
costliest micro-batches of both blocks together. A few ``n`` around the world-seconds split are
priced exactly (:func:`mixed_seconds`) and the cheapest kept. :func:`mix_rounds` puts the mixed
stage in place of the plan's stages of that working copy and keeps it only if the whole step
prices lower.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...layout import Layout, LayoutError, MeshShape
from ..cost.cost_model import OptionCost
from ..cost.terms import gradient_kind
from .assign import pack_lpt

__all__ = ["MixedBlock", "MixedGroups", "mix_rounds", "mixed_seconds", "nesting"]

StageGroups = tuple[tuple[tuple[int, ...], ...], ...]  # [dp group][micro-batch] -> doc indices
#: How many slot counts around the world-seconds split are priced per pair and variant.
_SLOT_TRIES = 2
#: The share of a block's token capacity its rounds are planned to fill (packing slack).
_FILL = 0.95


@dataclass(frozen=True)
class MixedBlock:
    """One block of a mixed stage as the solver holds it.

    Args:
        option: the block's compute option (its layout and checkpointing flag).
        dp_groups: which of the option layout's dp groups the block covers.
        groups: per covered dp group (same order), its micro-batches, costliest first.
    """

    option: OptionCost
    dp_groups: tuple[int, ...]
    groups: StageGroups


class BlockGroups:
    """What a stage of blocks (``self.blocks``, each with ``groups`` of micro-batches) tells the
    solver: its documents and its micro-batch count (:class:`MixedGroups`, ``ladder.LadderGroups``)."""

    blocks: tuple

    @property
    def doc_ids(self) -> list[int]:
        """Every document of the stage."""
        return [d for b in self.blocks for g in b.groups for mb in g for d in mb]

    @property
    def micro_batches(self) -> int:
        """How many micro-batches the stage computes (idle rounds not counted)."""
        return sum(len(g) for b in self.blocks for g in b.groups)


@dataclass(frozen=True)
class MixedGroups(BlockGroups):
    """A mixed stage's blocks (the solver's stand-in for a stage's groups of micro-batches).

    Args:
        blocks: the blocks, together tiling every rank of the world once.
    """

    blocks: tuple[MixedBlock, ...]

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """The blocks' compute layouts."""
        return tuple(b.option.layout for b in self.blocks)


def mixed_seconds(mixed: MixedGroups, lengths: np.ndarray, in_order: bool = False) -> float:
    """The stage's compute seconds: per lockstep round its slowest micro-batch over every block
    (a group without one that round computes an idle micro-batch: its option's
    ``per_micro_batch``), summed over the rounds of the busiest group.

    Args:
        mixed: the stage.
        lengths: every document's length.
        in_order: each group's micro-batches run as given (False: costliest first).
    """
    rows = []
    for b in mixed.blocks:
        opt = b.option
        secs = opt.doc_seconds(opt.padded(lengths))
        for g in b.groups:
            row = [float(secs[list(mb)].sum()) + opt.per_micro_batch for mb in g]
            rows.append((opt.per_micro_batch, row if in_order else sorted(row, reverse=True)))
    rounds = max((len(r) for _, r in rows), default=0)
    if rounds == 0:
        return 0.0
    table = np.array([r + [idle] * (rounds - len(r)) for idle, r in rows])
    return float(table.max(axis=0).sum())


def nesting(shape: MeshShape, outer: Layout, inner: Layout) -> np.ndarray | None:
    """Per dp group of ``inner``, the dp group of ``outer`` holding all its ranks; None when one
    straddles two (then no block split by ``outer``'s groups can give ``inner`` whole groups).

    Args:
        shape: the world mesh.
        outer: the wider-cp layout, whose dp groups are the slots.
        inner: the narrower-cp layout.
    """
    owner = np.full(inner.dp, -1, dtype=np.int64)
    for r in range(shape.world_size):
        g, o = shape.rank_coords(inner, r)[0], shape.rank_coords(outer, r)[0]
        if owner[g] == -1:
            owner[g] = o
        elif owner[g] != o:
            return None
    return owner


def _pack(ids: np.ndarray, opt: OptionCost, lengths: np.ndarray, bins: int) -> list[tuple[float, tuple[int, ...]]]:
    """(seconds with ``per_micro_batch``, documents) of ``ids`` packed into about ``bins``
    micro-batches: LPT on cost over ``bins`` bins, each first fit under the capacity (a bin that
    overflows opens another micro-batch); costliest first."""
    if ids.size == 0:
        return []
    padded = opt.padded(lengths[ids])
    secs = opt.doc_seconds(padded)
    out = []
    for group in pack_lpt(padded, opt.balance_cost(padded), opt.capacity, max(1, min(bins, ids.size))):
        for mb in group:
            out.append((float(secs[mb].sum()) + opt.per_micro_batch, tuple(sorted(int(ids[p]) for p in mb))))
    out.sort(key=lambda x: (-x[0], x[1]))
    return out


def _deal(mbs: list[tuple[float, tuple[int, ...]]], groups: int) -> list[list[tuple[int, ...]]]:
    """Costliest-first micro-batches dealt round by round: round ``r`` takes the next ``groups``."""
    out: list[list[tuple[int, ...]]] = [[] for _ in range(groups)]
    for k, (_, mb) in enumerate(mbs):
        out[k % groups].append(mb)
    return out


def _rounds_needed(ids: np.ndarray, opt: OptionCost, lengths: np.ndarray, groups: int) -> int:
    """The fewest rounds ``groups`` groups need for ``ids`` by tokens (packing may need more)."""
    if ids.size == 0:
        return 0
    return max(1, math.ceil(float(opt.padded(lengths[ids]).sum()) / (opt.capacity * groups)))


def _balance(lengths: np.ndarray, wide: OptionCost, narrow: OptionCost, wide_ids: np.ndarray,
             narrow_ids: np.ndarray, n_wide: int, n_narrow: int) -> tuple[np.ndarray, np.ndarray]:
    """(wide ids, narrow ids) after moving the ``k`` longest narrow documents to the wide block:
    the fewest rounds both blocks fit in, and within them the ``k`` that best balances the
    blocks' seconds per group (the wide block idles behind its long documents otherwise)."""
    if narrow_ids.size == 0 or n_narrow == 0:
        return wide_ids, narrow_ids
    order = narrow_ids[np.lexsort((narrow_ids, -lengths[narrow_ids]))]
    pw, pn = wide.padded(lengths[order]), narrow.padded(lengths[order])
    fit_w = pw <= wide.capacity
    movable = int(np.argmin(fit_w)) if not fit_w.all() else order.size  # a prefix that fits wide
    cum_w = np.concatenate([[0.0], np.cumsum(pw[:movable])])  # tokens moved wide, k = 0..movable
    cum_n = np.concatenate([[0.0], np.cumsum(pn[:movable])])
    sec_w = np.concatenate([[0.0], np.cumsum(wide.balance_cost(pw[:movable]))])
    sec_n = np.concatenate([[0.0], np.cumsum(narrow.balance_cost(pn[:movable]))])
    base_w = float(wide.padded(lengths[wide_ids]).sum()) if wide_ids.size else 0.0
    base_sw = float(wide.balance_cost(wide.padded(lengths[wide_ids])).sum()) if wide_ids.size else 0.0
    all_n, all_sn = float(pn.sum()), float(narrow.balance_cost(pn).sum())
    wide_tokens = base_w + cum_w
    narrow_tokens = all_n - cum_n
    rounds = np.maximum(np.ceil(wide_tokens / (_FILL * wide.capacity * n_wide)),
                        np.ceil(narrow_tokens / (_FILL * narrow.capacity * n_narrow)))
    best = float(rounds.min())
    per_group = np.maximum((base_sw + sec_w) / n_wide, (all_sn - sec_n) / n_narrow)
    k = int(np.argmin(np.where(rounds == best, per_group, np.inf)))
    moved = np.sort(order[:k])
    return np.sort(np.concatenate([wide_ids, moved])), np.setdiff1d(narrow_ids, moved)


class _Pair:
    """A wide option ``L`` and a narrow one ``S`` of one working copy, with the slot map."""

    def __init__(self, wide: OptionCost, narrow: OptionCost, owner: np.ndarray) -> None:
        self.wide, self.narrow, self.owner = wide, narrow, owner

    def build(self, lengths: np.ndarray, wide_ids: np.ndarray, narrow_ids: np.ndarray,
              slots: int) -> MixedGroups:
        """The mixed stage with ``slots`` of ``L``'s dp groups for ``L`` (its first ones): the
        fewest rounds ``R`` both blocks fit in (:data:`_FILL` of their capacity) once the longest
        of the narrow documents move to the wide block as needed, moving as many as balance the
        two blocks' seconds per group; each block LPT-packed into ``groups x R`` micro-batches."""
        L, S = self.wide, self.narrow
        s_groups = tuple(int(g) for g in np.flatnonzero(self.owner >= slots))
        wide_ids, narrow_ids = _balance(lengths, L, S, wide_ids, narrow_ids, slots, len(s_groups))
        blocks = []
        for opt, ids, dp_groups in ((L, wide_ids, tuple(range(slots))), (S, narrow_ids, s_groups)):
            n = len(dp_groups)
            rounds = _rounds_needed(ids, opt, lengths, n)
            dealt = _deal(_pack(ids, opt, lengths, n * rounds), n)
            blocks.append(MixedBlock(opt, dp_groups, tuple(tuple(g) for g in dealt)))
        return MixedGroups(tuple(blocks))

    def candidates(self, lengths: np.ndarray, wide_ids: np.ndarray, narrow_ids: np.ndarray) -> list[int]:
        """Slot counts to price: around the split of world-seconds between the two blocks."""
        L, S = self.wide, self.narrow
        if narrow_ids.size == 0 or wide_ids.size == 0:
            return []
        work = [float(o.balance_cost(o.padded(lengths[i])).sum()) * o.layout.cp
                for o, i in ((L, wide_ids), (S, narrow_ids))]
        share = work[0] / (work[0] + work[1]) * L.layout.dp
        # one whole round for the wide documents, at most one per slot
        out = {min(L.layout.dp - 1, max(1, int(wide_ids.size)))}
        for k in range(_SLOT_TRIES):
            out.add(min(L.layout.dp - 1, max(1, math.floor(share) - k)))
            out.add(min(L.layout.dp - 1, max(1, math.ceil(share) + k)))
        return sorted(out)


def _pairs(options: Sequence[OptionCost], shape: MeshShape | None) -> dict[tuple, list[_Pair]]:
    """Per (gradient kind, checkpointing), the (wide, narrow) option pairs whose dp groups nest."""
    out: dict[tuple, list[_Pair]] = {}
    if shape is None:
        return out
    sharded = [o for o in options if o.layout.lockstep and o.layout.pp == 1]
    for wide in sharded:
        for narrow in sharded:
            a, b = wide.layout, narrow.layout
            wide_kind = (gradient_kind(a), wide.activation_checkpointing)
            if wide_kind != (gradient_kind(b), narrow.activation_checkpointing) \
                    or a.cp <= b.cp or a.tp * a.fsdp_shard != b.tp * b.fsdp_shard:
                continue
            if a not in shape.layouts or b not in shape.layouts:
                continue
            owner = nesting(shape, a, b)
            if owner is not None:
                out.setdefault((gradient_kind(a), wide.activation_checkpointing), []).append(_Pair(wide, narrow, owner))
    return out


class MixedRounds:
    """The candidate pairs of one planner's options (built once), and the post-pass over plans.

    Args:
        options: the planner's options (every layout and checkpointing flag).
        shape: the world mesh (None: layouts that share no mesh, nothing to mix).
    """

    def __init__(self, options: Sequence[OptionCost], shape: MeshShape | None) -> None:
        try:
            self.pairs = _pairs(options, shape)
        except LayoutError:
            self.pairs = {}

    def improve(self, lengths: np.ndarray, total: float, stages: list, options: Sequence[OptionCost],
                price: Callable[[list], float]) -> tuple[float, list]:
        """``(seconds, stages)``: ``stages`` with the stages of one sharded working copy merged into a
        mixed stage where that prices lower (:func:`mix_rounds`)."""
        return mix_rounds(lengths, total, stages, options, self.pairs, price)


def mix_rounds(lengths: np.ndarray, total: float, stages: list, options: Sequence[OptionCost],
               pairs: dict[tuple, list[_Pair]], price: Callable[[list], float]) -> tuple[float, list]:
    """For each sharded working copy (gradient kind and checkpointing flag) the plan uses, tries a
    mixed stage over each nesting pair of the CURRENT options (``options``: the solve's, possibly
    refitted) holding that copy's documents, in place of its stages; keeps the cheapest whole plan.

    Args:
        lengths: every document's length.
        total: the plan's predicted seconds.
        stages: the plan, ``(option, groups)`` per stage in order.
        options: the options of this solve (their coefficients price the mixed stages).
        pairs: :class:`MixedRounds` pairs (by layout; re-bound to ``options`` here).
        price: the predicted seconds of a whole plan.
    """
    if not pairs:
        return total, stages
    by_key = {(o.layout, o.activation_checkpointing): o for o in options}
    best = (total, stages)
    for key, kind_pairs in sorted(pairs.items(), key=lambda kv: repr(kv[0])):
        members = [k for k, (opt, groups) in enumerate(stages) if not isinstance(groups, MixedGroups)
                   and opt.layout.lockstep and (gradient_kind(opt.layout), opt.activation_checkpointing) == key]
        if not members:
            continue
        for pair in kind_pairs:
            wide = by_key.get((pair.wide.layout, pair.wide.activation_checkpointing))
            narrow = by_key.get((pair.narrow.layout, pair.narrow.activation_checkpointing))
            if wide is None or narrow is None:
                continue
            bound = _Pair(wide, narrow, pair.owner)
            # merge the pair's own stages (the copy's other stages stay), or every stage of the copy
            own = [k for k in members if stages[k][0].layout in (wide.layout, narrow.layout)]
            for merged in [m for m in (own, members) if m][: 1 if own == members else 2]:
                ids = np.asarray(sorted(d for k in merged for g in stages[k][1] for mb in g for d in mb),
                                 dtype=np.int64)
                for wide_ids, narrow_ids in _splits(ids, wide, narrow, lengths):
                    for slots in bound.candidates(lengths, wide_ids, narrow_ids):
                        mixed = bound.build(lengths, wide_ids, narrow_ids, slots)
                        trial = [(stages[k][0], mixed) if k == merged[0] else s for k, s in enumerate(stages)
                                 if k not in merged[1:]]
                        seconds = price(trial)
                        if seconds < best[0]:
                            best = (seconds, trial)
    return best


def _splits(ids: np.ndarray, wide: OptionCost, narrow: OptionCost, lengths: np.ndarray,
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Ways to split ``ids`` between the wide and the narrow block: only what the narrow one cannot
    hold goes wide; and each document where it costs fewer world-seconds (rank-seconds per tp)."""
    p_w, p_n = wide.padded(lengths[ids]), narrow.padded(lengths[ids])
    fits_w, fits_n = p_w <= wide.capacity, p_n <= narrow.capacity
    if not np.all(fits_w | fits_n):
        return []
    out = [(ids[~fits_n], ids[fits_n])]
    rate_w = wide.balance_cost(p_w) * wide.layout.cp
    rate_n = np.where(fits_n, narrow.balance_cost(p_n) * narrow.layout.cp, np.inf)
    go_wide = fits_w & (rate_w < rate_n)
    if np.any(go_wide != ~fits_n):
        out.append((ids[go_wide], ids[~go_wide]))
    return out
