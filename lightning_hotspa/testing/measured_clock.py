"""A controlled clock for the measured planner: stage seconds = the model's times a per-option factor.

Issue 53's decision-rule tests and recipe: each stage of a plan "takes" the analytic cost model's
compute seconds for its micro-batches (:func:`~..planner.profiled.calibration.predict`) times a
true factor of its option (``factors``: option key -> factor, default 1) times ``exp(N(0, noise))``
drawn from ``(seed, step, stage, group)``: deterministic, so a resumed run sees the same times.
One :class:`~..planner.profiled.calibration.Observation` per stage and dp group, group-major (as the
gathered table is rank-major).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..plan import StepPlan
from ..planner.profiled.calibration import Observation, predict
from ..planner.profiled.measured_planner import option_key

__all__ = ["FactorClock"]


class FactorClock:
    """``observations(planner, plan)``: the step's timed stage table; ``true_seconds``: its sum (slowest group)."""

    def __init__(self, factors: Mapping[str, float] | None = None, noise: float = 0.0, seed: int = 0) -> None:
        self.factors, self.noise, self.seed = dict(factors or {}), float(noise), int(seed)

    def observations(self, planner, plan: StepPlan) -> list[Observation]:
        lengths = plan.doc_lengths
        per_group: dict[int, list[Observation]] = {}
        for k, stage in enumerate(plan.stages):
            if stage.blocks:
                raise ValueError(f"FactorClock: stage {k} is a block stage; build the planner with ladder=False, "
                                 f"mixed_rounds=False")
            key = (stage.layout, stage.activation_checkpointing)
            opt = planner._analytic[key]
            factor = self.factors.get(option_key(*key), 1.0)
            for g, mbs in enumerate(stage.micro_batches):
                if not mbs:
                    continue
                obs = Observation.from_lengths(stage.layout, stage.activation_checkpointing,
                                               [[lengths[d] for d in mb] for mb in mbs], 1.0)
                rng = np.random.default_rng([self.seed, plan.step, k, g])
                secs = predict(opt, obs) * factor * float(np.exp(rng.normal(0.0, self.noise))) if self.noise \
                    else predict(opt, obs) * factor
                per_group.setdefault(g, []).append(Observation(obs.layout, obs.activation_checkpointing, obs.sum_sq,
                                                               obs.sum_len, obs.micro_batches, secs, obs.documents))
        return [o for g in sorted(per_group) for o in per_group[g]]

    def true_seconds(self, planner, plan: StepPlan) -> float:
        """The plan's timed seconds: per stage, its slowest group."""
        obs = self.observations(planner, plan)
        worst: dict[tuple, float] = {}
        for o in obs:
            worst[o.key] = max(worst.get(o.key, 0.0), o.seconds)
        return sum(worst.values())
