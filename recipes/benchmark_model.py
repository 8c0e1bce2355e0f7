"""Model benchmark: forward + backward tokens/s of a Llama preset in every layout vs one process.

Every layout trains on the SAME global set of micro-batches (``--micro-batches`` of
``--tokens`` tokens each, documents of mixed lengths), dealt to its dp groups as the planner would;
so tokens/s compare like for like and every layout's gradients (reduced by the switch engine into
the home store, as full tensors) are checked against the single process's. A step here is one
stage run by the engine's StepRunner, as training runs it; its time is the stage's compute plus its
gradient reduction (the switch from home is not timed), the slowest rank's, median over ``--steps``
after ``--warmup`` untimed steps. The single process runs on rank 0 alone (one thread, as every rank)
while the others wait. The last line printed is one JSON object.

    python recipes/benchmark_model.py --preset small --tokens 512
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hotspa.engine.step_runner import StepHooks, StepRunner  # noqa: E402
from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters  # noqa: E402
from lightning_hotspa.layout import Layout  # noqa: E402
from lightning_hotspa.mesh import WorldMesh  # noqa: E402
from lightning_hotspa.models import param_roles  # noqa: E402
from lightning_hotspa.parallel.model import ParallelModel  # noqa: E402
from lightning_hotspa.placements import build_shardings  # noqa: E402
from lightning_hotspa.plan import Stage, StepPlan, pack_micro_batch, slice_plan  # noqa: E402
from lightning_hotspa.testing.spawn import RankPool  # noqa: E402

# the pp layouts run torch's 1F1B schedule (parallel/pipeline.py): the embedding on the first stage,
# the blocked loss head on the last
LAYOUTS = ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2", "cp4", "dp2xpp2", "tp2xpp2", "cp2xpp2"]
DOC_SHARES = (8, 4, 3, 1)  # a micro-batch's documents, as sixteenths of its tokens


def _documents(tokens: int, micro_batches: int, vocab: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    if tokens % 128:
        raise ValueError(f"--tokens must be a multiple of 128 (documents stay multiples of 2*cp), got {tokens}")
    g = torch.Generator().manual_seed(0)
    docs, groups = [], []
    for _ in range(micro_batches):
        groups.append([])
        for share in DOC_SHARES:
            groups[-1].append(len(docs))
            docs.append(torch.randint(0, vocab, (tokens * share // 16,), generator=g))
    return docs, groups


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class _StartTogether(StepHooks):
    def before_compute(self, stage) -> None:  # every rank's stage clock starts at once
        dist.barrier()


def _single_process(lm, docs, groups, total_targets, steps, warmup) -> tuple[float, dict[str, torch.Tensor]]:
    times = []
    for _ in range(warmup + steps):
        lm.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for ids in groups:
            mb = pack_micro_batch([docs[i] for i in ids])
            (lm.training_step(mb) * (mb.num_target_tokens / total_targets)).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]), {n: p.grad.clone() for n, p in lm.named_parameters()}


def bench_rank(preset: str, tokens: int, micro_batches: int, steps: int, warmup: int = 1) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*self.log.*")
    from lightning_hotspa.models import LlamaLM  # Lightning: imported by the worker, not the parent

    world = WorldMesh(LAYOUTS)
    lm = LlamaLM(preset, seed=0)
    docs, groups = _documents(tokens, micro_batches, lm.config.vocab_size)
    lengths = tuple(d.numel() for d in docs)
    total_targets = sum(n - 1 for n in lengths)
    init = {n: p.detach().clone() for n, p in lm.named_parameters()}
    result: dict = {"tokens_per_step": sum(lengths)}
    if world.rank == 0:
        seconds, reference = _single_process(lm, docs, groups, total_targets, steps, warmup)
        result["single_process"] = {"step_s": seconds, "tokens_per_s": sum(lengths) / seconds}
    dist.barrier()
    roles = param_roles(lm, lm.tp_plan(max(Layout.parse(x).tp for x in LAYOUTS)))
    shardings = build_shardings({n: tuple(p.shape) for n, p in lm.named_parameters()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(lm, roles, world)
    engine = SwitchEngine(world, shardings, home)
    runner, hooks = StepRunner(engine, parallel), _StartTogether()
    result["loss_parallel"] = type(lm.loss_fn).__name__
    for name in LAYOUTS:
        layout = Layout.parse(name)
        stage = Stage(layout, tuple(tuple(tuple(groups[i]) for i in range(dp, len(groups), layout.dp))
                                    for dp in range(layout.dp)))
        mine = slice_plan(StepPlan(0, lengths, (stage,)), docs, world.shape, world.rank)
        times = []
        for _ in range(warmup + steps):
            engine.clear_grad_store()
            (timed,) = runner.run(mine, lm.training_step, hooks).stages
            times.append(_slowest(timed.compute_s + timed.reduce_s))
        engine.assign_home_grads()
        errors = {}
        for pname, p in home.items():
            full = p.grad.full_tensor()
            if world.rank == 0:
                errors[pname] = float((full - reference[pname]).norm() / reference[pname].norm())
            p.grad = None
        engine.clear_grad_store()
        seconds = statistics.median(times[warmup:])
        result[name] = {"step_s": seconds, "tokens_per_s": sum(lengths) / seconds,
                        "max_grad_rel_err": max(errors.values()) if errors else None}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per micro-batch (multiple of 128)")
    parser.add_argument("--micro-batches", type=int, default=4, help="global micro-batches per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per layout first (the smoke run: 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    pool = RankPool(4, collective_timeout_s=600)
    try:
        out = pool.run(bench_rank, args.preset, args.tokens, args.micro_batches, args.steps, args.warmup,
                       timeout_s=3600)[0]
    finally:
        pool.close()
    single = out["single_process"]["tokens_per_s"]
    print(f"{'layout':<16}{'tokens/s':>12}{'vs 1 proc':>12}{'step s':>10}{'grad err':>12}")
    print(f"{'single process':<16}{single:>12.0f}{1.0:>12.2f}{out['single_process']['step_s']:>10.2f}{'-':>12}")
    for name in LAYOUTS:
        r = out[name]
        print(f"{name:<16}{r['tokens_per_s']:>12.0f}{r['tokens_per_s'] / single:>12.2f}{r['step_s']:>10.2f}"
              f"{r['max_grad_rel_err']:>12.2e}")
    result = {
        "preset": args.preset,
        "ranks": 4,
        "tokens_per_micro_batch": args.tokens,
        "micro_batches_per_step": args.micro_batches,
        "steps": args.steps,
        "warmup": args.warmup,
        "tokens_per_step": out["tokens_per_step"],
        "dtype": "float32",
        "lm_loss": out["loss_parallel"],
        "tokens_per_s": {"single_process": round(single, 1),
                         **{name: round(out[name]["tokens_per_s"], 1) for name in LAYOUTS}},
        "grad_rel_err": {name: out[name]["max_grad_rel_err"] for name in LAYOUTS},
        "max_grad_rel_err": max(out[name]["max_grad_rel_err"] for name in LAYOUTS),
        "per_layout_max_grad_rel_err": {name: out[name]["max_grad_rel_err"] for name in LAYOUTS},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
