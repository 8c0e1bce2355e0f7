"""Step simulator: predicted seconds and tokens/s of plans, and the paper-scale comparison grid.

On the SAME sampled global batches it prices (a) our plan (:class:`CostModelPlanner` over automatic
candidate layouts), (b) every static single layout that holds the longest document, planned by the
same solver restricted to that layout (so packing and balancing are equally good; pipeline-parallel
statics get LPT balancing, their schedule's bubble and the best of 1-8 x the micro-batch count), and
(c) the artifact's hand-set rule (:mod:`.artifact_rule`, combinations c1 and c2). All use one cost
model, so the figures compare planning decisions under one runtime model, not our runtime against the
artifact's. On 7B 8-GPU cells it also prices the artifact's three 7B strategies (:data:`REFERENCE_STRATEGIES`).

Batches: ``sequences`` documents (512, the paper's global batch) from a length profile, truncated to
the context as the artifact does. GitHub-like lengths are the byte-token profile scaled by 1/3.5
(a BPE rule of thumb, see ``data/lengths.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..layout import Layout
from ..micro_batch import PlanError
from ..planner.candidates import auto_layouts, enumerate_layouts, runs
from ..planner.cost.cost_model import AnalyticCostModel, CostModelError
from ..planner.solve.assign import pack_lpt
from ..planner.solve.packing import max_doc_length
from ..planner.solve.solver import CostModelPlanner
from .artifact_rule import RuleNotFoundError, artifact_rule, artifact_stages
from .progress import progress

__all__ = ["CellResult", "GRID", "REFERENCE_STRATEGIES", "reference_seconds", "sample_batches", "simulate_cell",
           "simulate_grid", "static_seconds",
           "static_layouts", "geometric_mean"]

#: The paper-scale grid: (model, GPUs) x contexts x data (docs/REFERENCE.md §2).
GRID: dict[str, Any] = {
    "settings": [("llama7b", 8), ("llama7b", 16), ("llama13b", 8), ("llama13b", 16), ("llama30b", 32)],
    "contexts": [8192, 16384, 32768],
    "data": ["commoncrawl", "github"],
}

DATA_SCALE = {"github": 1 / 3.5}

#: the reference artifact's three 7B-on-8-GPU strategies (dp, tp, pp) it hot-switches among (docs/REFERENCE.md,
#: issue 56): priced as static layouts next to ours on the paper grid's 7B 8-GPU cells
REFERENCE_STRATEGIES = (Layout(tp=4, pp=2), Layout(dp=8), Layout(dp=2, tp=2, pp=2))


def sample_batches(kind: str, context: int, batches: int, sequences: int = 512, seed: int = 0) -> list[np.ndarray]:
    """``batches`` global batches of ``sequences`` document lengths, truncated to ``context``."""
    # data is a sibling package that only the simulator needs (planner never imports data at import time)
    from ..data.lengths import LengthGenerator

    return [LengthGenerator(kind=kind, seed=seed * 1000 + b, max_length=context,
                            scale=DATA_SCALE.get(kind, 1.0)).lengths(sequences) for b in range(batches)]


def static_layouts(cm: AnalyticCostModel, longest: int, include_pp: bool = True,
                   tokens_per_rank: int | None = None) -> list[Layout]:
    """Every static layout that holds a ``longest``-token document: our (dp, tp, cp) family and,
    with ``include_pp``, the same over pp stages (Megatron-style (dp, tp, pp) among them; priced
    whether or not the runtime runs them). ``tokens_per_rank``: the planner's capacity override (then
    pp layouts are left out: the override has no pp rule)."""
    out = enumerate_layouts(cm.world_size, cm, pp=False)
    if include_pp:
        out += [lay for lay in enumerate_layouts(cm.world_size, cm, runnable_only=False) if lay.pp > 1]
    if tokens_per_rank is not None:
        ratio = cm.activation_ratio()
        return [p for p in out if p.pp == 1
                and max_doc_length(int(tokens_per_rank * p.tp * p.cp * ratio), p.cp) >= longest]
    return [p for p in out if max(cm.option(p, ac).max_doc_length for ac in (False, True)) >= longest]


def static_seconds(cm: AnalyticCostModel, par: Layout, lengths: np.ndarray,
                   planners: dict[Layout, CostModelPlanner] | None = None,
                   tokens_per_rank: int | None = None) -> float:
    """Predicted step seconds of one static layout (checkpointing only if it must)."""
    if par.pp == 1:
        planners = {} if planners is None else planners
        if par not in planners:
            planners[par] = CostModelPlanner([par], model=cm.model, hardware=cm.hardware,
                                             tokens_per_rank=tokens_per_rank, ladder=False, runtime=cm.runtime)
        return planners[par].solve(lengths)[0]
    best = math.inf
    for ac in (False, True):
        full = cm.option(par, ac)
        # a pipeline wants more, smaller micro-batches (its bubble is (p-1)/m): the memory's capacity or
        # 1/2 .. 1/8 of it, whichever prices fastest (each still holding the longest document)
        for opt in [full] + [cm.option(par, ac, capacity=full.capacity // k) for k in (2, 4, 8)]:
            padded = opt.padded(lengths)
            if padded.max() > opt.capacity:
                continue
            cost = opt.doc_seconds(padded)
            groups = pack_lpt(padded, cost + opt.per_micro_batch * padded / opt.capacity, opt.capacity, par.dp)
            worst = max(opt.group_seconds(float(sum(cost[i] for mb in g for i in mb)), len(g)) for g in groups)
            best = min(best, worst + opt.stage_fixed + cm.switch_seconds(None, par))
    return best


def rule_seconds(cm: AnalyticCostModel, rule: Sequence[tuple[int, Layout]], lengths: np.ndarray,
                 packing: str = "ours") -> tuple[float, bool]:
    stages, order, fits = artifact_stages(lengths, rule, cm, packing)
    return sum(s[2] for s in stages) + cm.switch_sequence_seconds(order), fits


def geometric_mean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


@dataclass
class CellResult:
    """One (model, GPUs, context, data) cell, averaged over its batches (seconds are means)."""

    model: str
    world_size: int
    context: int
    data: str
    layouts: list[str]
    tokens: float
    ours_s: float
    best_static: str
    best_static_s: float
    rule_s: dict[str, float] = field(default_factory=dict)
    rule_fits: dict[str, bool] = field(default_factory=dict)
    rule_artifact_packing_s: dict[str, float] = field(default_factory=dict)
    best_static_no_cp: str = ""  # the Megatron-like (dp, tp, pp) family only
    best_static_no_cp_s: float = float("nan")
    ours_batches_s: list[float] = field(default_factory=list)  # per batch, ours and the best static's
    static_batches_s: list[float] = field(default_factory=list)
    reference_strategies_s: dict[str, float | None] = field(default_factory=dict)  # None: does not hold a batch

    @property
    def speedup_static(self) -> float:
        return self.best_static_s / self.ours_s

    @property
    def speedup_static_no_cp(self) -> float:
        return self.best_static_no_cp_s / self.ours_s

    @property
    def speedup_rule_artifact_packing(self) -> float:
        vals = self.rule_artifact_packing_s.values()
        return min(vals) / self.ours_s if vals else float("nan")

    @property
    def speedup_rule(self) -> float:
        """Over the better of the hand-set combinations (c1, c2), both packed our way."""
        return min(self.rule_s.values()) / self.ours_s if self.rule_s else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "gpus": self.world_size, "context": self.context, "data": self.data,
            "layouts": self.layouts, "tokens_per_step": self.tokens, "ours_s": self.ours_s,
            "ours_tokens_per_s": self.tokens / self.ours_s, "best_static": self.best_static,
            "best_static_s": self.best_static_s, "hand_set_s": self.rule_s, "hand_set_fits_memory": self.rule_fits,
            "hand_set_artifact_packing_s": self.rule_artifact_packing_s,
            "best_static_no_cp": self.best_static_no_cp, "best_static_no_cp_s": self.best_static_no_cp_s,
            "speedup_vs_best_static": self.speedup_static, "speedup_vs_hand_set": self.speedup_rule,
            "speedup_vs_best_static_no_cp": self.speedup_static_no_cp,
            "speedup_vs_hand_set_artifact_packing": self.speedup_rule_artifact_packing,
            "reference_strategies_s": self.reference_strategies_s,
            "reference_strategies_over_ours": {k: None if v is None else v / self.ours_s
                                               for k, v in self.reference_strategies_s.items()},
        }


def _artifact_model(model: str) -> str:
    """The artifact's own shape of a paper model (vocabulary 30592), so the grid compares like with like."""
    from ..models.config import PRESETS

    return f"artifact-{model}" if f"artifact-{model}" in PRESETS else model


