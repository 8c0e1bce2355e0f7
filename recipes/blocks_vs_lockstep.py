"""Lockstep mixed-cp rounds against per-block streams on the same cost model (issue 38, item 2).

The planner's mixed-cp stages (``planner/solve/mixed_rounds.py``: blocks of one sharded working copy in
lockstep rounds) are priced three ways, compute seconds of the stage:

* ``lockstep``: :func:`mixed_seconds` (per round the slowest micro-batch over every block, plus the
  round's unit gathers; the busiest group's rounds);
* ``streams_same_copy``: the same blocks each on its own clock (rounds only among a block's own dp
  groups), the same per-micro-batch gathers: the lockstep cost alone;
* ``streams_own_copy``: each block with its copy sharded over its OWN ranks (``plan.Block(sharded=True)``,
  working layout ``:fsdp<n>``: its own gathers' price and memory), plus the joint exchange at the
  stage end (this rank's fp32 gradient shard sent at the inter-node bandwidth: an upper bound);
  ``fits``: every block's micro-batches within its own copy's capacity (the memory model's).

Batches are drawn from a seeded generator until the planner emits mixed stages. The last line is
one JSON object.

    python recipes/blocks_vs_lockstep.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (name, layouts, model, hardware, world, tokens_per_rank or None, document lengths (long range, short range, counts))
SETUPS = [
    ("e2e-mixed-4", ["dp4:fsdp", "dp2xcp2:fsdp"], "llama7b", "H100", 4, 48, ((49, 94), (2, 48), (1, 12))),
    ("llama7b-8", ["dp8:fsdp", "dp4xcp2:fsdp", "dp2xcp4:fsdp"], "llama7b", "H100", 8, None,
     ((16000, 50000), (200, 4000), (2, 48))),
]
DRAWS = 64


def own_copy(cost_model, option, dp_groups: int):
    """The block's option with its copy sharded over its own ranks (None: it cannot shard, 1 rank)."""
    from lightning_hotspa.layout import Layout

    lay = option.layout
    shard = dp_groups * lay.cp
    if shard < 2:
        return None
    own = Layout(dp=lay.dp, tp=lay.tp, cp=lay.cp, cp_kv=lay.cp_kv, fsdp=True,
                 fsdp_shard=0 if shard == lay.dp * lay.cp else shard)
    return cost_model.option(own, option.activation_checkpointing)


def price(planner, stage, lengths: np.ndarray) -> dict:
    """The three prices of one mixed stage (module docstring)."""
    from lightning_hotspa.planner.solve.mixed_rounds import MixedBlock, MixedGroups, mixed_seconds

    cm, ac = planner.cost_model, stage.activation_checkpointing
    blocks = [MixedBlock(planner.options.get((b.layout, ac)) or cm.option(b.layout, ac), b.dp_groups,
                         b.micro_batches) for b in stage.blocks]
    lockstep = mixed_seconds(MixedGroups(tuple(blocks)), lengths)
    same = max(mixed_seconds(MixedGroups((b,)), lengths) for b in blocks)
    own, fits, exchange = [], True, 0.0
    hw = cm.hardware
    for b in blocks:
        opt = own_copy(cm, b.option, len(b.dp_groups))
        if opt is None:
            own.append(math.inf)
            fits = False
            continue
        tokens = max((int(opt.padded(lengths[list(mb)]).sum()) for g in b.groups for mb in g), default=0)
        fits &= tokens <= opt.capacity
        own.append(mixed_seconds(MixedGroups((MixedBlock(opt, b.dp_groups, b.groups),)), lengths))
        ranks = len(b.dp_groups) * opt.layout.tp * opt.layout.cp
        exchange = max(exchange, cm.params * 4.0 / ranks / hw.inter_node_bw)
    return {"blocks": [f"{b.option.layout} x{len(b.dp_groups)}" for b in blocks], "lockstep_s": lockstep,
            "streams_same_copy_s": same, "streams_own_copy_s": max(own) + exchange,
            "joint_exchange_s": exchange, "own_copy_fits": bool(fits)}


def run(setup) -> dict:
    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    name, layouts, model, hardware, world, per_rank, (long, short, counts) = setup
    planner = CostModelPlanner(layouts, model=model, hardware=hardware, world_size=world, tokens_per_rank=per_rank,
                               activation_checkpointing=False, static_margin=0.0)
    rng = np.random.default_rng(0)
    rows = []
    for step in range(DRAWS):
        longs = int(rng.integers(1, counts[0] + 1))
        lengths = rng.integers(*short, counts[1]).tolist() + rng.integers(*long, longs).tolist()
        plan = planner.plan(step, lengths)
        rows += [price(planner, s, np.asarray(plan.doc_lengths)) for s in plan.stages if s.blocks]
    ratio = [r["lockstep_s"] / r["streams_same_copy_s"] for r in rows]
    own = [r["lockstep_s"] / r["streams_own_copy_s"] for r in rows if r["own_copy_fits"]]
    geo = lambda xs: float(np.exp(np.mean(np.log(xs)))) if xs else None  # noqa: E731
    return {"setup": name, "layouts": layouts, "model": model, "hardware": hardware, "world": world,
            "draws": DRAWS, "mixed_stages": len(rows), "geomean_lockstep_over_streams_same_copy": geo(ratio),
            "min_lockstep_over_streams_same_copy": min(ratio, default=None),
            "own_copy_fits": len(own), "geomean_lockstep_over_streams_own_copy": geo(own), "rows": rows[:6]}


def main() -> dict:
    out = {"setups": [run(s) for s in SETUPS]}
    for s in out["setups"]:
        print(f"{s['setup']}: {s['mixed_stages']} mixed stages; lockstep / per-block streams (same copy) geomean "
              f"{s['geomean_lockstep_over_streams_same_copy']}; own copies fit in {s['own_copy_fits']}, "
              f"lockstep / streams (own copy + joint exchange) {s['geomean_lockstep_over_streams_own_copy']}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
