"""Issue 53 on 4 gloo ranks: the measured cost planner settles on the layout that really runs fastest.

``python recipes/benchmark_measured.py`` trains the tiny Llama on 4 CPU ranks under a real Lightning
``Trainer`` over a seeded synthetic corpus (:class:`~lightning_hotspa.data.HotSPaDataModule`, the same
global mini-batches in every run):

1. **static**: each of ``--layouts`` alone (a :class:`~lightning_hotspa.planner.solve.solver.CostModelPlanner`
   of that one layout: the measured planner's own static candidate) for ``--static-steps`` steps, in
   ``--static-rounds`` rounds over the layouts (half before the measured run, half after: the load of
   a shared box drifts over minutes); its real seconds per step are the median over its rounds' steps
   after each round's first (warm-up) step, same batches for every layout;
2. **measured**: all layouts with the measured cost planner (``planner="cost-measured"``,
   :class:`~lightning_hotspa.planner.profiled.measured_planner.MeasuredCostPlanner`, no ladder and no
   mixed rounds, so every candidate is a plain layout or a multi-layout plan of plain stages) for
   ``--steps`` steps; each step's decision (what ran, what it would exploit) is recorded;
3. **reference**: rank 0 trains the same global mini-batches in ONE process (whole batch, token-mean
   loss, the same AdamW); every measured-run step's loss must match within ``--tolerance`` (1e-4).

``settled_step``: the first step from which the planner's exploit choice never changes again (its last
choice is ``settled_on``); ``fastest_measured``: the static layout with the fewest real seconds per step;
``settled_on_fastest``: whether they agree. ``exploration_share``: the guard's measured seconds spent
exploring over its measured seconds (its own account).

The default layouts are ones the ``cpu-gloo`` profile prices within ~25 % of each other on these
batches: dp4, priced ~3x cheaper than any, would always run, and a layout the model prices several
times dearer than the reference is never explored (the guard's prior trusts the model's between-layout
ratios to ~12 %: a gap of ln 3 is far outside it). An option never run takes a robust box factor of
those that ran as its prior (:func:`~lightning_hotspa.planner.profiled.measured.box_factor`: one
outlying layout is left out; of two far apart, the lower): with the MEAN, the slowed layout raised
every unmeasured prior, and a never-run layout (cp4 here) was never explored; it now is
(benchmarks/2026-12-07-measured-prior.md).

**Injected slowdown** (a documented test hook, on by default; ``--slow none`` turns it off): on this
loaded CPU box the layouts' real speeds differ from the model's by noise-sized amounts, so which one is
fastest is not certain run to run. ``--slow LAYOUT`` (``auto``: the static layout the model prices
cheapest on the first batch) makes every micro-batch of that layout sleep ``(--slow-factor - 1) x 3 x``
its forward's seconds after its forward (backward ~ 2 forwards), so its measured compute is about
``--slow-factor`` times its real one: the model's favourite is then wrong, and the planner must find
that out by measuring (its prior knows nothing of the sleep). The sleep is in the recipe's
LightningModule (:class:`SlowedLM`), not in the library.

``--probe-share`` (default 0.125, the planner's; 0: off): a never-run layout may be explored by a probe,
the middle document of every 8 in length order under it and the rest under the reference static, where
the model prices that below the layout's whole plan (``probe_steps`` counts them).

``--explore-budget`` defaults to 0.25 (not the planner's 3 %): a run of a few dozen steps cannot learn
anything on 3 % of its time; the share spent is reported. ``--smoke``: 2 layouts, 2 static steps,
3 measured steps (a check that it runs, not a figure). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_hotspa.testing.spawn import run_on_ranks  # noqa: E402

WORLD = 4
DEFAULTS = {"layouts": "dp2xcp2,cp4,dp2xtp2", "steps": 30, "static_steps": 5, "tokens_per_rank": 256,
            "static_rounds": 2, "tokens_per_batch": 1024, "docs": 600, "slow": "auto", "slow_factor": 2.0,
            "explore_budget": 0.25, "noise_sd": 0.1, "probe_share": 0.125, "seed": 0, "lr": 2e-3, "tolerance": 1e-4}
SMOKE = {"layouts": "dp2xcp2,cp4", "steps": 3, "static_steps": 2, "static_rounds": 1, "tokens_per_batch": 256,
         "docs": 40}


def corpus(args: argparse.Namespace):
    """Seeded documents: mostly short, some up to ``tokens_per_rank`` (every layout holds each)."""
    from lightning_hotspa.data import TokenizedCorpus

    rng = np.random.default_rng(args.seed)
    n_long = max(1, args.docs // 10)
    lengths = np.concatenate([rng.integers(4, 64, size=args.docs - n_long),
                              rng.integers(64, args.tokens_per_rank, size=n_long)])
    return TokenizedCorpus.from_token_arrays([rng.integers(0, 256, size=int(n)) for n in rng.permutation(lengths)])


def datamodule(args: argparse.Namespace, steps: int):
    from lightning_hotspa.data import HotSPaDataModule

    return HotSPaDataModule(corpus(args), tokens_per_batch=args.tokens_per_batch,
                            context_length=args.tokens_per_rank, num_workers=0, batches_per_epoch=steps)


def slowed_lm(args: argparse.Namespace, slow: str | None):
    """The tiny Llama; with ``slow``, :class:`SlowedLM` (module docstring: the injected slowdown)."""
    from lightning_hotspa.models import LlamaLM

    class SlowedLM(LlamaLM):
        """Each micro-batch of layout ``slow`` sleeps ``(slow_factor - 1) x 3 x`` its forward's seconds."""

        def training_step(self, batch, batch_idx: int = 0):
            t0 = time.perf_counter()
            loss = super().training_step(batch, batch_idx)
            parallel = getattr(self.trainer.strategy, "parallel", None)
            groups = getattr(getattr(parallel, "state", None), "groups", None)
            if groups is not None and groups.layout.name == slow:
                time.sleep((args.slow_factor - 1.0) * 3.0 * (time.perf_counter() - t0))
            return loss

    return (SlowedLM if slow else LlamaLM)("tiny", seed=3, lr=args.lr)


