"""End to end on 4 gloo ranks: the planner's mixed-cp rounds (issue 31) train like the single process.

``python recipes/benchmark_e2e.py --mixed`` (or this file) plans ``--steps`` global mini-batches
with :class:`~lightning_hotspa.planner.solve.solver.CostModelPlanner` over one sharded working copy in two
layouts, ``dp4:fsdp`` and ``dp2xcp2:fsdp``, with mixed rounds on, trains them with
``HotSPaStrategy`` on 4 CPU ranks under a real Lightning ``Trainer``, and trains the same
mini-batches in ONE process (whole batch, token-mean loss, the same AdamW). Every step's loss must
agree within ``--tolerance`` (1e-4). It reports the plan mix: per step its stages, and for a mixed
stage its blocks (layout, dp groups, rounds, documents).

The plans are PRICED for llama7b on the H100 profile (analytic; capacities set by
``tokens_per_rank``) because on the cpu-gloo profile a round's per-micro-batch latency dominates and
the planner rarely mixes; they RUN the tiny model on the CPU. Each mini-batch: 1-2 documents longer
than ``tokens_per_rank`` (only cp2 holds them) and short ones, drawn from a seeded generator until
the planner mixes one (``draws_per_step``; ``mixed_of_draws``: how often it mixed what was drawn).
Token ids are seeded per step. The last line is one JSON object.

``--blocks`` (``python recipes/benchmark_e2e.py --blocks``; issue 38): hand-built BLOCK stages
instead, no planner: even steps a sharded all-gather-KV cp2 block on ranks {0, 1} (full
checkpointing) takes the long documents, one per micro-batch, beside a dp block sharded over {2, 3}
that runs the short ones (any count per dp group); odd steps a replicated tp2 block {0, 1} beside
two replicated dp blocks {2}, {3}, the last with no micro-batch when there are few short documents.
``block_tokens_logged``: per step the sum of the per-block ``tokens`` the strategy logged (its W&B
block metrics, docs/metrics.md), which must equal ``batch_tokens``.

``--ladder`` (``python recipes/benchmark_e2e.py --ladder``; issue 38, planner half): each step's block
stage is the PLANNER's ladder (``CostModelPlanner.plan_ladder``, planner/solve/ladder.py) over the same
candidates (no checkpointing, so the long documents need a cp2 block); ``planner_choice_s_h100`` is
what the planner's own choice (ladder or not) is predicted to take for the same documents.
"""

from __future__ import annotations

import argparse
import json
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
LAYOUTS = ["dp4:fsdp", "dp2xcp2:fsdp"]
#: ``--blocks``: every block's compute layout and each sharded block's working layout
BLOCK_LAYOUTS = ["dp4", "dp2xcp2:kv", "dp2xtp2", "dp4:fsdp2", "dp2xcp2:kv:fsdp2"]
MODEL = "llama7b"  # the shape the planner prices (H100, capacities set small); the run trains "tiny"
MAX_DRAWS = 64
DEFAULTS = {"steps": 4, "tokens_per_rank": 48, "short_docs": 12, "seed": 0, "lr": 2e-3, "tolerance": 1e-4}


def draw(rng: np.random.Generator, args: argparse.Namespace) -> list[int]:
    """One mini-batch's document lengths: 1-2 long ones (only cp2 holds them), the rest short."""
    cap = args.tokens_per_rank
    longs = rng.integers(cap + 1, 2 * cap - 2, int(rng.integers(1, 3))).tolist()
    return rng.integers(2, cap, args.short_docs).tolist() + longs


def _dealt(docs: list[int], lengths: list[int], groups: int, per_micro_batch: int) -> list[list[tuple[int, ...]]]:
    """``docs`` dealt longest first to the least loaded of ``groups`` (tokens), then cut into
    micro-batches of ``per_micro_batch`` documents."""
    load, out = [0] * groups, [[] for _ in range(groups)]
    for d in sorted(docs, key=lambda i: (-lengths[i], i)):
        g = min(range(groups), key=lambda k: (load[k], k))
        load[g] += lengths[d]
        out[g].append(d)
    return [[tuple(g[i:i + per_micro_batch]) for i in range(0, len(g), per_micro_batch)] for g in out]


