"""Issue 53: the measured correction and the guard by measurement, on a controlled clock.

The clock is injected: each option's true seconds are its predicted seconds times a factor the test
sets (and may change mid-run), times optional seeded noise. No timing is read from the machine."""

import json
import math

import numpy as np
import pytest

from lightning_hotspa.planner.profiled.measured import (
    GAP_Z,
    OUTLIER_Z,
    MeasuredCorrection,
    box_factor,
    prior_sd_from_margin,
)
from lightning_hotspa.planner.profiled.measured_guard import Candidate, MeasuredGuard, expected_gain, slice_noise
from lightning_hotspa.planner.solve.static_guard import DEFAULT_STATIC_MARGIN

pytestmark = pytest.mark.fast


class Clock:
    """Measured stage seconds: predicted x the option's true factor x exp(N(0, noise))."""

    def __init__(self, factors: dict[str, float], noise: float = 0.0, seed: int = 0) -> None:
        self.factors, self.noise = dict(factors), noise
        self.rng = np.random.default_rng(seed)

    def table(self, cand: Candidate) -> list[tuple[str, float, float]]:
        return [(k, s, s * self.factors.get(k, 1.0) * math.exp(self.rng.normal(0.0, self.noise) if self.noise else 0.0))
                for k, s in cand.seconds.items()]

    def true(self, cand: Candidate) -> float:
        return sum(s * self.factors.get(k, 1.0) for k, s in cand.seconds.items())


def step(guard: MeasuredGuard, clock: Clock, t: int, cands: list[Candidate]):
    d = guard.decide(t, cands)
    run = next(c for c in cands if c.name == d.run)
    guard.observe(d, clock.table(run), static_run=run.static)
    return d


def two_layouts(gain: float) -> list[Candidate]:
    """Static A (10 s) and B (11 s); a multi plan over options a2, b2 predicted ``gain`` faster than A."""
    multi = 10.0 / (1.0 + gain)
    return [Candidate("A", {"A": 10.0}, True), Candidate("B", {"B": 11.0}, True),
            Candidate("multi", {"a2": multi / 2, "b2": multi / 2}, False)]


def test_prior_threshold_is_the_fixed_margin():
    """Before anything is measured the guard needs exactly the published margin: the margin is the prior."""
    corr = MeasuredCorrection()
    sd = corr.gap_sd({"x": 1.0}, {"y": 1.0})
    assert GAP_Z * sd == pytest.approx(math.log1p(DEFAULT_STATIC_MARGIN), rel=1e-12)
    assert prior_sd_from_margin(0.135) == pytest.approx(0.1122, abs=1e-4)
    for gain in (DEFAULT_STATIC_MARGIN + 0.005, DEFAULT_STATIC_MARGIN - 0.005):
        d = MeasuredGuard(budget=0.0).decide(0, [Candidate("A", {"A": 10.0}, True),
                                                 Candidate("multi", {"m": 10.0 / (1 + gain)}, False)])
        assert d.threshold == pytest.approx(math.log1p(DEFAULT_STATIC_MARGIN), rel=1e-12)
        assert (d.gain > d.threshold) is (gain > DEFAULT_STATIC_MARGIN)
        assert d.exploit == "A"  # whatever the gain: the static fallback is measured first


