"""The simulator with a ground truth (``hotspa simulate --grid long --truth perturbed``, issue 53).

The cost model is wrong by some factor per option; nobody knows which. Here a "true" time is drawn:
each (layout, checkpointing) option's true seconds are the model's times ``exp(e)``, ``e ~ N(0, s)``
per option (``s`` = :data:`TRUTH_SD`, so ``E|e_i - e_j| = 0.13``, the guard margin's published
between-layout error), and every measurement is the true time times per-stage noise ``exp(N(0, n))``
(:data:`NOISE`: 0.02 a GPU, 0.10 a shared CPU box). Per cell a fixed pool of batches is priced ONCE
(:func:`price_cell`: each batch's model-only guarded plan, the cheapest multi-layout plan the solver
priced (``last_multi_layout``; the pre-guard plan where none) and every static layout's plan, as
predicted seconds per option); then per draw of the truth, 200 steps drawn
from the pool run (:func:`run_draw`), priced in TRUE time (noise only in what is measured):

* ``model_only``: today's planner (the cost model and the fixed margin guard);
* ``measured``: :class:`~..planner.profiled.measured_guard.MeasuredGuard` re-weighting the same
  cached plans from measured stage times only, exploration included, a layout explored by a probe
  (:func:`probe_seconds`) where that costs less; ``measured_whole_plans``: the same without probes;
* ``true_oracle``: per batch the truly fastest of the same cached plans (it knows the factors);

each as the TRUE best static layout's seconds over its own (the static layout fastest in true time
over the run). Plans are not re-solved under the correction (the measured planner only re-weights;
an oracle re-solving each batch under the TRUE factors gained +0.001 and +0.0065 in 2 of 18 cell-draws and
nothing in 16, the first 6 cells x 3 draws: benchmarks/2026-12-07-probes.md). A plan's switch, reduction
and fixed seconds are attributed to its stages in proportion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..activation_checkpointing import Checkpointing
from ..layout import Layout, LayoutError
from ..planner.candidates import auto_layouts, enumerate_layouts
from ..planner.cost.cost_model import AnalyticCostModel
from ..planner.cost.predict import predict_stages
from ..planner.cost.terms import shares_gradients
from ..planner.profiled.measured import MeasuredCorrection
from ..planner.profiled.measured_guard import Candidate, MeasuredGuard, slice_noise
from ..planner.solve.solver import CostModelPlanner
from ..planner.solve.static_guard import DEFAULT_STATIC_MARGIN
from .long_grid import TOKENS_PER_GPU, cell_name, token_batch, with_layout
from .progress import progress
from .simulate import geometric_mean

__all__ = ["NOISE", "PROBE_SHARE", "TRUTH_SD", "plan_seconds", "price_cell", "print_truth", "probe_seconds", "run_draw",
           "summarize", "truth_grid"]

#: per-option sd of the true log error: E|e_i - e_j| = 2 s / sqrt(pi) = 0.13 (the published held-out 0.129)
TRUTH_SD = 0.115
#: per-stage measurement noise (log sd) by setting
NOISE = {"gpu": 0.02, "cpu": 0.10}
#: a probe's slice: this share of the batch's work runs under the probed layout
PROBE_SHARE = 0.125


def plan_seconds(planner: CostModelPlanner, lengths: np.ndarray, solution: tuple[float, list]) -> dict[str, float]:
    """A solver solution's predicted seconds per option label (``layout`` + checkpointing suffix),
    the step's switch / fixed / overlap seconds spread over its stages in proportion."""
    total, stages = solution
    pred = predict_stages(stages, lengths, planner.cost_model, planner.blocks, in_order=False)
    parts: dict[str, float] = {}
    for s in pred.stages:
        key = s.layout + Checkpointing.parse(s.activation_checkpointing).suffix
        parts[key] = parts.get(key, 0.0) + s.seconds + s.switch_seconds
    raw = sum(parts.values())
    if not raw > 0:
        raise ValueError(f"plan_seconds: a plan of {len(stages)} stages predicts {raw} seconds")
    return {k: float(total) * v / raw for k, v in sorted(parts.items())}


