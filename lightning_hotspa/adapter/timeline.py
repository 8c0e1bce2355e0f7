"""A picture of one step: every rank's stages and switches on one time axis (matplotlib, PNG).

Why a picture: a slow step is either a slow stage, a long switch, or one rank that waits for the
others (dp imbalance), and the three look different at a glance. Each rank's row is its own
sequence ``switch -> compute -> gradient reduce`` per stage, laid end to end from the step's start
(the strategy times parts, not wall-clock instants, so idle gaps between parts are not drawn).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["PARTS", "draw_timeline"]

PARTS = ("switch", "compute", "reduce")  # columns of the per-rank timing array


def draw_timeline(timings: np.ndarray, layouts: Sequence[str], labels: Sequence[str], path: str | Path, *,
                  step: int, predicted_s: Sequence[float | None] | None = None) -> Path:
    """Writes the PNG and returns its path.

    Args:
        timings: ``[ranks, stages, 3]`` seconds of (switch, compute, reduce) per rank and stage.
        layouts / labels: per stage, in run order (``labels`` are the length buckets).
        predicted_s: optional predicted seconds per stage (switch into it included), drawn as a row.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t = np.asarray(timings, dtype=np.float64)
    if t.ndim != 3 or t.shape[2] != len(PARTS) or t.shape[1] != len(layouts):
        raise ValueError(f"timings must be [ranks, {len(layouts)} stages, 3], got shape {t.shape}")
    ranks, stages = t.shape[0], t.shape[1]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(stages)]
    has_pred = predicted_s is not None and any(p is not None for p in predicted_s)
    rows = ranks + (1 if has_pred else 0)
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.4 * rows))
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
    ax.set_yticks(range(rows), [f"rank {r}" for r in range(ranks)] + (["predicted"] if has_pred else []))
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of the step")
    ax.set_title(f"HotSPa step {step}: stages per rank (hatched: switch, light: gradient reduce)")
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
