"""The HotSPa artifact's hand-set strategy table (docs/REFERENCE.md §3), as a comparator for the simulator.

Source: the table in docs/REFERENCE.md §3, transcribed from the artifact's experiment scripts
(``hotspa/scripts/exprs_for_paper/`` of github.com/ccchengff/HotSPa-AE). Each setting maps length bands
to ``(dp, tp, pp)`` strategies; ``c1`` uses fewer strategies, ``c2`` more. Bands are upper bounds in
tokens (K = 1024). Only contexts 8K-32K are listed there.

The artifact's step (docs/REFERENCE.md §4), which :func:`artifact_stages` can mimic:
``packing="artifact"`` packs each band first-fit into rows of the band's upper bound, one row per
micro-batch, padded to the bound, with packed documents attending to each other (cost of a row = cost of
one document of the bound's length); ``packing="ours"`` keeps the rule's band -> strategy assignment but
packs without padding and balances dp groups by cost, isolating the effect of the assignment itself.
Stage order: materialize in the longest band's strategy, run the other bands shortest first, finish with
the longest band. Rows dropped by the artifact (beyond a multiple of dp) are NOT dropped here: every
plan trains on the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..layout import Layout
from ..planner.cost.cost_model import AnalyticCostModel, OptionCost
from ..planner.solve.assign import pack_lpt

__all__ = ["HAND_SET_RULES", "artifact_rule", "artifact_stages", "RuleNotFoundError"]


class RuleNotFoundError(KeyError):
    """No hand-set rule for that (combination, model, GPUs, context)."""

    def __str__(self) -> str:
        return str(self.args[0])


# comb, model preset, GPUs, context K -> "bound_K:dp,tp,pp; ..." exactly as in docs/REFERENCE.md §3
_TABLE = """
c1 llama7b 8 32 | 4:8,1,1; 16:2,2,2; 32:1,4,2
c1 llama7b 8 16 | 4:8,1,1; 16:2,2,2
c1 llama7b 8 8 | 4:8,1,1; 8:2,2,2
c1 llama7b 16 32 | 4:16,1,1; 16:4,4,1; 32:2,4,2
c1 llama7b 16 16 | 4:16,1,1; 16:4,4,1
c1 llama7b 16 8 | 4:16,1,1; 8:4,4,1
c1 llama13b 8 32 | 4:4,2,1; 16:1,4,2; 32:1,8,1
c1 llama13b 8 16 | 4:4,2,1; 16:1,4,2
c1 llama13b 8 8 | 4:4,2,1; 8:1,4,2
c1 llama13b 16 32 | 4:8,2,1; 16:4,4,1; 32:2,8,1
c1 llama13b 16 16 | 4:8,2,1; 16:4,4,1
c1 llama13b 16 8 | 4:8,2,1; 8:4,4,1
c1 llama30b 32 32 | 4:4,2,4; 16:2,8,2; 32:1,16,2
c1 llama30b 32 16 | 4:4,2,4; 16:2,8,2
c1 llama30b 32 8 | 4:4,2,4; 8:2,8,2
c2 llama7b 8 32 | 4:8,1,1; 8:4,2,1; 16:2,2,2; 32:1,4,2
c2 llama7b 8 16 | 4:8,1,1; 8:4,2,1; 16:2,2,2
c2 llama7b 8 8 | 4:8,1,1; 8:4,2,1
c2 llama7b 16 32 | 4:16,1,1; 8:8,2,1; 16:4,4,1; 32:2,4,2
c2 llama7b 16 16 | 4:16,1,1; 8:8,2,1; 16:4,4,1
c2 llama7b 16 8 | 4:16,1,1; 8:8,2,1
c2 llama13b 8 32 | 4:4,2,1; 8:2,2,2; 16:1,4,2; 32:1,8,1
c2 llama13b 8 16 | 4:4,2,1; 8:2,2,2; 16:1,4,2
c2 llama13b 8 8 | 4:4,2,1; 8:2,2,2
c2 llama13b 16 32 | 4:8,2,1; 8:4,2,2; 16:4,4,1; 32:2,8,1
c2 llama13b 16 16 | 4:8,2,1; 8:4,2,2; 16:4,4,1
c2 llama13b 16 8 | 4:8,2,1; 8:4,2,2
c2 llama30b 32 32 | 4:4,2,4; 8:4,4,2; 16:2,8,2; 32:1,16,2
c2 llama30b 32 16 | 4:4,2,4; 8:4,4,2; 16:2,8,2
c2 llama30b 32 8 | 4:4,2,4; 8:4,4,2
"""


def _parse(table: str) -> dict[tuple[str, str, int, int], tuple[tuple[int, Layout], ...]]:
    out = {}
    for line in table.strip().splitlines():
        head, rule = line.split("|")
        comb, model, gpus, ctx = head.split()
        bands = []
        for part in rule.split(";"):
            bound, degrees = part.strip().split(":")
            dp, tp, pp = (int(x) for x in degrees.split(","))
            bands.append((int(bound) * 1024, Layout(dp=dp, tp=tp, pp=pp)))
        out[(comb, model, int(gpus), int(ctx) * 1024)] = tuple(bands)
    return out


HAND_SET_RULES = _parse(_TABLE)


def artifact_rule(model: str, world_size: int, context: int, comb: str = "c1") -> tuple[tuple[int, Layout], ...]:
    """``((upper bound, (dp, tp, pp)), ...)`` of the artifact's setting, shortest band first."""
    key = (comb, model, int(world_size), int(context))
    if key not in HAND_SET_RULES:
        known = sorted({(k[1], k[2], k[3]) for k in HAND_SET_RULES})
        raise RuleNotFoundError(f"no hand-set rule for {comb} {model} on {world_size} GPUs at context {context}; "
                                f"the artifact lists (model, GPUs, context) {known}")
    return HAND_SET_RULES[key]


