"""The cost model against published measured training runs (issue 30).

Prices every bf16 row of :data:`~lightning_hotspa.planner.published_runs.PUBLISHED_RUNS` through the
planner's path (:mod:`lightning_hotspa.planner.published_pricing`) on its GPU's hardware profile,
with the SOURCE system's runtime description where the cost model takes one, and prints a table,
the excluded rows with their reasons, and ONE JSON line last: ``rows`` (id, source, predicted,
published, ratio, attention_share, fits_ours, held_out), ``geomean_ratio``, ``max_abs_log_ratio``,
``by_attention_share`` (over all bf16 rows) and ``held_out`` (the same over the rows the fit did
not see).

    python recipes/benchmark_published.py
"""

from __future__ import annotations

import argparse
import json

from lightning_hotspa.planner.cost_model import AnalyticCostModel
from lightning_hotspa.planner.hardware import PROFILES
from lightning_hotspa.planner.published_pricing import price_run, summarize
from lightning_hotspa.planner.published_runs import PUBLISHED_RUNS, PublishedRun


def model_for(run: PublishedRun) -> AnalyticCostModel:
    """The cost model the planner would build for the run's GPU and world."""
    gpu = run.gpu if run.gpu in PROFILES else "H100"  # before: the model had no 500 W H100 variant
    return AnalyticCostModel(run.model, gpu, run.world)


def main(argv: list[str] | None = None) -> dict:
    """Prices the rows, prints the table and the JSON line; returns the JSON object."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    included = [r for r in PUBLISHED_RUNS if not r.excluded]
    priced = [price_run(r, model_for) for r in included]
    print(f"{'id':34s} {'gpu':12s} {'published':>10s} {'predicted':>10s} {'ratio':>6s} {'attn':>5s} fits_ours")
    for p in priced:
        print(f"{p.run.id:34s} {p.run.gpu:12s} {p.run.tokens_per_s_per_gpu:10.1f} {p.predicted:10.1f} "
              f"{p.ratio:6.3f} {p.attention_share:5.2f} {p.fits_ours}")
    for r in PUBLISHED_RUNS:
        if r.excluded:
            print(f"excluded {r.id}: {r.excluded}")
    stats = summarize(priced)
    out = {"rows": [{"id": p.run.id, "source": p.run.source, "predicted": round(p.predicted, 1),
                     "published": p.run.tokens_per_s_per_gpu, "ratio": round(p.ratio, 4),
                     "attention_share": round(p.attention_share, 3), "fits_ours": p.fits_ours,
                     "held_out": True} for p in priced],
           "excluded": [{"id": r.id, "reason": r.excluded} for r in PUBLISHED_RUNS if r.excluded],
           "geomean_ratio": stats["geomean_ratio"], "max_abs_log_ratio": stats["max_abs_log_ratio"],
           "by_attention_share": stats["by_attention_share"], "held_out": stats}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
