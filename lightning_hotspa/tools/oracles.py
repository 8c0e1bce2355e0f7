"""The long grid's oracles, and where their headroom lives (``hotspa simulate --grid long --breakdown``).

The grid's oracle (:func:`.long_grid.oracle_seconds`) relaxes several things at once. This module
tightens them one at a time, each step a lower bound of every real plan that has the next
constraint, so the gaps between the steps say which relaxation holds the headroom:

1. ``oracle``: every document in its cheapest layout of ALL layouts, checkpointing per document,
   perfect balance and fill, free switches, ONE gradient reduction (the cheapest of any layout);
2. ``reductions``: the same, but every tp degree the documents use pays its own gradient
   reduction (a real plan reduces once per run of same-tp stages, ``shares_gradients``: a tp1
   stage's replicated gradients cost what a tp1 reduction costs, whatever else runs), after the
   compute (the loosest oracle lets the reduction hide in the longest document's idle groups);
3. ``switches``: plus the cheapest order of switches between the tp degrees used;
4. ``candidates``: only the planner's 2-4 candidate layouts (one mesh; chosen on sample batches);
5. ``exclusive``: plus what a world-wide group excludes: a document on a layout of one dp group runs
   while nothing else does (:func:`~..planner.solve.oracle_bound.exclusive_seconds`; the steps
   before let a 491K document on the whole world overlap everything else);
6. then the real plans: ours with margin 0 (real packing, the solver), ours with the guard.

Every step is a minimum over the subsets of gradient kinds (tp degree x working copy: at most 8,
255 subsets), each an oracle of one rate table: cheap next to the solver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..layout import Layout
from ..planner.candidates import enumerate_layouts, layout_rates
from ..planner.cost.cost_model import AnalyticCostModel
from ..planner.solve.oracle_bound import charged_oracle as bound
from ..planner.solve.oracle_bound import charged_oracles, oracle_from_rates

__all__ = ["LADDER", "charged_oracle", "oracle_from_rates", "oracle_ladder", "print_breakdown"]

#: The steps of the ladder, loosest first (keys of :func:`oracle_ladder`).
LADDER = ("oracle", "reductions", "switches", "candidates", "exclusive")


def charged_oracle(cm: AnalyticCostModel, lengths: np.ndarray, layouts: Sequence[Layout], *,
                   switches: bool, rates: np.ndarray | None = None) -> float:
    """The oracle over ``layouts`` in which every tp degree used pays its gradient reduction (and,
    with ``switches``, the cheapest switch order visiting those degrees), after the compute: the
    minimum over the subsets of tp degrees (:func:`~..planner.solve.oracle_bound.charged_oracle`)."""
    rates = layout_rates(cm, list(layouts), lengths) if rates is None else rates
    return bound(cm, rates, layouts, switches=switches)[0]


def oracle_ladder(cm: AnalyticCostModel, lengths: np.ndarray, candidates: Sequence[Layout]) -> dict[str, float]:
    """Seconds of each step of :data:`LADDER` for one batch (each >= the one before). The layouts are every
    runnable one without pp plus the candidates' pp layouts: the exact bound enumerates subsets of gradient
    kinds (``oracle_bound.MAX_GRADIENT_KINDS``) and every pp degree multiplies them; pp is priced where the
    candidates hold it (its bubble keeps it out of every cell so far)."""
    flat = enumerate_layouts(cm.world_size, cm, pp=False)
    layouts = flat + [c for c in dict.fromkeys(candidates) if c.pp > 1 and c not in flat]
    rates = layout_rates(cm, layouts, lengths)
    dp = np.array([lay.dp for lay in layouts], dtype=np.float64)
    loosest = oracle_from_rates(rates, dp, min(cm.grad_reduce_seconds(lay) for lay in layouts))
    charged = charged_oracles(cm, rates, layouts)  # both steps from one pass over the subsets
    own = layout_rates(cm, list(candidates), lengths)
    return {"oracle": loosest, "reductions": charged[False][0], "switches": charged[True][0],
            "candidates": charged_oracle(cm, lengths, candidates, switches=True, rates=own),
            "exclusive": charged_oracles(cm, own, candidates, exclusive=True)[True][0]}


def print_breakdown(result: dict[str, Any]) -> None:
    """Per cell: each step's speed-up over the best static layout, and the summary."""
    print("\n| hw | model | GPUs | ctx | data | oracle | + reductions | + switches | candidates only "
          "| + world-wide alone | most under the guard | ours margin 0 | ours | candidates' best static "
          "| captured of + reductions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in result["cells"]:
        if not c["feasible"] or "breakdown" not in c:
            continue
        b = c["breakdown"]
        vals = " | ".join(f"{b[k]:.3f}" for k in (*LADDER, "guarded_bound", "ours_margin0", "ours", "candidate_static"))
        cap = c["captured_vs_reductions"]
        vals += " | -" if cap is None else f" | {cap:.2f}"
        print(f"| {c['hardware']} | {c['model']} | {c['gpus']} | {c['context'] // 1024}K | {c['data']} | {vals} |")
    s = result.get("breakdown_summary")
    if s:
        print("\ngeomean over cells (x over the best static layout): "
              + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
        print(f"captured of the oracle that pays its gradient reductions: mean "
              f"{result['mean_captured_vs_reductions']}, min {result['min_captured_vs_reductions']}, >= 0.9 in "
              f"{result['cells_captured_vs_reductions_ge_0_9']} of {result['cells_with_reductions_headroom']} cells")
