"""Crash and resume, atomic checkpoints, non-finite losses and breadcrumbs.

The crash tests run real 4-rank jobs (tests/reliability_job.py) as subprocesses, because a killed
rank takes a RankPool down with it. One chain of jobs covers all three crashes:

    uninterrupted: one epoch (one pass over the data: 6 steps)
    job 1: a checkpoint every step; rank 1 SIGKILLs itself in the switch into the 2nd stage of global
           step 1 (tp2xcp2 -> dp4: an all-gather over the tp groups)                 -> last ckpt: step 1
    job 2: resumes at 1, checkpoints every 2 steps; rank 1 dies in the middle of writing the step-4
           checkpoint                                                                 -> last ckpt: step 2
    job 3: resumes at 2 (skipping the broken step-4 save); rank 1 dies in a micro-batch of global step 2
    job 4: resumes at 2 and finishes the epoch

and the final weights and the tokens trained on must equal the uninterrupted run's.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "reliability_job.py"
# the strategy's process-group timeout in the jobs: it also bounds the rendezvous and set-up, where the
# ranks of a loaded machine may arrive seconds apart; a killed rank's peers fail at once anyway (its
# sockets close), so no test waits it out
PG_TIMEOUT_S = 60.0
# the job where rank 1 hangs: every rank meets at a barrier at the start of the hang step and only then
# sets this timeout (tests/reliability_job.py, ShortTimeoutAt), so a slow set-up cannot hit it
HANG_TIMEOUT_S = 10.0
TIMINGS: dict[str, float] = {}
# the chain's jobs run inside its first test: a few minutes on a loaded machine; the bound only stops a hang
pytestmark = pytest.mark.timeout(1200)


def run_jobs(base: Path, jobs: dict[str, dict], deadline_s: float = 150.0) -> dict[str, dict]:
    """Runs the 4-rank jobs in order from one subprocess (one import of torch and Lightning); its
    whole process group is killed afterwards, so no rank can outlive the test."""
    spec = [{"out": str(base / name), **job} for name, job in jobs.items()]
    (base / "jobs.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(JOB), str(base / "jobs.json"), "--timeout", str(PG_TIMEOUT_S),
           "--deadline", str(deadline_s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=deadline_s * len(jobs) + 60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    TIMINGS["all jobs"] = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    TIMINGS["all jobs, CPU"] = usage.ru_utime + usage.ru_stime  # the runner and every rank it forked
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    reports = {}
    for name in jobs:
        out = base / name
        report = json.loads((out / "job.json").read_text())
        report["logs"] = {r: (out / f"rank{r}.log").read_text(errors="replace") for r in range(4)}
        report["records"] = {r: [json.loads(x) for x in (out / f"record{r}.jsonl").read_text().splitlines()]
                             for r in range(4) if (out / f"record{r}.jsonl").exists()}
        report["exit_codes"] = {int(k): v for k, v in report["exit_codes"].items()}
        report["exit_times"] = {int(k): v for k, v in report["exit_times"].items()}
        TIMINGS[name] = report["wall_s"]
        reports[name] = report
    return reports


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    ckpt = str(base / "ckpt")
    jobs = run_jobs(base, {
        "uninterrupted": {"ckpt": str(base / "unused"), "every": 0},
        "switch": {"ckpt": ckpt, "every": 1, "kill": "switch:1"},
        "checkpoint": {"ckpt": ckpt, "resume": True, "kill": "checkpoint:4"},
        "stage": {"ckpt": ckpt, "resume": True, "kill": "stage:2"},
        "final": {"ckpt": ckpt, "resume": True, "every": 0},
        "hang": {"ckpt": str(base / "unused"), "every": 0, "kill": "hang:0", "hang_timeout": HANG_TIMEOUT_S},
    })
    jobs["base"] = base
    yield jobs
    print(f"\ncrash-test jobs (s, after imports): {', '.join(f'{k} {v:.1f}' for k, v in TIMINGS.items())}")


def _assert_crashed_cleanly(job: dict, step: int, timed_out: bool = False) -> list[str]:
    """Rank 1 was SIGKILLed; every other rank exited non-zero before the job's deadline with an error
    naming where it was: a closed connection (``timed_out`` False: it failed because rank 1 died, not
    by waiting out the collective timeout) or a timeout (True: rank 1 hung; a rank waiting only on
    survivors may see the closed connection of one that timed out first). Returns the error lines."""
    assert job["kill"] is not None, "rank 1 never reached its kill point"
    assert job["hung"] == [], f"ranks {job['hung']} were still running at the deadline"
    assert job["exit_codes"][1] == -signal.SIGKILL
    lines = []
    for rank in (0, 2, 3):
        log = job["logs"][rank]
        assert job["exit_codes"][rank] != 0, f"rank {rank} exited 0 after rank 1 died:\n{log[-2000:]}"
        error = [x for x in log.splitlines() if "CollectiveError:" in x]
        assert error, f"rank {rank} failed without naming where it was:\n{log[-3000:]}"
        assert f"rank {rank}, " in error[-1] and f"global step {step}" in error[-1], error[-1]
        said = error[-1].lower()
        if timed_out:  # its own timeout, or a peer that timed out first and closed its connections (a rank
            # waiting in a group without rank 1, e.g. ranks [0, 2], sees that peer's exit, not rank 1's hang)
            assert "timed out" in said or "connection closed" in said, error[-1]
        else:
            assert "timed out" not in said, error[-1]
        lines.append(error[-1])
    if timed_out:  # the first to give up waited out the timeout
        assert any("timed out" in x.lower() for x in lines), lines
    return lines


def test_killed_rank_during_a_switch_fails_the_others_fast_with_their_breadcrumb(chain):
    job = chain["switch"]
    lines = _assert_crashed_cleanly(job, step=1)
    where = job["kill"]["where"]  # e.g. "rank 1, global step 2 (batch 2), stage 2/2 (layout dp2xtp2, ..."
    assert "phase switch" in where and "stage 2/2" in where
    stage = where[where.index("stage 2/2"):where.index(",", where.index("(layout"))]
    # some rank that shares a group with rank 1 was waiting in that same switch
    assert any(stage in x and "phase switch" in x for x in lines), (stage, lines)


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(chain):
    job = chain["checkpoint"]
    lines = _assert_crashed_cleanly(job, step=4)
    assert any("phase checkpoint save to" in x and "epoch=0-step=4.ckpt" in x for x in lines), lines
    assert "resuming from" in job["logs"][0] and "epoch=0-step=1.ckpt" in job["logs"][0]
    names = job["checkpoints"]  # right after this job
    assert "epoch=0-step=2.ckpt" in names and "epoch=0-step=4.ckpt" not in names, names
    assert "epoch=0-step=4.ckpt.tmp" in names, names  # what the interrupted save left behind
    assert "its shards" in job["kill"]["where"]
    left = job["tmp_contents"]
    assert any(n.endswith(".distcp") for n in left) and ".metadata" not in left and "meta.pt" not in left, left


def test_resume_picks_the_last_complete_checkpoint_and_says_which(chain):
    log = chain["stage"]["logs"][0]
    assert "skipping checkpoint folder(s)" in log, log[-3000:]
    assert "epoch=0-step=4.ckpt.tmp (an interrupted save)" in log, log[-3000:]
    assert "hotspa: resuming from" in log and "epoch=0-step=2.ckpt (epoch 0, global step 2" in log, log[-3000:]


def test_killed_rank_during_a_stage_fails_the_others_fast(chain):
    job = chain["stage"]
    lines = _assert_crashed_cleanly(job, step=2)
    assert "phase forward-backward" in job["kill"]["where"]
    assert any("stage " in x for x in lines), lines


def test_a_hung_rank_makes_the_others_time_out_with_their_breadcrumb(chain):
    job = chain["hang"]
    # they wait out the (short) process-group timeout, then fail naming where they were
    _assert_crashed_cleanly(job, step=0, timed_out=True)
    assert "process-group timeouts now" in job["logs"][0]  # the short timeout began once all ranks were in step
    # rank 1 stayed alive and silent until every other rank had given up (then the job runner ended it)
    assert all(job["exit_times"][1] >= job["exit_times"][r] for r in (0, 2, 3)), job["exit_times"]


def _trained(records: dict, upto: int | None = None) -> dict[int, dict]:
    """global step -> (data position, target-token histogram summed over ranks), for steps <= upto."""
    out: dict[int, dict] = {}
    for rows in records.values():
        for row in rows:
            step = row["global_step"]
            if upto is not None and step > upto:
                continue
            entry = out.setdefault(step, {"position": (row["epoch"], row["step"]), "counts": [0] * len(row["counts"])})
            assert entry["position"] == (row["epoch"], row["step"])
            entry["counts"] = [a + b for a, b in zip(entry["counts"], row["counts"])]
    return out


def _corpus_targets() -> list[int]:
    """Every next-token target of one pass over the data, straight from the source (byte tokens)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from reliability_job import source

    counts = [0] * 256
    for _, text in source():
        for b in bytes(text)[1:]:
            counts[b] += 1
    return counts


