"""Test-only pieces for tests/e2e/test_multinode.py: a callback that records what each step trained
on, and a driver that runs ``recipes/train.py``'s ``train(cfg)`` on forked ranks posing as
``nodes x per_node`` torchrun workers (cheap: torch, Lightning and Hydra are imported once).

    python tests/multinode_job.py JOBS.json

runs each job ({"out", "nodes", "per_node", "overrides", "deadline"}) in order; a job writes
OUT/job.json (per-rank exit codes), OUT/rank<r>.log and, through :class:`Recorder` (added to the
config), OUT/record<r>.jsonl and OUT/weights.pt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_hotspa.testing.forked_ranks import free_port, run_forked_ranks  # noqa: E402


class Recorder(Callback):
    """Per optimizer step and rank: the step loss, the chunks this rank trained on (ranks with
    tp and cp coordinate 0 of each stage: every micro-batch counted once) and its target tokens
    (tp coordinate 0: cp ranks hold disjoint chunks); at the end, rank 0 saves the full weights.

    ``pause_node`` / ``pause_at_step``: the ranks of that node stop at the start of that global step
    (the previous step's checkpoint committed everywhere), write ``OUT/paused<rank>.json`` and wait
    to be killed, so the test kills the node at a known point however slowly it reacts."""

    def __init__(self, out: str, pause_node: int | None = None, pause_at_step: int | None = None,
                 pause_limit_s: float = 600.0) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rank = int(os.environ.get("RANK", "0"))
        self.pause_node, self.pause_at_step, self.pause_limit_s = pause_node, pause_at_step, pause_limit_s

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.node_rank != self.pause_node or trainer.global_step != self.pause_at_step:
            return
        (self.out / f"paused{self.rank}.json").write_text(json.dumps({"time": time.time()}))
        end = time.monotonic() + self.pause_limit_s
        while time.monotonic() < end:  # the test SIGKILLs this node; nothing else ends the wait
            time.sleep(0.1)
        raise RuntimeError(f"rank {self.rank} paused at global step {self.pause_at_step} was not killed within "
                           f"{self.pause_limit_s:.0f} s")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        shape = trainer.strategy.mesh_shape
        # micro-batches name documents by their index in the step's mini-batch: map them to the
        # corpus chunks (document, start, length) the data module drew for (epoch, step)
        refs = trainer.train_dataloader.dataset.minibatch(batch.extras["epoch"], batch.extras["step"])
        docs, tokens = [], 0
        for stage in batch.stages:
            _, tp, cp = shape.rank_coords(stage.layout, trainer.global_rank)
            for mb in stage.micro_batches:
                if tp == 0:
                    tokens += int((mb.labels >= 0).sum())
                if tp == 0 and cp == 0:
                    docs.extend([refs[d].doc, refs[d].start, refs[d].length] for d in mb.doc_ids)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        record = {"global_step": trainer.global_step, "loss": float(loss), "docs": docs, "tokens": tokens,
                  "position": {k: batch.extras.get(k) for k in ("epoch", "step")}}
        with (self.out / f"record{self.rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_exception(self, trainer, pl_module, exception):
        """When and what this rank raised (a killed peer: the survivors' CollectiveError)."""
        text = f"{type(exception).__name__}: {exception}"
        (self.out / f"error{self.rank}.json").write_text(json.dumps({"time": time.time(), "error": text}))

    def on_train_end(self, trainer, pl_module):
        weights = {n: p.detach().full_tensor().clone() for n, p in pl_module.named_parameters()}
        if trainer.global_rank == 0:
            torch.save({"weights": weights, "global_step": trainer.global_step}, self.out / "weights.pt")


def rank_main(job: dict, rank: int, port: int) -> None:
    from hydra import compose, initialize_config_dir

    from lightning_hotspa.adapter.recipes.hydra_recipe import CONFIG_DIR, register_resolvers, train

    out = Path(job["out"])
    log = (out / f"rank{rank}.log").open("w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    per_node = job["per_node"]
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "GROUP_RANK": str(rank // per_node),
                       "NODE_RANK": str(rank // per_node), "LOCAL_WORLD_SIZE": str(per_node),
                       "WORLD_SIZE": str(per_node * job["nodes"]), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    register_resolvers()
    overrides = list(job["overrides"]) + [
        f"trainer.num_nodes={job['nodes']}", f"trainer.devices={per_node}", f"output_dir={out}", "run_name=job",
        "+callbacks.recorder._target_=multinode_job.Recorder", f"+callbacks.recorder.out={out}"]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    status = train(cfg)
    print(f"job: rank {rank} done, status {status}", flush=True)


def launch(job: dict) -> None:
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    world = job["nodes"] * job["per_node"]
    port, start = free_port(), time.time()
    ended = run_forked_ranks(world, lambda rank: rank_main(job, rank, port), job.get("deadline", 240))
    codes, hung = ended.codes, ended.hung
    (out / "job.json").write_text(json.dumps({"exit_codes": codes, "hung": hung, "wall_s": time.time() - start}))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # multinode_job.Recorder for Hydra
    import lightning  # noqa: F401 - imported once, before the forks

    import lightning_hotspa.adapter.recipes.hydra_recipe  # noqa: F401
    import lightning_hotspa.models  # noqa: F401

    for job in json.loads(Path(sys.argv[1]).read_text()):
        pid = os.fork()  # each job starts from this clean, already-imported process
        if pid == 0:
            try:
                launch(job)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
