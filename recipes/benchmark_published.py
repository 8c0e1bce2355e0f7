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
``held_out`` (the same over the rows the fit did not see) and ``fit`` (the constants); the
context-parallel rows alone (``cp_rows``, ``cp_geomean_ratio``, ``cp_max_abs_log_ratio``, ``cp_kinds``,
``cp_sources``; ``cp_listed``: the same counts over every listed row, priced or excluded); the FP8
rates (``fp8``: torchtitan's from its Table 1 pair, NeMo / TE's fitted with the H100's cuDNN attention
efficiency on every other row of its long-sequence table); ``between_layout_error``
({mean, p90, max, pairs} over rows of one source, model and GPU in different layouts, and the same over
held-out rows only) and ``guard_margin_derived`` (docs/cost-model.md's rule applied to the held-out one) beside
``guard_margin_in_use`` (the planner's DEFAULT_STATIC_MARGIN, read from the code); ``targets`` (issue 39's,
each with its value and whether it is met).

    python recipes/benchmark_published.py
"""

from __future__ import annotations

import argparse
import json

from lightning_hotspa.planner.cost.hardware import get_profile
from lightning_hotspa.planner.cost.published_fit import fit_fp8_and_attention, fit_profile, price_all
from lightning_hotspa.planner.cost.published_pricing import (
    at_precision,
    between_layout_error,
    compiled,
    derive_fp8_speedup,
    derive_rate,
    guard_margin_from,
    source_model,
    summarize,
)
from lightning_hotspa.planner.cost.published_runs import PUBLISHED_RUNS, PublishedRun
from lightning_hotspa.planner.cost.runtime_profile import get_runtime
from lightning_hotspa.planner.solve.static_guard import DEFAULT_STATIC_MARGIN

FIT_GPUS = ("A100-80G", "H100")
#: torchtitan's bf16 / Float8 pair of one configuration (Table 1): its FP8 GEMM rate
FP8_PAIR = ("titan-8b-fsdp8-compile", "titan-8b-fsdp8-compile-fp8")
#: torchtitan's eager / torch.compile pair of one configuration (Table 1): its compile rate
COMPILE_PAIR = ("titan-8b-fsdp8", "titan-8b-fsdp8-compile")
#: torchao's float8 training table: the bf16 row and each recipe's row
TORCHAO_BASE = "torchao-8b-fsdp8-bf16"


#: the published-runs pricing (one function, shared with recipes/benchmark_peers.py)
model_for = source_model


def fit_rows(gpu: str) -> list[PublishedRun]:
    """The rows a GPU's constants are fitted on: every other llm-foundry bf16 row on it, in table order."""
    rows = [r for r in PUBLISHED_RUNS if not r.excluded and r.gpu == gpu and r.system == "llm-foundry"]
    return rows[::2]


def nemo_fit_rows() -> list[PublishedRun]:
    """The rows NeMo / TE's FP8 rate and the H100's cuDNN attention efficiency are fitted on: every other
    row of its long-sequence table, in table order."""
    return [r for r in PUBLISHED_RUNS if not r.excluded and r.system == "nemo-te"][::2]


def compile_and_recipe_rates() -> tuple[dict, set[str]]:
    """torch.compile's rate (torchtitan's eager / compile pair) and torchao's FP8 rate per recipe (its own
    table's pairs), as the sources imply them (printed), and the ids of the rows that set them."""
    runs = {r.id: r for r in PUBLISHED_RUNS}
    titan = get_runtime("torchtitan")
    rate = derive_rate(runs[COMPILE_PAIR[0]], runs[COMPILE_PAIR[1]], model_for,
                       lambda prof, s: compiled(prof, titan, s))
    recipes = {r.fp8_recipe: derive_rate(runs[TORCHAO_BASE], r, model_for,
                                         lambda prof, s: at_precision(prof, titan, "fp8", s))
               for r in PUBLISHED_RUNS if r.id.startswith("torchao-") and r.fp8_recipe}
    out = {"compile_speedup": rate, "pair": list(COMPILE_PAIR), "profile_compile_speedup": titan.compile_speedup,
           "torchao_recipes": recipes, "profile_torchao_recipes": dict(titan.fp8_recipe_speedups)}
    print(f"compile (pair {COMPILE_PAIR[0]} / {COMPILE_PAIR[1]}): GEMM-side rate x {rate:.4f} "
          f"(profile {titan.compile_speedup}); torchao recipes {({k: round(v, 4) for k, v in recipes.items()})} "
          f"(profile {dict(titan.fp8_recipe_speedups)})")
    return out, {COMPILE_PAIR[1]} | {r.id for r in PUBLISHED_RUNS if r.id.startswith("torchao-") and r.fp8_recipe}


def fp8_rates() -> tuple[dict, set[str]]:
    """The FP8 rates as the sources imply them (printed, and the ids of the rows that set them)."""
    runs = {r.id: r for r in PUBLISHED_RUNS}
    titan = derive_fp8_speedup(runs[FP8_PAIR[0]], runs[FP8_PAIR[1]], model_for)
    nemo = fit_fp8_and_attention(nemo_fit_rows(), model_for)
    h100 = get_profile(nemo.gpu)
    out = {"torchtitan": {"fp8_gemm_speedup": titan, "pair": list(FP8_PAIR),
                          "profile_fp8_gemm_speedup": get_runtime("torchtitan").fp8_gemm_speedup},
           "nemo-te": {"fp8_gemm_speedup": nemo.fp8_gemm_speedup, "attention": nemo.attention, "kernel": nemo.kernel,
                       "head_dim": nemo.head_dim,
                       "profile_fp8_gemm_speedup": get_runtime("nemo-te").fp8_gemm_speedup,
                       "profile_attention": h100.attention_efficiency_for(nemo.kernel, nemo.head_dim),
                       "fit_rows": [r["id"] for r in nemo.rows]}}
    print(f"fp8 torchtitan (pair {FP8_PAIR[0]} / {FP8_PAIR[1]}): GEMM rate x {titan:.4f} "
          f"(profile {out['torchtitan']['profile_fp8_gemm_speedup']})")
    print(f"fp8 nemo-te + H100 attention[{nemo.kernel}, hd {nemo.head_dim}]: GEMM rate x {nemo.fp8_gemm_speedup:.4f}, "
          f"attention {nemo.attention:.4f} (profile {out['nemo-te']['profile_fp8_gemm_speedup']}, "
          f"{out['nemo-te']['profile_attention']})")
    print(f"  {'row':32s} {'D1_s':>8s} {'A1_s':>8s} {'O_s':>8s} {'meas_s':>8s} {'fit_s':>8s} resid")
    for r in nemo.rows:
        print(f"  {r['id']:32s} {r['D1_s']:8.3f} {r['A1_s']:8.3f} {r['O_s']:8.3f} {r['measured_s']:8.3f} "
              f"{r['fitted_s']:8.3f} {r['residual']:+.3f}")
    return out, {FP8_PAIR[1]} | {r["id"] for r in nemo.rows}


def cp_kind(run: PublishedRun) -> str:
    """How a row's cp exchanges K / V: ``ulysses`` (all-to-all), ``ring/all-gather-KV`` or ``hybrid``."""
    return "ulysses" if run.cp_kv == 1 else "ring/all-gather-KV" if run.cp_kv == run.cp else "hybrid"


def cp_summary(runs: list[PublishedRun]) -> dict:
    """Count, kinds and source repositories of the rows with cp > 1 among ``runs``."""
    cp = [r for r in runs if r.cp > 1]
    return {"rows": len(cp), "kinds": sorted({cp_kind(r) for r in cp}),
            "sources": sorted({r.source.split(" ")[0] for r in cp})}


def targets(out: dict) -> dict:
    """Issue 39's targets, each ``{"value", "target", "met"}``, from the JSON's own statistics."""
    def band(v: float, lo: float, hi: float) -> dict:
        return {"value": v, "target": [lo, hi], "met": lo <= v <= hi}

    def at_most(v: float, hi: float) -> dict:
        return {"value": v, "target": f"<= {hi}", "met": v <= hi}

    n, src, kinds = out["cp_rows"], len(out["cp_sources"]), len(out["cp_kinds"])
    return {"geomean_ratio": band(out["geomean_ratio"], 0.92, 1.08),
            "max_abs_log_ratio": at_most(out["max_abs_log_ratio"], 0.25),
            "cp_rows_sources_kinds": {"value": [n, src, kinds], "target": ">= [12, 3, 2]",
                                      "met": n >= 12 and src >= 3 and kinds >= 2},
            "cp_geomean_ratio": band(out["cp_geomean_ratio"], 0.9, 1.1),
            "cp_max_abs_log_ratio": at_most(out["cp_max_abs_log_ratio"], 0.25),
            "guard_margin_derived_equals_in_use": {"value": [out["guard_margin_derived"], out["guard_margin_in_use"]],
                                                   "target": "equal",
                                                   "met": out["guard_margin_derived"] == out["guard_margin_in_use"]}}


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
    fp8, fp8_ids = fp8_rates()
    fitted_ids |= fp8_ids
    fp8["compile"], compile_ids = compile_and_recipe_rates()
    fitted_ids |= compile_ids
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
    cp = [p for p in priced if p.run.cp > 1]
    cp_stats = summarize(cp)
    between = between_layout_error(priced)
    between_held = between_layout_error([p for p in priced if p.run.id not in fitted_ids])
    derived = guard_margin_from(between_held)
    print(f"cp rows: {cp_stats['count']} geomean {cp_stats['geomean_ratio']:.3f} max |log| "
          f"{cp_stats['max_abs_log_ratio']:.3f}; between-layout error over {between['pairs']} pairs: mean "
          f"{between['mean']:.3f} p90 {between['p90']:.3f} max {between['max']:.3f}; held out ({between_held['pairs']} "
          f"pairs) mean {between_held['mean']:.3f} -> guard margin "
          f"{derived} (in use: {DEFAULT_STATIC_MARGIN})")
    out = {"rows": [{"id": p.run.id, "source": p.run.source, "predicted": round(p.predicted, 1),
                     "precision": p.run.precision, "cp": p.run.cp,
                     "published": p.run.tokens_per_s_per_gpu, "ratio": round(p.ratio, 4),
                     "attention_share": round(p.attention_share, 3), "fits_ours": p.fits_ours,
                     "held_out": p.run.id not in fitted_ids} for p in priced],
           "excluded": [{"id": r.id, "reason": r.excluded} for r in PUBLISHED_RUNS if r.excluded],
           "geomean_ratio": stats["geomean_ratio"], "max_abs_log_ratio": stats["max_abs_log_ratio"],
           "by_attention_share": stats["by_attention_share"], "held_out": held, "fit": fits, "fp8": fp8,
           "cp_rows": cp_stats["count"], "cp_geomean_ratio": cp_stats["geomean_ratio"],
           "cp_max_abs_log_ratio": cp_stats["max_abs_log_ratio"],
           "cp_kinds": cp_summary([p.run for p in cp])["kinds"],
           "cp_sources": cp_summary([p.run for p in cp])["sources"],
           "cp_listed": cp_summary(list(PUBLISHED_RUNS)),
           "between_layout_error": between, "between_layout_error_held_out": between_held,
           "guard_margin_derived": derived, "guard_margin_in_use": DEFAULT_STATIC_MARGIN}
    out["targets"] = targets(out)
    listed = out["cp_listed"]
    print(f"cp rows listed (priced or not): {listed['rows']} from {listed['sources']}, kinds {listed['kinds']}")
    for name, t in out["targets"].items():
        print(f"target {name}: {t['value']} (want {t['target']}): {'met' if t['met'] else 'NOT met'}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
