"""The cost model against published measured training runs (issue 30).

Prices every bf16 row of :data:`~lightning_hotspa.planner.cost.published_runs.PUBLISHED_RUNS` through the
planner's path (:mod:`lightning_hotspa.planner.cost.published_pricing`) on its GPU's hardware profile,
with the SOURCE system's runtime description (:mod:`lightning_hotspa.planner.cost.runtime_profile`).
First it re-fits each GPU's GEMM-width curve and attention efficiency on the FIT rows
(:func:`fit_rows`: every other llm-foundry row per GPU) and prints the fit's inputs, residuals and
the constants beside the ones the profile holds; then it prices every row with the profiles as
written and prints a table, the excluded rows with their reasons, and ONE JSON line last:
``rows`` (id, source, predicted, published, ratio, attention_share, fits_ours, held_out),
``geomean_ratio``, ``max_abs_log_ratio``, ``by_attention_share`` (over all bf16 rows),
``held_out`` (the same over the rows the fit did not see) and ``fit`` (the constants).

    python recipes/benchmark_published.py
"""

from __future__ import annotations

import argparse
import json

from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.planner.cost.hardware import HardwareProfile, get_profile
from lightning_hotspa.planner.cost.published_fit import fit_profile, price_all
from lightning_hotspa.planner.cost.published_pricing import summarize
from lightning_hotspa.planner.cost.published_runs import PUBLISHED_RUNS, PublishedRun

FIT_GPUS = ("A100-80G", "H100")


def model_for(run: PublishedRun, profile: HardwareProfile | str | None = None) -> AnalyticCostModel:
    """The cost model the planner would build for the run's GPU and world, with its system's runtime."""
    return AnalyticCostModel(run.model, run.gpu if profile is None else profile, run.world, runtime=run.system)


def fit_rows(gpu: str) -> list[PublishedRun]:
    """The rows a GPU's constants are fitted on: every other llm-foundry bf16 row on it, in table order."""
    rows = [r for r in PUBLISHED_RUNS if not r.excluded and r.gpu == gpu and r.system == "llm-foundry"]
    return rows[::2]


def main(argv: list[str] | None = None) -> dict:
    """Fits, prices, prints the tables and the JSON line; returns the JSON object."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    fits, fitted_ids = {}, set()
    for gpu in FIT_GPUS:
        rows = fit_rows(gpu)
        fitted_ids |= {r.id for r in rows}
        res = fit_profile(gpu, rows, model_for)
        prof = get_profile(gpu)
        fits[gpu] = {"e_max": res.e_max, "h_half": res.h_half, "attention": res.attention, "kernel": res.kernel,
                     "head_dim": res.head_dim, "profile_e_max": prof.dense_efficiency,
                     "profile_h_half": prof.gemm_half_width,
                     "profile_attention": prof.attention_efficiency_for(res.kernel, res.head_dim),
                     "fit_rows": [r.id for r in rows]}
        print(f"fit {gpu}: e_max {res.e_max:.4f} h_half {res.h_half:.1f} attention[{res.kernel}, hd {res.head_dim}] "
              f"{res.attention:.4f}  (profile: {prof.dense_efficiency}, {prof.gemm_half_width}, "
              f"{fits[gpu]['profile_attention']})")
        print(f"  {'row':32s} {'h':>5s} {'D1_s':>8s} {'A1_s':>8s} {'O_s':>8s} {'meas_s':>8s} {'fit_s':>8s} resid")
        for r in res.rows:
            print(f"  {r['id']:32s} {r['h']:5d} {r['D1_s']:8.3f} {r['A1_s']:8.3f} {r['O_s']:8.3f} "
                  f"{r['measured_s']:8.3f} {r['fitted_s']:8.3f} {r['residual']:+.3f}")
    included = [r for r in PUBLISHED_RUNS if not r.excluded]
    priced = price_all(included, model_for)
    print(f"{'id':34s} {'gpu':12s} {'published':>10s} {'predicted':>10s} {'ratio':>6s} {'attn':>5s} fits_ours held_out")
    for p in priced:
        print(f"{p.run.id:34s} {p.run.gpu:12s} {p.run.tokens_per_s_per_gpu:10.1f} {p.predicted:10.1f} "
              f"{p.ratio:6.3f} {p.attention_share:5.2f} {str(p.fits_ours):9s} {p.run.id not in fitted_ids}")
    for r in PUBLISHED_RUNS:
        if r.excluded:
            print(f"excluded {r.id}: {r.excluded}")
    stats = summarize(priced)
    held = summarize(priced, {p.run.id for p in priced} - fitted_ids)
    out = {"rows": [{"id": p.run.id, "source": p.run.source, "predicted": round(p.predicted, 1),
                     "published": p.run.tokens_per_s_per_gpu, "ratio": round(p.ratio, 4),
                     "attention_share": round(p.attention_share, 3), "fits_ours": p.fits_ours,
                     "held_out": p.run.id not in fitted_ids} for p in priced],
           "excluded": [{"id": r.id, "reason": r.excluded} for r in PUBLISHED_RUNS if r.excluded],
           "geomean_ratio": stats["geomean_ratio"], "max_abs_log_ratio": stats["max_abs_log_ratio"],
           "by_attention_share": stats["by_attention_share"], "held_out": held, "fit": fits}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