def measured_planner(args: argparse.Namespace, layouts: list[str], horizon: int):
    """The measured cost planner, recording each step's decision (:attr:`decisions`)."""
    from lightning_hotspa.planner.profiled.measured_planner import MeasuredCostPlanner

    class Recording(MeasuredCostPlanner):
        def plan(self, step, doc_lengths, *, latest=False):
            out = super().plan(step, doc_lengths, latest=latest)
            if not latest and self.last_measured is not None:
                self.decisions[int(step)] = self.last_measured
            return out

    planner = Recording(layouts, model="tiny", hardware="cpu-gloo", tokens_per_rank=args.tokens_per_rank,
                        activation_checkpointing=False, ladder=False, mixed_rounds=False,
                        explore_budget=args.explore_budget, noise_sd=args.noise_sd, horizon=horizon,
                        probe_share=args.probe_share)
    planner.decisions = {}
    return planner


def fit(args: argparse.Namespace, layouts: list[str], planner, steps: int, slow: str | None) -> dict[str, Any]:
    """``steps`` steps of the Trainer; per step its loss and wall seconds (rank 0's)."""
    import lightning as L
    from step_record import StepRecord

    from lightning_hotspa import HotSPaStrategy

    record = StepRecord()
    dm = datamodule(args, steps)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=steps, logger=False,
                        strategy=HotSPaStrategy(layouts, planner=planner, tokens_per_rank=args.tokens_per_rank),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[record])
    trainer.fit(slowed_lm(args, slow), datamodule=dm)
    return {"losses": record.losses, "seconds": record.seconds, "dm": dm}


def reference_losses(args: argparse.Namespace, dm, steps: int) -> list[float]:
    """The single process on the same global mini-batches (epoch 0, steps 0..steps-1)."""
    from lightning_hotspa.data.minibatches import chunk_tokens
    from lightning_hotspa.micro_batch import pack_micro_batch

    dataset = dm.train_dataloader().dataset
    model = slowed_lm(args, None)
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    out = []
    for step in range(steps):
        docs = [torch.as_tensor(chunk_tokens(dataset.corpus, r).astype(np.int64)) for r in dataset.minibatch(0, step)]
        optimizer.zero_grad()
        loss = model.training_step(pack_micro_batch(docs), 0)
        loss.backward()
        optimizer.step()
        out.append(float(loss))
    return out


def slowed_layout(args: argparse.Namespace, layouts: list[str]) -> str | None:
    """``--slow``: a layout name, None (``none``), or the model's cheapest static on the first batch."""
    if args.slow == "none":
        return None
    if args.slow != "auto":
        if args.slow not in layouts:
            raise SystemExit(f"--slow {args.slow!r} is not one of --layouts {layouts} (or 'auto' / 'none')")
        return args.slow
    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    dm = datamodule(args, args.steps)
    dm.setup("fit")
    lengths = [r.length for r in dm._train_sampler.batch(0, 0)]
    cost = {}
    for layout in layouts:
        single = CostModelPlanner([layout], model="tiny", hardware="cpu-gloo", world_size=WORLD,
                                  tokens_per_rank=args.tokens_per_rank, activation_checkpointing=False, ladder=False,
                                  mixed_rounds=False)
        cost[layout] = single.solve(lengths)[0]
    return min(layouts, key=lambda k: (cost[k], k))