def test_resumed_run_equals_the_uninterrupted_one(chain):
    ref = torch.load(chain["base"] / "uninterrupted" / "weights.pt")
    final = torch.load(chain["base"] / "final" / "weights.pt")
    assert ref["global_step"] == final["global_step"] == ref["batches_per_epoch"] == 6
    worst = max(float((final["weights"][n] - w).abs().max()) for n, w in ref["weights"].items())
    assert worst == 0.0, f"resumed weights differ from the uninterrupted run by up to {worst}"
    # the updates in the final weights: job 1's up to its step-1 checkpoint, job 2's up to step 2, job 4's
    ours = {**_trained(chain["switch"]["records"], 1), **_trained(chain["checkpoint"]["records"], 2),
            **_trained(chain["final"]["records"])}
    theirs = _trained(chain["uninterrupted"]["records"])
    assert sorted(ours) == sorted(theirs) == list(range(1, 7))
    for step in theirs:  # same data order: the same mini-batch at every step
        assert ours[step] == theirs[step], step
    # nothing lost, nothing seen twice: the epoch's targets are exactly the corpus's, once each
    total = [sum(ours[s]["counts"][t] for s in ours) for t in range(256)]
    assert total == _corpus_targets()
    assert collections.Counter(r["global_step"] for r in chain["final"]["records"][0]) == {3: 1, 4: 1, 5: 1, 6: 1}


