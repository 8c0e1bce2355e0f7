"""Issue 53: the ground-truth simulator (``hotspa simulate --truth perturbed``) on a synthetic cell and
on the smoke grid (its JSON keys)."""

import json

import pytest

from lightning_hotspa.tools import cli
from lightning_hotspa.tools.truth import run_draw, summarize

pytestmark = pytest.mark.fast


def synthetic_cell() -> dict:
    """Two batches; static A is the model's pick; B and C are close; a multi plan over a, b."""
    def batch(k: float) -> dict:
        return {"model_only": {"A": 10.0 * k}, "multi": {"a": 4.5 * k, "b": 4.9 * k},
                "statics": {"A": {"A": 10.0 * k}, "B": {"B": 10.3 * k}, "C": {"C": 10.6 * k, "Cx": 0.2 * k}}}
    return {"cell": "synthetic", "feasible": True, "model_static": "A", "batches": [batch(1.0), batch(1.3)]}


def _SWITCH(reference: str, candidate: str) -> float:
    return 0.05  # a probe's switches and reduction, seconds (the synthetic cell has no cost model)


def test_run_draw_prices_in_true_time():
    cell = synthetic_cell()
    runs = [run_draw(cell, d, 0.02, steps=120, probe_extra=_SWITCH) for d in range(6)]
    for r in runs:
        # the oracle is the per-batch best in true time: nobody beats it; the true best static is <= 1 of it
        assert r["true_oracle"] >= max(r["measured"], r["model_only"]) - 1e-12
        assert r["true_oracle"] >= 1.0 - 1e-12
        assert 0.0 <= r["exploration_share"] <= 0.2
        assert r["model_static_wrong"] is (r["true_best_static"] != "A")
    s = summarize(runs, 6)
    assert s["measured"] > s["model_only"]  # with 3 statics and a 9 % multi plan, measuring pays
    assert s["worst_measured"] == min(r["measured"] for r in runs)
    again = [run_draw(cell, d, 0.02, steps=120, probe_extra=_SWITCH) for d in range(6)]
    assert again == runs  # seeds fixed


def test_probes_explore_for_less_than_whole_plans_and_need_a_price():
    cell = synthetic_cell()
    probed = [run_draw(cell, d, 0.02, steps=120, probe_extra=_SWITCH) for d in range(6)]
    whole = [run_draw(cell, d, 0.02, steps=120, probes=False) for d in range(6)]
    assert sum(r["probe_steps"] for r in probed) > 0 and all(r["probe_steps"] == 0 for r in whole)
    # the same draws: a probe measures the same ratio for an eighth of the excess
    assert sum(r["exploration_share"] for r in probed) < sum(r["exploration_share"] for r in whole)
    assert summarize(probed, 6)["measured"] >= summarize(whole, 6)["measured"]
    with pytest.raises(ValueError, match="cell 'synthetic' has no cost model"):
        run_draw(cell, 0, 0.02, steps=5)


def test_cli_truth_smoke_json(capsys):
    assert cli.main(["simulate", "--grid", "smoke", "--truth", "perturbed", "--draws", "2", "--steps", "20",
                     "--pool", "2", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("truth", "truth_other_noise"):
        t = last[key]
        assert {"draws", "model_only", "measured", "true_oracle", "worst_measured", "cell_draws_below_model_only",
                "exploration_share", "wrong_static_share"} <= set(t)
        assert t["draws"] == 2 and t["cell_draws"] == 2
        assert {"measured_whole_plans", "worst_measured_whole_plans"} <= set(t)
    assert last["truth"]["noise"] == "gpu" and last["truth_other_noise"]["noise"] == "cpu"


def test_cli_truth_bad_inputs(capsys):
    assert cli.main(["simulate", "--grid", "smoke", "--truth", "perturbed", "--budget", "2"]) == 2
    assert "--budget must be in [0, 1), got 2.0" in capsys.readouterr().err
    assert cli.main(["simulate", "--grid", "smoke", "--truth", "perturbed", "--breakdown"]) == 2
    assert cli.main(["simulate", "--truth", "perturbed"]) == 2
    assert "runs on --grid long or --grid smoke, not paper" in capsys.readouterr().err
