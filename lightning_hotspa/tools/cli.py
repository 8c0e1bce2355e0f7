"""``hotspa``: dry-run planning, the paper-scale simulation grid, and CPU calibration.

* ``hotspa plan``: which layout (and checkpointing) runs which length band of one global batch, the
  predicted time per stage, and the predicted speed-up over the best static layout.
* ``hotspa simulate``: LLaMA-7B/13B on 8 and 16 GPUs and 30B on 32, contexts 8K-32K, CommonCrawl- and
  GitHub-like data: speed-ups of our plans over the best static layout and the artifact's hand-set rule.
* ``hotspa calibrate``: measures the ``cpu-gloo`` hardware profile's rates on local gloo ranks.
* ``hotspa memory``: peak memory per rank of the real training step at 7B-70B scale, under
  ``FakeTensorMode`` and a fake process group, next to the cost model's prediction (tools/memory.py).
* ``hotspa check-calibration``: profiled mode end to end on local gloo ranks with the real model:
  fit on early steps' stage timings, report the prediction error on later (held-out) steps, on
  each rank's CPU seconds (default, see :data:`~.check_calibration.CLOCKS`) and on wall seconds
  (tools/check_calibration.py).

``--json`` (plan, simulate) prints one JSON object as the last line. Bad inputs exit with code 2 and a
one-line message naming the cause.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .check_calibration import CLOCKS, calibration_errors
from .cli_args import CliError, HelpFormatter, SubParser, positive_int, registry_names, token_count

# the names tests and callers import from here (CLOCKS, calibration_errors: tools/check_calibration.py)
__all__ = ["CLOCKS", "CliError", "HelpFormatter", "build_parser", "calibration_errors", "main"]


# ------------------------------------------------------------------------------------------ data
def _corpus_lengths(path: str) -> np.ndarray:
    from pathlib import Path

    from ..data import (
        ByteTokenizer,
        JsonlSource,
        ParquetSource,
        StdlibCorpusSource,
        TextFolderSource,
        TokenizedCorpus,
    )

    if path == "stdlib":
        source: Any = StdlibCorpusSource()
    else:
        p = Path(path)
        if not p.exists():
            raise CliError(f"--data {path!r} is neither a length generator (commoncrawl, github, uniform, "
                           f"bimodal) nor an existing path")
        files = [p] if p.is_file() else list(p.rglob("*"))
        if any(f.suffix == ".parquet" for f in files):
            source = ParquetSource(p)
        elif any(f.suffix == ".jsonl" for f in files):
            source = JsonlSource(p)
        else:
            source = TextFolderSource(p if p.is_dir() else p.parent)
    from .progress import progress

    corpus = TokenizedCorpus.build(source, ByteTokenizer(), use_cache=False,
                                   progress=lambda docs: progress(docs, "hotspa plan: tokenizing --data", unit="doc"))
    return np.asarray(corpus.lengths, dtype=np.int64)


def batch_lengths(data: str, global_batch_tokens: int, context: int, seed: int, step: int) -> np.ndarray:
    """One token-budget global batch, as the DataModule composes it (documents longer than the context
    are cut into context-sized chunks)."""
    from ..data import LENGTH_PROFILES, LengthGenerator, MiniBatchSampler

    if data in LENGTH_PROFILES:
        gen = LengthGenerator(kind=data, seed=seed, scale=1 / 3.5 if data == "github" else 1.0)
        mean = float(np.minimum(gen.lengths(2000), context).mean())
        n = int(math.ceil((step + 2) * 1.3 * global_batch_tokens / mean)) + 16
        lengths = gen.lengths(n)
    else:
        lengths = _corpus_lengths(data)
    sampler = MiniBatchSampler(lengths, global_batch_tokens, context, seed)
    if step >= sampler.num_batches(0):
        raise CliError(f"--step {step}: the data holds only {sampler.num_batches(0)} global batches of "
                       f"{global_batch_tokens} tokens")
    return np.asarray(sampler.batch_lengths(0, step), dtype=np.int64)


# ------------------------------------------------------------------------------------------ plan
def _cmd_plan(args: argparse.Namespace) -> dict[str, Any]:
    from ..planner.candidates import auto_layouts
    from ..planner.cost.cost_model import AnalyticCostModel
    from ..planner.solve.solver import CostModelPlanner
    from .simulate import static_layouts, static_seconds

    cm = AnalyticCostModel(args.model, args.hardware, args.world_size)
    if args.global_batch_tokens < args.context:
        raise CliError(f"--global-batch-tokens {args.global_batch_tokens} is below --context {args.context}: "
                       f"a full-context document could never fit in a batch")
    lengths = batch_lengths(args.data, args.global_batch_tokens, args.context, args.seed, args.step)
    statics = static_layouts(cm, int(lengths.max()), include_pp=False, tokens_per_rank=args.tokens_per_rank)
    static = {p.name: static_seconds(cm, p, lengths, tokens_per_rank=args.tokens_per_rank) for p in statics}
    best = min(static, key=lambda k: (static[k], k)) if static else None
    if args.layouts == "auto":  # the candidates hold the static layout the plan is compared with
        layouts: Any = auto_layouts(args.world_size, cm.model, cm.hardware, args.context, lengths=lengths,
                                    static=best)
    else:
        layouts = [x for x in args.layouts.split(",") if x.strip()]
    ladder = {"auto": "auto", "declared": True, "off": False}[args.ladder]
    kwargs = dict(model=cm.model, hardware=cm.hardware, world_size=args.world_size,
                  tokens_per_rank=args.tokens_per_rank, ladder=ladder)
    if getattr(args, "calibration", None):  # issue 53: a run's saved measured corrections decide the plan
        from ..planner.profiled.measured_planner import MeasuredCostPlanner

        planner = MeasuredCostPlanner(layouts, explore_budget=0.0, **kwargs)
        planner.load_corrections(_read_corrections(args.calibration))
        plan = planner.plan(args.step, lengths, latest=True)
    else:
        planner = CostModelPlanner(layouts, **kwargs)
        plan = planner.plan(args.step, lengths)
    pred = planner.predict(plan)
    own = {x.name for x in planner.layouts}
    reference = min((k for k in static if k in own), key=lambda k: (static[k], k), default=None)
    rows = [("band", "docs", "tokens", "layout", "ckpt", "micro-batches", "predicted s")]
    for s in pred.stages:
        rows.append((s.band, str(s.documents), str(s.tokens), s.layout, "yes" if s.activation_checkpointing else "no",
                     str(s.micro_batches), f"{s.seconds:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"{cm.model.n_layers}-layer model ({cm.params / 1e9:.2f}B) on {args.world_size} x {cm.hardware.name}; "
          f"{lengths.size} documents, {int(lengths.sum())} tokens; candidates "
          f"{', '.join(x.name for x in planner.layouts)}")
    blocks = [block_rows(planner, st, sp) for st, sp in zip(plan.stages, pred.stages)]
    for k, r in enumerate(rows):
        cells = enumerate(zip(r, widths, strict=True))
        print("  ".join(c.rjust(w) if i in (1, 2, 5, 6) else c.ljust(w) for i, (c, w) in cells))
        for b in blocks[k - 1] if k else ():
            print(f"    block {b['block']}: ranks {b['ranks']}, {b['layout']} ({b['copy']} copy {b['working']}, "
                  f"ckpt {b['checkpointing']}), micro-batches {b['micro_batches']}, {b['documents']} docs, "
                  f"predicted {b['predicted_s']:.3f} s")
    print(f"switches {pred.switch_seconds:.3f} s; step {pred.seconds:.3f} s; {pred.tokens_per_s:,.0f} tokens/s")
    speedup = static[reference] / pred.seconds if reference else None
    guard_lines = plan_guard_lines(plan, pred.seconds, reference, static.get(reference), planner)
    for line in guard_lines:
        print(line)
    if best and best != reference:  # explicit --layouts without it: said, never passed off as the reference
        print(f"outside the candidates: static {best}: {static[best]:.3f} s (--layouts auto always includes the "
              f"best static layout)")
    measured = getattr(planner, "last_measured", None)
    if measured is not None:
        print(f"measured corrections ({args.calibration}): runs {measured.run} (reference static {measured.reference}"
              f"; best multi-layout gain {measured.gain:+.4f} ln, needed > {measured.threshold:.4f})")
    return {
        "measured": None if measured is None else {"run": measured.run, "reference": measured.reference,
                                                   "gain_ln": measured.gain, "threshold_ln": measured.threshold},
        "command": "plan", "model": args.model, "world_size": args.world_size, "hardware": cm.hardware.name,
        "context": args.context, "data": args.data, "documents": int(lengths.size), "tokens": int(lengths.sum()),
        "layouts": [x.name for x in planner.layouts], "step_s": pred.seconds, "tokens_per_s": pred.tokens_per_s,
        "stages": [{**s.as_dict(), **({"blocks": b} if b else {})} for s, b in zip(pred.stages, blocks)],
        "best_static": {"layout": reference, "seconds": static[reference]} if reference else None,
        "best_static_any": {"layout": best, "seconds": static[best]} if best else None,
        "static_s": static, "speedup_vs_best_static": speedup, "guard": guard_lines,
    }


def _read_corrections(path: str) -> dict[str, Any]:
    """A measured planner's saved corrections: JSON of ``MeasuredCostPlanner.save_corrections()``
    (or of its ``state_dict()``)."""
    import json

    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise CliError(f"--calibration {path!r}: cannot read it as JSON saved corrections: {exc}") from None
    if not isinstance(state, dict) or not ("guard" in state or "measured" in state):
        raise CliError(f"--calibration {path!r}: not a measured planner's saved corrections (no 'guard' key)")
    return state


def block_rows(planner: Any, stage: Any, predicted: Any) -> list[dict[str, Any]]:
    """The blocks of a block stage as ``hotspa plan`` prints them (empty for any other stage): ranks,
    compute and working layout, checkpointing, micro-batches per dp group, predicted seconds.

    Args:
        planner: the :class:`CostModelPlanner` that made the plan (its mesh places the blocks).
        stage: a :class:`~lightning_hotspa.plan.Stage`.
        predicted: its :class:`~lightning_hotspa.planner.cost.predict.StagePrediction` (per block seconds).
    """
    from ..plan import block_ranks

    if not stage.blocks or stage.lockstep_blocks:
        return []
    mesh = planner.block_mesh()
    out = []
    for k, (b, secs) in enumerate(zip(stage.blocks, predicted.group_seconds)):
        ranks = block_ranks(b, mesh)
        out.append({"block": k, "ranks": f"{ranks[0]}-{ranks[-1]}", "layout": b.layout.name,
                    "working": b.working_layout.name, "copy": "sharded" if b.sharded else "replicated",
                    "checkpointing": b.checkpointing(stage.activation_checkpointing).value,
                    "micro_batches": [len(g) for g in b.micro_batches],
                    "documents": sum(len(mb) for g in b.micro_batches for mb in g), "predicted_s": float(secs)})
    return out


def plan_name(plan: Any) -> str:
    """A step plan as ``hotspa plan`` names it: its stages' layouts in order (``dp8+ac -> dp4xcp2``), a
    block stage as its blocks' working layouts in brackets (``blocks[dp4xcp2, cp8:fsdp8]``).

    Args:
        plan: a :class:`~lightning_hotspa.plan.StepPlan`.
    """
    names = []
    for s in plan.stages:
        if s.blocks:
            names.append(f"blocks[{', '.join(dict.fromkeys(b.working_layout.name for b in s.blocks))}]")
        else:
            names.append(s.layout.name + s.activation_checkpointing.suffix)
    return " -> ".join(dict.fromkeys(names))


def plan_guard_lines(plan: Any, seconds: float, reference: str | None, reference_s: float | None,
                     planner: Any) -> list[str]:
    """What ``hotspa plan`` says about the never-worse-than-static guard: the chosen plan against the
    best static layout among the candidates, then, where the plan stays on one layout, the best
    multi-layout plan the solver priced, its gain and the guard's margin.

    Args:
        plan: the chosen :class:`~lightning_hotspa.plan.StepPlan`.
        seconds: its predicted step seconds.
        reference: the best static layout among the candidates (None: none holds every document alone).
        reference_s: that layout's predicted seconds alone.
        planner: the :class:`CostModelPlanner` that made the plan (``last_multi_layout``, ``static_margin``).
    """
    from ..planner.solve.static_guard import solution_name

    chosen = plan_name(plan)
    if reference is None:
        lines = [f"chosen {chosen}: {seconds:.3f} s; best static: none (no candidate holds every document alone)"]
    else:
        lines = [f"chosen {chosen}: {seconds:.3f} s; best static {reference}: {reference_s:.3f} s -> predicted "
                 f"speed-up {reference_s / seconds:.3f}x"]
    one_layout = len({s.layout for s in plan.stages if not s.blocks}) == 1 and not any(s.blocks for s in plan.stages)
    if one_layout and len(planner.layouts) > 1:
        margin = planner.static_margin
        spread = planner.last_multi_layout
        if spread is None:
            lines.append(f"best multi-layout plan priced: none (every plan the solver packed ran one layout), the "
                         f"margin {1 + margin:.3f}x")
        else:
            lines.append(f"best multi-layout plan priced: {solution_name(spread[1])}: {spread[0]:.3f} s, gain "
                         f"{seconds / spread[0]:.3f}x, below the margin {1 + margin:.3f}x")
    return lines


# ------------------------------------------------------------------------------------------ simulate
def _check_hardware(args: argparse.Namespace) -> None:
    """``--hardware`` names a known profile; the long / smoke grids price their own (H100, H200)."""
    from ..planner.cost.hardware import get_profile

    if args.hardware is not None and args.grid != "paper":
        raise CliError(f"--hardware {args.hardware!r}: --grid {args.grid} prices its own hardware (H100, H200 per "
                       f"cell); --hardware applies to --grid paper")
    try:
        get_profile(args.hardware or "A800-80G")
    except ValueError as exc:
        raise CliError(f"--hardware: {exc}") from None


def _cmd_simulate(args: argparse.Namespace) -> dict[str, Any]:
    _check_hardware(args)
    args.hardware = args.hardware or "A800-80G"
    if args.grid != "paper":
        return _cmd_long_grid(args)
    if args.truth is not None:
        raise CliError(f"--truth {args.truth}: the ground truth runs on --grid long or --grid smoke, not paper")
    if args.ours_options != "default" or args.fa3_conservative:
        raise CliError("--ours-options / --fa3-conservative price the long and smoke grids, not --grid paper")
    from .simulate import GRID, simulate_grid

    grid = dict(GRID)
    if args.contexts:
        grid["contexts"] = args.contexts
    result = simulate_grid(args.hardware, args.batches, args.sequences, args.seed, grid)
    cells = result["cells"]
    print(f"Predicted step time, {args.hardware}, {args.sequences} sequences per global batch, "
          f"{args.batches} batches per cell (hand-set: the better of c1/c2)\n")
    print("| model | GPUs | context | data | our layouts | ours s | best static | static s | hand-set s "
          "| x static | x hand-set |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        hand = min(c.rule_s.values()) if c.rule_s else float("nan")
        print(f"| {c.model} | {c.world_size} | {c.context // 1024}K | {c.data} | {', '.join(c.layouts)} | "
              f"{c.ours_s:.2f} | {c.best_static} | {c.best_static_s:.2f} | {hand:.2f} | "
              f"{c.speedup_static:.3f} | {c.speedup_rule:.3f} |")
    print(f"\ngeometric mean speed-up: {result['geomean_speedup_vs_best_static']:.3f}x over the best static "
          f"layout, {result['geomean_speedup_vs_hand_set']:.3f}x over the hand-set rule "
          f"({result['seconds']:.1f} s)")
    print(f"context: {result['geomean_speedup_vs_best_static_no_cp']:.3f}x over the best static layout without "
          f"cp (the paper's Megatron-like (dp,tp,pp) family); "
          f"{result['geomean_speedup_vs_hand_set_artifact_packing']:.3f}x over the hand-set rule with the "
          f"artifact's padded-row packing")
    return {"command": "simulate", **{k: v for k, v in result.items() if k != "cells"},
            "cells": [c.as_dict() for c in cells]}


def _cmd_long_grid(args: argparse.Namespace) -> dict[str, Any]:
    from .long_grid import LONG_GRID, SMOKE_GRID, long_grid, ours_options, print_long_grid

    if args.margin is not None and not 0 <= args.margin < 10:
        raise CliError(f"--margin must be in [0, 10), got {args.margin}")
    try:
        ours = ours_options(args.ours_options, args.fa3_conservative)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.truth is not None:
        from .truth import print_truth, truth_grid

        if args.breakdown or args.margin is not None or ours is not None:
            raise CliError("--truth prices its own plans at the default margin and prices: drop --breakdown / "
                           "--margin / --ours-options")
        if not 0 <= args.budget < 1:
            raise CliError(f"--budget must be in [0, 1), got {args.budget}")
        result = truth_grid(LONG_GRID if args.grid == "long" else SMOKE_GRID, args.noise, args.draws, args.steps,
                            args.pool, args.seed, args.budget, args.cells)
        print_truth(result)
        return {"command": "simulate", "grid": args.grid, **result}
    result = long_grid(LONG_GRID if args.grid == "long" else SMOKE_GRID, args.batches, args.seed, args.margin,
                       breakdown=args.breakdown, ours=ours)  # margin None: the planner's default
    print_long_grid(result)
    return {"command": "simulate", **result}


# ------------------------------------------------------------------------------------------ calibrate
def _cmd_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    import datetime

    from .measure_hardware import measure_cpu_gloo

    figures = measure_cpu_gloo(args.ranks, args.repeats)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
           "command": f"hotspa calibrate --ranks {args.ranks} --repeats {args.repeats}", **figures}
    for k, v in figures.items():
        print(f"{k}: {v:.4g}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = SubParser(prog="hotspa", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubParser)
    names = registry_names()
    plan = sub.add_parser("plan", help="plan one global batch: layout per length band, predicted speed-up")
    plan.add_argument("--model", default="llama7b", help=f"model preset: {names['models']}")
    plan.add_argument("--world-size", type=positive_int, default=8, help="number of devices (ranks)")
    plan.add_argument("--hardware", default="A800-80G", help=f"hardware profile: {names['hardware']}")
    plan.add_argument("--data", default="commoncrawl",
                      help=f"length generator ({names['data']}), a corpus path, or 'stdlib'")
    plan.add_argument("--global-batch-tokens", type=token_count, default=token_count("512K"),
                      help="tokens per global batch (e.g. 512K, 4M)")
    plan.add_argument("--context", type=token_count, default=token_count("32K"),
                      help="longest document in tokens (longer ones are cut into context-sized chunks)")
    plan.add_argument("--layouts", default="auto", help="'auto' or a comma list like dp8,dp4xtp2,tp4xcp2")
    plan.add_argument("--tokens-per-rank", type=positive_int, default=None,
                      help="micro-batch capacity per rank (default: from the memory model)")
    plan.add_argument("--ladder", choices=("declared", "auto", "off"), default="declared",
                      help="block stages (a cp ladder, blocks side by side): of the given layouts only (a real "
                           "run's mesh), of derived ones too (auto: declare them to run it), or none")
    plan.add_argument("--seed", type=int, default=0, help="seed of the length generator and the batch sampler")
    plan.add_argument("--step", type=int, default=0, help="which global batch of the data to plan")
    plan.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    plan.add_argument("--calibration", default=None,
                      help="a measured planner's saved corrections (JSON of MeasuredCostPlanner.save_corrections()):"
                           " plan with them (issue 53)")
    sim = sub.add_parser("simulate", help="the paper-scale grid: speed-ups over static layouts and the hand-set rule")
    sim.add_argument("--hardware", default=None, help="--grid paper: the profile (default A800-80G)")
    sim.add_argument("--batches", type=positive_int, default=2, help="global batches per cell")
    sim.add_argument("--sequences", type=positive_int, default=512, help="documents per global batch")
    sim.add_argument("--contexts", type=token_count, nargs="+", default=None,
                     help="--grid paper: the contexts (default: the grid's, 8K 16K 32K)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the sampled batches")
    sim.add_argument("--grid", choices=("paper", "long", "smoke"), default="paper", help="paper: 7B-30B, 8K-32K; "
                     "long: Llama 3 8B/70B, 7B/13B, 32K-512K, 8-1024 H100/H200 (tools/long_grid.py); smoke: 1 cell")
    sim.add_argument("--margin", type=float, default=None,
                     help="--grid long/smoke: the planner's static_margin (default: its own, DEFAULT_STATIC_MARGIN "
                     "of planner/solve/static_guard.py)")
    sim.add_argument("--breakdown", action="store_true", help="--grid long/smoke: the oracle ladder (oracles.py)")
    sim.add_argument("--ours-options", choices=("default", "matching"), default="default",
                     help="--grid long/smoke: what ours runs: the planner's own prices (FA2, eager) or what a "
                     "Hopper user turns on (FA3 + compile_blocks; competent torchtitan users then compile too)")
    sim.add_argument("--fa3-conservative", action="store_true", help="--ours-options matching: FA3 priced at the "
                     "fitted FA2 value x FA3_OVER_FA2 (the kernels' own ratio) instead of the profile's entry")
    sim.add_argument("--truth", choices=("perturbed",), default=None, help="--grid long/smoke: a ground truth per "
                     "option (tools/truth.py): model-only vs measured planner vs the true oracle")
    sim.add_argument("--noise", choices=("gpu", "cpu"), default="gpu", help="--truth: the headline noise setting")
    sim.add_argument("--draws", type=positive_int, default=5, help="--truth: truth draws per cell")
    sim.add_argument("--steps", type=positive_int, default=200, help="--truth: steps per cell and draw")
    sim.add_argument("--pool", type=positive_int, default=6, help="--truth: priced batches per cell")
    sim.add_argument("--cells", type=positive_int, default=None, help="--truth: only the grid's first N cells")
    sim.add_argument("--budget", type=float, default=0.03, help="--truth: exploration budget (share of seconds)")
    sim.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cal = sub.add_parser("calibrate", help="measure the cpu-gloo profile on local gloo ranks")
    cal.add_argument("--ranks", type=positive_int, default=4, help="local gloo ranks to measure on")
    cal.add_argument("--repeats", type=positive_int, default=9,
                     help="timed repeats per measurement (the median counts)")
    cal.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    from . import check_calibration, consolidate, export, memory
    for command in (check_calibration, export, consolidate, memory):
        command.add_parser(sub)
    return parser


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of ``parser`` and its sub-commands that take exactly one value."""
    found: set[str] = set()
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions there
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                found |= _value_options(sub)
        elif action.option_strings and action.nargs is None:
            found.update(action.option_strings)
    return found


def _attach_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--opt -5K`` as ``--opt=-5K`` for options that take one value, so argparse hands the value to
    its type check (which names it and says what is valid) instead of "expected one argument"."""
    takes_value, out = _value_options(parser), []
    for arg in argv:
        if out and out[-1] in takes_value and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hotspa`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(_attach_dash_values(parser, list(sys.argv[1:] if argv is None else argv)))
    from . import check_calibration, consolidate, export, memory
    commands = {"plan": _cmd_plan, "simulate": _cmd_simulate, "calibrate": _cmd_calibrate, "memory": memory.run,
                "check-calibration": check_calibration.run, "export": export.run, "consolidate": consolidate.run,
                "upgrade-checkpoint": export.run_upgrade}
    try:
        from .progress import progress_enabled

        progress_enabled()  # a bad HOTSPA_PROGRESS is refused by every command, not only those with a bar
        result = commands[args.command](args)
    except (CliError, ValueError, KeyError, OSError, OverflowError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"hotspa {args.command}: error: {message}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(result, default=float, sort_keys=False))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
