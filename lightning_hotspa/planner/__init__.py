"""Planning: which layout runs which documents, packed into which micro-batches (docs/DESIGN.md §3, §5;
the objective the cost-model solver minimizes: planner/README.md).

``planner`` never imports ``data``: it sees document lengths, never tokens. The names here are the
user-facing ones; the packing and solver internals are imported from their own modules.
"""

from .base import (
    BalancedPlanner,
    Planner,
    PlannerBase,
    PricedPlanner,
    ProfiledPlanner,
    StatefulPlanner,
    balance_cost,
    check_planner,
    is_profiled,
)
from .candidates import auto_layouts, auto_planner
from .cost.cost_model import AnalyticCostModel, CostModelError
from .cost.hardware import PROFILES, HardwareProfile, UnknownProfileError, get_profile
from .plan_stats import PlanStats, plan_stats
from .rule import Bucket, ThresholdPlanner
from .solve.packing import DocCost, DocumentTooLongError, QuadraticCost
from .solve.solver import CostModelPlanner

__all__ = [
    "PROFILES",
    "AnalyticCostModel",
    "BalancedPlanner",
    "Bucket",
    "CostModelError",
    "CostModelPlanner",
    "DocCost",
    "DocumentTooLongError",
    "HardwareProfile",
    "PlanStats",
    "Planner",
    "PlannerBase",
    "PricedPlanner",
    "ProfiledPlanner",
    "QuadraticCost",
    "StatefulPlanner",
    "ThresholdPlanner",
    "UnknownProfileError",
    "auto_layouts",
    "auto_planner",
    "balance_cost",
    "check_planner",
    "get_profile",
    "is_profiled",
    "plan_stats",
]
