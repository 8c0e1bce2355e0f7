"""The long-context grid (``hotspa simulate --grid long``): where switching should win, if anywhere.

Cells: (model, GPUs, context) settings x length mixes x hardware. Per cell, on the same sampled
global batches and one cost model (:mod:`..planner.cost.cost_model`):

* **ours**: :class:`CostModelPlanner` over automatic candidates (every CP kind the runtime has:
  Ulysses, all-gather-KV, the hybrid), with its never-worse-than-static guard (``margin``);
* **static**: the best single layout that holds the longest document, same solver, so the same
  packing and balancing, every CP kind available to it;
* **oracle**: every document in its cheapest feasible layout of ALL layouts (any mix, no mesh
  constraint, checkpointing per document), free switches, perfect dp balance and micro-batch fill,
  one gradient reduction; feasible = it finishes within the step on one dp group
  (:func:`oracle_seconds`);
* **megatron rows**: the documents concatenated into context-length rows with row-wide causal
  attention (Megatron-LM's default without a document mask: every row costs a full-context
  attention), in the best layout for such rows, no switching;
* **artifact rule**: the paper's hand-set rule where it defines one (only <= 32K settings);
* **competent user** (:func:`.competent_user.competent_user_layouts`): the static layout a competent user of a
  peer writes for the cell's batch, bf16, priced on that PEER's runtime description and on ours
  (``competent_user_static``).

``ours`` (:data:`OURS_OPTIONS`, ``--ours-options``): what our runtime runs, the planner's own prices by default.

Nothing here is tuned to a target: the hardware profiles are frozen (``planner/cost/hardware.py``, see
BENCHMARKS.md). Every layout comes with a replicated and a sharded (``:fsdp``) working copy
(:func:`~..planner.candidates.enumerate_layouts`), for ours, static and the oracle alike.
Batches hold ``max(tokens_per_gpu * GPUs, 2 * context)`` tokens, documents longer than the context
cut into context-sized chunks (as the DataModule does).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..layout import Layout, LayoutError, MeshShape
from ..planner.candidates import auto_layouts, enumerate_layouts, layout_rates
from ..planner.cost.cost_model import AnalyticCostModel
from ..planner.cost.peer_rows import OursOptions, ours_cost_model
from ..planner.solve.packing import DocumentTooLongError
from ..planner.solve.solver import CostModelPlanner
from ..planner.solve.static_guard import DEFAULT_STATIC_MARGIN, guard
from .artifact_rule import RuleNotFoundError, artifact_rule
from .competent_user import COMPILING_PEERS, PEER_RUNTIMES, competent_user_layouts, user_model, user_seconds
from .oracles import LADDER, oracle_from_rates, oracle_ladder, print_breakdown
from .progress import progress
from .simulate import geometric_mean, rule_seconds, static_seconds

__all__ = ["LONG_GRID", "OURS_OPTIONS", "SMOKE_GRID", "candidate_summary", "cell_name",
           "guarded_bound", "long_cell", "long_grid", "ours_options", "print_long_grid", "token_batch"]

#: (model, GPUs, context) settings; GPUs in nodes of 8.
LONG_GRID: dict[str, Any] = {
    "settings": [("llama7b", 8, 32768), ("llama7b", 32, 131072), ("llama13b", 16, 65536), ("llama13b", 64, 262144),
                 ("llama3-8b", 8, 32768), ("llama3-8b", 32, 131072), ("llama3-8b", 128, 524288),
                 ("llama3-70b", 64, 131072), ("llama3-70b", 256, 262144), ("llama3-70b", 1024, 524288)],
    "data": ["commoncrawl", "github", "sft-longtail"],
    "hardware": ["H100", "H200"],
}
SMOKE_GRID: dict[str, Any] = {"settings": [("llama3-8b", 16, 65536)], "data": ["github"], "hardware": ["H100"]}

#: Length mixes. ``sft-longtail`` is SYNTHETIC (an assumption, not a measurement): 95 % chat-like
#: samples around 1K tokens, 5 % long-context samples around 48K with a wide spread.
DATA: dict[str, dict[str, Any]] = {
    "commoncrawl": {"kind": "commoncrawl"},
    "github": {"kind": "github", "scale": 1 / 3.5},  # byte-token fit scaled to BPE (data/lengths.py)
    "sft-longtail": {"kind": "bimodal", "params": {"short_mu": math.log(1024), "short_sigma": 0.9,
                                                   "long_mu": math.log(49152), "long_sigma": 1.0,
                                                   "long_fraction": 0.05}},
}
TOKENS_PER_GPU = 16384
#: margins ours is also guarded at (issue 38: the derived 0.139 and the earlier 0.147)
ALT_MARGINS = (0.139, 0.147)
#: what OUR runtime runs in the grid (``hotspa simulate --ours-options``): the planner's default prices
#: (FlashAttention-2, eager), or what a user on the grid's Hopper GPUs turns on (``attention_backend`` fa3_varlen,
#: ``strategy.runtime.compile_blocks``: peer_rows.matching_options' choice for a Transformer Engine peer)
OURS_OPTIONS: dict[str, OursOptions | None] = {"default": None, "matching": OursOptions(attention="fa3", compiled=True)}


def ours_options(name: str, fa3_conservative: bool = False) -> OursOptions | None:
    """The options of :data:`OURS_OPTIONS` named ``name``, FA3 priced at the fitted FA2 value x the kernels' own
    ratio where ``fa3_conservative``; a clear error for an unknown name or a conservative price without FA3.

    Args:
        name: a key of :data:`OURS_OPTIONS`; fa3_conservative: ``--fa3-conservative``.
    """
    if name not in OURS_OPTIONS:
        raise ValueError(f"unknown ours' options {name!r}; known: {sorted(OURS_OPTIONS)}")
    ours = OURS_OPTIONS[name]
    if not fa3_conservative:
        return ours
    if ours is None or ours.attention != "fa3":
        raise ValueError(f"--fa3-conservative prices ours' FA3: it needs --ours-options matching, got {name!r}")
    return dataclasses.replace(ours, conservative=True)


def token_batch(data: str, context: int, tokens: int, seed: int) -> np.ndarray:
    """One global batch of about ``tokens`` tokens: documents drawn in order, cut at the context."""
    from ..data.lengths import LengthGenerator

    if data not in DATA:
        raise ValueError(f"unknown length mix {data!r}; known: {sorted(DATA)}")
    gen = LengthGenerator(seed=seed, **DATA[data])
    n = 256
    while True:
        raw = gen.lengths(n)
        pieces = np.concatenate([np.full(int(x) // context, context) if x >= context else np.zeros(0, np.int64)
                                 for x in raw] + [raw % context])
        pieces = pieces[pieces > 0]
        cum = np.cumsum(pieces)
        if cum[-1] >= tokens:
            return pieces[: int(np.searchsorted(cum, tokens)) + 1].astype(np.int64)
        n *= 2


def oracle_seconds(cm: AnalyticCostModel, lengths: np.ndarray, layouts: Sequence[Layout] | None = None,
                   fixed: float | None = None) -> float:
    """The smallest step time ``T`` such that every document can go to a layout of ALL layouts (any
    mix, no mesh constraint, checkpointing per document) in which it finishes within ``T`` on one dp
    group, and the documents' work, perfectly balanced over dp groups and micro-batches, plus one
    gradient reduction (the cheapest) fits in ``T``. Free switches. (Without the first condition a
    512K document would be "spread" over dp groups it cannot be split across.)

    ``layouts`` / ``fixed``: only these layouts, and these fixed seconds instead of the cheapest
    reduction (the tighter oracles of :mod:`.oracles`)."""
    layouts = list(enumerate_layouts(cm.world_size, cm) if layouts is None else layouts)
    rates = layout_rates(cm, layouts, lengths)  # [layout, doc] seconds / dp: perfectly balanced work
    reduce = min(cm.grad_reduce_seconds(lay) for lay in layouts) if fixed is None else float(fixed)
    return oracle_from_rates(rates, np.array([lay.dp for lay in layouts], dtype=np.float64), reduce)


def guarded_bound(bound: float, single: float, margin: float) -> float:
    """The least seconds any guarded plan of a batch can reach: ``bound`` (no plan is faster) when
    the best single candidate layout (``single`` seconds, the guard's fallback) is slower than it
    by more than ``margin``, else ``single`` (a plan of at least ``bound`` seconds gains at most
    ``single / bound - 1 <= margin``: the guard keeps the static layout)."""
    return bound if single > bound * (1.0 + margin) else single


def _single_seconds(cm: AnalyticCostModel, lay: Layout, lengths: np.ndarray, planners: dict,
                    per_batch: dict[Layout, list[float]], batch: int) -> float:
    """``lay``'s static seconds for batch ``batch`` (``lengths``), as the guard solves it (inf: a
    document it cannot hold); the static layouts' are already in ``per_batch``."""
    if lay in per_batch:
        return per_batch[lay][batch]
    try:
        return static_seconds(cm, lay, lengths, planners)
    except DocumentTooLongError:
        return math.inf


