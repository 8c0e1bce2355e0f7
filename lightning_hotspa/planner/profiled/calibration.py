"""Profiled mode: fit each option's ``a*s^2 + b*s`` per document and ``c`` per micro-batch to timings.

Hydraulis fits ``time = a s^2 + b s + c`` per strategy (docs/REFERENCE.md §5); here one observation is one
rank's measured compute seconds of one stage, whose features are ``(sum s^2, sum s, micro-batches,
documents)`` over that rank's micro-batches (padded lengths): ``c`` is paid per micro-batch (launches,
collective latencies) and ``e`` per document (per-document attention calls), so the fit is linear
least squares. It minimizes
RELATIVE error (rows scaled by ``1/seconds``: the target is "within x%") and keeps coefficients
non-negative (exact NNLS for three unknowns: the best of the LS solutions on every support). An
option with too few or too uniform observations to separate the three terms keeps its analytic
coefficients times one global scale fitted over all observations, so unobserved options stay
comparable with observed ones.

Determinism (docs/DESIGN.md §4, "Who holds what"): every rank must plan with the same coefficients. Ranks
time different micro-batches, so the strategy rides the rows on the step's one all-gather
(:func:`lightning_hotspa.engine.records.gather_step`, then
:func:`lightning_hotspa.adapter.lightning.profiling.gathered_observations`),
every rank feeds the same rows in the same order to :meth:`ProfiledCoefficients.observe`, and
coefficients change only in :meth:`ProfiledCoefficients.refit` at steps that are multiples of
``refit_every``; which plans a new version affects is :mod:`.schedule`'s business. Fitted values are
rounded to 9 significant digits so tiny platform differences in the last bits cannot split ranks.
:func:`encode_observations` / :func:`decode_observations` are the wire format for other exchanges
(``hotspa check-calibration``) and for checkpoints.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...activation_checkpointing import Checkpointing
from ...layout import Layout
from ..cost.cost_model import OptionCost
from ..solve.packing import cp_padded_lengths

__all__ = [
    "CalibrationReport",
    "Observation",
    "ProfiledCoefficients",
    "apply_coefficients",
    "ROW_WIDTH",
    "decode_observations",
    "encode_observations",
    "fit_option",
    "held_out_error",
    "held_out_stage_error",
    "nnls",
    "stage_errors",
]

OptionKey = tuple[Layout, Checkpointing]
Coefficients = tuple[float, float, float, float]  # a, b, c, e


@dataclass(frozen=True)
class Observation:
    """One rank's measured compute seconds of one stage, with the features the fit needs."""

    layout: Layout
    activation_checkpointing: Checkpointing  # (a bool or name is parsed)
    sum_sq: float  # sum over micro-batches and documents of padded length^2
    sum_len: float  # sum of padded lengths
    micro_batches: int
    seconds: float
    documents: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing", Checkpointing.parse(self.activation_checkpointing))

    @classmethod
    def from_lengths(cls, layout: Layout, activation_checkpointing: Checkpointing | bool,
                     micro_batch_lengths: Sequence[Sequence[int]], seconds: float) -> Observation:
        """``micro_batch_lengths``: the raw (unpadded, whole-document) lengths in each micro-batch."""
        flat = np.asarray([n for mb in micro_batch_lengths for n in mb], dtype=np.int64)
        s = cp_padded_lengths(flat, layout.cp).astype(np.float64)
        return cls(layout, Checkpointing.parse(activation_checkpointing), float((s * s).sum()), float(s.sum()),
                   len(micro_batch_lengths), float(seconds), int(flat.size))

    @classmethod
    def from_rank_stage(cls, stage: Any, seconds: float) -> Observation:
        """From a :class:`~lightning_hotspa.plan.RankStage` (cp-sliced micro-batches): a local
        document of a cp rank is exactly 1/cp of its padded row."""
        cp = stage.layout.cp
        lengths = []
        for mb in stage.micro_batches:
            cu = np.asarray(mb.cu_seqlens.tolist(), dtype=np.int64)
            lengths.append((np.diff(cu) * cp).tolist())
        return cls.from_lengths(stage.layout, stage.activation_checkpointing, lengths, seconds)

    @property
    def key(self) -> OptionKey:
        return (self.layout, self.activation_checkpointing)

    def features(self) -> np.ndarray:
        """Multipliers of (a, b, c per micro-batch, e per document)."""
        return np.array([self.sum_sq, self.sum_len, float(self.micro_batches), float(self.documents)])


