"""The guard by measurement: which of a step's candidate plans runs, from the measured correction.

Issue 53. Each step offers candidate plans of the same batch, priced once by the cost model (predicted
seconds per option): single-layout ("static") plans and multi-layout plans. :class:`MeasuredGuard`
re-weights them with a :class:`~.measured.MeasuredCorrection` and decides, from plain data only (the
same on every rank; a resumed state decides the same):

* **reference static**: a static layout kept across steps (initially the cheapest predicted); another
  static layout replaces it only when its corrected time beats the reference's by more than the gap's
  uncertainty (``GAP_Z`` sds of ``ln`` of the ratio), so a wrong static choice is corrected once measured;
* **multi-layout plan**: the cheapest corrected one runs only when it beats the reference static by
  more than the uncertainty of the options involved (the fixed margin at the prior, less once measured),
  and only once the reference static has been measured (it runs first);
* **drift**: a multi plan that measures slower than the reference's corrected time ``drift_steps``
  steps in a row is dropped for ``cooldown`` steps, with a log line;
* **exploration**: on a budget of ``budget`` of the run's measured seconds (charged the measured
  seconds above the exploit plan's corrected prediction), once the exploit plan's options have run,
  the candidate with the largest expected net saving runs instead: the value of one run of it
  (``E[max(0, X)]``, ``X ~ N(-|gap|, u^2)``, ``u`` how far one run may move its corrected time,
  :meth:`~.measured.MeasuredCorrection.update_sd`) times the seconds left in the run, less its
  corrected extra cost; never a candidate that does not fit memory (``fits`` False);
* **probes**: a candidate may carry a probe, a plan of the same batch that runs a slice of it under the
  candidate's options and the rest under the reference static (a hot switch inside the step). Measuring a
  probe tells the candidate's correction (a ratio, whatever the slice's size) at the probe's cost, less
  precisely (:func:`slice_noise`, which the update weighs); the exploration runs the probe where it costs
  less than the whole plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .measured import GAP_Z, MeasuredCorrection, StageRow

__all__ = ["Candidate", "Decision", "MeasuredGuard", "expected_gain", "slice_noise"]

#: steps a found gain is assumed to last when the run's length is unknown (``horizon`` None)
_DEFAULT_REMAINING = 100


@dataclass(frozen=True)
class Candidate:
    """One priced plan of the step's batch: ``seconds`` predicted per option key (summing to the
    plan's predicted step); ``static``: one layout (its ``name`` is the layout's, stable across steps)."""

    name: str
    seconds: Mapping[str, float]
    static: bool
    fits: bool = True
    probe: Mapping[str, float] | None = None  # predicted seconds per option of its probe plan (None: none)

    @property
    def usable(self) -> bool:
        return self.fits and bool(self.seconds) and all(math.isfinite(s) and s >= 0 for s in self.seconds.values())


@dataclass(frozen=True)
class Decision:
    """What runs this step, and why (logged; ``exploit`` is what would run without exploration)."""

    step: int
    run: str
    exploit: str
    reference: str
    exploring: bool
    reference_s: float  # the reference static's corrected seconds for this batch
    exploit_s: float  # the exploit plan's corrected seconds
    gain: float  # ln(reference / best multi), corrected (nan: no multi candidate)
    threshold: float  # what that gain had to exceed
    notes: tuple[str, ...] = field(default_factory=tuple)
    probe: bool = False  # ``run``'s probe plan runs (a slice of the batch under it), not its full plan


def slice_noise(whole: Mapping[str, float], probe: Mapping[str, float]) -> dict[str, float]:
    """Per option of a probe's slice, its measurement noise as a multiple of a whole plan's:
    ``sqrt(whole seconds / probe seconds)`` (a stage's noise averages over its length)."""
    return {k: math.sqrt(w / probe[k]) for k, w in whole.items() if 0 < probe.get(k, 0.0) < w}


def expected_gain(mean: float, sd: float) -> float:
    """``E[max(0, X)]`` for ``X ~ N(mean, sd^2)``."""
    if sd <= 0:
        return max(0.0, mean)
    z = mean / sd
    return mean * 0.5 * math.erfc(-z / math.sqrt(2.0)) + sd * math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


class MeasuredGuard:
    """Decides each step's plan from the measured correction (see the module docstring).

    ``budget``: exploration's share of the run's measured seconds (0: never explore);
    ``drift_steps`` / ``cooldown``: the drift rule; ``min_gain``: the least expected log gain worth
    exploring; ``reference``: the initial reference static (None: the cheapest predicted at the first step);
    ``horizon``: the run's steps when known (the budget is then a share of the whole run's expected
    seconds, spendable early), None: a share of the seconds so far.
    """

    def __init__(self, correction: MeasuredCorrection | None = None, budget: float = 0.03, drift_steps: int = 3,
                 cooldown: int = 50, min_gain: float = 0.0005, reference: str | None = None,
                 horizon: int | None = None) -> None:
        if not (isinstance(budget, (int, float)) and 0 <= budget < 1):
            raise ValueError(f"MeasuredGuard: budget must be in [0, 1), got {budget!r}")
        if drift_steps < 1 or cooldown < 0 or min_gain < 0:
            raise ValueError(f"MeasuredGuard: need drift_steps >= 1, cooldown >= 0, min_gain >= 0; got "
                             f"{drift_steps}, {cooldown}, {min_gain}")
        self.correction = correction or MeasuredCorrection()
        self.budget, self.drift_steps, self.cooldown, self.min_gain = float(budget), int(drift_steps), int(cooldown), \
            float(min_gain)
        if horizon is not None and horizon < 1:
            raise ValueError(f"MeasuredGuard: horizon must be >= 1 steps or None, got {horizon!r}")
        self.reference, self.horizon = reference, horizon
        self.slow_steps = 0  # consecutive multi steps measured slower than the reference
        self.banned_until = -1  # multi plans do not run before this step
        self.spent = 0.0  # exploration seconds charged
        self.elapsed = 0.0  # measured seconds of every step
        self.explored_steps = 0
        self.log: list[str] = []

    def _gap(self, a: Candidate, b: Candidate) -> tuple[float, float]:
        """(ln(T_b / T_a) corrected, its threshold): positive gap = ``a`` faster."""
        c = self.correction
        return math.log(c.corrected(b.seconds) / c.corrected(a.seconds)), GAP_Z * c.gap_sd(a.seconds, b.seconds)

    def decide(self, step: int, candidates: Sequence[Candidate]) -> Decision:
        """The plan to run at ``step`` among ``candidates`` (names unique)."""
        usable = [c for c in candidates if c.usable]
        statics = [c for c in usable if c.static]
        if len({c.name for c in candidates}) != len(candidates):
            raise ValueError(f"MeasuredGuard.decide: candidate names must be unique, got "
                             f"{[c.name for c in candidates]}")
        if not statics:
            raise ValueError(f"MeasuredGuard.decide: step {step} has no usable static candidate (the fallback); "
                             f"got {[c.name for c in candidates]}")
        corr = self.correction
        notes: list[str] = []
        ref = next((c for c in statics if c.name == self.reference), None)
        if ref is None:
            ref = min(statics, key=lambda c: (corr.corrected(c.seconds), c.name))
            notes.append(f"reference static {ref.name} (was {self.reference})")
        else:
            better = [(g - t, c) for c in statics if c is not ref for g, t in [self._gap(c, ref)] if g > t]
            if better:
                new = max(better, key=lambda x: (x[0], x[1].name))[1]
                notes.append(f"reference static {ref.name} -> {new.name}: measured faster beyond the uncertainty")
                ref = new
        self.reference = ref.name
        ref_s = corr.corrected(ref.seconds)
        multis = [c for c in usable if not c.static]
        exploit, gain, threshold = ref, math.nan, math.nan
        if multis:
            best = min(multis, key=lambda c: (corr.corrected(c.seconds), c.name))
            gain, threshold = self._gap(best, ref)
            measured_ref = all(corr.runs.get(k, 0) for k in ref.seconds)  # the fallback is measured first
            if gain > threshold and step >= self.banned_until and measured_ref:
                exploit = best
        exploit_s = corr.corrected(exploit.seconds)
        run, exploring, probe = exploit, False, False
        if self.budget > 0 and all(corr.runs.get(k, 0) for k in exploit.seconds):  # the exploit plan measured first
            # the budget: a share of the run's seconds so far, or of the whole run's expected seconds
            # when its length is known (then exploration may come early, where it is worth most)
            total = self.elapsed + exploit_s if self.horizon is None else max(self.elapsed, exploit_s * self.horizon)
            allowed = self.budget * total - self.spent
            remaining = _DEFAULT_REMAINING if self.horizon is None else max(1, self.horizon - step)
            scored = []
            for c in usable:
                if c is exploit or (not c.static and step < self.banned_until):
                    continue
                g = self._gap(c, exploit)[0]
                cost, by_probe = max(0.0, corr.corrected(c.seconds) - exploit_s), False
                if c.probe is not None and all(math.isfinite(s) and s >= 0 for s in c.probe.values()):
                    probe_cost = max(0.0, corr.corrected(c.probe) - exploit_s)
                    if probe_cost < cost:  # the probe measures the same options' ratios: run it where it costs less
                        cost, by_probe = probe_cost, True
                # what one run may change the choice by: a whole run's (a probe's noisier slice can be repeated;
                # weighing its noise here made the truth simulation explore less and gain less, DESIGN §10)
                value = expected_gain(-abs(g), corr.update_sd(c.seconds))
                net = value * exploit_s * remaining - cost  # expected seconds saved over the rest of the run
                if value > self.min_gain and cost <= allowed and net > 0:
                    scored.append((net, c.name, c, by_probe))
            if scored:
                _, _, run, probe = max(scored, key=lambda x: x[:2])
                exploring = True
        self.log.extend(f"step {step}: {n}" for n in notes)
        return Decision(int(step), run.name, exploit.name, ref.name, exploring, ref_s, exploit_s, gain, threshold,
                        tuple(notes), probe)

    def observe(self, decision: Decision, rows: Iterable[StageRow], static_run: bool) -> list[str]:
        """Feeds the step's measured stage table (of the plan ``decision.run``; ``static_run``: it was
        a static plan); returns new log lines (drift, exploration charged)."""
        rows = list(rows)
        measured = sum(r[2] for r in rows if r[2] > 0 and math.isfinite(r[2]))
        self.correction.observe(rows)
        self.elapsed += measured
        lines: list[str] = []
        if decision.exploring:
            self.explored_steps += 1
            self.spent += max(0.0, measured - decision.exploit_s)
        elif not static_run:  # the exploit plan was a multi plan: drift check against the reference
            self.slow_steps = self.slow_steps + 1 if measured > decision.reference_s else 0
            if self.slow_steps >= self.drift_steps:
                self.banned_until = decision.step + 1 + self.cooldown
                self.slow_steps = 0
                lines.append(f"step {decision.step}: multi-layout plan {decision.run} measured slower than static "
                             f"{decision.reference} for {self.drift_steps} steps: dropped until step "
                             f"{self.banned_until}")
        self.log.extend(lines)
        return lines

    @property
    def exploration_share(self) -> float:
        return self.spent / self.elapsed if self.elapsed > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"correction": self.correction.state_dict(), "budget": self.budget, "drift_steps": self.drift_steps,
                "cooldown": self.cooldown, "min_gain": self.min_gain, "reference": self.reference,
                "horizon": self.horizon,
                "slow_steps": self.slow_steps, "banned_until": self.banned_until, "spent": self.spent,
                "elapsed": self.elapsed, "explored_steps": self.explored_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.__init__(MeasuredCorrection.from_state(state["correction"]), float(state["budget"]),  # type: ignore[misc]
                      int(state["drift_steps"]), int(state["cooldown"]), float(state["min_gain"]), state["reference"],
                      state.get("horizon"))
        self.slow_steps, self.banned_until = int(state["slow_steps"]), int(state["banned_until"])
        self.spent, self.elapsed = float(state["spent"]), float(state["elapsed"])
        self.explored_steps = int(state["explored_steps"])