def price_cell(model: str, gpus: int, context: int, data: str, hardware: str, pool: int = 6, seed: int = 0,
               margin: float = DEFAULT_STATIC_MARGIN) -> dict[str, Any]:
    """Prices a cell's pool of batches once: per batch the model-only guarded plan, the cheapest
    multi-layout plan the solver priced, and every static layout's plan (the long grid's candidates and
    statics)."""
    cm = AnalyticCostModel(model, hardware, gpus)
    tokens = max(TOKENS_PER_GPU * gpus, 2 * context)
    out: dict[str, Any] = {"cell": cell_name({"model": model, "gpus": gpus, "context": context, "data": data,
                                              "hardware": hardware})}
    samples = [token_batch(data, context, tokens, seed + 7919 + i) for i in range(3)]
    try:
        static_sample = [token_batch(data, context, tokens, seed + 104729 + i) for i in range(16)]
        layouts = auto_layouts(gpus, cm.model, cm.hardware, context, lengths=np.concatenate(samples),
                               static_batches=static_sample, refine_batches=samples)
    except LayoutError as err:
        return {**out, "feasible": False, "reason": str(err)}
    statics = [lay for lay in enumerate_layouts(gpus, cm)
               if max(cm.option(lay, ac).max_doc_length for ac in (False, True)) >= context]
    batches = [token_batch(data, context, tokens, seed + b) for b in range(pool)]
    singles = {p: CostModelPlanner([p], model=cm.model, hardware=cm.hardware, ladder=False) for p in statics}
    static_plans = {p: [plan_seconds(singles[p], b, singles[p].solve(b)) for b in batches] for p in statics}
    model_static = min(statics, key=lambda p: (sum(sum(x.values()) for x in static_plans[p]), p.name))
    layouts = with_layout(layouts, model_static, gpus)
    planner = CostModelPlanner(layouts, model=cm.model, hardware=cm.hardware, static_margin=margin, ladder="auto")
    priced = []
    for k, lengths in enumerate(batches):
        chosen = planner.solve(lengths)
        priced.append({"model_only": plan_seconds(planner, lengths, chosen),
                       "multi": plan_seconds(planner, lengths, planner.last_multi_layout or planner.last_multi),
                       "statics": {p.name: static_plans[p][k] for p in statics}})
    return {**out, "feasible": True, "layouts": [x.name for x in layouts], "model_static": model_static.name,
            "model": model, "gpus": gpus, "hardware": hardware, "batches": priced}


def probe_seconds(reference: dict[str, float], candidate: dict[str, float], extra: float,
                  share: float = PROBE_SHARE) -> dict[str, float]:
    """A probe plan's predicted seconds per option: ``share`` of the batch's work under the candidate's
    plan, the rest under the reference static's, plus ``extra`` (the switches into and out of the
    candidate's layout and its own gradient reduction) on the candidate's options in proportion."""
    out = {k: (1.0 - share) * v for k, v in reference.items()}
    own = sum(candidate.values())
    for k, v in candidate.items():
        out[k] = out.get(k, 0.0) + share * v + (extra * v / own if own > 0 else 0.0)
    return out


class _Switches:
    """The cost model's switch and reduction seconds of a probe (into a layout and back, its own
    reduction unless it shares the reference's), per (reference, candidate) layout name, cached."""

    def __init__(self, cell: dict[str, Any]) -> None:
        self.cm = AnalyticCostModel(cell["model"], cell["hardware"], cell["gpus"])
        self.cache: dict[tuple[str, str], float] = {}

    def extra(self, reference: str, candidate: str) -> float:
        key = (reference, candidate)
        if key not in self.cache:
            a, b = Layout.parse(reference), Layout.parse(candidate)
            cm = self.cm
            own = 0.0 if shares_gradients(a, b) else cm.grad_reduce_seconds(b)
            self.cache[key] = cm.switch_seconds(a, b) + cm.switch_seconds(b, a) + own
        return self.cache[key]


