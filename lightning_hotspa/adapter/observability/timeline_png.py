"""A picture of one step: every rank's stages and switches on one time axis (matplotlib, PNG).

Why a picture: a slow step is either a slow stage, a long switch, or one rank that waits for the
others (dp imbalance), and the three look different at a glance. Each rank's row is its own
sequence ``switch -> compute -> gradient reduce`` per stage, laid end to end from the step's start
(the strategy times parts, not wall-clock instants, so idle gaps between parts are not drawn).
With ``lanes`` (a plan's block stage: :func:`block_lanes`) the rows are the blocks instead, one lane
per block (its slowest rank's parts per stage), labelled with its ranks and layout: blocks of a
block stage run side by side on their own clocks, so the picture shows which block the stage
waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["PARTS", "block_lanes", "draw_timeline", "lane_timings"]

PARTS = ("switch", "compute", "reduce")  # columns of the per-rank timing array


def block_lanes(plan, mesh) -> list[tuple[str, tuple[int, ...]]]:
    """One lane per block of the plan's first block stage: ``(label, ranks)``, e.g.
    ``("block 0: ranks 0-3 dp2xcp2:kv sharded", (0, 1, 2, 3))``; empty when the plan has none.

    Args:
        plan: a :class:`~lightning_hotspa.plan.StepPlan`.
        mesh: the world mesh's :class:`~lightning_hotspa.layout.MeshShape`.
    """
    from ...plan import block_ranks

    for stage in plan.stages:
        if stage.blocks and not stage.lockstep_blocks:
            out = []
            for k, b in enumerate(stage.blocks):
                ranks = block_ranks(b, mesh)
                copy = "sharded" if b.sharded else "replicated"
                out.append((f"block {k}: ranks {ranks[0]}-{ranks[-1]} {b.layout.name} {copy}", ranks))
            return out
    return []


def lane_timings(timings: np.ndarray, lanes: Sequence[tuple[str, Sequence[int]]]) -> np.ndarray:
    """``[lanes, stages, 3]``: per lane and stage, its slowest rank's (switch, compute, reduce)
    (the rank whose three parts sum highest).

    Args:
        timings: ``[ranks, stages, 3]`` seconds.
        lanes: ``(label, ranks)`` per lane (:func:`block_lanes`).
    """
    t = np.asarray(timings, dtype=np.float64)
    out = np.zeros((len(lanes), t.shape[1], t.shape[2]))
    for k, (_, ranks) in enumerate(lanes):
        rows = t[list(ranks)]
        slowest = rows.sum(axis=2).argmax(axis=0)  # per stage
        out[k] = rows[slowest, np.arange(t.shape[1])]
    return out


def draw_timeline(timings: np.ndarray, layouts: Sequence[str], labels: Sequence[str], path: str | Path, *,
                  step: int, predicted_s: Sequence[float | None] | None = None,
                  lanes: Sequence[tuple[str, Sequence[int]]] | None = None) -> Path:
    """Writes the PNG and returns its path.

    Args:
        timings: ``[ranks, stages, 3]`` seconds of (switch, compute, reduce) per rank and stage.
        layouts / labels: per stage, in run order (``labels`` are the length buckets).
        predicted_s: optional predicted seconds per stage (switch into it included), drawn as a row.
        lanes: one row per lane instead of per rank (a block stage's blocks: :func:`block_lanes`).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t = np.asarray(timings, dtype=np.float64)
    if t.ndim != 3 or t.shape[2] != len(PARTS) or t.shape[1] != len(layouts):
        raise ValueError(f"timings must be [ranks, {len(layouts)} stages, 3], got shape {t.shape}")
    names = [f"rank {r}" for r in range(t.shape[0])]
    if lanes:
        t, names = lane_timings(t, lanes), [label for label, _ in lanes]
    ranks, stages = t.shape[0], t.shape[1]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(stages)]
    has_pred = predicted_s is not None and any(p is not None for p in predicted_s)
    rows = ranks + (1 if has_pred else 0)
    fig, ax = plt.subplots(figsize=(11 + (3 if lanes else 0), 1.4 + 0.4 * rows))
    for r in range(ranks):
        x = 0.0
        for s in range(stages):
            sw, comp, red = t[r, s]
            ax.barh(r, sw, left=x, color="0.75", hatch="///", edgecolor="0.35", linewidth=0.4)
            ax.barh(r, comp, left=x + sw, color=colors[s], edgecolor="black", linewidth=0.4)
            ax.barh(r, red, left=x + sw + comp, color=colors[s], alpha=0.45, edgecolor="black", linewidth=0.4)
            x += sw + comp + red
    if has_pred:
        x = 0.0
        for s, p in enumerate(predicted_s or ()):
            if p is None:
                continue
            ax.barh(ranks, p, left=x, color=colors[s], alpha=0.35, edgecolor=colors[s], linestyle="--")
            x += p
    ax.set_yticks(range(rows), names + (["predicted"] if has_pred else []))
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of the step")
    what = "per block (its slowest rank)" if lanes else "per rank"
    ax.set_title(f"HotSPa step {step}: stages {what} (hatched: switch, light: gradient reduce)")
    handles = [Patch(facecolor=colors[s], edgecolor="black", label=f"{layouts[s]} {labels[s]}".strip())
               for s in range(stages)]
    handles.append(Patch(facecolor="0.75", hatch="///", edgecolor="0.35", label="switch"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