def block_plan(step: int, lengths: list[int], cap: int):
    """A hand-built plan of one block stage (module docstring, ``--blocks``) for one mini-batch."""
    from lightning_hotspa.layout import Layout, MeshShape
    from lightning_hotspa.plan import Block, Stage, StepPlan, block_dp_groups

    mesh = MeshShape.for_layouts([Layout.parse(x) for x in BLOCK_LAYOUTS], WORLD)
    longs = [i for i, n in enumerate(lengths) if n > cap]
    shorts = [i for i, n in enumerate(lengths) if n <= cap]
    dp4 = Layout.parse("dp4")
    if step % 2 == 0:
        cp2 = Layout.parse("dp2xcp2:kv")
        blocks = (Block(cp2, block_dp_groups(cp2, mesh, (0, 1)), (tuple((d,) for d in longs),), sharded=True,
                        activation_checkpointing="full"),
                  Block(dp4, block_dp_groups(dp4, mesh, (2, 3)),
                        tuple(tuple(g) for g in _dealt(shorts, lengths, 2, 3)), sharded=True))
    else:
        tp2 = Layout.parse("dp2xtp2")
        few = shorts[:2]  # rank 3's block gets none of them when there are two or fewer
        blocks = (Block(tp2, block_dp_groups(tp2, mesh, (0, 1)), (tuple((d,) for d in longs + shorts[2:]),)),
                  Block(dp4, block_dp_groups(dp4, mesh, (2,)), (tuple((d,) for d in few),)),
                  Block(dp4, block_dp_groups(dp4, mesh, (3,)), ((),)))
    return StepPlan(step, tuple(lengths), (Stage(blocks[0].layout, (), label="blocks", blocks=blocks),))


def make_plans(args: argparse.Namespace):
    """``(plans, planner, draws)``: per step, mini-batches are drawn from the seeded generator until
    the planner mixes one (at most ``MAX_DRAWS``; the last drawn is kept either way): this run checks
    that mixed plans train correctly, and ``draws`` says how often the planner mixes such batches."""
    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    if args.ladder:  # the planner's own ladder (planner/solve/ladder.py) of every mini-batch
        planner = CostModelPlanner(BLOCK_LAYOUTS, model=MODEL, hardware="H100", world_size=WORLD,
                                   tokens_per_rank=args.tokens_per_rank, activation_checkpointing="none")
        rng = np.random.default_rng(args.seed)
        plans = [planner.plan_ladder(step, draw(rng, args)) for step in range(args.steps)]
        if any(p is None for p in plans):
            raise SystemExit("the ladder planner found no block plan for a drawn mini-batch")
        return plans, planner, [1] * args.steps
    if args.blocks:
        rng = np.random.default_rng(args.seed)
        return [block_plan(step, draw(rng, args), args.tokens_per_rank) for step in range(args.steps)], None, \
            [1] * args.steps
    planner = CostModelPlanner(LAYOUTS, model=MODEL, hardware="H100", world_size=WORLD,
                               tokens_per_rank=args.tokens_per_rank, activation_checkpointing=False,
                               static_margin=0.0)
    rng = np.random.default_rng(args.seed)
    plans, draws = [], []
    for step in range(args.steps):
        tries, plan = 0, None
        while tries < MAX_DRAWS and (plan is None or not any(s.blocks for s in plan.stages)):
            plan, tries = planner.plan(step, draw(rng, args)), tries + 1
        plans.append(plan)
        draws.append(tries)
    return plans, planner, draws


def documents(plan, vocab: int) -> list[torch.Tensor]:
    """Byte-range token ids of one plan's documents, seeded by its step."""
    g = torch.Generator().manual_seed(1000 + plan.step)
    return [torch.randint(0, vocab, (n,), generator=g) for n in plan.doc_lengths]


def plan_mix(plan) -> list[dict[str, Any]]:
    """Per stage: its working layout, and its blocks (layout, dp groups, rounds, documents)."""
    out = []
    for s in plan.stages:
        entry: dict[str, Any] = {"layout": s.layout.name, "documents": len(s.doc_ids)}
        if s.blocks:
            entry["blocks"] = [{"layout": b.layout.name, "dp_groups": list(b.dp_groups),
                                "working": b.working_layout.name, "sharded": b.sharded,
                                "checkpointing": str(b.checkpointing(s.activation_checkpointing)),
                                "micro_batches": [len(g) for g in b.micro_batches],
                                "rounds": max(len(g) for g in b.micro_batches),
                                "documents": sum(len(mb) for g in b.micro_batches for mb in g)} for b in s.blocks]
        else:
            entry["rounds"] = max(len(g) for g in s.micro_batches)
        out.append(entry)
    return out