def run_draw(cell: dict[str, Any], draw: int, noise_sd: float, steps: int = 200, seed: int = 0,
             budget: float = 0.03, truth_sd: float = TRUTH_SD, probes: bool = True,
             probe_extra: Callable[[str, str], float] | None = None) -> dict[str, Any]:
    """One truth draw of a priced cell: the three planners over ``steps`` steps, in true time.

    ``probes``: the measured planner may explore a static layout by a probe (:func:`probe_seconds`:
    :data:`PROBE_SHARE` of the batch under it, the rest under its reference static), whose slice is
    measured with ``noise_sd`` times :func:`~..planner.profiled.measured_guard.slice_noise` (~sqrt(8));
    False: only whole plans (the planner before probes).
    ``probe_extra``: a probe's switch and reduction seconds per (reference, candidate) layout name;
    None: the cell's cost model's (:class:`_Switches`; a cell priced by :func:`price_cell` has one)."""
    if probes and probe_extra is None:
        if "model" not in cell:
            raise ValueError(f"run_draw: cell {cell.get('cell')!r} has no cost model (model, gpus, hardware) to "
                             f"price its probes' switches: pass probe_extra, or probes=False")
        probe_extra = _Switches(cell).extra
    batches = cell["batches"]
    keys = sorted({k for b in batches for plan in (b["model_only"], b["multi"], *b["statics"].values()) for k in plan})
    rng = np.random.default_rng([seed, draw, 53])
    factor = dict(zip(keys, np.exp(rng.normal(0.0, truth_sd, len(keys))).tolist()))
    order = np.random.default_rng([seed, 530]).integers(0, len(batches), steps).tolist()  # same steps every draw

    def true(plan: dict[str, float]) -> float:
        return sum(s * factor[k] for k, s in plan.items())

    names = sorted(batches[0]["statics"])
    static_tot = {n: sum(true(batches[b]["statics"][n]) for b in order) for n in names}
    best = min(names, key=lambda n: (static_tot[n], n))
    model_only = sum(true(batches[b]["model_only"]) for b in order)
    oracle = sum(min(true(p) for p in (batches[b]["multi"], batches[b]["model_only"], *batches[b]["statics"].values()))
                 for b in order)
    guard = MeasuredGuard(MeasuredCorrection(noise_sd=noise_sd), budget=budget, reference=cell["model_static"],
                         horizon=steps)
    noise = np.random.default_rng([seed, draw, 5353])
    measured = excess = 0.0
    multi_steps = probe_steps = 0
    for step, b in enumerate(order):
        statics = batches[b]["statics"]
        ref = guard.reference if guard.reference in statics else cell["model_static"]
        probed: dict[str, dict[str, float]] = {}
        if probes:
            assert probe_extra is not None
            probed = {n: probe_seconds(statics[ref], statics[n], probe_extra(ref, n)) for n in names if n != ref}
        cands = [Candidate("multi", batches[b]["multi"], False)] + [
            Candidate(n, statics[n], True, probe=probed.get(n)) for n in names]
        by_name = {c.name: c for c in cands}
        d = guard.decide(step, cands)
        plan = by_name[d.run].probe if d.probe else by_name[d.run].seconds
        scale = slice_noise(by_name[d.run].seconds, plan) if d.probe else {}  # as the planner reports it
        rows = [(k, s, s * factor[k] * math.exp(noise.normal(0.0, noise_sd * scale.get(k, 1.0))), scale.get(k, 1.0))
                for k, s in plan.items()]
        probe_steps += d.probe
        guard.observe(d, rows, static_run=by_name[d.run].static and not d.probe)
        t = true(plan)
        measured += t
        multi_steps += d.run == "multi"
        if d.exploring:
            excess += max(0.0, t - true(by_name[d.exploit].seconds))
    ref = static_tot[best]
    return {"model_only": ref / model_only, "measured": ref / measured, "true_oracle": ref / oracle,
            "exploration_share": excess / measured, "explored_steps": guard.explored_steps, "probe_steps": probe_steps,
            "multi_step_share": multi_steps / steps, "true_best_static": best,
            "model_static_wrong": cell["model_static"] != best,
            "model_static_cost": static_tot[cell["model_static"]] / ref,
            "final_reference_wrong": guard.reference != best, "drops": sum("dropped" in x for x in guard.log)}


def summarize(runs: Sequence[dict[str, Any]], draws: int) -> dict[str, Any]:
    """The ``truth`` JSON object over cell-draws (geomeans of speed-ups over the true best static)."""
    wrong = [r for r in runs if r["model_static_wrong"]]
    return {"draws": draws, "cell_draws": len(runs),
            "model_only": geometric_mean([r["model_only"] for r in runs]),
            "measured": geometric_mean([r["measured"] for r in runs]),
            "true_oracle": geometric_mean([r["true_oracle"] for r in runs]),
            "worst_measured": min(r["measured"] for r in runs),
            **({"measured_whole_plans": geometric_mean([r["measured_whole_plans"] for r in runs]),
                "worst_measured_whole_plans": min(r["measured_whole_plans"] for r in runs)}
               if all("measured_whole_plans" in r for r in runs) else {}),
            "worst_model_only": min(r["model_only"] for r in runs),
            "cell_draws_below_model_only": sum(r["measured"] < r["model_only"] * (1 - 1e-9) for r in runs),
            "exploration_share": float(np.mean([r["exploration_share"] for r in runs])),
            "exploration_share_max": max(r["exploration_share"] for r in runs),
            "wrong_static_share": {"model_only": len(wrong) / len(runs),
                                   "model_only_cost": geometric_mean([r["model_static_cost"] for r in wrong])
                                   if wrong else 1.0,
                                   "measured_final": sum(r["final_reference_wrong"] for r in runs) / len(runs)},
            "multi_step_share": float(np.mean([r["multi_step_share"] for r in runs])),
            "drops": sum(r["drops"] for r in runs)}


