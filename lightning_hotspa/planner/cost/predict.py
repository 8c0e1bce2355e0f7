"""Predicted seconds of a step, stage by stage: the one evaluation planner, simulator and CLI share.

A step's prediction is ``sum over stages (slowest dp group + stage fixed cost) + switches``, the
switches being home -> first stage -> second stage ... in stage order (the planner's objective). The
fixed cost (the gradient reduction) is paid once per run of consecutive stages that share gradients
(same tp degree, :func:`~.cost_model.shares_gradients`): by the run's last stage, as the runtime does.
Given the world mesh's dp groups (``blocks``), the stages of a run of one replicated tp degree run
free (:mod:`.timeline`): the step saves ``overlap_seconds`` against that sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...activation_checkpointing import Checkpointing
from ..solve.ladder import LadderGroups
from ..solve.mixed_rounds import MixedGroups, mixed_seconds
from .cost_model import AnalyticCostModel, OptionCost, shares_gradients
from .timeline import GroupBlocks, Timeline, stage_group_seconds

__all__ = ["StagePrediction", "StepPrediction", "predict_stages"]

Groups = Sequence[Sequence[Sequence[int]]]


@dataclass(frozen=True)
class StagePrediction:
    """One stage: its option, what it holds, and its predicted seconds."""

    layout: str
    activation_checkpointing: Checkpointing
    documents: int
    tokens: int
    micro_batches: int
    min_length: int
    max_length: int
    group_seconds: tuple[float, ...]
    stage_fixed: float  # 0 when the next stage shares its gradients (the run's last stage reduces)
    switch_seconds: float  # switching INTO this stage
    switch_bytes: float

    @property
    def compute_seconds(self) -> float:
        return max(self.group_seconds, default=0.0)

    @property
    def seconds(self) -> float:
        """Stage time including its gradient reduction (not the switch into it)."""
        return self.compute_seconds + self.stage_fixed

    @property
    def band(self) -> str:
        return f"{self.min_length}-{self.max_length}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout, "checkpointing": self.activation_checkpointing, "band": self.band,
            "documents": self.documents, "tokens": self.tokens, "micro_batches": self.micro_batches,
            "compute_s": self.compute_seconds, "grad_reduce_s": self.stage_fixed,
            "switch_s": self.switch_seconds, "switch_bytes": self.switch_bytes, "seconds": self.seconds,
        }


@dataclass(frozen=True)
class StepPrediction:
    stages: tuple[StagePrediction, ...]
    overlap_seconds: float = 0.0  # what free runs save against each stage's slowest group in turn

    @property
    def switch_seconds(self) -> float:
        return sum(s.switch_seconds for s in self.stages)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages) + self.switch_seconds - self.overlap_seconds

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stages)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
                "switch_s": self.switch_seconds, "overlap_s": self.overlap_seconds,
                "stages": [s.as_dict() for s in self.stages]}


def _ladder_name(ladder: LadderGroups) -> str:
    """A block stage's name in predictions: its blocks, ``blocks[dp4xcp256:kv32:fsdp256+ac x256 | ...]``."""
    return "blocks[" + " | ".join(f"{b.option.label} x{b.size}" for b in ladder.blocks) + "]"


def predict_stages(stages: Sequence[tuple[OptionCost, Groups]], lengths: Sequence[int] | np.ndarray,
                   cost_model: AnalyticCostModel, blocks: GroupBlocks | None = None,
                   in_order: bool = True) -> StepPrediction:
    """Prediction of ``stages`` (option, groups of micro-batches of doc indices, or the blocks of a
    mixed stage, :class:`~..solve.mixed_rounds.MixedGroups`) in this order;
    ``in_order``: an fsdp group's micro-batches run in the given order (False: costliest first,
    the order the planner emits)."""
    arr = np.asarray(lengths, dtype=np.int64)
    out, prev, line = [], None, Timeline(blocks)
    for k, (opt, groups) in enumerate(stages):
        carried = k + 1 < len(stages) and shares_gradients(opt.layout, stages[k + 1][0].layout) \
            and not isinstance(groups, LadderGroups) and not isinstance(stages[k + 1][1], LadderGroups)
        if isinstance(groups, LadderGroups):  # blocks on their own clocks: the stage is its slowest
            ids = np.asarray(groups.doc_ids, dtype=np.int64)  # block, then the joint exchange
            group_seconds = groups.block_seconds(arr, in_order)
            line.add_barrier(float(group_seconds.max(initial=0.0)))
            out.append(StagePrediction(
                layout=_ladder_name(groups), activation_checkpointing=opt.activation_checkpointing,
                documents=int(ids.size), tokens=int(arr[ids].sum()) if ids.size else 0,
                micro_batches=groups.micro_batches, min_length=int(arr[ids].min()) if ids.size else 0,
                max_length=int(arr[ids].max()) if ids.size else 0, group_seconds=tuple(group_seconds.tolist()),
                stage_fixed=groups.exchange, switch_seconds=groups.switch_in, switch_bytes=max(
                    cost_model.switch_bytes(None, b.option.layout) for b in groups.blocks)))
            prev = None  # the next stage starts from home
            continue
        if isinstance(groups, MixedGroups):  # mixed-cp lockstep rounds: all blocks end together
            ids = np.asarray(groups.doc_ids, dtype=np.int64)
            group_seconds = np.array([mixed_seconds(groups, arr, in_order)])
            count = groups.micro_batches
        else:
            ids = np.asarray([d for g in groups for mb in g for d in mb], dtype=np.int64)
            # every dp group's own seconds; an fsdp stage's lockstep rounds: all groups end together
            group_seconds = stage_group_seconds(opt, groups, opt.doc_seconds(opt.padded(arr)), in_order)
            count = sum(len(g) for g in groups)
        line.add(opt, group_seconds)
        par = opt.layout
        out.append(StagePrediction(
            layout=par.name, activation_checkpointing=opt.activation_checkpointing, documents=int(ids.size),
            tokens=int(arr[ids].sum()) if ids.size else 0, micro_batches=count,
            min_length=int(arr[ids].min()) if ids.size else 0, max_length=int(arr[ids].max()) if ids.size else 0,
            group_seconds=tuple(group_seconds.tolist()), stage_fixed=0.0 if carried else opt.stage_fixed,
            switch_seconds=cost_model.switch_seconds(prev, par), switch_bytes=cost_model.switch_bytes(prev, par),
        ))
        prev = par
    in_turn = sum(s.compute_seconds for s in out)
    return StepPrediction(tuple(out), overlap_seconds=in_turn - line.finish() if blocks is not None else 0.0)
