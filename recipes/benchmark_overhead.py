"""Strategy overhead: HotSPaStrategy pinned to one layout vs Lightning's own strategies, side by side.

Same model, data and tokens per rank, all in one invocation on 4 CPU ranks over gloo:
(a) ours pinned to dp4 vs Lightning ``DDPStrategy``; (b) ours pinned to dp2xtp2 vs Lightning
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` (FSDP2 + DTensor TP, applied
in ``configure_model`` with torch's ``parallelize_module``; lightning_baselines.py says how its plan fits
our fused SwiGLU and where it keeps full logits that ours does not). Repeats are interleaved (A B C D, then
D C B A, ...) so machine noise hits all alike; tokens/s is the median over measured steps of the
slowest rank. The ``*_paired`` ratios compare the two runs of each pair within each repeat (adjacent
in time, so under about the same load) and take the median over repeats. Also reported: wall
and process-CPU seconds per phase and rank (``phases_wall_cpu_s``) and the CPU-seconds ratio
``dp4_vs_ddp_cpu`` (DDP's CPU seconds per step over ours: the work per step, less sensitive to how
a shared machine schedules the ranks, though contention still inflates it). The last line is one
JSON object.

    python recipes/benchmark_overhead.py --steps 6 --repeats 3
    python recipes/benchmark_overhead.py --model tiny --steps 2 --repeats 1 --tokens 256   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_baselines import as_launched_ranks, model_parallel_llama  # noqa: E402

from lightning_hotspa.testing.spawn import run_on_ranks  # noqa: E402

WORLD = 4


def _docs(step: int, micro_batch: int, tokens: int, lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro_batch)
    out, left = [], tokens
    for n in lengths * (tokens // sum(lengths) + 1):
        n = min(n, left)
        if n <= 0:
            break
        out.append(torch.randint(0, 256, (n,), generator=g))
        left -= n
    return out


def _micro_batches(steps: int, per_step: int, tokens: int):
    from lightning_hotspa.plan import pack_micro_batch

    lengths = [300, 120, 700, 60, 400]
    return [[pack_micro_batch(_docs(s, i, tokens, lengths)) for i in range(per_step)] for s in range(steps)]


PHASES = ("forward", "backward", "rest")


class _StepTimer:
    """Step wall time (slowest rank) plus this rank's wall and process-CPU seconds per phase:
    forward = step start to the first backward (our switch included), backward = first to last
    backward (DDP's overlapped all-reduce included), rest = the remainder (our gradient reduction
    tail, the optimizer). CPU seconds count every thread of the rank (gloo's too), so they say
    how much work a step is, independent of how the shared machine schedules it."""

    def __init__(self):
        import lightning as L

        def now():
            return time.perf_counter(), time.process_time()

        class Timer(L.Callback):
            def __init__(self):
                self.times, self.phases, self._marks = [], [], []

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                dist.barrier()
                self._marks = [now()]

            def on_before_backward(self, trainer, pl_module, loss):
                if len(self._marks) == 1:
                    self._marks.append(now())

            def on_after_backward(self, trainer, pl_module):
                self._marks[2:] = [now()]

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self._marks.append(now())
                start, end = self._marks[0], self._marks[-1]
                t = torch.tensor([end[0] - start[0]], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                self.times.append(float(t))
                self.phases.append([(b[0] - a[0], b[1] - a[1]) for a, b in zip(self._marks, self._marks[1:])])

        self.callback = Timer()


def bench_rank(config: str, steps: int, repeats: int, tokens: int) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.layout import Layout, MeshShape
    from lightning_hotspa.models import LlamaLM
    from lightning_hotspa.plan import RankPlan, RankStage

    rank = dist.get_rank()
    as_launched_ranks()
    layouts = [Layout(dp=4), Layout(dp=2, tp=2)]
    mesh = MeshShape.for_layouts(layouts, WORLD)
    # dp4 comparisons: one micro-batch per rank per step; dp2xtp2: one per dp group (tp pairs share it)
    per_rank = _micro_batches(steps, WORLD, tokens)
    per_dp2 = _micro_batches(steps, 2, tokens)

    def plans(layout, batches):
        dp_rank = mesh.rank_coords(layout, rank)[0]
        total = sum(m.num_target_tokens for m in batches)
        return RankPlan(0, (RankStage(layout, (batches[dp_rank],)),), total)

    runs = {
        "hotspa_dp4": lambda: (HotSPaStrategy(layouts, default_layout="dp4"),
                               [plans(Layout(dp=4), b) for b in per_rank], LlamaLM(config, seed=0, lr=1e-3)),
        "ddp": lambda: (DDPStrategy(), [b[rank] for b in per_rank], LlamaLM(config, seed=0, lr=1e-3)),
        "hotspa_dp2xtp2": lambda: (HotSPaStrategy(layouts), [plans(Layout(dp=2, tp=2), b) for b in per_dp2],
                                   LlamaLM(config, seed=0, lr=1e-3)),
        "model_parallel_dp2xtp2": lambda: (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
                                           [b[mesh.rank_coords(Layout(dp=2, tp=2), rank)[0]] for b in per_dp2],
                                           model_parallel_llama(config, 0)),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    phases: dict[str, list] = {k: [] for k in runs}
    per_repeat: dict[str, list[float]] = {k: [] for k in runs}
    for repeat in range(repeats):
        order = list(runs.items())
        for name, make in order if repeat % 2 == 0 else order[::-1]:  # A B C D, D C B A, ...: pairs stay adjacent
            strategy, batches, model = make()
            timer = _StepTimer().callback
            trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                use_distributed_sampler=False, callbacks=[timer])
            trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None,
                                                                             collate_fn=lambda x: x))
            times[name] += timer.times[1:]  # the first step pays for warm-up
            phases[name] += timer.phases[1:]
            per_repeat[name].append(statistics.median(timer.times[1:]))
    tokens_per_step = {"hotspa_dp4": WORLD * tokens, "ddp": WORLD * tokens,
                       "hotspa_dp2xtp2": 2 * tokens, "model_parallel_dp2xtp2": 2 * tokens}
    mean_phases = {k: {p: [statistics.mean(step[i][j] for step in v) for j in (0, 1)] for i, p in enumerate(PHASES)}
                   for k, v in phases.items()}
    return {"tokens_per_s": {k: tokens_per_step[k] / statistics.median(v) for k, v in times.items()},
            "phases": mean_phases, "per_repeat_s": per_repeat}


def _paired(per_repeat: dict[str, list[float]], ours: str, theirs: str) -> dict:
    """Throughput ratio within each repeat (the two runs were adjacent in time, so they saw about
    the same machine load), and the median over repeats."""
    ratios = [t / o for o, t in zip(per_repeat[ours], per_repeat[theirs])]
    return {"per_repeat": [round(r, 3) for r in ratios], "median": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1 or args.tokens < 1:
        raise SystemExit(f"--steps >= 2 (the first is warm-up), --repeats >= 1 and --tokens >= 1, got {args.steps}, "
                         f"{args.repeats}, {args.tokens}")
    ranks = run_on_ranks(bench_rank, WORLD, args.model, args.steps, args.repeats, args.tokens, timeout_s=3000)
    result = ranks[0]["tokens_per_s"]
    # per phase [wall s, cpu s] per step, mean over ranks; cpu_s: the whole step's CPU seconds per rank
    phases = {k: {p: [round(statistics.mean(r["phases"][k][p][j] for r in ranks), 3) for j in (0, 1)]
                  for p in PHASES} for k in result}
    cpu = {k: round(sum(v[1] for v in phases[k].values()), 3) for k in result}
    out = {"world": WORLD, "model": args.model, "tokens_per_micro_batch": args.tokens, "steps": args.steps,
           "repeats": args.repeats, "tokens_per_s": result,
           "dp4_vs_ddp": result["hotspa_dp4"] / result["ddp"],
           "dp2xtp2_vs_model_parallel": result["hotspa_dp2xtp2"] / result["model_parallel_dp2xtp2"],
           "dp4_vs_ddp_paired": _paired(ranks[0]["per_repeat_s"], "hotspa_dp4", "ddp"),
           "dp2xtp2_vs_model_parallel_paired": _paired(ranks[0]["per_repeat_s"], "hotspa_dp2xtp2",
                                                       "model_parallel_dp2xtp2"),
           "phases_wall_cpu_s": phases, "cpu_s_per_step": cpu,
           "dp4_vs_ddp_cpu": cpu["ddp"] / cpu["hotspa_dp4"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
