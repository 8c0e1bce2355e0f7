"""``hotspa check-calibration``: profiled mode end to end on local gloo ranks with the real model.

Times real stages (:func:`_measure_stages`, on every rank), fits the profiled coefficients on early
steps and reports the prediction error on later (held-out) steps (:func:`calibration_errors`), on each
rank's CPU seconds (default, see :data:`CLOCKS`) and on wall seconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cli_args import CliError, positive_int, registry_names

__all__ = ["CLOCKS", "add_parser", "calibration_errors", "run"]

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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``hotspa check-calibration``: the JSON result (printed by the CLI with ``--json``)."""
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


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``hotspa check-calibration`` subcommand (``sub``: the CLI's subparsers)."""
    chk = sub.add_parser("check-calibration", help="profiled mode end to end: time real stages on local gloo "
                         "ranks, fit on early steps, report the error on later ones")
    chk.add_argument("--ranks", type=positive_int, default=4, help="local gloo ranks")
    chk.add_argument("--layouts", default="dp4,dp2xtp2,tp2xcp2", help="comma list of the layouts to time")
    chk.add_argument("--model", default="tiny", help=f"model preset: {registry_names()['models']}")
    chk.add_argument("--steps", type=positive_int, default=16, help="steps to time")
    chk.add_argument("--warmup", type=int, default=2, help="first steps left out (start-up)")
    chk.add_argument("--train-fraction", type=float, default=0.5,
                     help="share of the timed steps the fit sees; the error is reported on the rest")
    chk.add_argument("--tokens-per-rank", type=positive_int, default=1024, help="micro-batch capacity per rank")
    chk.add_argument("--seed", type=int, default=0, help="seed of the sampled documents")
    chk.add_argument("--clock", default="cpu", help="cpu (each rank's CPU seconds: see CLOCKS) or wall")
    chk.add_argument("--rows-out", default=None, help="save the raw observation rows (np.savetxt) here")
    chk.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return chk
