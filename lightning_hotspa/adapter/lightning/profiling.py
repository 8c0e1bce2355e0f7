"""Profiled planning: every rank's measured stage seconds feed the planner's coefficients.

The step's one all-gather (:func:`~lightning_hotspa.engine.records.gather_step`) already carries
each rank's cost-model features of every stage (``sum_sq``, ``sum_len``: its cp-padded document
lengths, see :class:`~lightning_hotspa.planner.profiled.calibration.Observation`) beside its device seconds,
so a profiled planner gets every rank's timings with no collective of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...engine.records import StepResult, rank_stage_fields
from ...plan import RankPlan
from ...planner.base import Planner, ProfiledPlanner, is_profiled

__all__ = ["ProfilingFeedback", "gathered_observations"]


def gathered_observations(result: StepResult, activation_checkpointing: Sequence[Any] | None = None) -> list:
    """Every rank's measured stage seconds (``compute_s``) with its cost-model features:
    rank-major, stage order, bit-identical on every rank. ``activation_checkpointing``: per stage
    (default: what each stage ran with). Stages a rank had no micro-batch in are skipped."""
    from ...planner.profiled.calibration import Observation

    ac = activation_checkpointing if activation_checkpointing is not None else [
        s.activation_checkpointing for s in result.stages]
    out = []
    for row in rank_stage_fields(result.table, len(result.stages)):
        for s, flag, cols in zip(result.stages, ac, row):
            if cols["micro_batches"] < 1:
                continue
            out.append(Observation(s.layout, flag, cols["sum_sq"], cols["sum_len"],
                                   int(cols["micro_batches"]), cols["compute_s"], int(cols["documents"])))
    return out


class ProfilingFeedback:
    """After each training step: observations to a profiled planner, then ``refit(plan.step)``.

    Coefficients change only at multiples of its ``refit_every`` and plan steps ``>= plan.step +
    plan_lag``, on every rank and loader worker alike (planner/profiled/schedule.py). A process' first step
    is not observed: it pays one-off costs (allocations, first switches)."""

    def __init__(self) -> None:
        self.timed_steps = 0

    def after_step(self, planner: Planner, plan: RankPlan, result: StepResult) -> None:
        if not is_profiled(planner) or plan.step < 0 or plan.extras.get("plain"):
            return
        assert isinstance(planner, ProfiledPlanner)
        self.timed_steps += 1
        if self.timed_steps > 1:
            planner.observe(gathered_observations(result))
        planner.refit(plan.step)
