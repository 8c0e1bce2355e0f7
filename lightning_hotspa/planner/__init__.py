"""Planning: which layout runs which documents, packed into which micro-batches (docs/DESIGN.md §3, §5).

``planner`` never imports ``data``: it sees document lengths, never tokens.
"""

from .base import Planner, PlannerBase, check_planner
from .candidates import auto_layouts, auto_planner
from .packing import (
    DEFAULT_QUADRATIC_SCALE,
    DocCost,
    DocumentTooLongError,
    PackedLayout,
    QuadraticCost,
    StagePlanStats,
    cp_padded_lengths,
    first_fit_decreasing,
    max_doc_length,
    pack_layout,
    spread_over_groups,
)
from .plan_stats import PlanStats, plan_stats, stage_stats
from .rule import Bucket, ThresholdPlanner
from .solver import CostModelPlanner

__all__ = [
    "DEFAULT_QUADRATIC_SCALE",
    "Bucket",
    "CostModelPlanner",
    "DocCost",
    "DocumentTooLongError",
    "PackedLayout",
    "PlanStats",
    "Planner",
    "PlannerBase",
    "QuadraticCost",
    "StagePlanStats",
    "ThresholdPlanner",
    "check_planner",
    "auto_layouts",
    "auto_planner",
    "cp_padded_lengths",
    "first_fit_decreasing",
    "max_doc_length",
    "pack_layout",
    "plan_stats",
    "spread_over_groups",
    "stage_stats",
]
