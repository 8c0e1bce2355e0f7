"""A step's compute time when dp groups run free between the stages of a run.

Why: between consecutive stages that share gradients with a replicated working copy (same tp
degree, not ``:fsdp``) the runtime issues no collective that spans dp groups: the switch between
them is local, the gradient reduction waits for the run's last stage, and a micro-batch's tp and cp
collectives stay inside its tp x cp group (docs/DESIGN.md §4, "Free runs"). A dp group done with
its share of one stage starts its micro-batches of the next at once. So a run's compute time is not
the sum of each stage's slowest dp group: it is the latest finish over the world's tp blocks, where
a dp group starts when every block it spans is free. Short documents of a wide-dp stage fill the
blocks that a long document left idle in a wide-cp stage before it: FlexSP's heterogeneous
sequence-parallel groups (arXiv 2412.01523), with the stages of one step in sequence. The solver
therefore packs each stage of a run from the times its groups become free
(:meth:`Timeline.release_times`).

A tp block is one tp group: tp takes the mesh's first dims, so block ``b`` is ranks
``b*tp .. b*tp+tp-1``; the dp group of a layout spans the ``cp`` blocks whose ranks share its dp
coordinates (:class:`GroupBlocks`, read off the world mesh). An fsdp stage's per-unit collectives
span every dp group (lockstep rounds), and a run ends with a reduction over the dp and cp dims: both
start and end with every block in step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ...layout import Layout, LayoutError, MeshShape
from .cost_model import OptionCost

__all__ = ["GroupBlocks", "Timeline", "compute_seconds", "stage_group_seconds"]


class GroupBlocks:
    """Per layout of one world mesh: ``spans[g]``, the tp blocks dp group ``g`` covers (``[dp, cp]``)."""

    def __init__(self, layouts: Iterable[Layout], world_size: int) -> None:
        try:
            self.shape: MeshShape | None = MeshShape.for_layouts(list(layouts), world_size)
        except LayoutError:
            self.shape = None  # layouts that share no mesh: no stage runs free (priced in lockstep)
        self._spans: dict[Layout, np.ndarray] = {}

    def spans(self, lay: Layout) -> np.ndarray | None:
        """``[dp, cp]`` block indices of ``lay``'s dp groups; None when it is not on this mesh."""
        if self.shape is None or lay not in self.shape.layouts:
            return None
        if lay not in self._spans:
            dims = list(self.shape.dp_dims(lay))
            members: list[list[int]] = [[] for _ in range(lay.dp)]
            for block in range(self.shape.world_size // lay.tp):
                members[self.shape.shard_index(block * lay.tp, dims)].append(block)
            self._spans[lay] = np.asarray(members, dtype=np.int64)
        return self._spans[lay]


class Timeline:
    """A step's compute seconds, stage by stage in order: a free run's stages on its blocks' own
    clocks (each dp group starts when every block it spans is free, a group without micro-batches
    issues no collective and leaves its blocks alone), every other stage in step (its slowest dp
    group; an fsdp stage its lockstep rounds). The solver packs a stage from
    :meth:`release_times` before it adds it with :meth:`add`."""

    def __init__(self, blocks: GroupBlocks | None) -> None:
        self.blocks = blocks
        self.total = 0.0
        self._run: tuple[int, int] | None = None  # (tp, pp) of the free run under way
        self._free = np.zeros(0)  # per tp block: when it is free, in seconds since the run began

    def _spans(self, opt: OptionCost) -> np.ndarray | None:
        par = opt.layout
        # a pp layout's dp group spans its stages' ranks: priced in step (its stage's slowest dp group)
        return None if par.fsdp or par.pp > 1 or self.blocks is None else self.blocks.spans(par)

    def release_times(self, opt: OptionCost) -> np.ndarray | None:
        """When each dp group of a stage in ``opt`` would start (None: at once, in step)."""
        spans = self._spans(opt)
        if spans is None or self._run != (opt.layout.tp, opt.layout.pp):
            return None
        return self._free[spans].max(axis=1)

    def add(self, opt: OptionCost, seconds: np.ndarray) -> None:
        """A stage in ``opt`` whose dp groups take ``seconds`` each (:func:`stage_group_seconds`)."""
        par, spans = opt.layout, self._spans(opt)
        run = None if spans is None else (par.tp, par.pp)
        if run != self._run:
            self._close()
            self._run, self._free = run, np.zeros(0 if spans is None else spans.size)
        seconds = np.asarray(seconds, dtype=np.float64)
        if spans is None:
            self.total += float(seconds.max(initial=0.0))
            return
        busy = seconds > 0
        self._free[spans[busy]] = (self._free[spans[busy]].max(axis=1) + seconds[busy])[:, None]

    def add_barrier(self, seconds: float) -> None:
        """A stage every rank starts together and ends together (a block stage: ``seconds``, its slowest block)."""
        self._close()
        self.total += float(seconds)

    def _close(self) -> None:
        self.total += float(self._free.max(initial=0.0))
        self._run, self._free = None, np.zeros(0)

    def finish(self) -> float:
        self._close()
        return self.total


def stage_group_seconds(opt: OptionCost, groups: Sequence[Sequence[Sequence[int]]], doc_seconds: np.ndarray,
                         in_order: bool) -> np.ndarray:
    """Every dp group's own seconds in a stage (an fsdp stage: its lockstep time in every entry)."""
    if opt.layout.lockstep and len(groups) > 1:
        return np.full(len(groups), opt.stage_seconds(doc_seconds, groups, in_order=in_order))
    return np.array([opt.group_seconds(float(sum(doc_seconds[list(mb)].sum() for mb in g)), len(g))
                     for g in groups], dtype=np.float64)


def compute_seconds(stages: Sequence[tuple[OptionCost, Sequence[Sequence[Sequence[int]]]]], lengths: np.ndarray,
                    blocks: GroupBlocks | None, in_order: bool = False) -> float:
    """Compute seconds of ``stages`` (option, groups of micro-batches of doc indices) in order:
    :class:`Timeline`. ``blocks`` None: every stage in step (the sum of their slowest groups)."""
    line = Timeline(blocks)
    for opt, groups in stages:
        line.add(opt, stage_group_seconds(opt, groups, opt.doc_seconds(opt.padded(lengths)), in_order))
    return line.finish()
