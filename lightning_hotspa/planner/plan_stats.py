"""What a plan's packing achieved, for any planner: fill, cp padding and dp imbalance per stage.

Metrics and benchmarks read these, so they do not depend on which planner made the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..layout import Layout
from ..plan import Stage, StepPlan
from .solve.packing import DocCost, QuadraticCost, StagePlanStats, cp_padded_lengths

__all__ = ["PlanStats", "plan_stats", "stage_stats"]


@dataclass(frozen=True)
class PlanStats:
    """Per-stage stats and their step-level aggregates."""

    stages: tuple[StagePlanStats, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stages)

    @property
    def fill(self) -> float:
        used = sum(s.micro_batches * s.capacity for s in self.stages)
        return self.tokens / used if used else 1.0

    @property
    def padding_fraction(self) -> float:
        padded = sum(s.padded_tokens for s in self.stages)
        return (padded - self.tokens) / padded if padded else 0.0

    @property
    def imbalance(self) -> float:
        """Predicted step time over its ideal: sum of stage maxima / sum of stage means."""
        worst = sum(max(s.group_costs) for s in self.stages if s.group_costs)
        ideal = sum(sum(s.group_costs) / len(s.group_costs) for s in self.stages if s.group_costs)
        return worst / ideal if ideal > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "fill": self.fill,
            "padding": self.padding_fraction,
            "imbalance": self.imbalance,
            "stages": [s.as_dict() for s in self.stages],
        }



def stage_stats(stage: Stage, doc_lengths: Sequence[int], capacity: int,
                cost_fn: DocCost | None = None) -> StagePlanStats:
    """Stats of any planner's stage (so metrics do not depend on which planner made the plan)."""
    cost_fn = cost_fn or QuadraticCost()
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    ids = np.asarray(stage.doc_ids, dtype=np.int64)
    # (cp, dp group) of every group: a mixed stage's blocks pad to their own cp
    groups = [(stage.layout.cp, g) for g in stage.micro_batches] + \
        [(b.layout.cp, g) for b in stage.blocks for g in b.micro_batches]
    padded_tokens, group_costs = 0, []
    for cp, group in groups:
        members = np.asarray([d for mb in group for d in mb], dtype=np.int64)
        sizes = cp_padded_lengths(lengths[members], cp)
        padded_tokens += int(sizes.sum())
        group_costs.append(float(np.asarray(cost_fn(sizes), dtype=np.float64).sum()) if members.size else 0.0)
    return StagePlanStats(
        layout=stage.layout,
        label=stage.label,
        documents=int(ids.size),
        tokens=int(lengths[ids].sum()) if ids.size else 0,
        padded_tokens=padded_tokens,
        micro_batches=sum(len(g) for _, g in groups),
        capacity=int(capacity),
        group_costs=tuple(group_costs),
    )


def plan_stats(
    plan: StepPlan, capacity: Callable[[Layout], int], cost_fn: DocCost | None = None
) -> PlanStats:
    """Fill, padding and dp imbalance of every stage of ``plan`` (``capacity``: the planner's)."""
    return PlanStats(
        tuple(stage_stats(s, plan.doc_lengths, capacity(s.layout), cost_fn) for s in plan.stages)
    )