# ---------------------------------------------------------------------------------------- non-finite losses
NF_LAYOUTS = ["dp4", "dp2xtp2", "tp2xcp2"]
NF_LENGTHS = [[7, 30, 12, 5, 64, 9, 3, 40, 17, 25, 11, 50, 8, 33],
              [20, 4, 44, 13, 6, 70, 15, 9, 31, 2, 27, 18],
              [60, 10, 21, 35, 5, 14, 48, 26, 7, 19, 3, 38, 12]]


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def nonfinite_phase(policy: str | None, value: float | None, steps: list[int]) -> dict:
    """Fits the mixed plans ``steps`` in order; rank 2 turns the loss of its first micro-batch after
    the first stage of global step 1 into ``value`` (None: a clean run)."""
    import lightning as L
    import torch.distributed as dist
    from helpers import lightning_rank_env, mixed_plan, rank_plans
    from lightning.pytorch.callbacks import Callback

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.models import LlamaLM

    poisoned: list[str] = []

    class Poisoned(LlamaLM):
        def training_step(self, batch, batch_idx=0):
            loss = super().training_step(batch, batch_idx)
            tracker = self.trainer.strategy.tracker
            if value is not None and not poisoned and dist.get_rank() == 2 and tracker.step == 1 and tracker.stage >= 1:
                poisoned.append(tracker.describe())
                loss = loss * value
            return loss

    after: list[dict] = []

    class AfterFirst(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                after.append(_full_weights(pl_module))

    layouts = [Layout.parse(x) for x in NF_LAYOUTS]
    plans = [mixed_plan(s, NF_LENGTHS[s], layouts) for s in steps]
    batches = rank_plans(plans, layouts, dist.get_rank())
    kwargs = {} if policy is None else {"nonfinite": policy}
    strategy = HotSPaStrategy(NF_LAYOUTS, **kwargs)
    model = Poisoned("tiny", seed=3, lr=2e-3)
    error = None
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=len(steps), logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, callbacks=[AfterFirst()])
        try:
            trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None,
                                                                             collate_fn=lambda x: x))
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "poisoned": poisoned, "weights": _full_weights(model), "after_first": after,
            "global_step": trainer.global_step, "skipped": strategy.skipped_steps}