def train_rank(args: argparse.Namespace) -> dict[str, Any]:
    """On every rank: the strategy trains the plans; rank 0 then trains them in one process."""
    import lightning as L
    import torch.distributed as dist
    from lightning_baselines import as_launched_ranks
    from step_record import StepRecord

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.layout import Layout, MeshShape
    from lightning_hotspa.models import LlamaLM
    from lightning_hotspa.plan import pack_micro_batch, slice_plan

    as_launched_ranks()
    plans, planner, draws = make_plans(args)
    rank = dist.get_rank()
    layouts = BLOCK_LAYOUTS if args.blocks or args.ladder else LAYOUTS
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in layouts], WORLD)
    vocab = LlamaLM("tiny").config.vocab_size
    batches = [slice_plan(p, documents(p, vocab), mesh, rank) for p in plans]
    for batch, plan in zip(batches, plans):
        batch.extras["global_plan"] = plan  # as the DataModule does: the W&B block metrics read it

    class Losses(StepRecord):
        """Also, per step, the sum of the block tokens the strategy logged."""

        def __init__(self) -> None:
            super().__init__()
            self.block_tokens: list[float] = []

        def after_step(self, trainer) -> None:
            metrics = trainer.strategy.last_metrics  # what the strategy logged this step
            self.block_tokens.append(sum(float(v) for k, v in metrics.items()
                                         if k.count("/") == 3 and k.endswith("/tokens")))

    record = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=HotSPaStrategy(layouts), max_steps=len(plans),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[record])
    trainer.fit(LlamaLM("tiny", seed=3, lr=args.lr),
                train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda x: x))
    if rank != 0:
        return {}
    model = LlamaLM("tiny", seed=3, lr=args.lr)  # the single process: same seed, whole mini-batch
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    reference = []
    for plan in plans:
        optimizer.zero_grad()
        loss = model.training_step(pack_micro_batch(documents(plan, vocab)), 0)
        loss.backward()
        optimizer.step()
        reference.append(float(loss))
    return {"losses": record.losses, "reference": reference, "step_s": record.seconds, "draws": draws,
            "block_tokens": record.block_tokens, "batch_tokens": [sum(p.doc_lengths) for p in plans],
            "plans": [plan_mix(p) for p in plans],
            "predicted_s": [planner.predict(p).seconds for p in plans] if planner is not None else None,
            # what the planner itself would run for the same documents (the ladder only where cheaper)
            "planner_choice_s": [planner.solve(p.doc_lengths)[0] for p in plans] if args.ladder else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--blocks", action="store_true", help="hand-built block stages (issue 38), no planner")
    parser.add_argument("--ladder", action="store_true", help="the planner's ladder of blocks (issue 38) per step")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tokens_per_rank < 8 or args.short_docs < 1:
        raise SystemExit(f"--steps >= 1, --tokens-per-rank >= 8 and --short-docs >= 1, got {args.steps}, "
                         f"{args.tokens_per_rank}, {args.short_docs}")
    t0 = time.perf_counter()
    raw = run_on_ranks(train_rank, WORLD, args, timeout_s=1800)[0]
    diffs = [abs(a - b) / abs(b) for a, b in zip(raw["losses"], raw["reference"])]
    mixed_steps = sum(any("blocks" in s for s in p) for p in raw["plans"])
    out = {"world": WORLD, "layouts": BLOCK_LAYOUTS if args.blocks or args.ladder else LAYOUTS, "blocks": args.blocks,
           "ladder": args.ladder, "planner_choice_s_h100": raw["planner_choice_s"],
           **{k: getattr(args, k) for k in DEFAULTS},
           "losses": raw["losses"], "reference_losses": raw["reference"], "max_loss_rel_diff": max(diffs),
           "losses_match": max(diffs) <= args.tolerance, "steps_with_a_mixed_stage": mixed_steps,
           "draws_per_step": raw["draws"], "mixed_of_draws": mixed_steps / sum(raw["draws"]),
           "plans": raw["plans"], "predicted_s_h100": raw["predicted_s"], "step_s_cpu": raw["step_s"],
           "block_tokens_logged": raw["block_tokens"], "batch_tokens": raw["batch_tokens"],
           "wall_s": round(time.perf_counter() - t0, 1)}
    kind = "ladder" if args.ladder else "block" if args.blocks else "mixed"
    print(f"{kind} e2e: {mixed_steps} of {args.steps} steps with a block stage; "
          f"max loss rel diff "
          f"{out['max_loss_rel_diff']:.1e} (tolerance {args.tolerance:g}): "
          f"{'match' if out['losses_match'] else 'MISMATCH'}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