def test_correction_converges_and_round_trips():
    corr = MeasuredCorrection(noise_sd=0.05)
    rng = np.random.default_rng(1)
    for _ in range(200):
        corr.observe([("x", 2.0, 2.0 * 1.3 * math.exp(rng.normal(0, 0.05))), ("y", 1.0, 1.1)])
    mean, sd = corr.belief("x")
    assert mean == pytest.approx(math.log(1.3), abs=0.02) and sd < 0.02
    assert corr.runs["x"] == 200
    # a never-run option: centred on the mean correction of the options that ran (they agree), its sd
    # the prior's widened by that mean's own variance (two options: prior_sd^2 / 2, to first order)
    mean_z, sd_z = corr.belief("z")
    assert mean_z == pytest.approx((math.log(1.3) + math.log(1.1)) / 2, abs=0.02)
    assert sd_z == pytest.approx(corr.prior_sd * math.sqrt(1.5), rel=0.01)
    again = MeasuredCorrection.from_state(json.loads(json.dumps(corr.state_dict())))
    assert again.state_dict() == corr.state_dict() and again.belief("x") == corr.belief("x")
    with pytest.raises(ValueError, match="bad entry for 'q'"):
        MeasuredCorrection().load_state_dict({**corr.state_dict(), "options": [["q", float("nan"), 0.1, 1]]})
    with pytest.raises(ValueError, match="noise_sd must be in"):
        MeasuredCorrection(noise_sd=0.0)
    # rows with a zero or non-finite seconds say nothing
    assert MeasuredCorrection().observe([("x", 1.0, 0.0), ("y", float("nan"), 1.0)]) == {}


def _ran(factors: dict[str, float], steps: int = 10) -> MeasuredCorrection:
    """A correction that saw ``steps`` noise-free runs of each option at its factor (10 s predicted)."""
    corr = MeasuredCorrection(noise_sd=0.02)
    for _ in range(steps):
        corr.observe([(k, 10.0, 10.0 * f) for k, f in factors.items()])
    return corr


def test_one_slowed_option_does_not_raise_the_unmeasured_prior():
    """Corrections ~0, ~0, ln 2 (one layout slowed 2x): a never-run option's prior stays near 0 (the
    arithmetic mean put it at ~ln 2 / 3); with no outlier the estimate is the plain mean."""
    corr = _ran({"A": 2.0, "B": 1.0, "C": 1.01})
    plain_mean = sum(corr.mean.values()) / 3
    assert plain_mean > 0.2  # the old prior: one slowed layout raised every unmeasured one by ~6 prior sds / 3
    mean_d, sd_d = corr.belief("D")
    assert mean_d == pytest.approx((corr.mean["B"] + corr.mean["C"]) / 2, abs=1e-12) and abs(mean_d) < 0.01
    var_g = (2 * corr.prior_sd ** 2 + corr.var["B"] + corr.var["C"]) / 4  # the mean of B and C's variance
    assert sd_d == pytest.approx(math.sqrt(corr.prior_sd ** 2 + var_g), rel=1e-12)
    agree = _ran({"A": 1.1, "B": 1.0, "C": 0.95, "E": 1.05})  # within the prior's spread: no outlier
    assert agree.belief("D")[0] == pytest.approx(sum(agree.mean.values()) / 4, abs=1e-12)
    # two ran options: one cannot tell the outlier; far apart -> the lower (optimism), close -> the mean
    apart = _ran({"A": 2.0, "B": 1.0})
    assert apart.belief("D")[0] == apart.mean["B"] < 0.01
    close = _ran({"A": 1.1, "B": 1.0})
    assert close.belief("D")[0] == pytest.approx((close.mean["A"] + close.mean["B"]) / 2, abs=1e-12)
    assert box_factor({}, 0.1) == (0.0, 0.0) and MeasuredCorrection().belief("D")[1] == MeasuredCorrection().prior_sd
    edge = OUTLIER_Z * math.sqrt(2.0) * 0.1  # two options exactly this far apart still agree
    assert box_factor({"a": (0.0, 0.0), "b": (edge * 0.999, 0.0)}, 0.1)[0] == pytest.approx(edge * 0.999 / 2)
    assert box_factor({"a": (0.0, 0.0), "b": (edge * 1.001, 0.0)}, 0.1)[0] == 0.0
    with pytest.raises(ValueError, match="prior_sd must be > 0, got -1"):
        box_factor({"a": (0.0, 0.0)}, -1)