# each test fits twice on 4 ranks: a minute or two each on a loaded 2-core machine; the bounds only stop a hang
NF_FIT_TIMEOUT_S = 600.0


@pytest.mark.timeout(1500)
def test_nonfinite_loss_stops_every_rank_before_the_update_by_default(ranks):
    results = ranks(4).run(nonfinite_phase, None, float("nan"), [0, 1, 2], timeout_s=NF_FIT_TIMEOUT_S)
    clean = ranks(4).run(nonfinite_phase, "stop", None, [0, 2], timeout_s=NF_FIT_TIMEOUT_S)[0]
    where = results[2]["poisoned"][0]  # e.g. "rank 2, global step 1 (batch 1), stage 2/3 (layout dp2xtp2), ..."
    stage = where.split("stage ")[1].split("/")[0]
    layout = where.split("(layout ")[1].split(")")[0].split(",")[0]
    for r in results:  # every rank, the same verdict and the same report
        assert r["error"] is not None and r["error"].startswith("NonFiniteLossError: non-finite loss at step 1")
        assert f"rank 2 stage {stage} (layout {layout}" in r["error"] and "micro-batch 1: loss nan" in r["error"]
        assert "Plan: [stage 1 dp4" in r["error"] and "nonfinite='skip'" in r["error"]
        assert r["error"].split(". Plan:")[0] == results[0]["error"].split(". Plan:")[0]
        assert r["global_step"] == 1
    # nothing of step 1 reached the weights: they are those after step 0
    for n, w in clean["after_first"][0].items():
        assert torch.equal(results[0]["weights"][n], w), n


@pytest.mark.timeout(1500)
def test_nonfinite_loss_skip_policy_drops_only_that_update(ranks):
    results = ranks(4).run(nonfinite_phase, "skip", float("inf"), [0, 1, 2], timeout_s=NF_FIT_TIMEOUT_S)
    clean = ranks(4).run(nonfinite_phase, "skip", None, [0, 2], timeout_s=NF_FIT_TIMEOUT_S)[0]
    for r in results:
        assert r["error"] is None and r["global_step"] == 3
        assert [s["global_step"] for s in r["skipped"]] == [1]
        report = r["skipped"][0]["report"]
        assert "rank 2 stage" in report and "loss inf" in report and "Plan: [stage 1 dp4" in report
    # AdamW without a schedule: skipping step 1 leaves exactly the run over steps 0 and 2
    for n, w in clean["weights"].items():
        assert torch.equal(results[0]["weights"][n], w), n


# ---------------------------------------------------------------------------------------- single process
def test_breadcrumb_names_the_position_and_survives_in_its_file(tmp_path):
    from lightning_hotspa.adapter.lightning.reliability import StepTracker
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.plan import RankStage, pack_micro_batch

    tracker = StepTracker()
    tracker.rank = 3
    path = tracker.open_file(tmp_path, 3)
    mb = pack_micro_batch([torch.arange(5), torch.arange(3)])
    tracker.begin_step(7, 2, num_stages=2)
    tracker.enter_stage(RankStage(Layout(dp=2, tp=2), (mb, mb, mb), label="(256,512]"))
    assert path.read_text().startswith("rank 3, global step 7 (batch 2), stage 1/2 (layout dp2xtp2, bucket "
                                       "(256,512]), phase switch")
    tracker.enter_micro_batch()
    tracker.enter_micro_batch()
    assert "micro-batch 2/3, phase forward-backward" in path.read_text()
    tracker.enter_phase("reduce")
    assert path.read_text().rstrip().endswith("stage 1/2 (layout dp2xtp2, bucket (256,512]), phase reduce")
    tracker.enter_phase("optimizer")
    assert path.read_text().rstrip() == "rank 3, global step 7 (batch 2), phase optimizer"
    assert len(path.read_bytes()) == 400  # rewritten in place, never growing
    tracker.close_file()


