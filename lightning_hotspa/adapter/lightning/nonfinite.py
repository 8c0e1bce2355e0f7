"""``HotSPaStrategy(nonfinite=...)``: what a step with a NaN/Inf loss does.

The step runner only finds the gathered global loss non-finite (the same verdict on every rank,
from the same numbers) and hands the step to this policy: ``"stop"`` raises
:class:`~.reliability.NonFiniteLossError` naming every offending micro-batch on every rank;
``"skip"`` drops the update and keeps the report in :attr:`NonFiniteHandler.skipped_steps`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from ...plan import RankPlan
from .reliability import NonFiniteLossError, StepTracker, check_nonfinite_policy

__all__ = ["NonFiniteHandler"]


class NonFiniteHandler:
    """The runner's non-finite seam: ``handler(loss, plan)`` -> True to skip the update (or raises)."""

    def __init__(self, policy: str, tracker: StepTracker) -> None:
        self.policy = check_nonfinite_policy(policy)
        self.tracker = tracker
        self.skipped_steps: list[dict[str, Any]] = []  # non-finite steps dropped under "skip"

    def __call__(self, loss: Tensor, plan: RankPlan) -> bool:
        report = self.tracker.nonfinite_report(plan)  # a collective, on every rank together
        if self.policy == "stop":
            raise NonFiniteLossError(f"{report}. Stopping before the optimizer step (nonfinite='stop'; "
                                     f"nonfinite='skip' drops such steps instead)")
        self.skipped_steps.append({"global_step": self.tracker.step, "batch_idx": self.tracker.batch_idx,
                                   "report": report})
        rank_zero_warn(f"hotspa: skipping the update: {report} (nonfinite='skip')")
        return True