def simulate_cell(model: str, world_size: int, context: int, data: str, hardware: str = "A800-80G",
                  batches: int = 2, sequences: int = 512, seed: int = 0) -> CellResult:
    """Our plan vs the best static layout vs the hand-set rule on the same batches."""
    cm = AnalyticCostModel(_artifact_model(model), hardware, world_size)
    data_batches = sample_batches(data, context, batches, sequences, seed)
    longest = max(int(b.max()) for b in data_batches)
    statics = static_layouts(cm, longest)
    planners: dict[Layout, CostModelPlanner] = {}
    static_totals = {p: sum(static_seconds(cm, p, b, planners) for b in data_batches) for p in statics}
    best = min(statics, key=lambda p: (static_totals[p], p.name))
    # candidates from other data, holding the static layout the cell compares with (every set then
    # holds it: the guard's fallback, issue 54; pipeline-parallel statics are priced, never run)
    sample = sample_batches(data, context, 1, sequences, seed + 7919)[0]
    runnable = min((p for p in statics if runs(p)), key=lambda p: (static_totals[p], p.name))
    layouts: tuple[Layout, ...] = auto_layouts(world_size, cm.model, cm.hardware, context, lengths=sample,
                                               static=runnable)
    planner = CostModelPlanner(layouts, model=cm.model, hardware=cm.hardware)
    ours, tokens = [], []
    rules: dict[str, list[float]] = {}
    rules_art: dict[str, list[float]] = {}
    fits: dict[str, bool] = {}
    for lengths in data_batches:
        tokens.append(float(lengths.sum()))
        ours.append(planner.solve(lengths)[0])
        for comb in ("c1", "c2"):
            try:
                rule = artifact_rule(model, world_size, context, comb)
            except RuleNotFoundError:
                continue
            secs, ok = rule_seconds(cm, rule, lengths)
            rules.setdefault(comb, []).append(secs)
            rules_art.setdefault(comb, []).append(rule_seconds(cm, rule, lengths, "artifact")[0])
            fits[comb] = fits.get(comb, True) and ok
    no_cp = [p for p in statics if p.cp == 1]
    best_no_cp = min(no_cp, key=lambda p: (static_totals[p], p.name)) if no_cp else None
    n = len(data_batches)
    reference = {lay.name: reference_seconds(cm, lay, data_batches, planners) / n
                 for lay in REFERENCE_STRATEGIES if lay.world_size == world_size and model == "llama7b"}
    return CellResult(model, world_size, context, data, [x.name for x in layouts], float(np.mean(tokens)),
                      float(np.mean(ours)), best.name, static_totals[best] / n,
                      {k: float(np.mean(v)) for k, v in rules.items()}, fits,
                      {k: float(np.mean(v)) for k, v in rules_art.items()},
                      best_no_cp.name if best_no_cp else "",
                      static_totals[best_no_cp] / n if best_no_cp else float("nan"),
                      [float(x) for x in ours], [static_seconds(cm, best, b, planners) for b in data_batches],
                      {k: None if not math.isfinite(v) else v for k, v in reference.items()})


