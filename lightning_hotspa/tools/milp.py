"""A MILP of the planning problem (HiGHS), to bound how far the heuristic is from optimal.

Same objective as the solver, one relaxation: the micro-batches of a dp group are counted as
``n >= tokens / capacity`` (integer ``n``) instead of an exact bin packing, so the MILP optimum is a
LOWER bound of the true optimum (true packings need at least that many micro-batches). FlexSP
(docs/REFERENCE.md §5) plans with a MILP too; here it only checks the heuristic. ``highspy`` is imported on
use: it is a test dependency.

Variables: ``x[i,o,g]`` document i in option o's dp group g (only where it fits), ``y[o]`` option
used, ``n[o,g]`` micro-batches, ``z[o]`` stage compute seconds, ``w[U]`` the set of used layouts is
exactly U (its switch cost, less the gradient reductions same-tp neighbours share: ``stage_order``).
Rows: each document once; per layout one option, or both its plain and checkpointed options
(``split_checkpointing``: two stages back to back; ``b[layout]`` refunds the second reduction); a
used option runs at least one document; ``z[o] >= sum c x + d n`` per group; capacity; symmetric dp
groups ordered by load.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..layout import Layout
from ..planner.cost.cost_model import OptionCost

__all__ = ["MilpResult", "solve_milp"]


@dataclass(frozen=True)
class MilpResult:
    objective: float  # best plan found (of the relaxed model)
    bound: float  # proven lower bound
    optimal: bool
    seconds: float


def solve_milp(lengths: Sequence[int], options: Sequence[OptionCost],
               switch_cost: Callable[[tuple[Layout, ...]], tuple[float, tuple[Layout, ...]]],
               time_limit: float = 30.0, split_checkpointing: bool = True) -> MilpResult:
    import highspy

    arr = np.asarray(lengths, dtype=np.int64)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.setOptionValue("threads", 1)
    inf = highspy.kHighsInf
    ncol = 0

    def col(cost: float, lb: float, ub: float, integer: bool) -> int:
        nonlocal ncol
        h.addCol(float(cost), float(lb), float(ub), 0, np.array([], dtype=np.int32), np.array([], dtype=np.float64))
        if integer:
            h.changeColIntegrality(ncol, highspy.HighsVarType.kInteger)
        ncol += 1
        return ncol - 1

    def row(lb: float, ub: float, idx: list[int], vals: list[float]) -> None:
        h.addRow(float(lb), float(ub), len(idx), np.asarray(idx, dtype=np.int32), np.asarray(vals, dtype=np.float64))

    layouts = list(dict.fromkeys(o.layout for o in options))
    x: dict[tuple[int, int, int], int] = {}
    y, z, nmb = {}, {}, {}
    for o, opt in enumerate(options):
        padded = opt.padded(arr)
        cost = opt.doc_seconds(padded)
        y[o] = col(opt.stage_fixed, 0, 1, True)
        z[o] = col(1.0, 0, inf, False)
        loads = []
        for g in range(opt.layout.dp):
            nmb[o, g] = col(0.0, 0, inf, True)
            members = [i for i in range(arr.size) if padded[i] <= opt.capacity]
            for i in members:
                x[i, o, g] = col(0.0, 0, 1, True)
                row(-inf, 0, [x[i, o, g], y[o]], [1, -1])
            # z >= sum c x + d n ; capacity * n >= sum size x
            row(0, inf, [z[o], nmb[o, g]] + [x[i, o, g] for i in members],
                [1, -opt.per_micro_batch] + [-float(cost[i]) for i in members])
            row(0, inf, [nmb[o, g]] + [x[i, o, g] for i in members],
                [float(opt.capacity)] + [-float(padded[i]) for i in members])
            loads.append(([nmb[o, g]] + [x[i, o, g] for i in members],
                          [opt.per_micro_batch] + [float(cost[i]) for i in members]))
        for (ia, va), (ib, vb) in zip(loads, loads[1:], strict=False):  # symmetry: group loads non-increasing
            row(0, inf, ia + ib, va + [-v for v in vb])
        used = [x[k] for k in x if k[1] == o]
        row(0, inf, used + [y[o]], [1.0] * len(used) + [-1.0])
    for i in range(arr.size):
        idx = [v for k, v in x.items() if k[0] == i]
        if not idx:
            raise ValueError(f"document {i} fits no option")
        row(1, 1, idx, [1.0] * len(idx))
    w = {}
    for r in range(1, len(layouts) + 1):
        for used in itertools.combinations(layouts, r):
            w[used] = col(switch_cost(used)[0], 0, 1, True)
    row(1, 1, list(w.values()), [1.0] * len(w))
    for lay in layouts:
        mine = [o for o, opt in enumerate(options) if opt.layout == lay]
        ys = [y[o] for o in mine]
        ws = [v for used, v in w.items() if lay in used]
        both: list[int] = []
        if split_checkpointing and len(mine) == 2:  # both stages: one reduction, refunded here
            b = col(-options[mine[0]].stage_fixed, 0, 1, True)
            for o in mine:
                row(-inf, 0, [b, y[o]], [1, -1])
            both = [b]
        row(0, 0, ys + both + ws, [1.0] * len(ys) + [-1.0] * (len(both) + len(ws)))
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    return MilpResult(float(info.objective_function_value), float(info.mip_dual_bound),
                      status == highspy.HighsModelStatus.kOptimal, float(h.getRunTime()))
