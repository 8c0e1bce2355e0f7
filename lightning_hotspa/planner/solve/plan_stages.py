"""The solver's stages as the plan's :class:`~lightning_hotspa.plan.Stage` objects, and back (a plan's
block stage as :class:`~.ladder_blocks.LadderGroups`, priced like the solver's own): used by
:meth:`~.solver.CostModelPlanner.plan` and :meth:`~.solver.CostModelPlanner.predict`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...activation_checkpointing import Checkpointing
from ...layout import Layout, MeshShape
from ...plan import Block, Stage, block_dp_groups, block_ranks
from ..cost.cost_model import AnalyticCostModel, OptionCost
from .ladder_blocks import LadderBlock, LadderGroups, joint_exchange_seconds
from .mixed_rounds import MixedGroups

__all__ = ["ladder_groups", "ladder_stage", "mixed_stage", "plain_stage", "remap_plain"]


def remap_plain(stages: list, ids: np.ndarray) -> list:
    """Plain solver stages solved over ``lengths[ids]``, their document indices mapped back to the batch's.

    Args:
        stages: (option, groups of micro-batches of indices into ``ids``) per stage.
        ids: the batch's document index of each solved document.
    """
    return [(o, tuple(tuple(tuple(int(ids[d]) for d in mb) for mb in g) for g in groups)) for o, groups in stages]


def plain_stage(opt: OptionCost, groups: tuple, lengths: np.ndarray) -> Stage:
    """The plan's stage of one compute layout: per dp group its micro-batches (lockstep rounds:
    costliest first in every group; otherwise the fullest first)."""
    ids = [d for g in groups for mb in g for d in mb]
    label = f"{int(lengths[ids].min())}-{int(lengths[ids].max())}"
    if opt.layout.lockstep:  # lockstep rounds: costliest micro-batches first in every group
        secs = opt.doc_seconds(opt.padded(lengths))
        key = lambda mb, s=secs: (-float(s[list(mb)].sum()), -len(mb), tuple(sorted(mb)))  # noqa: E731
    else:
        key = lambda mb: (-len(mb), mb)  # noqa: E731
    mbs = tuple(tuple(tuple(sorted(mb)) for mb in sorted(g, key=key)) for g in groups)
    return Stage(opt.layout, mbs, opt.activation_checkpointing, label)


def mixed_stage(opt: OptionCost, mixed: MixedGroups, lengths: np.ndarray) -> Stage:
    """The plan's mixed stage: the working copy in ``opt``'s layout, a :class:`Block` per block."""
    ids = mixed.doc_ids
    blocks = tuple(Block(b.option.layout, b.dp_groups, tuple(tuple(tuple(sorted(mb)) for mb in g) for g in b.groups))
                   for b in mixed.blocks)
    label = f"{int(lengths[ids].min())}-{int(lengths[ids].max())}"
    return Stage(opt.layout, (), opt.activation_checkpointing, label, blocks=blocks)


def ladder_stage(ladder: LadderGroups, lengths: np.ndarray, mesh: MeshShape) -> Stage:
    """The plan's block stage: a :class:`Block` per ladder block, its dp groups in the mesh's dp order."""
    blocks = []
    for b in ladder.blocks:
        unit = b.compute.tp * b.compute.cp
        dp = [mesh.rank_coords(b.compute, b.start + j * unit)[0] for j in range(len(b.groups))]
        order = sorted(range(len(dp)), key=lambda j: dp[j])
        assert tuple(sorted(dp)) == block_dp_groups(b.compute, mesh, range(b.start, b.start + b.size))
        secs = b.option.doc_seconds(b.option.padded(lengths))  # costliest micro-batch first (lockstep rounds)
        key = lambda mb, s=secs: (-float(s[list(mb)].sum()), -len(mb), mb)  # noqa: E731
        blocks.append(Block(b.compute, tuple(dp[j] for j in order),
                            tuple(tuple(sorted(b.groups[j], key=key)) for j in order),
                            sharded=b.sharded, activation_checkpointing=b.option.activation_checkpointing))
    ids = ladder.doc_ids
    label = f"{int(lengths[ids].min())}-{int(lengths[ids].max())}"
    return Stage(ladder.blocks[0].compute, (), Checkpointing.NONE, label, blocks=tuple(blocks))


def ladder_groups(stage: Stage, opt_of: Callable[[Layout, bool], OptionCost], mesh: MeshShape,
                  cost_model: AnalyticCostModel) -> tuple[OptionCost, LadderGroups]:
    """A plan's block stage as the solver prices it (:mod:`.ladder`).

    Args:
        stage: the plan's block stage.
        opt_of: the priced option of (working layout, checkpointing).
        mesh: the mesh the blocks are placed on.
        cost_model: prices the copies' materialization and the joint exchange.
    """
    blocks = []
    for b in stage.blocks:
        ranks = block_ranks(b, mesh)
        opt = opt_of(b.working_layout, b.checkpointing(stage.activation_checkpointing))
        blocks.append(LadderBlock(opt, b.layout, ranks[0], len(ranks), b.sharded, b.micro_batches))
    blocks.sort(key=lambda x: x.start)
    trio = [(x.compute, x.size, x.sharded) for x in blocks]
    cm = cost_model
    groups = LadderGroups(tuple(blocks), max(cm.switch_seconds(None, x.option.layout) for x in blocks),
                          joint_exchange_seconds(cm, trio))
    return blocks[0].option, groups
