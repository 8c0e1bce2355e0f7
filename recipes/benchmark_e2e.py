"""End to end: HotSPa against every static layout, a threshold rule and Lightning, side by side.

The same model, seed, global mini-batches (token budget) and number of optimizer steps, on 4 CPU
ranks over gloo, all in one invocation; repeats interleaved and the configuration order rotated per
repeat, so machine noise hits all alike; each run's process groups are destroyed when it ends:

* ``hotspa``: our strategy with the ``auto`` candidate layouts and the cost-model planner, its
  coefficients calibrated on a SEPARATE earlier run (other mini-batches, see ``calibrate``);
* ``static/<layout>``: our strategy pinned to each layout that holds the longest document (what a
  Megatron-LM or torchtitan user picks: one layout for everything);
* ``rule``: an artifact-style hand-set rule, docs/REFERENCE.md §3's "<=4K: dp8; <=8K: dp4 x tp2; <=16K:
  dp2 x tp2 x pp2" (7B, 8 GPUs, 16K, c2) mapped to 4 ranks as fixed fractions of the context:
  <= context/4: dp4, <= context/2: dp2xtp2, <= context: tp2xcp2 (our runtime has no pp);
* ``model_parallel``: Lightning's own ``ModelParallelStrategy`` (torch TP + FSDP2) with the best
  feasible static (dp, tp), for reference (one optimizer step per global mini-batch; the activation
  capacity is not enforced on it);
* ``bands/<layout>``: each length band of the batch as its own stage in one layout, to measure
  every band's time in every layout that holds it (``ideal_speedup``).

**Memory capacity** is the same for every configuration: ``--memory-mib`` per rank (default 8 MiB,
a stand-in for a GPU's memory at this model scale) goes through the cost model's memory model
(home state + working weights + activations per token) and gives the activation-token capacity of
one rank, ``tokens_per_rank``; a layout holds micro-batches of ``tokens_per_rank * tp * cp`` tokens.
With the defaults a document longer than ``tokens_per_rank`` cannot run pure data parallel, as on
GPUs where long sequences force TP/CP.

**Figures** per data set: tokens/s (median over repeats of tokens / summed step time), step time
(slowest rank), switch time, loss per step. ``ideal_speedup`` = best static step time divided by the
same step with its compute replaced by the sum over bands of each band's time in its fastest
layout: ``T_static / (T_static - W_static + sum_b min_L t(b, L))``, ``W`` and ``t`` being stage
compute + gradient reduction (what a zero-cost switch would give). ``predicted_speedup``: the cost
model with the calibrated coefficients, pricing the plans that ran. ``cpu_work_speedup``: CPU seconds
of all ranks per step, best static / hotspa; ``core_utilization``: those CPU seconds / (wall x cores).
Near 100 % the box is throughput-bound (more ranks than free cores): a rank waiting in a collective
lends its core to another, so layouts differ only by the CPU work they do, not by exposed
communication. The last line is one JSON object.

    python recipes/benchmark_e2e.py                   # both data sets, defaults below
    python recipes/benchmark_e2e.py --calibration e2e_calibration.json   # reuse / write the fit
    python recipes/benchmark_e2e.py --mixed           # mixed-cp rounds vs one process (recipes/e2e_mixed.py)
    python recipes/benchmark_e2e.py --blocks          # block stages vs one process (recipes/e2e_mixed.py)
    python recipes/benchmark_e2e.py --ladder          # the planner's ladder of blocks vs one process
    python recipes/benchmark_e2e.py --datasets stdlib --context 512 --tokens-per-batch 1024 --steps 1 \
        --warmup 0 --repeats 1 --calibration-steps 1 --memory-mib 3 --layouts dp4   # smoke: 4 layouts, <= 14 fits
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from lightning_hotspa.testing.spawn import run_on_ranks  # noqa: E402

WORLD = 4
#: the benchmark model: the tiny preset with one kv head per query head, so that Lightning's
#: ModelParallelStrategy (which shards k/v projections like q) can run tp4 too.
MODEL = {"preset": "tiny", "n_kv_heads": 4}
#: ``layouts``: a comma list that limits ``every`` (the calibrated and band-timed layouts, and the statics
#: among them) to these plus the hotspa candidates and the rule's layouts; "" = every layout (the smoke
#: run in tests/e2e/test_recipe_smoke.py uses it to stay short)
DEFAULTS = {"context": 2048, "tokens_per_batch": 8192, "memory_mib": 8.0, "steps": 2, "warmup": 1,
            "repeats": 2, "calibration_steps": 3, "lr": 1e-3, "layouts": ""}
DATASETS = ("stdlib", "commoncrawl")
CALIBRATION_OFFSET = 40  # calibration mini-batches start here in the stream: never the measured ones


# ------------------------------------------------------------------------------------------ setup
def budget_profile(memory_mib: float):
    """The cpu-gloo profile with ``memory_mib`` per rank, all of it usable (the budget is stated)."""
    from lightning_hotspa.planner.cost.hardware import get_profile

    base = get_profile("cpu-gloo")
    return dataclasses.replace(base, name=f"cpu-gloo-{memory_mib:g}MiB", memory_bytes=memory_mib * 2**20,
                               memory_usable_fraction=1.0, memory_reserved_bytes=0.0)


def model_config():
    from lightning_hotspa.models.lightning_module import _as_config

    return _as_config(MODEL)


def tokens_per_rank(memory_mib: float) -> int:
    """Activation tokens one rank holds with no tp/cp: the cost model's capacity of pure dp."""
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

    cap = AnalyticCostModel(model_config(), budget_profile(memory_mib), WORLD).capacity(Layout(dp=WORLD), False)
    if cap < 64:
        raise SystemExit(f"--memory-mib {memory_mib} leaves {cap} activation tokens per rank; raise it")
    return cap