def test_guard_wraps_failed_collectives_only():
    from lightning_hotspa.adapter.lightning.reliability import CollectiveError, StepTracker

    tracker = StepTracker()
    tracker.begin_step(4, 4, 1)
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(CollectiveError, match=r"a collective failed in a barrier at rank 0, global step 4") as info:
        with tracker.guard("a barrier"):
            raise gloo
    assert info.value.__cause__ is gloo and "Connection closed by peer" in str(info.value)
    with pytest.raises(ValueError, match="user bug"):  # not a collective: passes through untouched
        with tracker.guard():
            raise ValueError("user bug")
    with pytest.raises(CollectiveError) as outer:  # nested guards wrap once
        with tracker.guard(), tracker.guard():
            raise gloo
    assert outer.value.__cause__ is gloo


def test_nccl_flight_recorder_is_enabled_unless_the_user_chose():
    from lightning_hotspa.adapter.lightning.reliability import enable_nccl_flight_recorder

    env: dict[str, str] = {}
    assert enable_nccl_flight_recorder("nccl", env) and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert not enable_nccl_flight_recorder("nccl", mine) and mine == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    gloo: dict[str, str] = {}
    assert not enable_nccl_flight_recorder("gloo", gloo) and gloo == {}


def _save(path, value: float, step: int):
    from lightning_hotspa.adapter.checkpoints.dcp_state import save_distributed_checkpoint

    checkpoint = {"state_dict": {"w": torch.full((4,), value)}, "global_step": step}
    save_distributed_checkpoint(checkpoint, path, is_rank_zero=True, barrier=lambda: None)


def _load(path) -> float:
    from lightning_hotspa.adapter.checkpoints.dcp_state import load_distributed_checkpoint

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(4))
    meta = load_distributed_checkpoint(path, module, [])
    return float(module.w.detach()[0]), meta["global_step"]


def test_interrupted_saves_leave_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from lightning_hotspa.adapter.checkpoints import dcp_state as ck

    _save(tmp_path / "step=2", 2.0, 2)
    # 1) a new checkpoint dies while DCP writes its shards
    real_save = dcp.save

    def dying_save(state, *, storage_writer):
        (ck.Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path / "step=4", 4.0, 4)
    monkeypatch.setattr(dcp, "save", real_save)
    assert (tmp_path / "step=4.tmp").is_dir() and not (tmp_path / "step=4").exists()
    assert ck.latest_checkpoint(tmp_path).name == "step=2" and _load(ck.latest_checkpoint(tmp_path)) == (2.0, 2)
    with pytest.raises(ck.CheckpointError, match=r"step=4.tmp' ends in '.tmp'"):
        _save(tmp_path / "step=4.tmp", 4.0, 4)
    # 2) overwriting step=2 in place dies between moving the old one aside and moving the new one in
    real_replace = ck.os.replace
    calls = []

    def dying_replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path / "step=2", 3.0, 3)
    monkeypatch.setattr(ck.os, "replace", real_replace)
    assert not (tmp_path / "step=2").exists() and (tmp_path / "step=2.old").is_dir()
    assert _load(tmp_path / "step=2") == (2.0, 2)  # resolved to the intact .old
    assert ck.latest_checkpoint(tmp_path).name == "step=2.old"
    # 3) a complete newer save wins
    _save(tmp_path / "step=6", 6.0, 6)
    assert ck.latest_checkpoint(tmp_path).name == "step=6" and _load(tmp_path / "step=6") == (6.0, 6)


def test_periodic_checkpoints_come_from_the_hydra_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hotspa.adapter.recipes.hydra_recipe import CONFIG_DIR, build_trainer, register_resolvers

    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["trainer=cpu1", "logger=none", "strategy.layouts=[{dp: 1}]",
                                           "checkpoint.every_n_steps=5", f"checkpoint.dirpath={tmp_path}",
                                           "output_dir=" + str(tmp_path), "hardware=cpu-gloo"])
    trainer = build_trainer(cfg)
    saver = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert len(saver) == 1 and saver[0]._every_n_train_steps == 5 and saver[0].dirpath == str(tmp_path)
