"""recipes/benchmark_e2e.py: the pieces that decide its figures (capacity, band plans, the ideal and
speed-up arithmetic), without the minutes-long multi-process run itself."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from lightning_hotspa.layout import Layout
from lightning_hotspa.planner.solve.packing import max_doc_length

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def e2e():
    sys.path.insert(0, str(ROOT / "recipes"))
    spec = importlib.util.spec_from_file_location("benchmark_e2e", ROOT / "recipes" / "benchmark_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(e2e, **overrides) -> argparse.Namespace:
    args = argparse.Namespace(**{**e2e.DEFAULTS, **overrides})
    args.tokens_per_rank = e2e.tokens_per_rank(args.memory_mib)
    return args


def test_the_memory_budget_forces_long_documents_off_pure_data_parallel(e2e) -> None:
    args = _args(e2e)
    sets = e2e.layout_sets(args)
    assert args.tokens_per_rank < args.context  # a context-long document cannot run dp4
    assert Layout(dp=4) not in sets["statics"]
    for lay in sets["statics"]:
        assert max_doc_length(args.tokens_per_rank * lay.tp * lay.cp, lay.cp) >= args.context
    assert set(sets["statics"]) <= set(sets["every"]) and set(sets["candidates"]) <= set(sets["every"])
    assert sets["bands"][-1] == args.context and sets["bands"] == sorted(sets["bands"])
    # a bigger budget raises the capacity: it comes from the memory model, not a constant
    assert e2e.tokens_per_rank(4 * args.memory_mib) > 2 * args.tokens_per_rank
    with pytest.raises(SystemExit, match="memory-mib"):
        e2e.tokens_per_rank(0.6)


def test_band_plans_hold_each_held_document_once_in_its_band_stage(e2e) -> None:
    bands = [100, 300, 1000]
    lengths = [50, 120, 999, 300, 7, 250, 1000, 101]
    small = e2e.BandPlanner(Layout(dp=4), bands, tokens_per_rank=300)  # holds bands <= 300
    plan, kept, band_ids = small.plan(3, lengths)
    assert band_ids == [0, 1]
    assert sorted(kept) == [0, 1, 3, 4, 5, 7]  # the two long documents are left out
    assert [plan.doc_lengths[i] for i in range(len(kept))] == [lengths[d] for d in kept]
    for stage, band in zip(plan.stages, band_ids):
        lo, hi = ([0] + bands)[band], bands[band]
        assert all(lo < plan.doc_lengths[d] <= hi for d in stage.doc_ids)
    big = e2e.BandPlanner(Layout(tp=2, cp=2), bands, tokens_per_rank=300)
    plan, kept, band_ids = big.plan(3, lengths)
    assert band_ids == [0, 1, 2] and sorted(kept) == list(range(len(lengths)))
    assert e2e.BandPlanner(Layout(dp=4), bands, tokens_per_rank=60).plan(0, lengths)[0] is None


def _run(step_s, work, switch=(0.0,), loss=(2.0, 1.5), cpu=None):
    cpu = cpu or [2 * t for t in step_s]
    return [{"step_s": t, "cpu_s": c, "loss": x, "switch_s": list(switch), "work_s": list(w)}
            for t, c, w, x in zip(step_s, cpu, work, loss)]


def test_summary_arithmetic(e2e) -> None:
    """Two configurations' steps by hand: speed-ups, the ideal, switch fraction, loss difference."""
    args = argparse.Namespace(warmup=1, steps=1)
    steps = {
        "hotspa": [_run([9, 5.0], [[1], [1.0, 3.0]], switch=(0.25, 0.25), loss=(2.0, 1.5000001), cpu=[9, 8.0])],
        "static/tp4": [_run([9, 8.0], [[1], [7.0]])],
        "static/cp4": [_run([9, 10.0], [[1], [9.0]])],
        "rule": [_run([9, 6.0], [[1], [5.0]])],
        # band 0 fastest in dp4 (1 s), band 1 fastest in tp4 (2.5 s)
        "bands/dp4": [_run([9, 2.0], [[1], [1.0]])],
        "bands/tp4": [_run([9, 6.0], [[1], [3.0, 2.5]])],
    }
    raw = {"cores": 2, "results": {"cc": steps}, "tokens": {"cc": [100, 800]},
           "sets": {"bands": [512, 2048]},
           "band_meta": {"cc": {"bands/dp4": [[0], [0]], "bands/tp4": [[0, 1], [0, 1]]}},
           "predicted": {"cc": {"hotspa": [1, 4.0], "static/tp4": [1, 6.0], "static/cp4": [1, 7.0], "rule": [1, 5.0]}},
           "plan_layouts": {"cc": []}, "plan_ms": {}}
    out = e2e.summarize("cc", raw, args)
    assert out["best_static_layout"] == "tp4"
    assert out["hotspa_tokens_per_s"] == pytest.approx(800 / 5.0)
    assert out["speedup"] == pytest.approx(8.0 / 5.0)
    assert out["speedup_per_repeat"] == pytest.approx([8.0 / 5.0])
    # ideal: 8 - 7 (static work) + 1 (band 0 in dp4) + 2.5 (band 1 in tp4) = 4.5
    assert out["ideal_speedup"] == pytest.approx(8.0 / 4.5)
    assert out["threshold_rule_speedup"] == pytest.approx(8.0 / 6.0)
    assert out["switch_fraction"] == pytest.approx(0.5 / 5.0)
    assert out["max_loss_rel_diff"] == pytest.approx(1e-7 / 1.5, rel=1e-3)
    assert out["predicted_speedup"] == pytest.approx(6.0 / 4.0)
    # CPU work per step: tp4 16 (2 x its 8 s step) vs hotspa 8; utilization = CPU / (wall x 2 cores)
    assert out["cpu_work_speedup"] == pytest.approx(16.0 / 8.0)
    assert out["core_utilization"] == pytest.approx({"hotspa": 8.0 / (5.0 * 2), "static/tp4": 1.0})
    assert out["configs"]["rule"]["cpu_s_per_step"] == pytest.approx(12.0)
    assert out["band_s"] == {"<=512": {"dp4": 1.0, "tp4": 3.0}, "<=2048": {"tp4": 2.5}}


def test_run_order_rotates_so_no_configuration_always_runs_first(e2e) -> None:
    configs = ["hotspa", "static/cp4", "rule", "model_parallel"]
    orders = [e2e.run_order(configs, r) for r in range(4)]
    assert all(sorted(o) == sorted(configs) for o in orders)
    assert {o[0] for o in orders} == set(configs)
    assert len({tuple(o) for o in orders}) == 4


def test_layouts_limits_the_set_to_it_plus_the_candidates_and_the_rule(e2e) -> None:
    args = _args(e2e, context=512, memory_mib=3.0, layouts="tp4")
    sets = e2e.layout_sets(args)
    rule = {lay for _, lay in sets["rule"]}
    assert set(sets["every"]) == {Layout(tp=4)} | set(sets["candidates"]) | rule
    assert set(sets["statics"]) <= set(sets["every"]) and Layout(tp=4) in sets["statics"]
    assert len(sets["every"]) < len(e2e.layout_sets(_args(e2e, context=512, memory_mib=3.0))["every"])
    with pytest.raises(SystemExit, match=r"--layouts: \['dp2xtp3'\]"):
        e2e.layout_sets(_args(e2e, context=512, memory_mib=3.0, layouts="tp4,dp2xtp3"))
