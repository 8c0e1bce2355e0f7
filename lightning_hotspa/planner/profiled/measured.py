"""Measured correction: per option, a running estimate of ``ln(measured / predicted)`` seconds and its sd.

Issue 53. Each (layout, checkpointing) option ``k`` has an unknown factor ``f_k`` by which its real
seconds differ from the cost model's: ``measured = predicted * f_k * noise``. Before anything runs,
``ln f_k ~ N(0, prior_sd^2)``; each step an option ran, its stage table (predicted seconds, measured
seconds at the slowest rank; stages of one option summed) gives ``y = ln(measured / predicted)`` with
per-step noise sd ``noise_sd``, and the estimate is a Kalman update of a random walk: the variance
first grows by ``drift_sd^2`` (the hardware may change: another job, a slow link), then shrinks by
the measurement. An option never run keeps its prior: large uncertainty, shrinking as it runs; its
prior mean is the mean correction of the options that ran (one factor everywhere, e.g. a slower box).

The prior sd comes from the guard's margin (:data:`~..solve.static_guard.DEFAULT_STATIC_MARGIN`, the
mean held-out between-layout error of published runs, ``exp(E|e_i - e_j|) - 1``): for iid
``e ~ N(0, s^2)``, ``E|e_i - e_j| = 2 s / sqrt(pi)``, so ``s = ln(1 + margin) * sqrt(pi) / 2``
(:func:`prior_sd_from_margin`, 0.112 at 0.135, 0.114 at 0.137). :data:`GAP_Z` makes the guard's threshold the expected
absolute error of a plan gap, ``sqrt(2/pi)`` sds: at the prior, two one-option plans need exactly the
fixed margin (the margin survives only as the prior).

Options are keyed by plain strings (an option's label). State is plain data (:meth:`state_dict`),
independent of the world size: keys of layouts a resumed run no longer has are kept and unused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..solve.static_guard import DEFAULT_STATIC_MARGIN

__all__ = ["GAP_Z", "MeasuredCorrection", "StageRow", "prior_sd_from_margin"]

#: sds of a plan gap equal to its expected absolute error (E|N(0, s^2)| = s * sqrt(2 / pi))
GAP_Z = math.sqrt(2.0 / math.pi)

StageRow = tuple[str, float, float]  # (option key, predicted seconds, measured seconds at the slowest rank)


def prior_sd_from_margin(margin: float = DEFAULT_STATIC_MARGIN) -> float:
    """The per-option log-error sd whose expected between-option gap is ``ln(1 + margin)``."""
    if not 0 < margin < 10:
        raise ValueError(f"prior_sd_from_margin: margin must be in (0, 10), got {margin!r}")
    return math.log1p(margin) * math.sqrt(math.pi) / 2.0


def _round(x: float) -> float:
    return float(f"{x:.12g}")  # every rank feeds the same rows; rounding keeps resumes bit-equal


class MeasuredCorrection:
    """Per option key: posterior mean and variance of ``ln(measured / predicted)``, and runs seen.

    ``prior_sd``: before any run (default from the guard's margin); ``noise_sd``: one step's log
    noise of a measured stage; ``drift_sd``: how far the true factor may move per observed step.
    """

    def __init__(self, prior_sd: float | None = None, noise_sd: float = 0.02, drift_sd: float = 0.005) -> None:
        prior_sd = prior_sd_from_margin() if prior_sd is None else prior_sd
        for name, v in (("prior_sd", prior_sd), ("noise_sd", noise_sd)):
            if not (isinstance(v, (int, float)) and 0 < v < 10):
                raise ValueError(f"MeasuredCorrection: {name} must be in (0, 10), got {v!r}")
        if not (isinstance(drift_sd, (int, float)) and 0 <= drift_sd < 10):
            raise ValueError(f"MeasuredCorrection: drift_sd must be in [0, 10), got {drift_sd!r}")
        self.prior_sd, self.noise_sd, self.drift_sd = float(prior_sd), float(noise_sd), float(drift_sd)
        self.mean: dict[str, float] = {}
        self.var: dict[str, float] = {}
        self.runs: dict[str, int] = {}

    # ------------------------------------------------------------------ beliefs
    def global_mean(self) -> float:
        """The prior mean of an option never run: the mean correction of the options that ran (the
        model may be off by one factor everywhere: a CPU box, a slower clock), 0 before any ran."""
        return sum(self.mean.values()) / len(self.mean) if self.mean else 0.0

    def belief(self, key: str) -> tuple[float, float]:
        """(mean, sd) of ``ln(measured / predicted)`` for ``key`` (the prior when never run)."""
        if key in self.mean:
            return self.mean[key], math.sqrt(self.var[key])
        return self.global_mean(), self.prior_sd

    def factor(self, key: str) -> float:
        return math.exp(self.belief(key)[0])

    def corrected(self, seconds: Mapping[str, float]) -> float:
        """A plan's corrected seconds: its predicted seconds per option times each option's factor."""
        return sum(s * self.factor(k) for k, s in seconds.items())

    def gap_sd(self, a: Mapping[str, float], b: Mapping[str, float]) -> float:
        """sd of ``ln(T_a / T_b)`` for two plans (predicted seconds per option), first order: each
        option's log error weighted by its share of each plan's corrected time (shared options cancel)."""
        ta, tb = self.corrected(a), self.corrected(b)
        if not (ta > 0 and tb > 0):
            return math.inf
        var = 0.0
        for k in sorted(set(a) | set(b)):
            w = (a.get(k, 0.0) / ta - b.get(k, 0.0) / tb) * self.factor(k)
            var += w * w * self.belief(k)[1] ** 2
        return math.sqrt(var)

    def update_sd(self, seconds: Mapping[str, float]) -> float:
        """sd of the change one more run of a plan would make to its corrected log time (the value of
        measuring it: large for options never run, ~``noise_sd / n`` after ``n`` runs)."""
        total = self.corrected(seconds)
        if not total > 0:
            return 0.0
        var = 0.0
        for k in sorted(seconds):
            v = self.belief(k)[1] ** 2 + (self.drift_sd ** 2 if k in self.var else 0.0)
            w = seconds[k] * self.factor(k) / total
            var += w * w * v * v / (v + self.noise_sd ** 2)
        return math.sqrt(var)

    # ------------------------------------------------------------------ updates
    def observe(self, rows: Iterable[StageRow]) -> dict[str, float]:
        """Updates from one step's stage table; returns the observed ``ln(measured / predicted)`` per key.
        Rows with non-positive or non-finite seconds are skipped (an idle stage says nothing)."""
        sums: dict[str, list[float]] = {}
        for key, predicted, measured in rows:
            if not (predicted > 0 and measured > 0 and math.isfinite(predicted) and math.isfinite(measured)):
                continue
            acc = sums.setdefault(str(key), [0.0, 0.0])
            acc[0] += float(predicted)
            acc[1] += float(measured)
        seen = {}
        for key in sorted(sums):
            y = math.log(sums[key][1] / sums[key][0])
            mean, sd = self.belief(key)
            var = sd * sd + self.drift_sd ** 2 if key in self.var else sd * sd
            gain = var / (var + self.noise_sd ** 2)
            self.mean[key] = _round(mean + gain * (y - mean))
            self.var[key] = _round(var * (1.0 - gain))
            self.runs[key] = self.runs.get(key, 0) + 1
            seen[key] = y
        return seen

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"prior_sd": self.prior_sd, "noise_sd": self.noise_sd, "drift_sd": self.drift_sd,
                "options": [[k, self.mean[k], self.var[k], self.runs.get(k, 0)] for k in sorted(self.mean)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.__init__(float(state["prior_sd"]), float(state["noise_sd"]), float(state["drift_sd"]))  # type: ignore[misc]
        for key, mean, var, runs in state.get("options", []):
            if not (math.isfinite(float(mean)) and float(var) >= 0):
                raise ValueError(f"MeasuredCorrection state: bad entry for {key!r}: mean {mean!r}, var {var!r}")
            self.mean[str(key)], self.var[str(key)], self.runs[str(key)] = float(mean), float(var), int(runs)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> MeasuredCorrection:
        out = cls()
        out.load_state_dict(state)
        return out