def predict(option: OptionCost, obs: Observation) -> float:
    """What ``option`` predicts for the observation's micro-batches."""
    return (option.quadratic * obs.sum_sq + option.linear * obs.sum_len + option.per_micro_batch * obs.micro_batches
            + option.per_document * obs.documents)


# ------------------------------------------------------------------------------------------ fitting
def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``argmin ||a x - y||`` over ``x >= 0`` for a few columns: the best non-negative LS solution
    on any support (KKT: the optimum is the unconstrained LS solution on its own support)."""
    a = np.asarray(a, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    k = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms
    best, best_res = np.zeros(k), float(y @ y)
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(k)
            x[cols] = sol
            r = scaled @ x - y
            res = float(r @ r)
            if res < best_res - 1e-15 * max(1.0, best_res):
                best, best_res = x, res
    return best / norms


def _round(x: float) -> float:
    return float(f"{x:.9g}")


def fit_scale(prior: Mapping[OptionKey, OptionCost], observations: Sequence[Observation]) -> float:
    """One factor k minimizing the relative error of ``k * prior`` over all observations (1.0: none)."""
    num = den = 0.0
    for obs in observations:
        if obs.key in prior and obs.seconds > 0:
            p = predict(prior[obs.key], obs) / obs.seconds
            num += p
            den += p * p
    return num / den if den > 0 else 1.0


def fit_option(observations: Sequence[Observation]) -> tuple[float, float, float, float] | None:
    """Non-negative ``(a, b, c, e)`` of one option by relative-error least squares. The
    per-document term ``e`` is dropped (0) when the observations cannot tell it from the
    per-micro-batch one; None when even ``(a, b, c)`` are not separable (rank < 3)."""
    rows = [o.features() / o.seconds for o in observations if o.seconds > 0]
    if len(rows) < 3:
        return None
    a = np.vstack(rows)
    for cols in ([0, 1, 2, 3], [0, 1, 2]):
        sub = a[:, cols]
        scaled = sub / np.maximum(np.linalg.norm(sub, axis=0), 1e-300)
        if np.linalg.matrix_rank(scaled, tol=1e-6) == len(cols):
            x = np.zeros(4)
            x[cols] = nnls(sub, np.ones(len(rows)))
            return (_round(x[0]), _round(x[1]), _round(x[2]), _round(x[3]))
    return None


def apply_coefficients(option: OptionCost, scale: float, fitted: Mapping[OptionKey, Coefficients]) -> OptionCost:
    """``option`` with its fitted coefficients, or its analytic ones times ``scale`` when it has none (a fit
    measured the cp ring's exposure into its coefficients: the analytic ring term is dropped; the scale's
    observations leave it out, ``predict``: it is 0 wherever nothing overlaps, as on cpu-gloo)."""
    key = (option.layout, option.activation_checkpointing)
    if key in fitted:
        return option.with_coefficients(*fitted[key], ring_scale=0.0)
    return option.with_coefficients(option.quadratic * scale, option.linear * scale, option.per_micro_batch * scale,
                                    option.per_document * scale, ring_scale=scale)


# ------------------------------------------------------------------------------------------ state
class ProfiledCoefficients:
    """Pending observations and the fitted coefficients, with a version that bumps on each change.

    ``window``: observations kept per option (oldest dropped first); ``min_observations``: an option
    gets its own fit only with that many, otherwise its analytic coefficients times the global scale.
    """

    def __init__(self, refit_every: int = 10, window: int = 256, min_observations: int = 6) -> None:
        if refit_every < 1 or window < 1 or min_observations < 1:
            raise ValueError("refit_every, window and min_observations must be >= 1")
        self.refit_every, self.window = refit_every, window
        self.min_observations = min_observations
        self.version = 0
        self.last_refit_step = -1
        self.scale = 1.0
        self.fitted: dict[OptionKey, Coefficients] = {}
        self.observations: list[Observation] = []

    def observe(self, observations: Iterable[Observation]) -> None:
        """Buffers observations (identical on every rank: feed all-gathered rows). No effect on
        plans until :meth:`refit`."""
        for obs in observations:
            if obs.micro_batches == 0 or not (obs.seconds > 0 and np.isfinite(obs.seconds)):
                continue  # an idle dp group says nothing about the coefficients
            self.observations.append(obs)
        counts: dict[OptionKey, int] = {}
        kept: list[Observation] = []
        for obs in reversed(self.observations):
            counts[obs.key] = counts.get(obs.key, 0) + 1
            if counts[obs.key] <= self.window:
                kept.append(obs)
        self.observations = kept[::-1]

    def due(self, step: int) -> bool:
        return step % self.refit_every == 0 and step != self.last_refit_step and bool(self.observations)

    def refit(self, step: int, prior: Mapping[OptionKey, OptionCost]) -> bool:
        """Refits at steps that are multiples of ``refit_every``; True when coefficients changed."""
        if not self.due(step):
            return False
        self.last_refit_step = step
        scale = _round(fit_scale(prior, self.observations))
        fitted: dict[OptionKey, Coefficients] = {}
        by_key: dict[OptionKey, list[Observation]] = {}
        for obs in self.observations:
            by_key.setdefault(obs.key, []).append(obs)
        for key, obs in by_key.items():
            if key in prior and len(obs) >= self.min_observations:
                coeffs = fit_option(obs)
                if coeffs is not None:
                    fitted[key] = coeffs
        changed = fitted != self.fitted or scale != self.scale
        self.fitted, self.scale = fitted, scale
        if changed:
            self.version += 1
        return changed

    def apply(self, option: OptionCost) -> OptionCost:
        """The option with fitted coefficients (or its analytic ones times the global scale)."""
        return apply_coefficients(option, self.scale, self.fitted)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "last_refit_step": self.last_refit_step,
            "scale": self.scale,
            "fitted": [[k[0].to_state(), str(Checkpointing.parse(k[1])), list(v)]
                       for k, v in sorted(self.fitted.items(), key=lambda kv: (kv[0][0].name, str(kv[0][1])))],
            # the observations' layout indices point into this list (encode_observations: sorted by name)
            "observations": encode_observations(self.observations, None).tolist(),
            "layouts": [lay.to_state() for lay in sorted({o.layout for o in self.observations}, key=lambda x: x.name)],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        self.last_refit_step = int(state.get("last_refit_step", -1))
        self.scale = float(state.get("scale", 1.0))
        self.fitted = {(Layout.from_state(lay), Checkpointing.parse(ac)): tuple(float(x) for x in v)  # type: ignore[misc]
                       for lay, ac, v in state.get("fitted", [])}
        layouts = [Layout.from_state(lay) for lay in state.get("layouts", [])]
        rows = np.asarray(state.get("observations", []), dtype=np.float64)
        self.observations = decode_observations(rows, layouts) if rows.size else []


# ------------------------------------------------------------------------------------------ wire format
ROW_WIDTH = 7
#: the wire code of a checkpointing mode: its index here (0 / 1 were False / True before "selective")
_MODES = (Checkpointing.NONE, Checkpointing.FULL, Checkpointing.SELECTIVE)


def encode_observations(observations: Sequence[Observation], layouts: Sequence[Layout] | None) -> np.ndarray:
    """``[k, 7]`` float64 rows ``(layout index, ac, sum s^2, sum s, micro-batches, seconds, documents)``
    to all-gather across ranks. ``layouts`` None: index into the sorted names of the observed layouts."""
    if layouts is None:
        observed = sorted({o.layout for o in observations}, key=lambda lay: lay.name)
        index = {lay: i for i, lay in enumerate(observed)}
    else:
        index = {lay: i for i, lay in enumerate(layouts)}
    out = np.zeros((len(observations), ROW_WIDTH), dtype=np.float64)
    for r, o in enumerate(observations):
        mode = float(_MODES.index(o.activation_checkpointing))
        out[r] = (index[o.layout], mode, o.sum_sq, o.sum_len, o.micro_batches,
                  o.seconds, o.documents)
    return out


def decode_observations(rows: np.ndarray, layouts: Sequence[Layout]) -> list[Observation]:
    """Inverse of :func:`encode_observations` (rows of all ranks, in rank order)."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, ROW_WIDTH)
    return [Observation(layouts[int(r[0])], _MODES[int(r[1])], float(r[2]), float(r[3]), int(r[4]), float(r[5]),
                        int(r[6]))
            for r in rows]


