"""The long grid with ours priced as the planner prices it and with the options its users turn on, in one run.

Three sides on the same sampled batches (issue 51's ``competent_user_static``): ``default`` (ours as the planner
prices it: FlashAttention-2, eager), ``matching`` (:data:`~.long_grid.OURS_OPTIONS`: FA3 + ``compile_blocks``, the
torchtitan-like user compiled too) and ``matching-conservative`` (the same, FA3 priced at the fitted FA2 value x
the kernels' own ratio). The Megatron-TE-like user is priced alike on every side (NeMo / TE's description).

    python -m lightning_hotspa.tools.long_grid_options [--grid long|smoke] [--batches 2] [--jobs 2] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from .long_grid import LONG_GRID, SMOKE_GRID, long_grid, ours_options
from .long_grid_communication import headline

__all__ = ["SIDES", "side_by_side"]

#: the sides, each :func:`~.long_grid.ours_options`' arguments: an options name and whether FA3 is priced conservatively
SIDES = {"default": ("default", False), "matching": ("matching", False), "matching-conservative": ("matching", True)}


def _side(grid: dict[str, Any], batches: int, name: str) -> dict[str, Any]:
    return long_grid(grid, batches, ours=ours_options(*SIDES[name]))


def side_by_side(grid: dict[str, Any], batches: int = 2, jobs: int = 1, out: str | None = None) -> dict[str, Any]:
    """Every side of :data:`SIDES` priced on ``grid``: ``{"sides": {name: headline}, "seconds", "wall_seconds"}``.

    Args:
        grid: a grid of :mod:`.long_grid`; batches: global batches per cell; jobs: sides priced at once (worker
        processes; 1: in this process); out: a path prefix: each side's full result written to ``{out}-{side}.json``.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    start = time.perf_counter()
    if jobs == 1:
        results = {name: _side(grid, batches, name) for name in SIDES}
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {name: pool.submit(_side, grid, batches, name) for name in SIDES}
            results = {name: f.result() for name, f in futures.items()}
    if out:
        for name, result in results.items():
            Path(f"{out}-{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return {"sides": {name: {**headline(r), "ours_options": r["ours_options"]} for name, r in results.items()},
            "seconds": sum(r["seconds"] for r in results.values()), "wall_seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run :func:`side_by_side` and print one JSON line last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=("long", "smoke"), default="long")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=1, help="sides priced at once, in worker processes")
    parser.add_argument("--out", default=None, help="path prefix of each side's full result JSON")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.jobs < 1:
        parser.error(f"--batches and --jobs must be >= 1, got {args.batches} and {args.jobs}")
    out = side_by_side(LONG_GRID if args.grid == "long" else SMOKE_GRID, args.batches, args.jobs, args.out)
    print(json.dumps({"grid": args.grid, **out}))
    return out


if __name__ == "__main__":
    main()