def test_a_never_run_layout_is_explored_despite_one_slowed_layout():
    """A (the model's favourite) ran slowed 2x, B and C at the model's price; D never ran and is truly
    10 % faster than the model says. The guard explores D and makes it the reference; with the prior at
    the MEAN correction (~0.23) D looked 26 % dearer and was never run."""
    clock = Clock({"A": 2.0, "B": 1.0, "C": 1.01, "D": 0.9})
    corr = _ran({k: clock.factors[k] for k in "ABC"})
    guard = MeasuredGuard(corr, budget=0.03, horizon=100, reference="B")
    cands = [Candidate(k, {k: 10.0}, True) for k in "ABCD"]
    first = step(guard, clock, 0, cands)
    assert first.run == "D" and first.exploring and first.exploit == "B"
    runs = [step(guard, clock, t, cands).run for t in range(1, 30)]
    assert guard.reference == "D" == min(cands, key=clock.true).name and runs[-10:] == ["D"] * 10


def test_never_runs_a_plan_that_measures_slower_than_static():
    """The model promises 25 % (above the margin); the multi plan's options are truly 40 % slow."""
    clock = Clock({"a2": 1.4, "b2": 1.4}, noise=0.02, seed=3)
    guard = MeasuredGuard(MeasuredCorrection(noise_sd=0.02), budget=0.0)
    cands = two_layouts(0.25)
    runs = [step(guard, clock, t, cands).run for t in range(30)]
    assert runs[:2] == ["A", "multi"]  # static measured first; the prior trusts the model by the margin once
    assert runs[2:] == ["A"] * 28  # then never again: it measures slower than static
    assert clock.true(cands[2]) > clock.true(cands[0])


def test_measured_gain_below_the_margin_runs():
    """A 6 % gain the fixed margin refuses: explored once, measured, then run every step."""
    clock = Clock({}, noise=0.02, seed=4)
    guard = MeasuredGuard(MeasuredCorrection(noise_sd=0.02), budget=0.03, horizon=100)
    cands = two_layouts(0.06)
    decisions = [step(guard, clock, t, cands) for t in range(100)]
    assert decisions[0].exploit == "A" and not decisions[0].exploring  # the static plan is measured first
    first = next(t for t, d in enumerate(decisions) if d.run == "multi")
    assert decisions[first].exploring and first <= 3
    assert all(d.exploit == "multi" for d in decisions[first + 1:])
    assert decisions[-1].threshold < math.log(1.06) < math.log1p(DEFAULT_STATIC_MARGIN)


def test_drops_a_plan_that_slows_down():
    clock = Clock({}, noise=0.0)
    guard = MeasuredGuard(MeasuredCorrection(noise_sd=0.02), budget=0.0, drift_steps=3, cooldown=20)
    cands = two_layouts(0.25)
    assert [step(guard, clock, t, cands).run for t in range(10)] == ["A"] + ["multi"] * 9
    clock.factors.update(a2=1.5, b2=1.5)  # another job on the node: the multi plan's layouts slow down
    runs = [step(guard, clock, t, cands).run for t in range(10, 40)]
    slow = runs.index("A")
    assert slow <= 3 and all(r == "A" for r in runs[slow:slow + 20])
    assert any("dropped" in line for line in guard.log) or slow < 3  # by the drift rule or the correction
    # the slow steps measured: the correction alone would also refuse it now
    assert guard.correction.belief("a2")[0] > 0.1


def test_drift_rule_drops_when_the_correction_lags():
    """A correction that trusts its past (tiny noise, no drift term) keeps the multi plan; the drift
    rule drops it after ``drift_steps`` slow steps, with a log line, for ``cooldown`` steps."""
    clock = Clock({}, noise=0.0)
    corr = MeasuredCorrection(noise_sd=0.3, drift_sd=0.0)  # heavy assumed noise: the mean moves slowly
    guard = MeasuredGuard(corr, budget=0.0, drift_steps=3, cooldown=20)
    cands = two_layouts(0.25)
    for t in range(60):
        step(guard, clock, t, cands)
    clock.factors.update(a2=1.35, b2=1.35)
    runs = [step(guard, clock, t, cands).run for t in range(60, 90)]
    assert runs[:3] == ["multi"] * 3 and runs[3:23] == ["A"] * 20, runs
    assert any("dropped until step 83" in line for line in guard.log), guard.log


