"""A ladder's blocks as the solver holds them, and their price (issue 38; the planner: :mod:`.ladder`).

Priced as the runtime runs it (:func:`ladder_seconds`): each block on its own clock over its own
working copy (a sharded copy: its option is the ``:fsdp<n>`` working layout's, whose per-micro-batch
gathers and reduce-scatters span the block only and whose capacity holds parameters / block ranks;
a replicated one: the plain layout's), the stage's compute is its slowest block, plus the copy's
materialization from home (the slowest block's gather) and the joint exchange (each rank's share
of its block's fp32 gradient sent to the home holders, one all-to-all at the per-rank inter-node
bandwidth once the world spans nodes).

Also: the block sizes that tile a world aligned (:func:`block_chain`), a block's working layout
(:func:`working_layout`), and the micro-batches of one dp group (:func:`balanced_groups`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...layout import Layout
from ..cost.cost_model import AnalyticCostModel, OptionCost
from ..cost.timeline import stage_group_seconds
from .mixed_rounds import BlockGroups

__all__ = ["LadderBlock", "LadderGroups", "StageGroups", "balanced_groups", "block_chain", "chain_pieces",
           "joint_exchange_seconds", "ladder_seconds", "remap", "working_layout"]

StageGroups = tuple[tuple[tuple[int, ...], ...], ...]  # [dp group][micro-batch] -> doc indices


def block_chain(world: int) -> tuple[int, ...]:
    """Block sizes that tile ``world`` aligned when placed largest first: ``world / 2^j``."""
    out, n = [], world
    while True:
        out.append(n)
        if n % 2:
            return tuple(out)
        n //= 2


def chain_pieces(need: int, sizes: Sequence[int]) -> list[int] | None:
    """Block sizes of ``sizes`` (chain members a layout can run) summing to at least ``need``, largest
    that fits first; None: no sizes."""
    out, rest = [], need
    if not sizes:
        return None
    while rest > 0:
        fit = [s for s in sizes if s <= rest]
        s = max(fit) if fit else min(sizes)
        out.append(s)
        rest -= s
    return out


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


def remap(ladder: LadderGroups, ids: np.ndarray) -> LadderGroups:
    """``ladder`` planned over ``lengths[ids]`` with its document indices mapped back to ``ids``."""
    def back(groups: StageGroups) -> StageGroups:
        return tuple(tuple(tuple(sorted(int(ids[d]) for d in mb)) for mb in g) for g in groups)

    blocks = tuple(dataclasses.replace(b, groups=back(b.groups)) for b in ladder.blocks)
    return dataclasses.replace(ladder, blocks=blocks)


def balanced_groups(docs: np.ndarray, padded: np.ndarray, cost: np.ndarray, capacity: int,
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