# ------------------------------------------------------------------------------------------ checking
@dataclass(frozen=True)
class CalibrationReport:
    """Relative error |predicted - measured| / measured on held-out observations."""

    train: int
    test: int
    mean_error: float
    p90_error: float
    max_error: float
    per_option: dict[str, float]
    analytic_mean_error: float  # the same held-out rows, uncalibrated analytic prediction

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _label(key: OptionKey) -> str:
    return key[0].name + Checkpointing.parse(key[1]).suffix


def held_out_error(observations: Sequence[Observation], prior: Mapping[OptionKey, OptionCost],
                   train_fraction: float = 0.6, min_observations: int = 6) -> CalibrationReport:
    """Fits on the first ``train_fraction`` of the observations (in order: earlier steps) and
    reports the relative error on the rest (later, held-out steps)."""
    obs = [o for o in observations if o.key in prior and o.seconds > 0 and o.micro_batches > 0]
    cut = int(round(len(obs) * train_fraction))
    train, test = obs[:cut], obs[cut:]
    if not train or not test:
        raise ValueError(f"need observations on both sides of the split, got {len(train)} / {len(test)}")
    coeffs = ProfiledCoefficients(refit_every=1, window=10**9, min_observations=min_observations)
    coeffs.observe(train)
    coeffs.refit(0, prior)
    errors: list[float] = []
    analytic: list[float] = []
    per: dict[str, list[float]] = {}
    for o in test:
        opt = coeffs.apply(prior[o.key])
        e = abs(predict(opt, o) - o.seconds) / o.seconds
        errors.append(e)
        analytic.append(abs(predict(prior[o.key], o) - o.seconds) / o.seconds)
        per.setdefault(_label(o.key), []).append(e)
    arr = np.asarray(errors)
    return CalibrationReport(len(train), len(test), float(arr.mean()), float(np.percentile(arr, 90)),
                             float(arr.max()), {k: float(np.mean(v)) for k, v in sorted(per.items())},
                             float(np.mean(analytic)))


