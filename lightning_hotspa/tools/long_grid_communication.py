"""The long grid before and after issue 52's communication terms, in one run (the same code, the same batches).

``before`` prices OUR runtime as main described it before issue 52 (:data:`BEFORE_52`): tp collectives, the
replicated gradient reduction and the cp ring exchange fully exposed, all-gather-KV recomputing attention in
backward. ``after`` is :data:`~..planner.cost.runtime_profile.HOTSPA` as it is. The peers' runtime descriptions
(``competent_user_static``'s layouts) are the same on both sides, so "ours over a competent user" moves only
with ours.

    python -m lightning_hotspa.tools.long_grid_communication [--grid long|smoke] [--batches 2] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..planner.cost import runtime_profile
from ..planner.cost.runtime_profile import HOTSPA, RuntimeProfile

__all__ = ["BEFORE_52", "before_after", "headline", "ours_described_as"]

#: our runtime as the cost model described it before issue 52 (main 5d61bc4's model of it)
BEFORE_52 = dataclasses.replace(HOTSPA, tp_comm_overlap=False, cp_comm_overlap=False, dp_reduce_overlap=False,
                                kv_gather_recomputes_attention=True)

#: the long grid's figures compared side by side
HEADLINE = ("geomean_ours_over_static", "geomean_oracle_over_static", "competent_user_static",
            "competent_user_static_on_ours_runtime", "competent_user_static_cells_ours_slower", "infeasible_cells")


@contextlib.contextmanager
def ours_described_as(profile: RuntimeProfile) -> Iterator[None]:
    """Inside the block, every cost model built for OUR runtime (the profile name ``"hotspa"``) prices ``profile``.

    Args:
        profile: the description to price ours on; restored to the shipped one on exit, also on an error.
    """
    shipped = runtime_profile.RUNTIME_PROFILES["hotspa"]
    runtime_profile.RUNTIME_PROFILES["hotspa"] = dataclasses.replace(profile, name="hotspa")
    try:
        yield
    finally:
        runtime_profile.RUNTIME_PROFILES["hotspa"] = shipped


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The compared figures of one :func:`~.long_grid.long_grid` result.

    Args:
        result: a long grid result.
    """
    return {k: result[k] for k in HEADLINE}


def before_after(grid: dict[str, Any], batches: int = 2, out: str | None = None) -> dict[str, Any]:
    """The grid priced with ours as :data:`BEFORE_52`, then as shipped: ``{"before": ..., "after": ...}`` headlines.

    Args:
        grid: a grid of :mod:`.long_grid` (``LONG_GRID`` or ``SMOKE_GRID``); batches: global batches per cell;
        out: a path prefix: both full results written to ``{out}-before.json`` / ``{out}-after.json``.
    """
    from .long_grid import long_grid

    with ours_described_as(BEFORE_52):
        before = long_grid(grid, batches)
    after = long_grid(grid, batches)
    if out:
        for side, result in (("before", before), ("after", after)):
            Path(f"{out}-{side}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return {"before": headline(before), "after": headline(after), "seconds": before["seconds"] + after["seconds"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run :func:`before_after` and print one JSON line last."""
    from .long_grid import LONG_GRID, SMOKE_GRID

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=("long", "smoke"), default="long")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--out", default=None, help="path prefix of the two full results' JSON files")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    out = before_after(LONG_GRID if args.grid == "long" else SMOKE_GRID, args.batches, args.out)
    print(json.dumps({"grid": args.grid, **out}))
    return out


if __name__ == "__main__":
    main()