def truth_grid(grid: dict[str, Any], noise: str = "gpu", draws: int = 5, steps: int = 200, pool: int = 6,
               seed: int = 0, budget: float = 0.03, cells: int | None = None) -> dict[str, Any]:
    """Prices the grid's cells (the first ``cells`` of them, None: all), then runs ``draws`` truths per
    cell at both noise settings; ``truth`` is the ``noise`` setting's summary, ``truth_other_noise`` the other's."""
    if noise not in NOISE:
        raise ValueError(f"unknown noise setting {noise!r}; known: {sorted(NOISE)}")
    if draws < 1 or steps < 1 or pool < 1:
        raise ValueError(f"need draws, steps and pool >= 1; got {draws}, {steps}, {pool}")
    start = time.perf_counter()
    jobs = [(m, g, c, d, hw) for hw in grid["hardware"] for m, g, c in grid["settings"] for d in grid["data"]]
    jobs = jobs[:cells] if cells is not None else jobs
    priced = [price_cell(m, g, c, d, hw, pool, seed) for m, g, c, d, hw in progress(jobs, "hotspa simulate --truth")]
    ok = [p for p in priced if p["feasible"]]
    if not ok:
        raise ValueError(f"no feasible cell among {len(priced)}")
    out: dict[str, Any] = {"cells_priced": len(priced), "cells_feasible": len(ok), "pool": pool, "steps": steps,
                           "pricing_seconds": time.perf_counter() - start}
    per_cell: dict[str, list] = {}
    for setting in (noise, *(n for n in NOISE if n != noise)):
        runs = []
        for p in ok:
            cell_runs = [run_draw(p, d, NOISE[setting], steps, seed, budget) for d in range(draws)]
            for d, r in enumerate(cell_runs):  # the measured planner without probes, same draws (before / after)
                whole = run_draw(p, d, NOISE[setting], steps, seed, budget, probes=False)
                r["measured_whole_plans"] = whole["measured"]
            per_cell.setdefault(p["cell"], []).append({setting: summarize(cell_runs, draws)})
            runs += cell_runs
        out["truth" if setting == noise else "truth_other_noise"] = {"noise": setting, "noise_sd": NOISE[setting],
                                                                     **summarize(runs, draws)}
    out["per_cell"] = per_cell
    out["seconds"] = time.perf_counter() - start
    return out


def print_truth(result: dict[str, Any]) -> None:
    """Per cell and overall: speed-ups over the true best static layout (what ``--truth`` prints)."""
    print(f"Truth simulation: {result['cells_feasible']} of {result['cells_priced']} cells, pool "
          f"{result['pool']} batches, {result['steps']} steps per draw ({result['seconds']:.0f} s)\n")
    print("| cell | noise | model-only x | measured x | true oracle x | worst measured | explore share |")
    print("|---|---|---|---|---|---|---|")
    for cell, rows in result["per_cell"].items():
        for row in rows:
            for setting, t in row.items():
                print(f"| {cell} | {setting} | {t['model_only']:.3f} | {t['measured']:.3f} | {t['true_oracle']:.3f} "
                      f"| {t['worst_measured']:.3f} | {t['exploration_share']:.4f} |")
    for key in ("truth", "truth_other_noise"):
        t = result[key]
        whole = (f" (without probes {t['measured_whole_plans']:.3f}x, worst {t['worst_measured_whole_plans']:.3f})"
                 if "measured_whole_plans" in t else "")
        print(f"\n{t['noise']} noise: model-only {t['model_only']:.3f}x, measured {t['measured']:.3f}x{whole}, "
              f"true oracle {t['true_oracle']:.3f}x over the true best static ({t['cell_draws']} cell-draws); "
              f"worst measured {t['worst_measured']:.3f}; below model-only in {t['cell_draws_below_model_only']}; "
              f"exploration {t['exploration_share']:.4f}; model-only's static wrong in "
              f"{t['wrong_static_share']['model_only']:.0%}")
