"""Per-block torch.compile through hot switches and variable lengths (issue 51, item 2): one JSON line last.

4 gloo ranks on CPU, the tiny Llama, every step a plan of mixed stages over eight layouts (dp2xtp2:fsdp, dp4,
dp2xtp2, tp4 and the context-parallel kinds: dp2xcp2 and tp2xcp2 Ulysses, cp4:kv the KV ring, cp4:kv2 the hybrid; a
hot switch between every stage) and new document lengths each step. Each rank runs
the SAME steps twice through the engine's ``StepRunner`` (the strategy's step loop): first eager,
then with every block compiled (``compile_blocks``, inductor by default, the token dim dynamic),
and compares the global losses and the reduced home gradients of every step (fp32, no optimizer
update, so both passes see the same weights). tp overlap is off, as the strategy has it under
compile (``--tp-overlap``: its row layer is one custom op, its column regions' ring still breaks);
``--layouts`` picks other layouts of 4 ranks (a ``:fsdp`` unit's gathers run in its hooks, outside the graph; cp
attention is one opaque op, ``parallel/cp_attention_op.py``). The smoke runs four: dp2xtp2:fsdp, dp4, tp2xcp2,
cp4:kv2 (sharded, replicated, tp with Ulysses, Ulysses with the KV ring). Keys:

* ``layouts_run``, ``steps``; ``compiled_graphs``, ``graph_breaks``, ``cache_limit_hits``,
  ``skipped_frames`` (dynamo's own counters, the max over ranks; a limit hit or a skipped frame means
  a block ran eager); ``recompiles``: graphs beyond the first per block; ``recompile_limit``: what
  ``compile_blocks`` set it to (layouts x blocks, x2 for the checkpointing variant, + warm-up);
  ``graphs_per_layout_block``: ``compiled_graphs / (layouts x blocks)``; ``recompile_reasons``: the first
  line of each guard that failed (why a graph was added), over all ranks; ``break_reasons``: dynamo's
  graph-break reasons, over all ranks;
* ``max_abs_diff_vs_eager``: the largest |compiled - eager| over every step's loss and gradients.

    python recipes/benchmark_compile.py             # inductor, 40 steps
    python recipes/benchmark_compile.py --smoke     # aot_eager, 1 step
    python recipes/benchmark_compile.py --smoke --backend eager --layers 1   # the smoke test's run
    python recipes/benchmark_compile.py --checkpointing selective           # the attention core recomputed
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_hotspa.testing.spawn import run_on_ranks  # noqa: E402

WORLD = 4
LAYOUTS = ("dp2xtp2:fsdp", "dp4", "dp2xtp2", "tp4", "dp2xcp2", "cp4:kv", "tp2xcp2", "cp4:kv2")  # sharded first: its
#: hooks meet the first trace
SMOKE_LAYOUTS = ("dp2xtp2:fsdp", "dp4", "tp2xcp2", "cp4:kv2")


def plans(steps: int, docs_per_step: int, max_len: int, layouts: tuple[str, ...] = LAYOUTS,
          seed: int = 0) -> list[Any]:
    """Per step: random document lengths dealt to one stage per layout, each dp group 1-2 micro-batches."""
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.plan import Stage, StepPlan

    rng = random.Random(seed)
    out = []
    for step in range(steps):
        lengths = [rng.randint(4, max_len) for _ in range(docs_per_step)]
        share = -(-docs_per_step // len(layouts))
        stages = []
        for i, name in enumerate(layouts):
            layout, ids = Layout.parse(name), list(range(i * share, min(docs_per_step, (i + 1) * share)))
            groups = [ids[g::layout.dp] for g in range(layout.dp)]
            stages.append(Stage(layout, tuple(tuple((d,) for d in g) for g in groups), label=name))
        out.append(StepPlan(step, tuple(lengths), tuple(stages)))
    return out


def _documents(plan: Any, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + plan.step)
    return [torch.randint(0, vocab, (n,), generator=g) for n in plan.doc_lengths]


def _run(state: Any, runner: Any, module: Any, batches: list[Any]) -> list[torch.Tensor]:
    """Every step's global loss and full home gradients, flattened into one tensor per step."""
    out = []
    for batch in batches:
        result = runner.run(batch, lambda mb: module.model(mb.input_ids, mb.position_ids, mb.cu_seqlens,
                                                           mb.max_seqlen, labels=mb.labels))
        state.engine.assign_home_grads()
        grads = [p.grad.full_tensor().reshape(-1) for _, p in sorted(state.home.items())]
        out.append(torch.cat([result.loss.reshape(1).float(), *grads]))
        for p in state.home.values():
            p.grad = None
        state.engine.clear_grad_store()
    return out