def reference_seconds(cm: AnalyticCostModel, lay: Layout, batches: Sequence[np.ndarray],
                      planners: dict[Layout, CostModelPlanner]) -> float:
    """Summed predicted seconds of one declared static layout over ``batches`` (inf: it cannot run the
    model or hold a document)."""
    try:
        cm.check(lay)
        return sum(static_seconds(cm, lay, b, planners) for b in batches)
    except (CostModelError, PlanError):  # the weights do not fit, or a document does not (DocumentTooLongError)
        return math.inf


def simulate_grid(hardware: str = "A800-80G", batches: int = 2, sequences: int = 512, seed: int = 0,
                  grid: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every cell of the grid, and the geometric means of the speed-ups."""
    grid = grid or GRID
    start = time.perf_counter()
    jobs = [(m, w, c, d) for m, w in grid["settings"] for c in grid["contexts"] for d in grid["data"]]
    cells = [simulate_cell(m, w, c, d, hardware, batches, sequences, seed)
             for m, w, c, d in progress(jobs, "hotspa simulate")]
    return {
        "hardware": hardware, "batches_per_cell": batches, "sequences_per_batch": sequences,
        "cells": cells,
        "geomean_speedup_vs_best_static": geometric_mean([c.speedup_static for c in cells]),
        "geomean_speedup_vs_hand_set": geometric_mean([c.speedup_rule for c in cells]),
        "geomean_speedup_vs_best_static_no_cp": geometric_mean([c.speedup_static_no_cp for c in cells]),
        "geomean_speedup_vs_hand_set_artifact_packing": geometric_mean(
            [c.speedup_rule_artifact_packing for c in cells]),
        "min_speedup_vs_best_static": min(c.speedup_static for c in cells),
        "seconds": time.perf_counter() - start,
    }
