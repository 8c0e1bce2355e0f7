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


def test_run_draw_prices_in_true_time():
    cell = synthetic_cell()
    runs = [run_draw(cell, d, 0.02, steps=120) for d in range(6)]
    for r in runs:
        # the oracle is the per-batch best in true time: nobody beats it; the true best static is <= 1 of it
        assert r["true_oracle"] >= max(r["measured"], r["model_only"]) - 1e-12
        assert r["true_oracle"] >= 1.0 - 1e-12
        assert 0.0 <= r["exploration_share"] <= 0.2
        assert r["model_static_wrong"] is (r["true_best_static"] != "A")
    s = summarize(runs, 6)
    assert s["measured"] > s["model_only"]  # with 3 statics and a 9 % multi plan, measuring pays
    assert s["worst_measured"] == min(r["measured"] for r in runs)
    again = [run_draw(cell, d, 0.02, steps=120) for d in range(6)]
    assert again == runs  # seeds fixed


def test_cli_truth_smoke_json(capsys):
    assert cli.main(["simulate", "--grid", "smoke", "--truth", "perturbed", "--draws", "2", "--steps", "20",
                     "--pool", "2", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("truth", "truth_other_noise"):
        t = last[key]
        assert {"draws", "model_only", "measured", "true_oracle", "worst_measured", "cell_draws_below_model_only",
                "exploration_share", "wrong_static_share"} <= set(t)
        assert t["draws"] == 2 and t["cell_draws"] == 2
    assert last["truth"]["noise"] == "gpu" and last["truth_other_noise"]["noise"] == "cpu"


def test_cli_truth_bad_inputs(capsys):
    assert cli.main(["simulate", "--grid", "smoke", "--truth", "perturbed", "--budget", "2"]) == 2
    assert "--budget must be in [0, 1), got 2.0" in capsys.readouterr().err
    assert cli.main(["simulate", "--grid", "smoke", "--truth", "perturbed", "--breakdown"]) == 2
    assert cli.main(["simulate", "--truth", "perturbed"]) == 2
    assert "runs on --grid long or --grid smoke, not paper" in capsys.readouterr().err
