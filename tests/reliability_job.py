"""A 4-rank training job for the crash tests (tests/e2e/test_reliability.py), run as a subprocess.

The parent imports torch and Lightning once, then forks the ranks (cheap on a loaded 2-core machine),
each with torchrun-style environment variables, so Lightning sees externally created processes. Each
rank trains a tiny LlamaLM on HotSPaDataModule step plans with HotSPaStrategy and a ModelCheckpoint
every ``--every`` steps for one epoch (one pass over the data), records what it trained on, and may
be told to SIGKILL itself (rank 1) at a given global step and phase. This file, not the product, does the killing.

    python tests/reliability_job.py JOBS.json [--timeout S] [--deadline S]

runs the listed jobs one after another ({"out", "ckpt", "every", "resume", "hang_timeout", "kill": "switch:2"
| "stage:4" | "checkpoint:6" | "hang:0"}), each forked from one process that imported everything once.
Every job sets up under the generous ``--timeout``; in a "hang" job every rank meets at a barrier at
the start of the hang step and only then shortens its groups' timeout to ``hang_timeout``, so the
short timeout covers the hang and nothing a loaded machine may make slow (rendezvous, set-up). A job writes
OUT_DIR/job.json (per-rank exit codes and exit times, the kill time), OUT_DIR/rank<r>.log,
OUT_DIR/record<r>.jsonl (per optimizer step: data position and target-token histogram) and, when the
fit finishes, OUT_DIR/weights.pt (rank 0, full tensors).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lightning_hotspa  # noqa: E402, F401
from lightning_hotspa import HotSPaStrategy  # noqa: E402
from lightning_hotspa.adapter.checkpoints.dcp_state import latest_checkpoint  # noqa: E402
from lightning_hotspa.data import HotSPaDataModule  # noqa: E402
from lightning_hotspa.data.sources import SyntheticSource  # noqa: E402
from lightning_hotspa.models import LlamaLM  # noqa: E402
from lightning_hotspa.testing.forked_ranks import free_port, run_forked_ranks  # noqa: E402

WORLD = 4
T0 = 0.0
LAYOUTS = ["dp4", "dp2xtp2", "tp2xcp2"]
TOKENS_PER_RANK = 32  # buckets: (0, 32] dp4, (32, 64] dp2xtp2, (64, 128] tp2xcp2
CONTEXT = 128
NUM_DOCS = 36
TOKENS_PER_BATCH = 512
VOCAB = 256


def source() -> SyntheticSource:
    """Byte documents of 2..128 tokens: steps mix the three buckets."""
    return SyntheticSource(NUM_DOCS, kind="uniform", seed=7, params={"low": 2, "high": CONTEXT})


class Recorder(Callback):
    """Per optimizer step: the data position and this rank's share of the target tokens (the ranks
    with tp coordinate 0 of each stage; cp ranks hold disjoint chunks), flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        counts = torch.zeros(VOCAB, dtype=torch.int64)
        for stage in batch.stages:
            _, tp_rank, _ = strategy.mesh_shape.rank_coords(stage.layout, trainer.global_rank)
            if tp_rank == 0:
                for mb in stage.micro_batches:
                    labels = mb.labels[mb.labels >= 0]
                    counts += torch.bincount(labels, minlength=VOCAB)[:VOCAB]
        print(f"job: {time.time() - T0:.1f}s step {trainer.global_step}", flush=True)
        record = {"global_step": trainer.global_step, "epoch": batch.extras["epoch"], "step": batch.extras["step"],
                  "stages": [str(s.layout) for s in batch.stages], "counts": counts.tolist()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def install_kill(kind: str, at_step: int, strategy: HotSPaStrategy, out: Path) -> None:
    """Rank 1 SIGKILLs itself at global step ``at_step``: in a switch of the step's second stage, in
    a later micro-batch's forward, or in the middle of the distributed checkpoint write (its shards
    written, the checkpoint not yet complete); or ("hang") stops answering in that micro-batch."""
    tracker = strategy.tracker

    def die(where: str) -> None:
        (out / "kill.json").write_text(json.dumps({"time": time.time(), "where": where}))
        if kind == "hang":
            time.sleep(3600)  # alive but silent: the others must give up after the process-group timeout
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "switch":
        from lightning_hotspa.engine.switch import SwitchEngine

        real = SwitchEngine.switch

        def switch(self, layout, **kwargs):
            if tracker.step == at_step and tracker.stage >= 1:
                die(tracker.describe())
            return real(self, layout, **kwargs)

        SwitchEngine.switch = switch
    elif kind in ("stage", "hang"):
        real_step = LlamaLM.training_step

        def training_step(self, batch, batch_idx=0):
            if tracker.step == at_step and (tracker.micro_batch >= 1 or tracker.stage >= 1):
                die(tracker.describe())
            return real_step(self, batch, batch_idx)

        LlamaLM.training_step = training_step
    elif kind == "checkpoint":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        real_write = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            written = real_write(self, plan, planner)
            if strategy.lightning_module.trainer.global_step == at_step:
                written.wait()  # this rank's shards are on disk; DCP's .metadata and meta.pt are not
                die(f"after writing its shards of the step-{at_step} checkpoint")
            return written

        FileSystemWriter.write_data = write_data
    else:
        raise SystemExit(f"unknown kill kind {kind!r}")


class ShortTimeoutAt(Callback):
    """At the start of global step ``step``, after a barrier every rank meets (under the set-up
    timeout), set every process group of this rank to ``seconds``: the hang job's short timeout
    starts only once all ranks are in step, whatever the load was before."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        dist.barrier()
        for group in list(c10d._world.pg_map):
            c10d._set_pg_timeout(datetime.timedelta(seconds=self.seconds), group)
        print(f"job: {time.time() - T0:.1f}s process-group timeouts now {self.seconds}s", flush=True)


def rank_main(rank: int, args: argparse.Namespace) -> None:
    global T0
    T0 = time.time()
    out, ckpt_dir = Path(args.out), Path(args.ckpt_dir)
    log = (out / f"rank{rank}.log").open("w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port)})
    torch.set_num_threads(1)
    strategy = HotSPaStrategy(LAYOUTS, tokens_per_rank=TOKENS_PER_RANK,
                              timeout=datetime.timedelta(seconds=args.timeout))
    if args.kill and rank == 1:
        kind, step = args.kill.split(":")
        install_kill(kind, int(step), strategy, out)
    callbacks: list[Callback] = [Recorder(out / f"record{rank}.jsonl")]
    if args.kill and args.kill.startswith("hang"):
        callbacks.append(ShortTimeoutAt(int(args.kill.split(":")[1]), args.hang_timeout))
    if args.every:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.every, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, default_root_dir=str(out),
                        enable_checkpointing=bool(args.every),
                        callbacks=callbacks)
    model = LlamaLM("tiny", seed=3, lr=3e-3, warmup_steps=2, max_steps=20)
    data = HotSPaDataModule(source(), tokens_per_batch=TOKENS_PER_BATCH, context_length=CONTEXT, seed=11,
                            use_cache=False)
    ckpt_path = None
    if args.resume:
        ckpt_path = latest_checkpoint(ckpt_dir)
        print(f"job: latest complete checkpoint: {ckpt_path}", flush=True)
    print(f"job: {time.time() - T0:.1f}s fit", flush=True)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    print(f"job: {time.time() - T0:.1f}s fit done", flush=True)
    weights = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"weights": weights, "global_step": trainer.global_step,
                    "batches_per_epoch": data.batches_per_epoch}, out / "weights.pt")
    print(f"job: rank {rank} finished at global step {trainer.global_step}", flush=True)


def launch(job: dict, timeout_s: float, deadline_s: float) -> None:
    """One job: fork the ranks, wait (killing any rank still alive at the deadline), write job.json."""
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(out=str(out), ckpt_dir=job["ckpt"], every=job.get("every", 2),
                              resume=job.get("resume", False), kill=job.get("kill"), timeout=timeout_s,
                              hang_timeout=job.get("hang_timeout", timeout_s), port=free_port())
    hanging = 1 if str(job.get("kill")).startswith("hang") else None
    start = time.time()
    ended = run_forked_ranks(WORLD, lambda rank: rank_main(rank, args), deadline_s, end_if_alone=hanging)
    codes, times, hung = ended.codes, ended.times, ended.hung
    kill_file = out / "kill.json"
    kill = json.loads(kill_file.read_text()) if kill_file.exists() else None
    ckpt = Path(job["ckpt"])
    report = {"exit_codes": codes, "exit_times": times, "hung": hung, "start": start, "kill": kill,
              "wall_s": time.time() - start, "checkpoints": sorted(os.listdir(ckpt)) if ckpt.is_dir() else [],
              "tmp_contents": sorted(n for d in ckpt.glob("*.tmp") for n in os.listdir(d)) if ckpt.is_dir() else []}
    (out / "job.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs", help="a JSON list of jobs: {out, ckpt, every, resume, kill, hang_timeout}, in order")
    parser.add_argument("--timeout", type=float, default=30.0, help="process-group timeout, seconds")
    parser.add_argument("--deadline", type=float, default=150.0, help="kill a job's ranks after this many seconds")
    args = parser.parse_args()
    for job in json.loads(Path(args.jobs).read_text()):
        pid = os.fork()  # each job starts from this clean, already-imported process
        if pid == 0:
            try:
                launch(job, args.timeout, args.deadline)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
