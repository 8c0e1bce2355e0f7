"""Issue 53: the measured cost planner's decision rules under a controlled clock (FactorClock)."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hotspa.plan import PlanError
from lightning_hotspa.planner.profiled.measured_planner import MeasuredCostPlanner, probe_documents
from lightning_hotspa.testing.measured_clock import FactorClock

LAYOUTS = ["dp4", "dp2xcp2", "cp4"]


ARGS = dict(model="tiny", world_size=4, hardware="cpu-gloo", ladder=False, mixed_rounds=False,
            activation_checkpointing="none", horizon=40)


def _planner(**kw) -> MeasuredCostPlanner:
    return MeasuredCostPlanner(LAYOUTS, **{**ARGS, **kw})


def _pool(long_lo: int = 600, long_hi: int = 1000, n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [np.concatenate([rng.integers(16, 64, 40), rng.integers(long_lo, long_hi, 2)]).tolist() for _ in range(n)]


def _run(planner, clock, pool, steps, start=0, events=None):
    out = []
    for s in range(start, steps):
        if events and s in events:
            events[s](clock)
        plan = planner.plan(s, pool[s % len(pool)])
        d = planner.last_measured
        planner.observe(clock.observations(planner, plan))
        planner.refit(s)
        out.append(d)
    return out


def _true_static_seconds(layout: str, factors: dict[str, float], pool: list[list[int]]) -> float:
    """The clock's seconds of ``layout``'s static plans over ``pool`` (a one-layout planner, no exploration)."""
    p = MeasuredCostPlanner([layout], **{**ARGS, "explore_budget": 0.0})
    clock, total = FactorClock(factors), 0.0
    for s, lengths in enumerate(pool):
        total += clock.true_seconds(p, p.plan(s, lengths))
        p.observe([])
        p.refit(s)
    return total


def test_wrong_static_corrected_and_exploration_within_budget():
    """The model's static choice measures 30 % slow: the reference moves (measured, or explored within the
    budget) to the truly fastest static layout under the clock, which the run then keeps."""
    pool = _pool()
    first = _planner().plan(0, pool[0])
    model_pick = next(iter({s.layout.name for s in first.stages}))
    factors = {f"{lay}/none": (1.3 if lay == model_pick else 1.0) for lay in LAYOUTS}
    truth = {lay: _true_static_seconds(lay, factors, pool) for lay in LAYOUTS}
    fastest = min(truth, key=truth.get)
    assert fastest != model_pick, truth  # the premise: the model's pick is wrong under this clock
    p = _planner(explore_budget=0.05)
    ds = _run(p, FactorClock(factors, noise=0.02), pool, 30)
    assert ds[0].reference == model_pick
    assert all(d.exploit == fastest for d in ds[15:]), [(d.step, d.exploit) for d in ds]
    assert any(d.exploring for d in ds)
    assert p.guard.exploration_share <= 0.05 + 1e-9


def test_budget_off_never_explores_and_unfit_never_runs():
    """Budget 0: only exploit plans run; a layout that cannot hold the batch's longest document
    (tokens_per_rank 1024: dp4 holds <= 1024 tokens) never runs, exploration included."""
    pool = _pool(1500, 2000)
    p = _planner(explore_budget=0.0, tokens_per_rank=1024)
    p._probes = lambda *a: pytest.fail("a probe priced without an exploration budget")
    ds = _run(p, FactorClock({"dp4/none": 0.5}, noise=0.02), pool, 12)
    assert not any(d.exploring for d in ds)
    assert all(d.run != "dp4" for d in ds)
    p = _planner(explore_budget=0.5, tokens_per_rank=1024)
    ds = _run(p, FactorClock({"dp4/none": 0.5}, noise=0.02), pool, 12)
    assert all(d.run != "dp4" for d in ds)


def test_never_runs_multi_measuring_slower_than_static():
    """dp4 (used by the multi plan for short documents) truly 4x slow: once its options have run,
    the multi plan never runs as the exploit plan (its gain is below the uncertainty)."""
    pool = _pool(1500, 2000)
    p = _planner(tokens_per_rank=1024, explore_budget=0.0)
    ds = _run(p, FactorClock({"dp4/none": 4.0}, noise=0.02), pool, 20)
    ran_multi = [d.step for d in ds if d.exploit == "multi"]
    # the multi plan may run while dp4 is unmeasured (the prior says it gains); drift drops it, and
    # after its first measurement + the lag it is never the exploit plan again
    assert ran_multi and max(ran_multi) <= ran_multi[0] + p.plan_lag + p.guard.drift_steps
    assert all(d.exploit == d.reference for d in ds[-10:])


def test_drop_a_multi_plan_that_slows_down():
    """The multi plan wins (dp4 fast) until dp4 becomes 10x slower at step 15: within drift_steps +
    plan_lag steps it is dropped with a log line and the reference static runs."""
    pool = _pool(1500, 2000)
    p = _planner(tokens_per_rank=1024, explore_budget=0.0, cooldown=10)
    clock = FactorClock({"dp4/none": 0.8, "dp2xcp2/none": 1.2}, noise=0.02)
    ds = _run(p, clock, pool, 30, events={15: lambda c: c.factors.__setitem__("dp4/none", 10.0)})
    assert all(d.exploit == "multi" for d in ds[5:15])
    dropped = [line for line in p.log if "dropped until step" in line]
    assert dropped and int(dropped[0].split(":")[0].split()[1]) <= 15 + p.guard.drift_steps + p.plan_lag
    assert all(d.exploit != "multi" for d in ds[15 + p.guard.drift_steps + p.plan_lag + 1:25])


def test_resume_replays_published_decisions_and_lag_is_enforced():
    """A planner resumed from step 11's state decides steps 12.. exactly as the uninterrupted run;
    a plan requested beyond the published lag is an error naming the steps."""
    pool = _pool()
    clock = FactorClock({"dp4/none": 1.3, "cp4/none": 0.9}, noise=0.05, seed=3)
    a = _planner(explore_budget=0.05)
    full = _run(a, clock, pool, 24)
    b = _planner(explore_budget=0.05)
    _run(b, clock, pool, 12)
    state = b.state_dict()
    c = _planner(explore_budget=0.05)
    c.load_state_dict(state)
    resumed = _run(c, clock, pool, 24, start=12)
    assert [(d.run, d.reference, d.exploring) for d in resumed] == [(d.run, d.reference, d.exploring)
                                                                     for d in full[12:]]
    with pytest.raises(PlanError, match="raise plan_lag"):
        c.plan(24 + c.plan_lag + 1, pool[0])
    assert c.plan(24 + c.plan_lag - 1, pool[0]).notes  # within the lag: plans, with W&B notes


def test_notes_and_saved_corrections():
    pool = _pool()
    p = _planner()
    _run(p, FactorClock({"cp4/none": 0.9}), pool, 6)
    notes = dict(p.plan(6, pool[0]).notes)
    for key in ("measured/gain_over_static", "measured/margin", "measured/exploration_share",
                "measured/exploring", "measured/multi_won"):
        assert key in notes
    assert any(k.startswith("measured/cp4/none/correction") for k in notes)
    q = _planner()
    q.load_corrections(p.save_corrections())
    assert q.guard.correction.state_dict() == p.guard.correction.state_dict()


def test_cli_plan_with_saved_corrections(tmp_path, capsys):
    """``hotspa plan --calibration``: cp4 measured 40 % fast makes it the reference static it plans."""
    import json

    from lightning_hotspa.tools.cli import main

    p = MeasuredCostPlanner(["dp8", "dp4xcp2", "dp2xcp4"], model="llama7b", hardware="H100", world_size=8)
    for key in ("dp8/none", "dp8/full", "dp4xcp2/none", "dp4xcp2/full", "dp2xcp4/none", "dp2xcp4/full"):
        p.guard.correction.observe([(key, 1.0, 0.6 if key.startswith("dp2xcp4") else 1.4)])
    path = tmp_path / "corr.json"
    path.write_text(json.dumps(p.save_corrections()))
    main(["plan", "--model", "llama7b", "--hardware", "H100", "--world-size", "8", "--layouts",
          "dp8,dp4xcp2,dp2xcp4", "--calibration", str(path), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["measured"]["reference"] == "dp2xcp4"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", "--layouts", "dp8,dp4xcp2", "--calibration", str(bad)]) != 0
    assert "no 'guard' key" in capsys.readouterr().err


def test_reused_solves_plan_and_decide_the_same():
    """``reuse_solves`` (memoized solves and predictions within one plan) changes no plan and no decision:
    a 20-step clocked run with exploration, and the 64-rank long-context set of the planner benchmark
    (ladder and mixed rounds on) over seeded batches."""
    pool, factors = _pool(), {"dp4/none": 1.3, "cp4/none": 0.9}
    runs = {}
    for reuse in (False, True):
        p = _planner(explore_budget=0.1)
        p.reuse_solves = reuse
        runs[reuse] = [(d, p.plan(d.step, pool[d.step % len(pool)], latest=True))
                       for d in _run(p, FactorClock(factors, noise=0.05, seed=1), pool, 20)]
    assert runs[False] == runs[True]
    assert len({d.run for d, _ in runs[True]}) > 1  # the run moved between plans: decisions were exercised
    from lightning_hotspa.tools.long_grid import token_batch

    layouts = ["dp16xtp4", "dp4xtp4xcp4:kv", "dp2xtp4xcp8:kv4", "tp4xcp16:kv8"]
    plans = {}
    for reuse in (False, True):
        p = MeasuredCostPlanner(layouts, model="llama3-8b", hardware="H100")
        p.reuse_solves = reuse
        plans[reuse] = [(p.plan(0, token_batch("sft-longtail", 131072, 2**21, seed)[:96], latest=True),
                         p.last_measured) for seed in range(3)]
    assert plans[False] == plans[True]


def test_probe_documents_keep_the_mix_of_lengths():
    lengths = np.array([50, 10, 40, 20, 30, 80, 70, 60, 90, 100, 5, 1000, 7, 3, 2, 1])
    picked = probe_documents(lengths, 0.125)
    assert sorted(lengths[picked].tolist()) == [7, 80]  # the 5th of every 8, in length order
    assert probe_documents(np.array([5, 9]), 0.125).tolist() == [0]  # at least one, never all
    assert probe_documents(np.array([5]), 0.5).size == 1
    with pytest.raises(ValueError, match="share must be in \\(0, 1\\), got 1.5"):
        probe_documents(lengths, 1.5)
    with pytest.raises(ValueError, match="probe_share must be in \\[0, 1\\) \\(0: no probes\\), got -0.1"):
        _planner(probe_share=-0.1)


def _stage_documents(plan) -> list[int]:
    return sorted(d for s in plan.stages for g in s.micro_batches for mb in g for d in mb)


def test_a_layout_is_explored_by_a_probe_for_less_and_the_slowed_pick_is_left():
    """The first test's clock: an unmeasured layout is explored by a probe (a slice of the batch under it,
    the rest under the reference static, every document once) where the model prices the probe below the
    whole plan (documents of 64-2,000 tokens: on shorter ones the second stage's fixed seconds outweigh the
    slice); each probe is predicted faster than the whole plan it stands for, and the model's slowed pick
    is still left."""
    rng = np.random.default_rng(0)
    pool = [np.concatenate([rng.integers(64, 1024, 40), rng.integers(1200, 2000, 2)]).tolist() for _ in range(6)]
    model_pick = next(iter({s.layout.name for s in _planner().plan(0, pool[0]).stages}))
    factors = {f"{lay}/none": (1.3 if lay == model_pick else 1.0) for lay in LAYOUTS}
    runs = {}
    for share in (0.125, 0.0):
        p, clock, plans = _planner(explore_budget=0.05, probe_share=share), FactorClock(factors, noise=0.02), []
        ds = []
        for s in range(30):
            plan = p.plan(s, pool[s % len(pool)])
            ds.append(p.last_measured)
            plans.append(plan)
            p.observe(clock.observations(p, plan))
            p.refit(s)
        runs[share] = (p, ds, plans)
    p, ds, plans = runs[0.125]
    probes = [(d, plan) for d, plan in zip(ds, plans) if d.probe]
    assert probes and all(d.exploring for d, _ in probes)
    for d, plan in probes:
        assert {s.layout.name for s in plan.stages} == {d.reference, d.run}
        assert _stage_documents(plan) == list(range(len(plan.doc_lengths)))
        whole = MeasuredCostPlanner([d.run], **{**ARGS, "explore_budget": 0.0})
        assert whole.predict(plan).seconds < whole.predict(whole.plan(0, plan.doc_lengths)).seconds  # analytic both
    assert all(d.exploit != model_pick for d in ds[10:]), [(d.step, d.exploit) for d in ds]
    assert not any(d.probe for d in runs[0.0][1])
