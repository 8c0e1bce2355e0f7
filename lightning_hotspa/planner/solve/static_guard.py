"""Never worse than static by design: switch layouts only for a predicted gain above a margin.

Why: a multi-layout plan wins only by the cost model's prediction, and predictions err. On the CPU
box the planner switched for predicted gains of 0-8 % that noise and per-stage costs ate.
So for every step the solver also plans the same documents in each single candidate layout and keeps
the multi-layout plan only when ``best single / multi - 1 > margin``. A plan already in one layout is
checked too (margin 0): the heuristic's one-layout plan, picked among all options, can be slower than
a layout solved alone. A single layout whose lower bound cannot win is not solved (planner time).

The default margin is the cost model's typical error BETWEEN two layouts' predictions on one model and
one machine (issue 39): the mean over held-out pairs of published runs (one source, model and GPU,
different layouts) of ``|ln(pred_a / pub_a) - ln(pred_b / pub_b)|``, as a relative gain
``exp(mean) - 1`` (docs/cost-model.md, recipes/benchmark_published.py ``guard_margin_derived``): a gain
smaller than what two layouts' predictions typically err against each other is not evidence of a
gain. (Before: 0.147, the profiled CPU model's absolute held-out error; 0.138 until issue 51 priced
torch.compile.) It is a
constant, not refreshed online, because every rank and loader worker must compute the same plan and
the coefficient schedule carries only coefficients (planner/profiled/schedule.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..cost.cost_model import OptionCost
from .ladder import LadderGroups
from .mixed_rounds import MixedGroups

__all__ = ["DEFAULT_STATIC_MARGIN", "GuardDecision", "check_margin", "guard", "solution_name", "used_layouts"]

#: exp(mean held-out between-layout log error) - 1 over 31 pairs of published runs (llm-foundry's tables,
#: torchtitan's incl. its cp table, NeMo's long-sequence cp table), recipes/benchmark_published.py
#: on 2026-12-03 (benchmarks/2026-12-03-published-cp.md), 0.137 since the KV ring (benchmarks/2026-12-06-kv-ring.md),
#: 0.139 since attention is priced by call length (benchmarks/2026-12-07-attention-length.md);
#: tests/unit/test_published.py re-derives it.
DEFAULT_STATIC_MARGIN = 0.139

Solution = tuple[float, list[tuple[OptionCost, tuple]]]


@dataclass(frozen=True)
class GuardDecision:
    """What the guard saw for one step: logged as planner metrics."""

    multi_s: float  # the multi-layout plan's predicted seconds
    static_s: float  # the best single-layout plan's (inf: no single layout holds every document)
    static_layout: str
    margin: float
    fell_back: bool  # True: the step runs the single-layout plan

    @property
    def predicted_gain(self) -> float:
        """``static / multi - 1`` (0 when they are the same plan)."""
        return self.static_s / self.multi_s - 1.0 if np.isfinite(self.static_s) and self.multi_s > 0 else 0.0

    def notes(self) -> tuple[tuple[str, float], ...]:
        return (("predicted_gain_over_static", self.predicted_gain), ("static_fallback", float(self.fell_back)),
                ("static_margin", self.margin), ("predicted_static_s", self.static_s),
                ("predicted_multi_s", self.multi_s))


def check_margin(margin: object, where: str) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 10:
        raise ValueError(f"{where}: static_margin must be a number in [0, 10), got {margin!r}")
    return float(margin)


def guard(lengths: np.ndarray, options: Sequence[OptionCost], multi: Solution, margin: float,
          solve: Callable[[np.ndarray, list[OptionCost]], Solution]) -> tuple[Solution, GuardDecision]:
    """The plan to run and the decision. ``solve(lengths, options)`` plans over a subset of options
    (the same solver the multi-layout plan came from)."""
    total, stages = multi
    used = used_layouts(stages)
    longest = int(lengths.max())
    by_layout: dict[object, list[OptionCost]] = {}
    for opt in options:
        by_layout.setdefault(opt.layout, []).append(opt)
    bounds = sorted((_lower_bound(lengths, opts, longest), i, par) for i, (par, opts) in enumerate(by_layout.items()))
    best: Solution | None = None
    best_name = ""
    if len(used) > 1:
        threshold = total * (1.0 + margin)
        for bound, _, par in bounds:  # cheapest bound first; a bound above the threshold (or the
            if bound > threshold or (best is not None and bound >= best[0]):  # best so far) cannot
                break  # change the decision: skip the solve (keeps the guard within the time budget)
            single = solve(lengths, by_layout[par])
            if best is None or single[0] < best[0]:
                best, best_name = single, par.name
        if best is None and bounds and np.isfinite(bounds[0][0]):  # every single layout is bounded
            bound, _, par = bounds[0]  # out: report the best bound as its time (a lower bound)
            return multi, GuardDecision(total, bound, f"{par.name} (bound)", margin, False)
    else:  # already one layout, but a heuristic's pick: a layout solved alone (another, or this
        own = next(iter(used))  # one without the other options' distraction) may plan these
        best, best_name = multi, own.name  # documents faster; then that runs (static either way)
        for bound, _, par in (bounds if len(by_layout) > 1 else ()):  # one layout: multi IS it solved alone
            if bound >= best[0]:
                break
            single = solve(lengths, by_layout[par])
            if single[0] < best[0] * (1 - 1e-9):
                best, best_name = single, par.name
        if best is not multi:
            return best, GuardDecision(total, best[0], best_name, margin, True)
    if best is None:
        return multi, GuardDecision(total, float("inf"), "", margin, False)
    fall_back = best is not multi and not best[0] > total * (1.0 + margin)
    decision = GuardDecision(total, best[0], best_name, margin, fall_back)
    return (best if fall_back else multi), decision


def used_layouts(stages: Sequence[tuple[OptionCost, object]]) -> set[object]:
    """What a solution computes in: its stages' layouts, a mixed or block stage's blocks' layouts, and a
    block stage's blocks themselves (never a static plan, even of one compute layout: its blocks run
    copies of their own). More than one entry: a multi-layout plan.

    Args:
        stages: a solver solution's ``[(option, groups)]``.
    """
    used: set[object] = {opt.layout for opt, _ in stages}
    for _, groups in stages:
        if isinstance(groups, (MixedGroups, LadderGroups)):
            used.update(groups.layouts)
        if isinstance(groups, LadderGroups):
            used.update(("block", k) for k in range(len(groups.blocks)))
    return used


def solution_name(stages: Sequence[tuple[OptionCost, object]]) -> str:
    """A solution as ``hotspa plan`` names it: its stages in order (``dp8+ac -> dp4xcp2``), a mixed or
    block stage as its blocks' working options in brackets (``blocks[dp4xcp2, cp8:fsdp8]``).

    Args:
        stages: a solver solution's ``[(option, groups)]``.
    """
    names = []
    for opt, groups in stages:
        if isinstance(groups, (MixedGroups, LadderGroups)):
            inner = list(dict.fromkeys(b.option.label for b in groups.blocks))
            names.append(f"blocks[{', '.join(inner)}]")
        else:
            names.append(opt.label)
    return " -> ".join(dict.fromkeys(names))


def _lower_bound(lengths: np.ndarray, options: Sequence[OptionCost], longest: int) -> float:
    """No single-layout plan over ``options`` is faster: its slowest dp group is at least the mean
    group (each document's seconds in the cheapest of the layout's options that holds it, plus its
    share of the fewest micro-batches, over dp). Per document, not per option: the layout may run
    a checkpointed stage for the documents that need it and a plain one for the rest."""
    if not options or max(opt.max_doc_length for opt in options) < longest:
        return np.inf
    work = np.full(lengths.size, np.inf)
    for opt in options:
        padded = opt.padded(lengths)
        secs = opt.doc_seconds(padded) + opt.per_micro_batch * padded / opt.capacity
        work = np.minimum(work, np.where(padded <= opt.capacity, secs, np.inf))
    return float(work.sum()) / options[0].layout.dp