def held_out_stage_error(steps: Sequence[Sequence[Observation]], prior: Mapping[OptionKey, OptionCost],
                         train_steps: int, min_observations: int = 6) -> dict[str, Any]:
    """Stage-level check: fit on every rank's observations of the first ``train_steps`` steps, then
    for each later step and option compare the predicted stage time (the slowest rank's predicted
    seconds, as the solver's "slowest dp group") with the measured one (the slowest rank's seconds).

    ``steps``: per step, every rank's observations (rank-major or not, order does not matter).
    Returns mean and max relative error overall and per option, and the fitted coefficients.
    """
    if not 1 <= train_steps < len(steps):
        raise ValueError(f"train_steps must leave held-out steps: got {train_steps} of {len(steps)} steps")
    return stage_errors(steps[:train_steps], steps[train_steps:], prior, min_observations)


def stage_errors(fit_steps: Sequence[Sequence[Observation]], check_steps: Sequence[Sequence[Observation]],
                 prior: Mapping[OptionKey, OptionCost], min_observations: int = 6) -> dict[str, Any]:
    """Stage-level errors on ``check_steps`` of a fit to ``fit_steps`` (see :func:`held_out_stage_error`)."""
    coeffs = ProfiledCoefficients(refit_every=1, window=10**9, min_observations=min_observations)
    coeffs.observe(o for step in fit_steps for o in step if o.key in prior)
    coeffs.refit(0, prior)
    per: dict[str, list[float]] = {}
    for step in check_steps:
        by_key: dict[OptionKey, list[Observation]] = {}
        for o in step:
            if o.key in prior and o.micro_batches > 0 and o.seconds > 0:
                by_key.setdefault(o.key, []).append(o)
        for key, obs in by_key.items():
            opt = coeffs.apply(prior[key])
            measured = max(o.seconds for o in obs)
            per.setdefault(_label(key), []).append(abs(max(predict(opt, o) for o in obs) - measured) / measured)
    if not per:
        raise ValueError("no held-out stage ran any micro-batch")
    every = [e for v in per.values() for e in v]
    return {"stage_mean_error": float(np.mean(every)), "stage_max_error": float(np.max(every)),
            "stage_per_option": {k: float(np.mean(v)) for k, v in sorted(per.items())},
            "stages": len(every), "fitted": {_label(k): list(v) for k, v in sorted(
                coeffs.fitted.items(), key=lambda kv: _label(kv[0]))}, "scale": coeffs.scale}