def _option(cm: AnalyticCostModel, par: Layout, longest: int) -> tuple[OptionCost, bool]:
    """The band's option: no checkpointing if its documents fit, else checkpointing; (option, fits)."""
    for ac in (False, True):
        opt = cm.option(par, ac)
        if opt.max_doc_length >= longest:
            return opt, True
    opt = cm.option(par, True)  # does not fit by our memory model: priced anyway, flagged
    return dataclasses.replace(opt, capacity=max(longest, opt.capacity)), False


def artifact_stages(
    lengths: Sequence[int] | np.ndarray,
    rule: Sequence[tuple[int, Layout]],
    cost_model: AnalyticCostModel,
    packing: str = "ours",
) -> tuple[list[tuple[OptionCost, tuple, float]], list[Layout], bool]:
    """Stages of the rule for one batch: ([(option, groups, seconds)], switch sequence, all fit).

    ``groups`` are dp groups of micro-batches of document indices (``packing="ours"``) or of the
    padded rows (``"artifact"``: each row is priced as one document of the band's upper bound).
    The switch sequence starts with the materialization in the longest band's strategy.
    """
    if packing not in ("ours", "artifact"):
        raise ValueError(f"packing must be 'ours' or 'artifact', got {packing!r}")
    arr = np.asarray(lengths, dtype=np.int64)
    bounds = np.array([b for b, _ in rule])
    band = np.searchsorted(bounds, arr, side="left")
    if arr.size and int(band.max()) >= len(rule):
        i = int(np.argmax(band >= len(rule)))
        raise ValueError(f"document {i} ({int(arr[i])} tokens) is longer than the rule's last band ({bounds[-1]})")
    stages, all_fit = [], True
    for k, (bound, par) in enumerate(rule):
        idx = np.flatnonzero(band == k)
        if idx.size == 0:
            continue
        longest = bound if packing == "artifact" else int(arr[idx].max())
        opt, fits = _option(cost_model, par, longest)
        all_fit &= fits
        if packing == "artifact":
            rows = _rows(arr[idx], bound)
            row_cost = float(opt.doc_seconds(np.array([bound]))[0])
            per_group = [rows[g::par.dp] for g in range(par.dp)]
            secs = max(opt.group_seconds(row_cost * len(g), len(g)) for g in per_group) + opt.stage_fixed
            groups = tuple(tuple(tuple(int(idx[i]) for i in row) for row in g) for g in per_group)
        else:
            padded = opt.padded(arr[idx])
            cost = opt.doc_seconds(padded)
            bal = cost + opt.per_micro_batch * padded / opt.capacity
            local = pack_lpt(padded, bal, opt.capacity, par.dp)
            groups = tuple(tuple(tuple(int(idx[i]) for i in mb) for mb in g) for g in local)
            secs = max((opt.group_seconds(float(sum(cost[i] for mb in g for i in mb)), len(g)) for g in local),
                       default=0.0) + opt.stage_fixed
        stages.append((opt, groups, secs))
    order = [rule[-1][1]] + [s[0].layout for s in stages]
    return stages, order, all_fit


def _rows(lengths: np.ndarray, bound: int) -> list[list[int]]:
    """First fit (in the given order, as the artifact does after sorting by length) into rows of
    ``bound`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(lengths, kind="stable").tolist():
        n = int(lengths[i])
        for r, free in enumerate(room):
            if free >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(bound - n)
    return rows