def megatron_rows_seconds(cm: AnalyticCostModel, lengths: np.ndarray, context: int) -> tuple[float, str]:
    """Concatenated context-length rows, row-wide causal attention, the best static layout for them."""
    rows = int(math.ceil(lengths.sum() / context))
    best, name = math.inf, ""
    for lay in enumerate_layouts(cm.world_size, cm):
        for ac in (False, True):
            opt = cm.option(lay, ac)
            if opt.max_doc_length < context:
                continue
            per_row = float(opt.doc_seconds(opt.padded([context]))[0])
            rows_per_mb = max(1, opt.capacity // int(opt.padded([context])[0]))
            mine = math.ceil(rows / lay.dp)
            secs = opt.group_seconds(mine * per_row, math.ceil(mine / rows_per_mb))
            secs += opt.stage_fixed + cm.switch_seconds(None, lay)
            if secs < best:
                best, name = secs, opt.label
            break  # no checkpointing when the rows fit without it
    return best, name


def long_cell(model: str, gpus: int, context: int, data: str, hardware: str, batches: int = 2, seed: int = 0,
              margin: float = DEFAULT_STATIC_MARGIN, breakdown: bool = False, pp: bool = True,
              ours: OursOptions | None = None) -> dict[str, Any]:
    """One cell; ``feasible`` False (with ``reason``) when no layout holds the context.
    ``pp``: pipeline-parallel layouts among ours and the static ones where the runtime runs them (False:
    none, the same cell without pp). ``ours``: what OUR runtime runs (:data:`OURS_OPTIONS`; None: the planner's
    default prices, FlashAttention-2, eager): ours, the static layouts and the oracle are priced on it, and the
    competent users compile where ours does (:func:`.competent_user.user_model`).
    ``breakdown``: also the oracle ladder of :mod:`.oracles`, the most any plan reaches under the
    guard (``guarded_bound``) and ours with margin 0."""
    cm = AnalyticCostModel(model, hardware, gpus) if ours is None else ours_cost_model(model, hardware, gpus, ours)
    if ours is not None and ours.attention not in {k for k, _, _ in cm.hardware.attention_kernels}:
        raise ValueError(f"ours' options name attention {ours.attention!r}, which the {hardware} profile does not rate "
                         f"(it rates {sorted({k for k, _, _ in cm.hardware.attention_kernels})})")
    tokens = max(TOKENS_PER_GPU * gpus, 2 * context)
    out: dict[str, Any] = {"model": model, "gpus": gpus, "context": context, "data": data, "hardware": hardware,
                           "tokens_per_step": tokens}
    # candidates chosen on other data: 3 batches (in one for the relaxed scores, one by one for the
    # solver's), 16 more to pick the best static layout (every set then holds it: the guard's
    # fallback) robustly
    samples = [token_batch(data, context, tokens, seed + 7919 + i) for i in range(3)]
    sample = np.concatenate(samples)
    try:
        static_sample = [token_batch(data, context, tokens, seed + 104729 + i) for i in range(16)]
        layouts = auto_layouts(gpus, cm.model, cm.hardware, context, lengths=sample, static_batches=static_sample,
                               refine_batches=samples, pp=pp, runtime=cm.runtime)
    except LayoutError as err:
        return {**out, "feasible": False, "reason": str(err)}
    statics = [lay for lay in enumerate_layouts(gpus, cm, pp=pp)
               if max(cm.option(lay, ac).max_doc_length for ac in (False, True)) >= context]
    batch_list = [token_batch(data, context, tokens, seed + b) for b in range(batches)]
    planners: dict[Layout, CostModelPlanner] = {}
    per_batch = {p: [static_seconds(cm, p, lengths, planners) for lengths in batch_list] for p in statics}
    static_totals = {p: sum(v) for p, v in per_batch.items()}
    best = min(statics, key=lambda p: (static_totals[p], p.name))
    layouts = with_layout(layouts, best, gpus)  # the grid's best static layout is a candidate (issue 38)
    planner = CostModelPlanner(layouts, model=cm.model, hardware=cm.hardware, static_margin=margin, ladder="auto",
                               runtime=cm.runtime)
    users = competent_user_layouts(cm, context, tokens)
    compiles = ours is not None and ours.compiled
    user_models = {(k, rt): cm if rt == "hotspa" else user_model(cm, hardware, k, compiles)
                   for k in users for rt in (PEER_RUNTIMES[k], "hotspa")}
    sums = {"ours": 0.0, "oracle": 0.0, "rows": 0.0, "rule": 0.0}
    alt = {m: 0.0 for m in ALT_MARGINS if m != margin}
    user_sums = dict.fromkeys(user_models, 0.0)
    fallbacks, rows_layout, has_rule = 0, "", True
    ladder = {k: 0.0 for k in (*LADDER, "guarded_bound", "ours_margin0")}
    free = None
    ladders = 0
    if breakdown and margin > 0:
        free = CostModelPlanner(layouts, model=cm.model, hardware=cm.hardware, static_margin=0.0, ladder="auto",
                                runtime=cm.runtime)
    for b, lengths in enumerate(batch_list):
        ours_s, stages = planner.solve(lengths)
        sums["ours"] += ours_s
        ladders += any(type(g).__name__ == "LadderGroups" for _, g in stages)
        fallbacks += bool(planner.last_decision and planner.last_decision.fell_back)
        for m in alt:  # the same pre-guard plan, guarded at another margin
            alt[m] += guard(lengths, planner._option_list, planner.last_multi, m, planner._solve_over)[0][0]
        for (k, rt), user_cm in user_models.items():
            user_sums[k, rt] += user_seconds(user_cm, users[k], lengths, planners, rt)
        if breakdown:
            steps = oracle_ladder(cm, lengths, layouts)
            for k, v in steps.items():
                ladder[k] += v
            single = min((_single_seconds(cm, p, lengths, planners, per_batch, b) for p in layouts), default=math.inf)
            ladder["guarded_bound"] += guarded_bound(steps["exclusive"], single, margin)
            ladder["ours_margin0"] += free.solve(lengths)[0] if free is not None else 0.0
            sums["oracle"] += steps["oracle"]
        else:
            sums["oracle"] += oracle_seconds(cm, lengths)
        secs, rows_layout = megatron_rows_seconds(cm, lengths, context)
        sums["rows"] += secs
        try:
            sums["rule"] += min(rule_seconds(cm, artifact_rule(model, gpus, context, c), lengths)[0]
                                for c in ("c1", "c2"))
        except RuleNotFoundError:
            has_rule = False
    ulysses = [p for p in statics if p.cp_kv == 1]
    best_u = min(ulysses, key=lambda p: (static_totals[p], p.name)) if ulysses else None
    static_s = static_totals[best]
    ours_x, oracle_x = static_s / sums["ours"], static_s / sums["oracle"]
    extra: dict[str, Any] = {}
    if breakdown:
        if margin == 0:
            ladder["ours_margin0"] = sums["ours"]
        own = [p for p in statics if p in layouts]  # the guard's fallbacks
        ladder["ours"] = sums["ours"]
        ladder["candidate_static"] = min((static_totals[p] for p in own), default=math.inf)
        extra["breakdown"] = {k: static_s / v for k, v in ladder.items()}
        tight = extra["breakdown"]["reductions"]  # the oracle (free switches) paying reductions
        extra["captured_vs_reductions"] = (ours_x - 1) / (tight - 1) if tight > 1.01 else None
    return {**out, **extra, "feasible": True, "layouts": [x.name for x in layouts], "best_static": best.name,
            "ours_s": sums["ours"] / batches, "static_s": static_s / batches, "oracle_s": sums["oracle"] / batches,
            "megatron_rows_s": sums["rows"] / batches, "megatron_rows_layout": rows_layout,
            "best_static_ulysses_only": best_u.name if best_u else "",
            "static_ulysses_only_s": static_totals[best_u] / batches if best_u else math.inf,
            "artifact_rule_s": sums["rule"] / batches if has_rule else None,
            "ours_over_static": ours_x, "oracle_over_static": oracle_x,
            "ours_over_megatron_rows": sums["rows"] / sums["ours"],
            "captured": (ours_x - 1) / (oracle_x - 1) if oracle_x > 1.01 else None,
            "static_fallback_batches": fallbacks, "batches": batches, "ladder_batches": ladders,
            "ours_at_margin": {f"{m:.3f}": v / batches for m, v in alt.items()},
            "competent_user_static": {
                k: {"layout": lay.name, "checkpointing": "auto", "peer_runtime": PEER_RUNTIMES[k],
                    "peer_compiled": compiles and k in COMPILING_PEERS,
                    "seconds_on_peer_runtime": user_sums[k, PEER_RUNTIMES[k]] / batches,
                    "seconds_on_ours": user_sums[k, "hotspa"] / batches,
                    "ours_over": user_sums[k, PEER_RUNTIMES[k]] / sums["ours"],
                    "ours_over_on_ours_runtime": user_sums[k, "hotspa"] / sums["ours"]} for k, lay in users.items()}}


def long_grid(grid: dict[str, Any] | None = None, batches: int = 2, seed: int = 0,
              margin: float | None = DEFAULT_STATIC_MARGIN, breakdown: bool = False,
              ours: OursOptions | None = None) -> dict[str, Any]:
    """Every cell and the headline: geomean over cells, share of the oracle's headroom captured;
    ``margin`` None: the planner's default; ``breakdown``: per cell the oracle ladder
    (:mod:`.oracles`) and its geomeans; ``ours``: what our runtime runs (:data:`OURS_OPTIONS`; None: the
    planner's default prices), reported as ``ours_options``."""
    grid = grid or LONG_GRID
    margin = DEFAULT_STATIC_MARGIN if margin is None else margin
    start = time.perf_counter()
    jobs = [(m, g, c, d, hw) for hw in grid["hardware"] for m, g, c in grid["settings"] for d in grid["data"]]
    cells = [long_cell(m, g, c, d, hw, batches, seed, margin, breakdown, ours=ours)
             for m, g, c, d, hw in progress(jobs, "hotspa simulate")]
    ok = [c for c in cells if c["feasible"]]
    big = [c["ours_over_static"] for c in ok if c["oracle_over_static"] >= 1.4]
    captured = [c["captured"] for c in ok if c["captured"] is not None]
    extra: dict[str, Any] = {}
    if breakdown and ok:
        extra["breakdown_summary"] = {k: geometric_mean([c["breakdown"][k] for c in ok]) for k in ok[0]["breakdown"]}
        tight = [c["captured_vs_reductions"] for c in ok if c["captured_vs_reductions"] is not None]
        extra.update(mean_captured_vs_reductions=float(np.mean(tight)) if tight else None,
                     min_captured_vs_reductions=min(tight) if tight else None,
                     cells_captured_vs_reductions_ge_0_9=sum(x >= 0.9 for x in tight),
                     cells_with_reductions_headroom=len(tight))
        extra.update(candidate_summary(ok))
    long_cells = [c for c in ok if c["context"] >= 256 * 1024]
    extra["geomean_long_cells"] = geometric_mean([c["ours_over_static"] for c in long_cells]) if long_cells else None
    extra["geomean_oracle_long_cells"] = (geometric_mean([c["oracle_over_static"] for c in long_cells])
                                          if long_cells else None)
    kinds = sorted({k for c in ok for k in c["competent_user_static"]})
    for key, field in (("competent_user_static", "ours_over"), ("competent_user_static_on_ours_runtime",
                                                                   "ours_over_on_ours_runtime")):
        extra[key] = {k: geometric_mean([c["competent_user_static"][k][field] for c in ok
                                         if k in c["competent_user_static"]]) for k in kinds}
    extra["competent_user_static_cells_ours_slower"] = {
        k: sum(c["competent_user_static"][k]["ours_over"] < 1 for c in ok if k in c["competent_user_static"])
        for k in kinds}
    extra["cells_with_ladder"] = sum(c["ladder_batches"] > 0 for c in ok)
    extra["at_margin"] = {m: at_margin(ok, m) for m in sorted({m for c in ok for m in c["ours_at_margin"]})}
    extra["ours_options"] = ("default" if ours is None else
                             {**ours.flags(), "fa3_priced": "conservative" if ours.conservative else "profile"})
    return {"grid": "long", **extra, "margin": margin, "batches_per_cell": batches, "cells": cells,
            "geomean_ours_over_static": geometric_mean([c["ours_over_static"] for c in ok]),
            "geomean_oracle_over_static": geometric_mean([c["oracle_over_static"] for c in ok]),
            "geomean_where_oracle_ge_1_4": geometric_mean(big) if big else None,
            "cells_where_oracle_ge_1_4": len(big),
            "min_captured": min(captured) if captured else None,
            "mean_captured": float(np.mean(captured)) if captured else None,
            "cells_with_headroom": len(captured), "infeasible_cells": len(cells) - len(ok),
            "seconds": time.perf_counter() - start}


def at_margin(cells: Sequence[dict[str, Any]], margin: str) -> dict[str, Any]:
    """The headline numbers with ours guarded at ``margin`` (the same pre-guard plans): geomean over
    the best static layout, over the long cells, and the captured share of the candidates' bound."""
    ours = {cell_name(c): c["static_s"] / c["ours_at_margin"][margin] for c in cells if margin in c["ours_at_margin"]}
    long_cells = [cell_name(c) for c in cells if c["context"] >= 256 * 1024]
    captured = [(ours[cell_name(c)] - 1) / (c["breakdown"]["candidates"] - 1) for c in cells
                if "breakdown" in c and c["breakdown"]["candidates"] >= 1.05 and cell_name(c) in ours]
    return {"geomean_ours_over_static": geometric_mean(list(ours.values())) if ours else None,
            "geomean_long_cells": geometric_mean([ours[k] for k in long_cells if k in ours]) if long_cells else None,
            "mean_captured_of_candidates": float(np.mean(captured)) if captured else None,
            "min_ours_over_static": min(ours.values()) if ours else None}


def with_layout(layouts: Sequence[Layout], extra: Layout, world: int) -> tuple[Layout, ...]:
    """``layouts`` plus ``extra``, dropping the candidates whose groups do not nest with it on one mesh."""
    if extra in layouts:
        return tuple(layouts)
    keep = [lay for lay in layouts if _nests([lay, extra], world)]
    out = [*keep, extra]
    return tuple(sorted(out, key=lambda lay: (lay.tp * lay.cp, lay.tp)))


def _nests(layouts: Sequence[Layout], world: int) -> bool:
    try:
        MeshShape.for_layouts(layouts, world)
    except LayoutError:
        return False
    return True


def cell_name(cell: dict[str, Any]) -> str:
    """A cell's key in the grid's per-cell maps: ``"H100 llama3-8b 128 512K sft-longtail"``."""
    return f"{cell['hardware']} {cell['model']} {cell['gpus']} {cell['context'] // 1024}K {cell['data']}"


def candidate_summary(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What ours captures of its OWN candidates' bound (issue 31's targets), from cells priced with
    ``breakdown``: ``geomean_ours`` and ``geomean_bound_candidates`` over the best static layout,
    ``captured_of_candidates`` per cell whose bound is >= 1.05x, ``(ours - 1) / (bound - 1)``, and
    its mean; ``min_ours_over_candidate_static`` (ours over the candidate set's best static layout);
    ``guarded_bound``: the same figures for the most any plan reaches under the guard (the
    breakdown's ``guarded_bound``, :func:`guarded_bound` per batch): their ceiling at the margin.

    Args:
        cells: the feasible cells, each with its ``breakdown``.
    """
    cells = [c for c in cells if "breakdown" in c]
    captured = {cell_name(c): (c["breakdown"]["ours"] - 1) / (c["breakdown"]["candidates"] - 1)
                for c in cells if c["breakdown"]["candidates"] >= 1.05}
    own = [c["breakdown"]["ours"] / c["breakdown"]["candidate_static"] for c in cells]
    guarded = [(c["breakdown"]["guarded_bound"] - 1) / (c["breakdown"]["candidates"] - 1)
               for c in cells if c["breakdown"]["candidates"] >= 1.05 and "guarded_bound" in c["breakdown"]]
    long_cells = [c["breakdown"]["guarded_bound"] for c in cells
                  if c["context"] >= 256 * 1024 and "guarded_bound" in c["breakdown"]]
    return {"geomean_ours": geometric_mean([c["breakdown"]["ours"] for c in cells]) if cells else None,
            "geomean_bound_candidates": (geometric_mean([c["breakdown"]["candidates"] for c in cells])
                                         if cells else None),
            "captured_of_candidates": captured,
            "mean_captured_of_candidates": float(np.mean(list(captured.values()))) if captured else None,
            "min_ours_over_candidate_static": min(own) if own else None,
            # the most any plan reaches under the guard (per batch :func:`guarded_bound` of the
            # exclusive bound): the ceiling of the three above at the cells' margin
            "guarded_bound": {"geomean": geometric_mean([c["breakdown"]["guarded_bound"] for c in cells
                                                         if "guarded_bound" in c["breakdown"]]) if cells else None,
                              "geomean_long_cells": geometric_mean(long_cells) if long_cells else None,
                              "mean_captured_of_candidates": float(np.mean(guarded)) if guarded else None}}


def print_long_grid(result: dict[str, Any]) -> None:
    """The grid as a markdown table and the headline (what ``hotspa simulate --grid long`` prints)."""
    print(f"Long-context grid: predicted step seconds, {result['batches_per_cell']} batches per cell, "
          f"guard margin {result['margin']:.3f}\n")
    print("| hw | model | GPUs | context | data | our layouts | best static | ours x | oracle x | captured "
          "| x Megatron rows | x artifact rule |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in result["cells"]:
        if not c["feasible"]:
            print(f"| {c['hardware']} | {c['model']} | {c['gpus']} | {c['context'] // 1024}K | {c['data']} | "
                  f"infeasible: {c['reason']} |")
            continue
        cap = "-" if c["captured"] is None else f"{c['captured']:.2f}"
        rule = "-" if c["artifact_rule_s"] is None else f"{c['artifact_rule_s'] / c['ours_s']:.3f}"
        print(f"| {c['hardware']} | {c['model']} | {c['gpus']} | {c['context'] // 1024}K | {c['data']} | "
              f"{', '.join(c['layouts'])} | {c['best_static']} | {c['ours_over_static']:.3f} | "
              f"{c['oracle_over_static']:.3f} | {cap} | {c['ours_over_megatron_rows']:.2f} | {rule} |")
    g14 = result["geomean_where_oracle_ge_1_4"]
    print(f"\ngeomean over cells: ours {result['geomean_ours_over_static']:.3f}x, oracle "
          f"{result['geomean_oracle_over_static']:.3f}x over the best static layout; where the oracle >= 1.4x "
          f"({result['cells_where_oracle_ge_1_4']} cells): {'-' if g14 is None else f'{g14:.3f}x'}; captured "
          f"headroom min {result['min_captured']}, mean {result['mean_captured']} over "
          f"{result['cells_with_headroom']} cells with oracle > 1.01x ({result['seconds']:.0f} s)")
    users = result.get("competent_user_static", {})
    print("ours over a competent user's static layout (bf16), on the peer's runtime / on ours: " + "; ".join(
        f"{k} {v:.3f}x / {result['competent_user_static_on_ours_runtime'][k]:.3f}x "
        f"(ours slower in {result['competent_user_static_cells_ours_slower'][k]} cells)" for k, v in users.items()))
    print(f"ours priced with: {result['ours_options']}")
    if "breakdown_summary" in result:
        print_breakdown(result)