def many_statics(seed: int) -> tuple[list[Candidate], Clock]:
    rng = np.random.default_rng(seed)
    cands = [Candidate(f"S{i}", {f"S{i}": 10.0 + 0.2 * i}, True) for i in range(12)]
    cands.append(Candidate("big", {"big": 5.0}, True, fits=False))  # fastest of all, but out of memory
    factors = {f"S{i}": float(np.exp(rng.normal(0, 0.115))) for i in range(12)}
    factors["big"] = 0.5
    return cands, Clock(factors, noise=0.02, seed=seed)


@pytest.mark.parametrize("horizon", [None, 300])
def test_explores_within_the_budget_and_finds_the_true_best_static(horizon):
    cands, clock = many_statics(7)
    guard = MeasuredGuard(MeasuredCorrection(noise_sd=0.02), budget=0.03, horizon=horizon, reference="S0")
    decisions = [step(guard, clock, t, cands) for t in range(300)]
    assert all(d.run != "big" for d in decisions)  # never an option that does not fit memory
    assert guard.explored_steps > 0
    total = guard.elapsed if horizon is None else max(guard.elapsed, decisions[-1].exploit_s * horizon)
    # the budget holds up to the last exploration's surprise (one step's charge over the prediction)
    assert guard.spent <= 0.03 * total + max(clock.true(c) for c in cands if c.fits) * 0.5
    true_best = min((c for c in cands if c.fits), key=clock.true).name
    assert guard.reference == true_best != "S0"
    off = MeasuredGuard(MeasuredCorrection(noise_sd=0.02), budget=0.0, reference="S0")
    assert all(step(off, clock, t, cands).run == "S0" for t in range(50)) and off.explored_steps == 0


@pytest.mark.parametrize("horizon,budget", [(None, 0.01), (200, 0.002)])
def test_exploration_spends_at_most_the_budget(horizon, budget):
    """The model is right (no surprise): at every step, what exploration was charged is within the budget."""
    cands = [Candidate(f"S{i}", {f"S{i}": 10.0 + 0.5 * i}, True) for i in range(30)]
    clock = Clock({}, noise=0.0)
    guard = MeasuredGuard(MeasuredCorrection(noise_sd=0.02), budget=budget, horizon=horizon, reference="S0")
    for t in range(200):
        assert step(guard, clock, t, cands).exploit == "S0"  # nothing measures faster: the reference stays
        total = guard.elapsed if horizon is None else max(guard.elapsed, 10.0 * horizon)
        assert guard.spent <= budget * total + 1e-9, t
    assert guard.explored_steps >= 2


def test_resumed_state_gives_the_same_decisions():
    cands, _ = many_statics(11)
    cands.append(Candidate("multi", {"S1": 4.6, "S5": 4.8}, False))

    def clock() -> Clock:
        return Clock(many_statics(11)[1].factors, noise=0.05, seed=5)

    first, c1 = MeasuredGuard(MeasuredCorrection(noise_sd=0.05), budget=0.01), clock()
    full = [step(first, c1, t, cands) for t in range(80)]
    second, c2 = MeasuredGuard(MeasuredCorrection(noise_sd=0.05), budget=0.01), clock()
    for t in range(40):
        step(second, c2, t, cands)
    resumed = MeasuredGuard()
    resumed.load_state_dict(json.loads(json.dumps(second.state_dict())))  # a checkpoint: plain data
    assert [step(resumed, c2, t, cands) for t in range(40, 80)] == full[40:]
    assert sum(d.exploring for d in full) > 0 and len({d.run for d in full}) > 2  # the replay decided things


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="budget must be in"):
        MeasuredGuard(budget=1.5)
    with pytest.raises(ValueError, match="no usable static candidate"):
        MeasuredGuard().decide(0, [Candidate("m", {"a": 1.0}, False), Candidate("S", {"S": 1.0}, True, fits=False)])
    with pytest.raises(ValueError, match="names must be unique"):
        MeasuredGuard().decide(0, [Candidate("S", {"S": 1.0}, True), Candidate("S", {"T": 1.0}, True)])


