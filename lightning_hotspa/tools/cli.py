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
  each rank's CPU seconds (default, see :data:`CLOCKS`) and on wall seconds.

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

__all__ = ["main"]


class CliError(Exception):
    """A bad input; printed as one line, exit code 2."""


_MAX_TOKENS, _MAX_INT = 2**30, 2**31 - 1  # beyond them an argument is a typo, not a plan (numpy's int64 overflows)


def _tokens(text: str) -> int:
    """``32768``, ``32K`` / ``32k`` (x1024), ``1M`` (x1024^2)."""
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024**2}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except (ValueError, OverflowError):  # OverflowError: 'inf'
        raise argparse.ArgumentTypeError(f"expected a token count like 32768, 32K or 1M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    if value > _MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"token counts above {_MAX_TOKENS // 1024**2}M are out of range, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 1 <= value <= _MAX_INT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {_MAX_INT}, got {text!r}")
    return value


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
    from .long_grid import LONG_GRID, SMOKE_GRID, long_grid, print_long_grid

    if args.margin is not None and not 0 <= args.margin < 10:
        raise CliError(f"--margin must be in [0, 10), got {args.margin}")
    if args.truth is not None:
        from .truth import print_truth, truth_grid

        if args.breakdown or args.margin is not None:
            raise CliError("--truth prices its own plans at the default margin: drop --breakdown / --margin")
        if not 0 <= args.budget < 1:
            raise CliError(f"--budget must be in [0, 1), got {args.budget}")
        result = truth_grid(LONG_GRID if args.grid == "long" else SMOKE_GRID, args.noise, args.draws, args.steps,
                            args.pool, args.seed, args.budget, args.cells)
        print_truth(result)
        return {"command": "simulate", "grid": args.grid, **result}
    result = long_grid(LONG_GRID if args.grid == "long" else SMOKE_GRID, args.batches, args.seed, args.margin,
                       breakdown=args.breakdown)  # margin None: the planner's default
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


# ------------------------------------------------------------------------------------------ check-calibration
#: Which clock ``check-calibration`` reads. ``cpu``: the rank's CPU seconds (``time.process_time``,
#: all its threads, gloo's included). On this testbed 4 ranks time-share 2 cores with other users'
#: jobs, so a rank's wall time is set by the OS scheduler and the machine's load (it depends on what
#: every OTHER process does), not by its own micro-batches; its CPU seconds are what it would take
#: with a core of its own, the analog of a GPU rank's dedicated device. ``wall``: perf_counter.
CLOCKS = ("cpu", "wall")


def _measure_stages(layouts: list[str], steps: int, seed: int, model: str, tokens_per_rank: int) -> list[list[float]]:
    """On every rank: run ``steps`` random step plans over all ``layouts`` with the real model
    (the engine's StepRunner on gloo) and time each stage's micro-batches (forward + backward) on
    both clocks (device seconds and this rank's CPU seconds). Returns the all-gathered rows (the
    same on every rank), step-major: the :func:`~.planner.profiled.calibration.encode_observations` columns
    with device (wall) seconds, plus CPU seconds."""
    import torch
    import torch.distributed as dist

    from ..engine.step_runner import StepHooks, StepRunner
    from ..engine.switch import SwitchEngine, build_home_parameters
    from ..group_collectives import world_collectives
    from ..layout import Layout
    from ..mesh import WorldMesh
    from ..models import Llama, LlamaConfig, llama_tp_plan, param_roles, token_mean_cross_entropy
    from ..parallel.model import ParallelModel
    from ..placements import build_shardings
    from ..plan import Stage, StepPlan, slice_plan
    from ..planner.profiled.calibration import ROW_WIDTH, Observation, encode_observations
    from ..planner.solve.packing import pack_layout

    config = LlamaConfig.preset(model)
    world = WorldMesh(layouts)
    lays = [Layout.parse(x) for x in layouts]

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = Llama(config)
            self.loss_fn = token_mean_cross_entropy

        def forward(self, mb):  # type: ignore[no-untyped-def]
            return self.loss_fn(self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen), mb.labels)

    module = Wrapped()
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    roles = param_roles(module, llama_tp_plan(config, max(x.tp for x in lays), prefix="model."))
    shardings = build_shardings({n: tuple(p.shape) for n, p in module.named_parameters()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(module, roles, world)
    parallel.restore(home)
    engine = SwitchEngine(world, shardings, home)

    class StartTogether(StepHooks):
        def before_compute(self, stage):  # type: ignore[no-untyped-def]
            world_collectives().barrier()  # every rank's stage clock starts at once

    # each stage reduces at its end, none overlapped: compute_s is the micro-batches alone
    runner, hooks = StepRunner(engine, parallel, overlap=False, share_gradients=False), StartTogether()
    rows = []
    for step in range(steps):
        rng = np.random.default_rng([seed, step])
        lengths, stages = [], []
        for lay in lays:
            n = int(rng.integers(2, 6 * lay.dp + 1))
            doc = np.minimum(np.exp(rng.normal(5.5, 1.0, n)).astype(np.int64) + 8, tokens_per_rank * lay.tp * lay.cp)
            ids = list(range(len(lengths), len(lengths) + n))
            lengths.extend(int(x) for x in doc)
            packed = pack_layout(ids, doc, lay, tokens_per_rank * lay.tp * lay.cp)
            stages.append(Stage(lay, packed.micro_batches))
        plan = StepPlan(step, tuple(lengths), tuple(stages))
        g = torch.Generator().manual_seed(step)
        docs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
        mine = slice_plan(plan, docs, world.shape, world.rank)
        result = runner.run(mine, module, hooks)
        engine.clear_grad_store()
        observed = [Observation.from_rank_stage(stage, r.compute_s) for stage, r in zip(mine.stages, result.stages)]
        cpu = [r.compute_cpu_s for r in result.stages]
        local = torch.tensor(np.column_stack([encode_observations(observed, lays), cpu]), dtype=torch.float64)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        world_collectives().all_gather_list(gathered, local)
        rows.extend(r.tolist() for t in gathered for r in t.reshape(-1, ROW_WIDTH + 1))
    return rows


def _check_split(steps: int, warmup: int, train_fraction: float) -> None:
    if not 0 <= warmup <= steps - 2:
        raise CliError(f"--warmup {warmup} leaves fewer than 2 of the {steps} steps to fit and hold out")
    if not 0 < train_fraction < 1:
        raise CliError(f"--train-fraction must be in (0, 1), got {train_fraction}")


def calibration_errors(rows: np.ndarray, layouts: Sequence[str], steps: int, warmup: int, train_fraction: float,
                       prior: Any, clock: str) -> dict[str, Any]:
    """Held-out errors of one clock from :func:`_measure_stages` rows: the first ``warmup`` steps are
    dropped (one-off allocations), the next ``train_fraction`` of the steps are fitted, the rest are
    held out (never seen by the fit). Rank level (each rank's stage seconds) and stage level (the
    slowest rank, what a step waits for). ``noise_floor``: the stage error on the same held-out
    steps of a fit that DID see them (all steps): what no coefficients can beat on this data."""
    from ..layout import Layout
    from ..planner.profiled.calibration import (
        ROW_WIDTH,
        decode_observations,
        held_out_error,
        held_out_stage_error,
        stage_errors,
    )

    if clock not in CLOCKS:
        raise CliError(f"unknown clock {clock!r}; use one of {', '.join(CLOCKS)}")
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, ROW_WIDTH + 1)
    if steps < 1 or len(rows) % steps:
        raise CliError(f"{len(rows)} observation rows do not split into {steps} steps")
    _check_split(steps, warmup, train_fraction)
    table = rows[:, :ROW_WIDTH].copy()
    if clock == "cpu":
        table[:, 5] = rows[:, ROW_WIDTH]
    obs = decode_observations(table, [Layout.parse(x) for x in layouts])
    per_step = len(obs) // steps
    by_step = [obs[i * per_step:(i + 1) * per_step] for i in range(warmup, steps)]
    train_steps = min(max(1, int(round(len(by_step) * train_fraction))), len(by_step) - 1)
    flat = [o for step in by_step for o in step]
    rank = held_out_error(flat, prior, train_fraction=train_steps / len(by_step))
    stage = held_out_stage_error(by_step, prior, train_steps)
    floor = stage_errors(by_step, by_step[train_steps:], prior)["stage_mean_error"]
    return {"clock": clock, "train_steps": train_steps, "held_out_steps": len(by_step) - train_steps,
            "rank_mean_error": rank.mean_error, "rank_p90_error": rank.p90_error,
            "rank_per_option": rank.per_option, "analytic_rank_mean_error": rank.analytic_mean_error, **stage,
            "noise_floor": floor}


def _cmd_check_calibration(args: argparse.Namespace) -> dict[str, Any]:
    import os

    from ..planner.solve.solver import CostModelPlanner
    from ..testing.spawn import run_on_ranks

    layouts = [x for x in args.layouts.split(",") if x.strip()]
    planner = CostModelPlanner(layouts, model=args.model, hardware="cpu-gloo", tokens_per_rank=args.tokens_per_rank)
    if args.clock not in CLOCKS:
        raise CliError(f"unknown clock {args.clock!r}; use one of {', '.join(CLOCKS)}")
    _check_split(args.steps, args.warmup, args.train_fraction)
    load_before = os.getloadavg()[0]
    rows = np.asarray(run_on_ranks(_measure_stages, args.ranks, layouts, args.steps, args.seed, args.model,
                                   args.tokens_per_rank, timeout_s=3600)[0])
    load_after = os.getloadavg()[0]
    if args.rows_out:
        np.savetxt(args.rows_out, rows, header=f"layouts={','.join(layouts)} steps={args.steps} "
                   "columns=layout,ac,sum_sq,sum_len,micro_batches,wall_s,documents,cpu_s")
    results = {}
    for c in (args.clock, *[c for c in CLOCKS if c != args.clock]):
        r = results[c] = calibration_errors(rows, layouts, args.steps, args.warmup, args.train_fraction,
                                            planner._analytic, c)
        per = ", ".join(f"{k} {v:.1%}" for k, v in r["stage_per_option"].items())
        print(f"[{c} clock] held-out stage error (slowest rank): mean {r['stage_mean_error']:.1%} ({per}; "
              f"{r['stages']} stages of {r['held_out_steps']} held-out steps, fitted on {r['train_steps']}; "
              f"noise floor {r['noise_floor']:.1%}); rank level mean {r['rank_mean_error']:.1%} (uncalibrated "
              f"analytic {r['analytic_rank_mean_error']:.1%})")
    head = results[args.clock]
    out = {"ranks": args.ranks, "model": args.model, "layouts": layouts, "steps": args.steps,
           "warmup_steps": args.warmup, "seed": args.seed,
           "load_average": [load_before, load_after], "clock": args.clock,
           "stage_mean_error": head["stage_mean_error"], "stage_per_option": head["stage_per_option"],
           "clocks": results}
    print(f"load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cores")
    return out


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one (not a flag's False, not None:
    the help says what None means), unless the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with :class:`HelpFormatter` (every sub-command's parser is one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _names() -> dict[str, str]:
    """The registries' names as help text: model presets, hardware profiles, length generators."""
    from ..data.lengths import LENGTH_PROFILES
    from ..model_shape import PRESET_SHAPES
    from ..planner.cost.hardware import PROFILES

    return {"models": ", ".join(n for n in PRESET_SHAPES if not n.startswith("artifact-")),
            "hardware": ", ".join(PROFILES), "data": ", ".join(LENGTH_PROFILES)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hotspa", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    names = _names()
    plan = sub.add_parser("plan", help="plan one global batch: layout per length band, predicted speed-up")
    plan.add_argument("--model", default="llama7b", help=f"model preset: {names['models']}")
    plan.add_argument("--world-size", type=_positive, default=8, help="number of devices (ranks)")
    plan.add_argument("--hardware", default="A800-80G", help=f"hardware profile: {names['hardware']}")
    plan.add_argument("--data", default="commoncrawl",
                      help=f"length generator ({names['data']}), a corpus path, or 'stdlib'")
    plan.add_argument("--global-batch-tokens", type=_tokens, default=_tokens("512K"),
                      help="tokens per global batch (e.g. 512K, 4M)")
    plan.add_argument("--context", type=_tokens, default=_tokens("32K"),
                      help="longest document in tokens (longer ones are cut into context-sized chunks)")
    plan.add_argument("--layouts", default="auto", help="'auto' or a comma list like dp8,dp4xtp2,tp4xcp2")
    plan.add_argument("--tokens-per-rank", type=_positive, default=None,
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
    sim.add_argument("--batches", type=_positive, default=2, help="global batches per cell")
    sim.add_argument("--sequences", type=_positive, default=512, help="documents per global batch")
    sim.add_argument("--contexts", type=_tokens, nargs="+", default=None,
                     help="--grid paper: the contexts (default: the grid's, 8K 16K 32K)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the sampled batches")
    sim.add_argument("--grid", choices=("paper", "long", "smoke"), default="paper", help="paper: 7B-30B, 8K-32K; "
                     "long: Llama 3 8B/70B, 7B/13B, 32K-512K, 8-1024 H100/H200 (tools/long_grid.py); smoke: 1 cell")
    sim.add_argument("--margin", type=float, default=None,
                     help="--grid long/smoke: the planner's static_margin (default: its own, DEFAULT_STATIC_MARGIN "
                     "of planner/solve/static_guard.py)")
    sim.add_argument("--breakdown", action="store_true", help="--grid long/smoke: the oracle ladder (oracles.py)")
    sim.add_argument("--truth", choices=("perturbed",), default=None, help="--grid long/smoke: a ground truth per "
                     "option (tools/truth.py): model-only vs measured planner vs the true oracle")
    sim.add_argument("--noise", choices=("gpu", "cpu"), default="gpu", help="--truth: the headline noise setting")
    sim.add_argument("--draws", type=_positive, default=5, help="--truth: truth draws per cell")
    sim.add_argument("--steps", type=_positive, default=200, help="--truth: steps per cell and draw")
    sim.add_argument("--pool", type=_positive, default=6, help="--truth: priced batches per cell")
    sim.add_argument("--cells", type=_positive, default=None, help="--truth: only the grid's first N cells")
    sim.add_argument("--budget", type=float, default=0.03, help="--truth: exploration budget (share of seconds)")
    sim.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cal = sub.add_parser("calibrate", help="measure the cpu-gloo profile on local gloo ranks")
    cal.add_argument("--ranks", type=_positive, default=4, help="local gloo ranks to measure on")
    cal.add_argument("--repeats", type=_positive, default=9, help="timed repeats per measurement (the median counts)")
    cal.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    chk = sub.add_parser("check-calibration", help="profiled mode end to end: time real stages on local gloo "
                         "ranks, fit on early steps, report the error on later ones")
    chk.add_argument("--ranks", type=_positive, default=4, help="local gloo ranks")
    chk.add_argument("--layouts", default="dp4,dp2xtp2,tp2xcp2", help="comma list of the layouts to time")
    chk.add_argument("--model", default="tiny", help=f"model preset: {names['models']}")
    chk.add_argument("--steps", type=_positive, default=16, help="steps to time")
    chk.add_argument("--warmup", type=int, default=2, help="first steps left out (start-up)")
    chk.add_argument("--train-fraction", type=float, default=0.5,
                     help="share of the timed steps the fit sees; the error is reported on the rest")
    chk.add_argument("--tokens-per-rank", type=_positive, default=1024, help="micro-batch capacity per rank")
    chk.add_argument("--seed", type=int, default=0, help="seed of the sampled documents")
    chk.add_argument("--clock", default="cpu", help="cpu (each rank's CPU seconds: see CLOCKS) or wall")
    chk.add_argument("--rows-out", default=None, help="save the raw observation rows (np.savetxt) here")
    chk.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    from . import consolidate, export, memory
    for command in (export, consolidate, memory):
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
    from . import consolidate, export, memory
    commands = {"plan": _cmd_plan, "simulate": _cmd_simulate, "calibrate": _cmd_calibrate, "memory": memory.run,
                "check-calibration": _cmd_check_calibration, "export": export.run, "consolidate": consolidate.run,
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