def train_rank(args: argparse.Namespace) -> dict[str, Any]:
    """On every rank: each layout alone, then the measured planner; rank 0 then the single process."""
    import warnings

    import torch.distributed as dist
    from lightning_baselines import as_launched_ranks, own_process_groups

    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    as_launched_ranks()
    warnings.simplefilter("ignore")
    layouts = args.layouts.split(",")
    slow = slowed_layout(args, layouts)
    static: dict[str, list[float]] = {}
    planner = measured_planner(args, layouts, args.steps)
    for r in range(args.static_rounds):  # rounds of every layout, before and after the measured run:
        if r == args.static_rounds // 2:  # the box's load drifts over minutes (other jobs)
            with own_process_groups():
                run = fit(args, layouts, planner, args.steps, slow)
        for layout in layouts:
            single = CostModelPlanner([layout], model="tiny", hardware="cpu-gloo", tokens_per_rank=args.tokens_per_rank,
                                      activation_checkpointing=False, ladder=False, mixed_rounds=False)
            with own_process_groups():
                seconds = fit(args, [layout], single, args.static_steps, slow)["seconds"]
            static.setdefault(layout, []).extend(seconds[1:])
    if dist.get_rank() != 0:
        return {}
    decisions = [planner.decisions[s] for s in sorted(planner.decisions) if s < args.steps]
    return {"static": static, "slow": slow, "losses": run["losses"], "seconds": run["seconds"],
            "reference": reference_losses(args, run["dm"], args.steps),
            "runs": [d.run for d in decisions], "exploits": [d.exploit for d in decisions],
            "exploring": [bool(d.exploring) for d in decisions], "exploration_share": planner.guard.exploration_share,
            "probes": [bool(d.probe) for d in decisions],
            "corrections": {k: round(float(np.exp(m)), 4) for k, m in planner.guard.correction.mean.items()}}


def settled(exploits: list[str]) -> tuple[int | None, str | None]:
    """(first step from which the exploit choice never changes, that choice)."""
    if not exploits:
        return None, None
    last = exploits[-1]
    step = len(exploits)
    while step > 0 and exploits[step - 1] == last:
        step -= 1
    return step, last


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--smoke", action="store_true", help="tiny and few steps: " + str(SMOKE))
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if not 0 <= args.probe_share < 1:
        raise SystemExit(f"--probe-share must be in [0, 1) (0: no probes), got {args.probe_share}")
    if args.steps < 2 or args.static_steps < 2 or args.static_rounds < 1 or len(args.layouts.split(",")) < 2 \
            or args.slow_factor < 1:
        raise SystemExit(f"--steps >= 2, --static-steps >= 2, --static-rounds >= 1, two or more --layouts and "
                         f"--slow-factor >= 1, got {args.steps}, {args.static_steps}, {args.static_rounds}, "
                         f"{args.layouts!r}, {args.slow_factor}")
    t0 = time.perf_counter()
    raw = run_on_ranks(train_rank, WORLD, args, timeout_s=3600)[0]
    static_s = {k: statistics.median(v) for k, v in raw["static"].items()}
    fastest = min(static_s, key=lambda k: (static_s[k], k))
    step, on = settled(raw["exploits"])
    diffs = [abs(a - b) / abs(b) for a, b in zip(raw["losses"], raw["reference"])]
    out = {"world": WORLD, "layouts": args.layouts.split(","), "smoke": args.smoke, "slowed": raw["slow"],
           "slow_factor": args.slow_factor if raw["slow"] else 1.0, "explore_budget": args.explore_budget,
           "static_s_per_step": static_s, "fastest_measured": fastest, "settled_step": step, "settled_on": on,
           "settled_on_fastest": on == fastest, "runs": raw["runs"], "exploits": raw["exploits"],
           "measured_s_per_step": raw["seconds"], "corrections": raw["corrections"],
           "losses": raw["losses"], "reference_losses": raw["reference"], "max_loss_rel_err_vs_single": max(diffs),
           "losses_match": max(diffs) <= args.tolerance, "exploration_share": raw["exploration_share"],
           "explored_steps": sum(raw["exploring"]), "probe_steps": sum(raw["probes"]), "probe_share": args.probe_share,
           "steps": args.steps, "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"static s/step {({k: round(v, 3) for k, v in static_s.items()})} (slowed: {raw['slow']}); measured "
          f"planner settled on {on} at step {step} of {args.steps} (fastest measured: {fastest}); max loss rel err "
          f"{out['max_loss_rel_err_vs_single']:.1e}; exploration share {out['exploration_share']:.3f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