def test_expected_gain_closed_form():
    rng = np.random.default_rng(0)
    x = rng.normal(-0.02, 0.05, 400_000)
    assert expected_gain(-0.02, 0.05) == pytest.approx(np.maximum(x, 0).mean(), rel=0.01)
    assert expected_gain(0.3, 0.0) == 0.3 and expected_gain(-0.3, 0.0) == 0.0


def test_a_cheaper_probe_runs_instead_of_the_whole_plan_and_is_charged_its_own_cost():
    """B (never run, 2 % dearer than A) carries a probe: 1/8 of the batch under B, the rest under A, plus
    0.1 s of switches. Exploring B runs the probe where it is predicted cheaper than B's whole plan, the
    whole plan where not; the charge is the measured excess over the exploit plan either way."""
    def cands(probe_extra: float) -> list[Candidate]:
        probe = {"A": 10.0 * 7 / 8, "B": 10.2 / 8 + probe_extra}
        return [Candidate("A", {"A": 10.0}, True), Candidate("B", {"B": 10.2}, True, probe=probe)]

    for extra, by_probe in ((0.1, True), (0.5, False)):
        guard, clock = MeasuredGuard(budget=0.05, horizon=100, reference="A"), Clock({"A": 1.0, "B": 0.9})
        step(guard, clock, 0, cands(extra))  # A runs first (the reference is measured before exploring)
        d = guard.decide(1, cands(extra))
        assert (d.run, d.exploring, d.probe) == ("B", True, by_probe)
        run = next(c for c in cands(extra) if c.name == "B")
        plan = run.probe if d.probe else run.seconds
        rows = [(k, s, s * clock.factors[k]) for k, s in plan.items()]
        guard.observe(d, rows, static_run=not d.probe)
        measured = sum(r[2] for r in rows)
        assert guard.spent == pytest.approx(max(0.0, measured - d.exploit_s))
        assert guard.correction.belief("B")[0] == pytest.approx(math.log(0.9), abs=0.01)  # a ratio, whatever the slice
    no_probe = [Candidate("A", {"A": 10.0}, True), Candidate("B", {"B": 10.2}, True)]
    guard = MeasuredGuard(budget=0.05, horizon=100, reference="A")
    step(guard, Clock({}), 0, no_probe)
    assert not guard.decide(1, no_probe).probe


def test_a_row_noise_scale_weighs_a_short_slice_less():
    """A row's fourth element scales its noise: the same measured ratio moves the estimate less."""
    full, sliced = MeasuredCorrection(noise_sd=0.05), MeasuredCorrection(noise_sd=0.05)
    full.observe([("B", 1.0, 1.2)])
    sliced.observe([("B", 1.0, 1.2, 3.0)])
    assert 0 < sliced.belief("B")[0] < full.belief("B")[0] < math.log(1.2)
    assert sliced.belief("B")[1] > full.belief("B")[1]
    with pytest.raises(ValueError, match="'B''s noise scale must be > 0, got 0.0"):
        MeasuredCorrection().observe([("B", 1.0, 1.2, 0.0)])


def test_slice_noise_is_the_root_of_whole_over_slice_seconds():
    assert slice_noise({"B": 8.0}, {"A": 7.0, "B": 1.0}) == {"B": pytest.approx(math.sqrt(8.0))}
    assert slice_noise({"B": 8.0}, {"B": 8.0}) == {}  # not a slice: the whole plan's noise