def layout_sets(args: argparse.Namespace) -> dict[str, Any]:
    """Every layout the model can split (one shared mesh), the statics that hold the context, the
    hotspa candidates and the rule."""
    from lightning_hotspa.layout import Layout, MeshShape
    from lightning_hotspa.planner.candidates import auto_layouts, enumerate_layouts
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
    from lightning_hotspa.planner.solve.packing import max_doc_length

    hw = budget_profile(args.memory_mib)
    # no pp: this comparison's capacity rule is tokens_per_rank x tp x cp, which does not credit the weight
    # memory pp frees, while the cost model's pp layouts would hold the context by it (auto picks them)
    every = enumerate_layouts(WORLD, AnalyticCostModel(model_config(), hw, WORLD), pp=False)
    MeshShape.for_layouts(every, WORLD)  # one world mesh holds them all
    candidates = list(auto_layouts(WORLD, model_config(), hw, args.context, pp=False))
    rule = [(args.context // 4, Layout(dp=4)), (args.context // 2, Layout(dp=2, tp=2)),
            (args.context, Layout(tp=2, cp=2))]
    if args.layouts:
        keep = {Layout.parse(x) for x in args.layouts.split(",") if x}
        unknown = sorted(str(x) for x in keep - set(every))
        if unknown:
            raise SystemExit(f"--layouts: {unknown} not among this model's layouts {[str(x) for x in every]}")
        keep |= set(candidates) | {lay for _, lay in rule}
        every = [x for x in every if x in keep]
    cap = args.tokens_per_rank
    statics = [x for x in every if max_doc_length(cap * x.tp * x.cp, x.cp) >= args.context]
    if not statics:
        raise SystemExit(f"no layout holds a {args.context}-token document with {cap} tokens per rank")
    bands = sorted({max_doc_length(cap * x.tp * x.cp, x.cp) for x in every if
                    max_doc_length(cap * x.tp * x.cp, x.cp) < args.context} | {args.context})
    return {"every": every, "statics": statics, "candidates": candidates, "rule": rule, "bands": bands}


# ------------------------------------------------------------------------------------------ plans
class BandPlanner:
    """Each length band ``(previous bound, bound]`` of the batch as its own stage in ONE layout.

    Bands the layout cannot hold are left out, so the plan covers only the documents it lists: for
    timing bands (``ideal_speedup``, calibration), not for training."""

    def __init__(self, layout, bands: list[int], tokens_per_rank: int) -> None:
        from lightning_hotspa.planner.solve.packing import max_doc_length

        self.layout, self.capacity = layout, tokens_per_rank * layout.tp * layout.cp
        self.layouts = (layout,)
        self.bands = list(bands)
        self.held = [b <= max_doc_length(self.capacity, layout.cp) for b in self.bands]

    def plan(self, step: int, lengths: list[int]):
        """(StepPlan over the held documents or None, their indices in ``lengths``, band per stage)."""
        from lightning_hotspa.plan import Stage, StepPlan
        from lightning_hotspa.planner.solve.packing import pack_layout

        lower, stages, kept, band_ids = 0, [], [], []
        for i, upper in enumerate(self.bands):
            ids = [d for d, n in enumerate(lengths) if lower < n <= upper]
            lower = upper
            if not ids or not self.held[i]:
                continue
            local = list(range(len(kept), len(kept) + len(ids)))
            kept.extend(ids)
            packed = pack_layout(local, [lengths[d] for d in ids], self.layout, self.capacity)
            stages.append(Stage(self.layout, packed.micro_batches, label=f"band{i}"))
            band_ids.append(i)
        if not stages:
            return None, [], []
        return StepPlan(step, tuple(lengths[d] for d in kept), tuple(stages)), kept, band_ids


def config_planners(sets: dict[str, Any], args: argparse.Namespace, calibration: dict | None) -> dict[str, Any]:
    """Planner of each configuration (name -> planner); ``bands/<L>`` are BandPlanners."""
    from lightning_hotspa.planner.rule import ThresholdPlanner

    out: dict[str, Any] = {"hotspa": cost_planner(sets["candidates"], args, calibration)}
    for lay in sets["statics"]:
        out[f"static/{lay}"] = ThresholdPlanner([lay], args.tokens_per_rank, fixed_layout=lay)
    rule_layouts = sorted({lay for _, lay in sets["rule"]}, key=lambda x: x.dp, reverse=True)
    out["rule"] = ThresholdPlanner(rule_layouts, args.tokens_per_rank, buckets=sets["rule"], backfill=False)
    for lay in sets["every"]:
        out[f"bands/{lay}"] = BandPlanner(lay, sets["bands"], args.tokens_per_rank)
    return out


def cost_planner(layouts, args: argparse.Namespace, calibration: dict | None):
    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    planner = CostModelPlanner(layouts, model=model_config(), hardware=budget_profile(args.memory_mib),
                               tokens_per_rank=args.tokens_per_rank, activation_checkpointing=False,
                               profiled=True, refit_every=1)
    if calibration is not None:
        planner.load_state_dict(calibration)
    return planner


# ------------------------------------------------------------------------------------------ data
def open_dataset(name: str, args: argparse.Namespace, rank: int):
    """The token store of a data set and a function (position -> global mini-batch token arrays)."""
    from lightning_hotspa.data import HotSPaDataModule
    from lightning_hotspa.data.minibatches import chunk_tokens
    from lightning_hotspa.layout import Layout, MeshShape
    from lightning_hotspa.planner.rule import ThresholdPlanner

    source = ({"source": "stdlib", "source_kwargs": {"include_tests": True}} if name == "stdlib" else
              {"source": "synthetic", "source_kwargs": {"num_documents": 4000, "kind": "commoncrawl", "seed": 0,
                                                        "max_length": args.context}})
    lay = Layout(tp=2, cp=2)
    dm = HotSPaDataModule(**source, tokenizer="byte", tokens_per_batch=args.tokens_per_batch,
                          context_length=args.context, seed=0,
                          planner=ThresholdPlanner([lay], args.tokens_per_rank * 4, fixed_layout=lay),
                          mesh_shape=MeshShape.for_layouts([lay], WORLD), rank=rank)
    if rank == 0:
        dm.prepare_data()  # tokenize into the cache once
    dist.barrier()
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    needed = CALIBRATION_OFFSET + args.calibration_steps + 1
    if len(dataset) < max(needed, args.warmup + args.steps):
        raise SystemExit(f"{name}: only {len(dataset)} mini-batches per epoch, the benchmark needs {needed}")

    def batch(position: int) -> list[np.ndarray]:
        return [chunk_tokens(dataset.corpus, r) for r in dataset.minibatch(0, position)]

    return batch


def rank_plans(planner, batches: list[list[np.ndarray]], rank: int, first_step: int):
    """This rank's RankPlans, and per step the plan's (documents kept, band per stage) for bands."""
    from lightning_hotspa.layout import MeshShape
    from lightning_hotspa.plan import slice_plan
    from lightning_hotspa.planner.base import is_profiled

    mesh = MeshShape.for_layouts(planner.layouts, WORLD)
    plans, global_plans, meta = [], [], []
    for i, docs in enumerate(batches):
        lengths = [int(d.size) for d in docs]
        if isinstance(planner, BandPlanner):
            plan, kept, band_ids = planner.plan(first_step + i, lengths)
            docs = [docs[d] for d in kept]
            meta.append(band_ids)
        else:
            # a profiled planner plans with the newest (here: the calibration run's) coefficients
            plan = planner.plan(first_step + i, lengths, latest=is_profiled(planner))
            meta.append(None)
        plans.append(None if plan is None else slice_plan(plan, docs, mesh, rank))
        global_plans.append(plan)
    return plans, global_plans, meta


# ------------------------------------------------------------------------------------------ running
def _recorder(calibrate: bool):
    import lightning as L

    class Recorder(L.Callback):
        """Per step: slowest-rank step time, CPU seconds summed over ranks, loss, per-stage (switch,
        compute + reduce) times and, when calibrating, every rank's observations."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.observations: list[list[float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            dist.barrier()
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            elapsed, cpu = time.perf_counter() - self._t0, time.process_time() - self._c0
            from lightning_hotspa import HotSPaStrategy

            result = trainer.strategy.last_step if isinstance(trainer.strategy, HotSPaStrategy) else None
            stats = result.stages if result is not None else ()  # Lightning's strategies: none
            row = [elapsed] + [x for s in stats for x in (s.switch_s, s.compute_s + s.reduce_s, s.compute_s)]
            t = torch.tensor(row, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            cpu_all = torch.tensor([cpu], dtype=torch.float64)  # CPU seconds of all ranks together
            dist.all_reduce(cpu_all)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.steps.append({"step_s": float(t[0]), "cpu_s": float(cpu_all), "loss": float(loss),
                               "switch_s": [float(x) for x in t[1::3]], "work_s": [float(x) for x in t[2::3]]})
            if calibrate:
                from lightning_hotspa.adapter.lightning.profiling import gathered_observations

                ac = [st.activation_checkpointing for st in batch.stages]
                self.observations.append((batch_idx, gathered_observations(result, ac)))

    return Recorder()


def _trainer(strategy, steps: int, callbacks):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, callbacks=callbacks)


def _loader(items):
    return torch.utils.data.DataLoader(items, batch_size=None, collate_fn=lambda x: x)


def run_hotspa(planner, plans, args: argparse.Namespace, calibrate: bool = False):
    from lightning_baselines import own_process_groups

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.models import LlamaLM

    recorder = _recorder(calibrate)
    # the strategy runs the ready plans; a BandPlanner (timing bands, not a training Planner) is not its planner
    planner_arg = "rule" if isinstance(planner, BandPlanner) else planner
    strategy = HotSPaStrategy(list(planner.layouts), tokens_per_rank=args.tokens_per_rank, planner=planner_arg)
    with own_process_groups():
        _trainer(strategy, len(plans), [recorder]).fit(LlamaLM(MODEL, seed=0, lr=args.lr),
                                                      train_dataloaders=_loader(plans))
    return recorder


def run_model_parallel(layout, plans, args: argparse.Namespace):
    """Lightning's ModelParallelStrategy(dp, tp) on the micro-batches our static ``layout`` (cp=1)
    gives each rank, weighted so that FSDP's mean over dp yields the global token mean."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning_baselines import model_parallel_llama, own_process_groups

    batches = [[(mb, mb.num_target_tokens * layout.dp / p.global_target_tokens) for mb in p.stages[0].micro_batches]
               for p in plans]
    module = model_parallel_llama(MODEL, 0, lr=args.lr)
    recorder = _recorder(False)
    strategy = ModelParallelStrategy(data_parallel_size=layout.dp, tensor_parallel_size=layout.tp)
    with own_process_groups():
        _trainer(strategy, len(batches), [recorder]).fit(module, train_dataloaders=_loader(batches))
    return recorder


def run_order(configs: list[str], repeat: int) -> list[str]:
    """The configurations of one repeat, rotated by the repeat index: no configuration always runs
    first (or last) in a repeat, where the machine's state differs from the middle of it."""
    shift = repeat % len(configs)
    return configs[shift:] + configs[:shift]


# ------------------------------------------------------------------------------------------ rank main
def bench_rank(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_baselines import as_launched_ranks

    rank = dist.get_rank()
    as_launched_ranks()
    sets = layout_sets(args)
    data = {name: open_dataset(name, args, rank) for name in args.datasets}
    n = args.warmup + args.steps
    measured = {name: [batch(p) for p in range(n)] for name, batch in data.items()}

    # 1. calibration: a separate run on other mini-batches, every layout, each band its own stage
    calibration, calibration_s = args.calibration_state, 0.0
    if calibration is None:
        t0 = time.perf_counter()
        pricing = cost_planner(sets["every"], args, None)
        # the first batch is a warm-up (one-off costs), not observed
        cal_batches = [next(iter(data.values()))(CALIBRATION_OFFSET - 1)]
        cal_batches += [batch(CALIBRATION_OFFSET + p) for batch in data.values() for p in range(args.calibration_steps)]
        for lay in sets["every"]:
            band = BandPlanner(lay, sets["bands"], args.tokens_per_rank)
            plans = [p for p in rank_plans(band, cal_batches, rank, 10_000)[0] if p is not None]
            if not plans:  # the layout holds none of the bands: a Trainer fit of no step (~1 s) observes nothing
                continue
            rec = run_hotspa(band, plans, args, calibrate=True)
            pricing.observe(o for step, obs in rec.observations if step > 0 for o in obs)  # step 0: warm-up
        pricing.refit(0)
        calibration = pricing.state_dict()
        calibration_s = time.perf_counter() - t0

    # 2. the measured runs, repeats interleaved
    planners = config_planners(sets, args, calibration)
    # Lightning has no cp: its best feasible static is the most data-parallel static with cp = 1
    mp_layout = max((x for x in sets["statics"] if x.cp == 1), key=lambda x: x.dp, default=None)
    results: dict[str, dict[str, list]] = {name: {} for name in data}
    plans_of: dict[tuple[str, str], Any] = {}
    plan_ms: dict[str, float] = {}
    for name in data:
        for cfg, planner in planners.items():
            t0 = time.perf_counter()
            plans_of[(name, cfg)] = rank_plans(planner, measured[name], rank, 0)
            if cfg == "hotspa":  # the solver's time per plan (plus slicing), paid in the data loader
                plan_ms[name] = 1e3 * (time.perf_counter() - t0) / len(measured[name])
    configs = list(planners) + (["model_parallel"] if mp_layout is not None else [])
    for repeat in range(args.repeats):
        for name in data:
            for cfg in run_order(configs, repeat):
                if cfg == "model_parallel":
                    static_plans = plans_of[(name, f"static/{mp_layout}")][0]
                    results[name].setdefault(cfg, []).append(run_model_parallel(mp_layout, static_plans, args).steps)
                    continue
                plans, _, _ = plans_of[(name, cfg)]
                if any(p is None for p in plans):
                    continue
                results[name].setdefault(cfg, []).append(run_hotspa(planners[cfg], plans, args).steps)
    if rank != 0:
        return {}
    pricing = cost_planner(sets["every"], args, calibration)
    named = {k: [str(x) for x in v] if k != "rule" else [(b, str(x)) for b, x in v] for k, v in sets.items()}
    return {"cores": len(os.sched_getaffinity(0)), "sets": named,
            "calibration": calibration, "calibration_s": calibration_s, "plan_ms": plan_ms,
            "results": results, "mp_layout": str(mp_layout) if mp_layout is not None else None,
            "tokens": {name: [sum(int(d.size) for d in docs) for docs in measured[name]] for name in data},
            "predicted": {name: {cfg: [pricing.predict(p).seconds if p is not None else None
                                       for p in plans_of[(name, cfg)][1]]
                                 for cfg in planners if not cfg.startswith("bands/")} for name in data},
            "plan_layouts": {name: [[(st.layout.name, len(st.doc_ids)) for st in p.stages]
                                    for p in plans_of[(name, "hotspa")][1]] for name in data},
            "band_meta": {name: {cfg: plans_of[(name, cfg)][2] for cfg in planners if cfg.startswith("bands/")}
                          for name in data}}


# ------------------------------------------------------------------------------------------ figures
def summarize(name: str, raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The figures of one data set from every configuration's per-step records."""
    runs, tokens = raw["results"][name], raw["tokens"][name]
    w = args.warmup
    steps = range(w, w + args.steps)
    measured_tokens = sum(tokens[s] for s in steps)

    def repeat_tokens_per_s(cfg: str) -> list[float]:
        return [measured_tokens / sum(r[s]["step_s"] for s in steps) for r in runs[cfg]]

    def tokens_per_s(cfg: str) -> float:
        return statistics.median(repeat_tokens_per_s(cfg))

    def cpu_per_step(cfg: str) -> float:
        return statistics.median(sum(r[s]["cpu_s"] for s in steps) / len(steps) for r in runs[cfg])

    def median_step(cfg: str, s: int, key: str = "step_s", stage: int | None = None) -> float:
        vals = [r[s][key] if stage is None else r[s][key][stage] for r in runs[cfg]]
        return statistics.median(vals)

    per_config = {cfg: {"tokens_per_s": tokens_per_s(cfg),
                        "step_s": [median_step(cfg, s) for s in steps],
                        "cpu_s_per_step": cpu_per_step(cfg),
                        "switch_s": [sum(statistics.median(r[s]["switch_s"][i] for r in runs[cfg])
                                         for i in range(len(runs[cfg][0][s]["switch_s"]))) for s in steps],
                        "loss": [runs[cfg][0][s]["loss"] for s in range(len(tokens))]}
                  for cfg in runs if not cfg.startswith("bands/")}
    statics = {cfg: v for cfg, v in per_config.items() if cfg.startswith("static/")}
    best = max(statics, key=lambda c: statics[c]["tokens_per_s"])
    hot = per_config["hotspa"]

    # ideal: the best static step with its stage work replaced by each band's fastest layout
    ideal_steps, static_steps = [], []
    band_s: dict[str, dict[str, float]] = {}  # band bound -> layout -> seconds over the measured steps
    for s in steps:
        band_best: dict[int, float] = {}
        for cfg, metas in raw["band_meta"][name].items():
            if cfg not in runs:
                continue
            for stage, band in enumerate(metas[s]):
                t = median_step(cfg, s, "work_s", stage)
                band_best[band] = min(band_best.get(band, float("inf")), t)
                row = band_s.setdefault(f"<={raw['sets']['bands'][band]}", {})
                row[cfg.removeprefix("bands/")] = row.get(cfg.removeprefix("bands/"), 0.0) + t
        t_static = median_step(best, s)
        w_static = median_step(best, s, "work_s", 0)
        static_steps.append(t_static)
        ideal_steps.append(t_static - w_static + sum(band_best.values()))
    pred = raw["predicted"][name]
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(hot["loss"], statics[best]["loss"]))
    hot_s = sum(hot["step_s"])
    return {
        "hotspa_tokens_per_s": hot["tokens_per_s"],
        "best_static_tokens_per_s": statics[best]["tokens_per_s"],
        "best_static_layout": best.removeprefix("static/"),
        "speedup": hot["tokens_per_s"] / statics[best]["tokens_per_s"],
        # the spread: repeat i's hotspa over repeat i's best static (same position in the rotation)
        "speedup_per_repeat": [a / b for a, b in zip(repeat_tokens_per_s("hotspa"), repeat_tokens_per_s(best))],
        "ideal_speedup": sum(static_steps) / sum(ideal_steps),
        "threshold_rule_speedup": per_config["rule"]["tokens_per_s"] / statics[best]["tokens_per_s"],
        "switch_fraction": sum(hot["switch_s"]) / hot_s,
        "max_loss_rel_diff": loss_diff,
        "predicted_speedup": sum(pred[best][s] for s in steps) / sum(pred["hotspa"][s] for s in steps),
        "model_parallel_speedup": (per_config["model_parallel"]["tokens_per_s"] / statics[best]["tokens_per_s"]
                                   if "model_parallel" in per_config else None),
        # CPU work: on a box with fewer cores than ranks the step is throughput-bound (wall ~ CPU
        # seconds of all ranks / cores), so a layout gains only the CPU work it saves, not idle time
        "cpu_work_speedup": statics[best]["cpu_s_per_step"] / hot["cpu_s_per_step"],
        "core_utilization": {cfg: per_config[cfg]["cpu_s_per_step"] * len(steps) / (sum(per_config[cfg]["step_s"])
                                                                                    * raw["cores"])
                             for cfg in ("hotspa", best)},
        "configs": {cfg: {"tokens_per_s": v["tokens_per_s"], "step_s": v["step_s"], "switch_s": v["switch_s"],
                          "cpu_s_per_step": v["cpu_s_per_step"], "loss": v["loss"]} for cfg, v in per_config.items()},
        "hotspa_plan_ms": raw["plan_ms"].get(name),
        "band_s": band_s,
        "hotspa_plan": raw["plan_layouts"][name],
        "hotspa_step_s": hot["step_s"],
        "tokens_per_step": [tokens[s] for s in steps],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    given = sys.argv[1:] if argv is None else argv
    if "--mixed" in given or "--blocks" in given or "--ladder" in given:
        from e2e_mixed import main as mixed  # a planner-made mixed-cp plan / a block plan against one process

        return mixed([a for a in given if a != "--mixed"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated subset of stdlib,commoncrawl")
    parser.add_argument("--calibration", default=None,
                        help="JSON file of calibrated coefficients: read if it exists, else written after calibrating")
    args = parser.parse_args(argv)
    args.datasets = [x for x in args.datasets.split(",") if x]
    unknown = sorted(set(args.datasets) - set(DATASETS))
    if unknown or not args.datasets:
        raise SystemExit(f"--datasets: unknown {unknown or 'empty'}; choose from {list(DATASETS)}")
    for key in ("steps", "repeats", "calibration_steps", "tokens_per_batch", "context"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    args.tokens_per_rank = tokens_per_rank(args.memory_mib)
    path = Path(args.calibration) if args.calibration else None
    args.calibration_state = json.loads(path.read_text()) if path is not None and path.exists() else None
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    raw = run_on_ranks(bench_rank, WORLD, args, timeout_s=6000)[0]
    if path is not None and args.calibration_state is None:
        path.write_text(json.dumps(raw["calibration"]))
    out: dict[str, Any] = {
        "world": WORLD, "model": MODEL, "context": args.context, "tokens_per_batch": args.tokens_per_batch,
        "memory_mib": args.memory_mib, "tokens_per_rank": args.tokens_per_rank, "steps": args.steps,
        "warmup": args.warmup, "repeats": args.repeats, "layouts": raw["sets"],
        "model_parallel_layout": raw["mp_layout"],
        "calibration": "loaded from " + str(path) if args.calibration_state is not None else
        f"fitted in this invocation before the measured runs ({raw['calibration_s']:.0f} s)",
        "wall_s": round(time.perf_counter() - t0, 1), "cores": raw["cores"],
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }
    for name in args.datasets:
        out[name] = summarize(name, raw, args)
        s = out[name]
        print(f"{name}: hotspa {s['hotspa_tokens_per_s']:.0f} tok/s, best static {s['best_static_layout']} "
              f"{s['best_static_tokens_per_s']:.0f} -> speedup {s['speedup']:.2f} (ideal {s['ideal_speedup']:.2f}, "
              f"rule {s['threshold_rule_speedup']:.2f}, predicted {s['predicted_speedup']:.2f}); switch "
              f"{s['switch_fraction']:.1%}; max loss rel diff {s['max_loss_rel_diff']:.1e}; CPU work "
              f"best static / hotspa {s['cpu_work_speedup']:.2f}, core utilization "
              f"{', '.join(f'{k} {v:.0%}' for k, v in s['core_utilization'].items())}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