def rank_main(args: dict[str, Any]) -> dict[str, Any]:
    """On every rank: the steps eager, then compiled; the counters and the differences."""
    import dataclasses

    import torch.distributed as dist

    from lightning_hotspa.activation_checkpointing import Checkpointing
    from lightning_hotspa.adapter.lightning.compile_blocks import check_compile_spec, compile_blocks, compile_counts
    from lightning_hotspa.adapter.lightning.home_state import build_home_state
    from lightning_hotspa.engine.step_runner import StepRunner
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import LlamaConfig, LlamaLM
    from lightning_hotspa.plan import slice_plan

    torch.manual_seed(0)
    module = LlamaLM(dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=args["layers"]), seed=3)
    layouts = tuple(args["layouts"])
    world = WorldMesh(list(layouts))
    state = build_home_state(module, world, home_dtype=torch.float32, working_dtype=None,
                             device=torch.device("cpu"), tp_overlap=args["tp_overlap"])
    mode = Checkpointing.parse(args["checkpointing"])
    sharded = Checkpointing.FULL if mode is Checkpointing.SELECTIVE else mode  # :fsdp layouts refuse selective

    def checkpointing(layout: Any) -> Checkpointing:
        return sharded if layout.fsdp else mode

    runner = StepRunner(state.engine, state.parallel, activation_checkpointing=checkpointing)
    vocab = module.config.vocab_size
    batches = [slice_plan(p, _documents(p, vocab), world.shape, dist.get_rank())
               for p in plans(args["steps"], args["docs"], args["max_len"], layouts)]
    eager = _run(state, runner, module, batches)
    blocks = compile_blocks(module, check_compile_spec({"backend": args["backend"]}), len(layouts))
    compiled = _run(state, runner, module, batches)
    counts = compile_counts()
    from torch._dynamo.utils import counters, guard_failures

    reasons = sorted({str(r).split("\n")[0][:160] for failures in guard_failures.values() for r in failures})
    breaks = sorted({str(r).split("\n")[0][:160] for r in counters["graph_break"]})
    diff = max(float((c - e).abs().max()) for c, e in zip(compiled, eager, strict=True))
    return {**counts, "blocks": blocks, "max_abs_diff_vs_eager": diff, "recompile_reasons": reasons,
            "break_reasons": breaks}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints and returns its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="aot_eager, 1 step, short documents")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; smoke: aot_eager)")
    parser.add_argument("--layouts", default=None, help="comma-separated layouts of 4 ranks (the smoke: its four)")
    parser.add_argument("--tp-overlap", action="store_true", help="tp overlap on (its column regions still break)")
    parser.add_argument("--checkpointing", choices=("none", "selective", "full"), default="none",
                        help="what every stage recomputes in backward (selective: full on :fsdp layouts, which "
                             "refuse selective)")
    parser.add_argument("--layers", type=int, default=2, help="blocks of the tiny Llama (default 2, its own)")
    args = parser.parse_args(argv)
    layouts = tuple(args.layouts.split(",")) if args.layouts else (SMOKE_LAYOUTS if args.smoke else LAYOUTS)
    if args.layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {args.layers}")
    run = {"layouts": layouts, "tp_overlap": args.tp_overlap, "layers": args.layers,
           "checkpointing": args.checkpointing,
           "steps": args.steps or (1 if args.smoke else 40), "docs": (2 if args.smoke else 3) * len(layouts),
           "max_len": 24 if args.smoke else 96, "backend": args.backend or ("aot_eager" if args.smoke else "inductor")}
    results = run_on_ranks(rank_main, WORLD, run, timeout_s=3000)
    graphs = max(r["compiled_graphs"] for r in results)
    blocks = results[0]["blocks"]
    out = {"backend": run["backend"], "world": WORLD, "layouts": list(layouts), "layouts_run": len(layouts),
           "tp_overlap": run["tp_overlap"], "checkpointing": run["checkpointing"],
           "steps": run["steps"], "blocks": blocks, "compiled_graphs": graphs,
           "graph_breaks": max(r["graph_breaks"] for r in results),
           "recompiles": graphs - blocks, "graphs_per_layout_block": round(graphs / (blocks * len(layouts)), 3),
           "recompile_limit": results[0]["recompile_limit"],
           "cache_limit_hits": max(r["cache_limit_hits"] for r in results),
           "skipped_frames": max(r["skipped_frames"] for r in results),
           "max_abs_diff_vs_eager": max(r["max_abs_diff_vs_eager"] for r in results),
           "recompile_reasons": sorted({x for r in results for x in r["recompile_reasons"]}),
           "break_reasons": sorted({x for r in results for x in r["break_reasons"]})}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
