"""Measured correction: per option, a running estimate of ``ln(measured / predicted)`` seconds and its sd.

Issue 53. Each (layout, checkpointing) option ``k`` has an unknown factor ``f_k`` by which its real
seconds differ from the cost model's: ``measured = predicted * f_k * noise``. Before anything runs,
``ln f_k ~ N(0, prior_sd^2)``; each step an option ran, its stage table (predicted seconds, measured
seconds at the slowest rank; stages of one option summed) gives ``y = ln(measured / predicted)`` with
per-step noise sd ``noise_sd``, and the estimate is a Kalman update of a random walk: the variance
first grows by ``drift_sd^2`` (the hardware may change: another job, a slow link), then shrinks by
the measurement. An option never run keeps its prior: large uncertainty, shrinking as it runs.

Its prior (:func:`box_factor`) models ``ln f_k = g + e_k``: ``g`` one factor for the whole box (a CPU
box, a slower clock), ``e_k ~ N(0, prior_sd^2)`` per option. ``g`` is estimated robustly from the
options that ran: one whose mean lies more than :data:`OUTLIER_Z` sds from the median of the others is
left out (one slowed layout, ln 2 = ~6 sds, no longer raises every unmeasured prior), the rest are
averaged; where none agrees (two ran options that far apart: which is the outlier is unknown) the
lowest is taken, optimism an exploration's budget bounds. The prior sd adds the estimate's own
variance (``prior_sd^2 / n`` for ``n`` agreeing options); before anything ran it is ``prior_sd``.

The prior sd comes from the guard's margin (:data:`~..solve.static_guard.DEFAULT_STATIC_MARGIN`, the
mean held-out between-layout error of published runs, ``exp(E|e_i - e_j|) - 1``): for iid
``e ~ N(0, s^2)``, ``E|e_i - e_j| = 2 s / sqrt(pi)``, so ``s = ln(1 + margin) * sqrt(pi) / 2``
(:func:`prior_sd_from_margin`, 0.112 at 0.135, 0.114 at 0.137, 0.115 at 0.139). :data:`GAP_Z` makes the
guard's threshold the expected absolute error of a plan gap, ``sqrt(2/pi)`` sds: at the prior, two one-option
plans need exactly the fixed margin (the margin survives only as the prior).

Options are keyed by plain strings (an option's label). State is plain data (:meth:`state_dict`),
independent of the world size: keys of layouts a resumed run no longer has are kept and unused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..solve.static_guard import DEFAULT_STATIC_MARGIN

__all__ = ["GAP_Z", "OUTLIER_Z", "MeasuredCorrection", "StageRow", "box_factor", "prior_sd_from_margin"]

#: sds of a plan gap equal to its expected absolute error (E|N(0, s^2)| = s * sqrt(2 / pi))
GAP_Z = math.sqrt(2.0 / math.pi)

StageRow = tuple  # (option key, predicted seconds, measured seconds at the slowest rank[, noise scale])
#: sds from the median of the other ran options beyond which an option's mean is an outlier for the prior
OUTLIER_Z = 3.0


def prior_sd_from_margin(margin: float = DEFAULT_STATIC_MARGIN) -> float:
    """The per-option log-error sd whose expected between-option gap is ``ln(1 + margin)``."""
    if not 0 < margin < 10:
        raise ValueError(f"prior_sd_from_margin: margin must be in (0, 10), got {margin!r}")
    return math.log1p(margin) * math.sqrt(math.pi) / 2.0


def box_factor(beliefs: Mapping[str, tuple[float, float]], prior_sd: float) -> tuple[float, float]:
    """(estimate, variance) of the box-wide log factor ``g`` from the ran options' (mean, variance).

    Args:
        beliefs: per ran option, its posterior mean and variance of ``ln(measured / predicted)``.
        prior_sd: the per-option sd of ``e_k`` around ``g``.

    An option is an outlier when its mean is more than :data:`OUTLIER_Z` sds from the median of the
    others (sd: its own ``e_k`` and variance, plus the median's ``prior_sd^2 / (n - 1)``, first order);
    the others are averaged. Where every option is an outlier (two ran, far apart), the lowest mean is
    taken with the variance of one ran option. ``(0, 0)`` before any ran (the model's own prices).
    """
    if not (isinstance(prior_sd, (int, float)) and prior_sd > 0):
        raise ValueError(f"box_factor: prior_sd must be > 0, got {prior_sd!r}")
    order = sorted(beliefs, key=lambda k: (beliefs[k][0], k))  # by mean: each option's rest is O(1) away
    if not order:
        return 0.0, 0.0
    means = [beliefs[k][0] for k in order]
    inliers = [k for i, k in enumerate(order) if not _outlier(i, means, beliefs[k][1], prior_sd)]
    if not inliers:
        return means[0], prior_sd ** 2 + beliefs[order[0]][1]
    n = len(inliers)
    mean = math.fsum(beliefs[k][0] for k in inliers) / n
    return mean, math.fsum(prior_sd ** 2 + beliefs[k][1] for k in inliers) / (n * n)


def _outlier(i: int, means: list[float], var: float, prior_sd: float) -> bool:
    """Whether ``means[i]`` lies beyond :data:`OUTLIER_Z` sds of the median of the other means.

    Args:
        i: the index of the option tested in ``means``.
        means: the ran options' posterior means, sorted.
        var: the tested option's posterior variance.
        prior_sd: the per-option sd around the box factor.
    """
    rest = len(means) - 1
    if rest == 0:
        return False

    def other(j: int) -> float:  # the j-th smallest mean once ``means[i]`` is left out
        return means[j] if j < i else means[j + 1]

    median = other(rest // 2) if rest % 2 else (other(rest // 2 - 1) + other(rest // 2)) / 2.0
    sd = math.sqrt(prior_sd ** 2 * (1.0 + 1.0 / rest) + var)
    return abs(means[i] - median) > OUTLIER_Z * sd


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
        self._prior: tuple[float, float] | None = None  # cached prior(); cleared whenever a mean changes

    # ------------------------------------------------------------------ beliefs
    def prior(self) -> tuple[float, float]:
        """(mean, sd) of an option never run: the robust box factor of the options that ran
        (:func:`box_factor`), its sd ``prior_sd`` widened by the factor's own uncertainty."""
        if self._prior is None:
            g, var = box_factor({k: (self.mean[k], self.var[k]) for k in self.mean}, self.prior_sd)
            self._prior = (g, math.sqrt(self.prior_sd ** 2 + var))
        return self._prior

    def global_mean(self) -> float:
        """The prior mean of an option never run (:meth:`prior`), 0 before any ran."""
        return self.prior()[0]

    def belief(self, key: str) -> tuple[float, float]:
        """(mean, sd) of ``ln(measured / predicted)`` for ``key`` (the prior when never run)."""
        if key in self.mean:
            return self.mean[key], math.sqrt(self.var[key])
        return self.prior()

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
        Rows with non-positive or non-finite seconds are skipped (an idle stage says nothing). A row may
        carry a fourth element, its noise as a multiple of ``noise_sd`` (a short stage, e.g. a probe's
        slice, measures its ratio less precisely); a key's smallest applies."""
        sums: dict[str, list[float]] = {}
        for row in rows:
            key, predicted, measured = row[:3]
            scale = float(row[3]) if len(row) > 3 else 1.0
            if not (predicted > 0 and measured > 0 and math.isfinite(predicted) and math.isfinite(measured)):
                continue
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"MeasuredCorrection.observe: {key!r}'s noise scale must be > 0, got {scale!r}")
            acc = sums.setdefault(str(key), [0.0, 0.0, math.inf])
            acc[0] += float(predicted)
            acc[1] += float(measured)
            acc[2] = min(acc[2], scale)  # the longest row of a key sets its noise
        seen = {}
        for key in sorted(sums):
            y = math.log(sums[key][1] / sums[key][0])
            mean, sd = self.belief(key)
            var = sd * sd + self.drift_sd ** 2 if key in self.var else sd * sd
            gain = var / (var + (self.noise_sd * sums[key][2]) ** 2)
            self._prior = None
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
        self._prior = None

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> MeasuredCorrection:
        out = cls()
        out.load_state_dict(state)
        return out
