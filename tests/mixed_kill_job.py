"""A 4-rank job for tests/e2e/test_mixed_kill.py, run as a subprocess: rank 1 SIGKILLs itself inside a
mixed-cp round (issue 31) and the others must fail with a ``CollectiveError`` naming the group.

The parent imports torch and Lightning once, builds the planner-made mixed plan of
``helpers.MIXED_BATCHES[0]`` and forks the ranks (torchrun-style environment, so
Lightning sees external processes). Each trains on it with ``HotSPaStrategy`` and the default
process-group timeout (30 min): a survivor that fails before the job's deadline failed on the dead
peer's closed connection, not on a timeout. Rank 1 kills itself in the forward of the second
transformer block of its second round of the mixed stage (its cp2 block's partner is rank 0; ranks
2 and 3 compute at cp1 beside it).

    python tests/mixed_kill_job.py OUT_DIR [--deadline S] [--modes mixed,blocks,tp,pp]

``--modes``: the jobs to run one after the other from this one parent (one import of torch, Lightning
and tests/helpers.py), each into OUT_DIR/<mode>; default ``mixed``.

``blocks``: the block stage of ``helpers.block_plans(4)[2]`` instead (issue 38): rank 1 dies in
its second micro-batch of its sharded Ulysses cp2 block {0, 1}; rank 0 fails inside that block,
ranks 2 and 3 (replicated dp blocks of their own) in the stage's joint exchange.

``tp``: a switching plan (dp4, then tp4: issue 52) where rank 1 dies in the middle of a tp-overlap
ring (after the first step of a row-parallel layer's matmul + reduce-scatter in its tp4 stage); the
others fail inside that ring, naming the tp group.

``pp``: a switching plan (dp4, then dp2xpp2: issue 56) where rank 1 (the first pipeline stage of pp
group {1, 3}) dies entering a transformer layer inside torch's pipeline schedule; rank 3 fails in the
schedule's point-to-point, ranks 0 and 2 (the other pp group) in the stage's gradient reduction.

writes OUT_DIR/<mode>/job.json (exit codes, who hung, the kill's breadcrumb) and
OUT_DIR/<mode>/rank<r>.log.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # tests/helpers.py (the plans it reuses)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from helpers import BLOCK_LAYOUTS, PAIR_4, block_plans, planner_mixed_plans, rank_plans  # noqa: E402

import lightning_hotspa  # noqa: E402, F401
from lightning_hotspa import HotSPaStrategy  # noqa: E402
from lightning_hotspa.layout import Layout  # noqa: E402
from lightning_hotspa.models import LlamaLM  # noqa: E402
from lightning_hotspa.plan import StepPlan  # noqa: E402
from lightning_hotspa.testing.forked_ranks import free_port, run_forked_ranks  # noqa: E402

WORLD = 4


def install_kill(model: LlamaLM, strategy: HotSPaStrategy, stage: int, out: Path) -> None:
    """Rank 1 dies entering the second transformer block in round 2 of stage ``stage``."""
    tracker = strategy.tracker

    def die(module, args):
        if tracker.stage == stage and tracker.micro_batch == 1:
            (out / "kill.json").write_text(json.dumps({"where": tracker.describe()}))
            os.kill(os.getpid(), signal.SIGKILL)

    model.model.layers[1].register_forward_pre_hook(die)


def install_ring_kill(strategy: HotSPaStrategy, out: Path) -> None:
    """Rank 1 dies between two steps of a tp-overlap ring (its first step's partial sum sent)."""
    from lightning_hotspa import group_collectives

    tracker, ring = strategy.tracker, group_collectives.GlooCollectives.matmul_reduce_scatter

    def dying(self, lefts, rights):
        if self.size == WORLD and tracker.micro_batch == 1:
            send = group_collectives.dist.isend

            def isend_then_die(*args, **kwargs):
                work = send(*args, **kwargs)
                work.wait()
                (out / "kill.json").write_text(json.dumps({"where": tracker.describe()}))
                os.kill(os.getpid(), signal.SIGKILL)

            group_collectives.dist.isend = isend_then_die
        return ring(self, lefts, rights)

    group_collectives.GlooCollectives.matmul_reduce_scatter = dying


def tp_plan() -> tuple[StepPlan, list[str]]:
    """dp4 then tp4 over 8 documents, each dp group's share in two micro-batches."""
    from helpers import dealt_stage

    lengths = (40, 33, 57, 21, 64, 18, 45, 30)
    return StepPlan(0, lengths, (dealt_stage("dp4", [0, 1, 2, 3]), dealt_stage("tp4", [4, 5, 6, 7]))), ["dp4", "tp4"]


def install_pp_kill(model: LlamaLM, strategy: HotSPaStrategy, out: Path) -> None:
    """Rank 1 dies entering any transformer layer in the pp stage (the plan's second)."""
    tracker = strategy.tracker

    def die(module, args):
        if tracker.stage == 1:
            (out / "kill.json").write_text(json.dumps({"where": tracker.describe()}))
            os.kill(os.getpid(), signal.SIGKILL)

    for layer in model.model.layers:
        layer.register_forward_pre_hook(die)


def pp_plan() -> tuple[StepPlan, list[str]]:
    """dp4 then dp2xpp2 over 8 documents, two one-document micro-batches per dp group in the pp stage."""
    from helpers import dealt_stage

    from lightning_hotspa.plan import Stage

    lengths = (40, 33, 57, 21, 64, 18, 45, 30)
    pp = Stage(Layout.parse("dp2xpp2"), (((4,), (6,)), ((5,), (7,))))
    return StepPlan(0, lengths, (dealt_stage("dp4", [0, 1, 2, 3]), pp)), ["dp4", "dp2xpp2"]


def rank_main(rank: int, port: int, out: Path, blocks: bool = False, tp: bool = False, pp: bool = False) -> None:
    log = (out / f"rank{rank}.log").open("w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    if tp or pp:
        plan, layouts = tp_plan() if tp else pp_plan()
    else:
        plan, layouts = (block_plans(WORLD)[2], BLOCK_LAYOUTS[WORLD]) if blocks else (planner_mixed_plans()[0], PAIR_4)
        stage = next(k for k, s in enumerate(plan.stages) if s.blocks)
    batches = rank_plans([plan], [Layout.parse(x) for x in layouts], rank)
    strategy = HotSPaStrategy(layouts)  # the default process-group timeout
    model = LlamaLM("tiny", seed=3, lr=2e-3)
    if rank == 1 and tp:
        install_ring_kill(strategy, out)
    elif rank == 1 and pp:
        install_pp_kill(model, strategy, out)
    elif rank == 1:
        install_kill(model, strategy, stage, out)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, default_root_dir=str(out))
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None,
                                                                     collate_fn=lambda x: x))
    print(f"job: rank {rank} finished", flush=True)


MODES = ("mixed", "blocks", "tp", "pp")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--deadline", type=float, default=300.0, help="kill a job's ranks still running after this")
    parser.add_argument("--modes", default="mixed",
                        help="comma list of: mixed (a mixed-cp round), blocks (the block stage of test_blocks, "
                             "issue 38), tp (a tp4 stage, killed inside a tp-overlap ring, issue 52), pp (a dp2xpp2 "
                             "stage, killed inside the pipeline schedule, issue 56)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise SystemExit(f"--modes: unknown {unknown or 'empty'}; choose from {list(MODES)}")
    for mode in modes:
        out = Path(args.out) / mode
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        job = functools.partial(rank_main, port=port, out=out, blocks=mode == "blocks", tp=mode == "tp",
                                pp=mode == "pp")
        ended = run_forked_ranks(WORLD, job, args.deadline)
        kill = out / "kill.json"
        (out / "job.json").write_text(json.dumps({"exit_codes": ended.codes, "hung": ended.hung,
                                                  "kill": json.loads(kill.read_text()) if kill.exists() else None}))


if __name__ == "__main__":
    main()
