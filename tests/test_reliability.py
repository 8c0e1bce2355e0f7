"""Crash and resume, atomic checkpoints, non-finite losses and breadcrumbs.

The crash tests run real 4-rank jobs (tests/reliability_job.py) as subprocesses, because a killed
rank takes a RankPool down with it. One chain of jobs covers all three crashes:

    uninterrupted: one epoch (8 steps), a checkpoint every 2 steps
    job 1: rank 1 SIGKILLs itself in the switch into the 2nd stage of global step 2   -> last ckpt: step 2
    job 2: resumes at 2, saves step 4, rank 1 dies inside the step-6 checkpoint write -> step-6 save incomplete
    job 3: resumes at 4 (skipping the broken step-6 save), rank 1 dies in a micro-batch of step 4
    job 4: resumes at 4 and finishes the epoch

and the final weights and the tokens trained on must equal the uninterrupted run's.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "reliability_job.py"
PG_TIMEOUT_S = 30.0  # the strategy's process-group timeout in the jobs
TIMINGS: dict[str, float] = {}


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
        "switch": {"ckpt": ckpt, "kill": "switch:2"},
        "checkpoint": {"ckpt": ckpt, "resume": True, "kill": "checkpoint:6"},
        "stage": {"ckpt": ckpt, "resume": True, "kill": "stage:4"},
        "final": {"ckpt": ckpt, "resume": True},
    })
    jobs["base"] = base
    yield jobs
    print(f"\ncrash-test jobs (s, after imports): {', '.join(f'{k} {v:.1f}' for k, v in TIMINGS.items())}")


def _assert_crashed_cleanly(job: dict, step: int) -> list[str]:
    """Rank 1 was SIGKILLed; every other rank exited non-zero, within the collective timeout, with an
    error naming where it was. Returns the survivors' error lines."""
    assert job["kill"] is not None, "rank 1 never reached its kill point"
    assert job["hung"] == [], f"ranks {job['hung']} were still running at the deadline"
    assert job["exit_codes"][1] == -signal.SIGKILL
    lines = []
    for rank in (0, 2, 3):
        log = job["logs"][rank]
        assert job["exit_codes"][rank] != 0, f"rank {rank} exited 0 after rank 1 died:\n{log[-2000:]}"
        waited = job["exit_times"][rank] - job["kill"]["time"]
        assert waited < PG_TIMEOUT_S, f"rank {rank} took {waited:.1f}s to fail"
        error = [x for x in log.splitlines() if "CollectiveError:" in x]
        assert error, f"rank {rank} failed without naming where it was:\n{log[-3000:]}"
        assert f"rank {rank}, " in error[-1] and f"global step {step}" in error[-1], error[-1]
        lines.append(error[-1])
    return lines


def test_killed_rank_during_a_switch_fails_the_others_fast_with_their_breadcrumb(chain):
    job = chain["switch"]
    lines = _assert_crashed_cleanly(job, step=2)
    assert "phase switch" in job["kill"]["where"] and "stage 2/2" in job["kill"]["where"]
    # who shares a group with rank 1 was waiting in that switch (stage 2, layout dp4)
    assert any("stage 2/2 (layout dp4" in x and "phase switch" in x for x in lines), lines


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(chain):
    job = chain["checkpoint"]
    lines = _assert_crashed_cleanly(job, step=6)
    assert any("phase checkpoint save to" in x and "epoch=0-step=6.ckpt" in x for x in lines), lines
    assert "resuming from" in job["logs"][0] and "epoch=0-step=2.ckpt" in job["logs"][0]
    names = job["checkpoints"]  # right after this job
    assert "epoch=0-step=4.ckpt" in names and "epoch=0-step=6.ckpt" not in names, names
    assert "epoch=0-step=6.ckpt.tmp" in names, names  # what the interrupted save left behind


def test_resume_picks_the_last_complete_checkpoint_and_says_which(chain):
    log = chain["stage"]["logs"][0]
    assert "skipping incomplete checkpoint(s)" in log and "epoch=0-step=6.ckpt.tmp" in log, log[-3000:]
    assert "hotspa: resuming from" in log and "epoch=0-step=4.ckpt (epoch 0, global step 4" in log, log[-3000:]


def test_killed_rank_during_a_stage_fails_the_others_fast(chain):
    job = chain["stage"]
    lines = _assert_crashed_cleanly(job, step=4)
    assert "phase forward-backward" in job["kill"]["where"]
    assert any("stage " in x for x in lines), lines


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
    assert ref["global_step"] == final["global_step"] == ref["batches_per_epoch"] == 8
    worst = max(float((final["weights"][n] - w).abs().max()) for n, w in ref["weights"].items())
    assert worst == 0.0, f"resumed weights differ from the uninterrupted run by up to {worst}"
    # the updates in the final weights: job 1 up to its step-2 checkpoint, job 2 up to step 4, job 4 the rest
    ours = {**_trained(chain["switch"]["records"], 2), **_trained(chain["checkpoint"]["records"], 4),
            **_trained(chain["final"]["records"])}
    theirs = _trained(chain["uninterrupted"]["records"])
    assert sorted(ours) == sorted(theirs) == list(range(1, 9))
    for step in theirs:  # same data order: the same mini-batch at every step
        assert ours[step] == theirs[step], step
    # nothing lost, nothing seen twice: the epoch's targets are exactly the corpus's, once each
    total = [sum(ours[s]["counts"][t] for s in ours) for t in range(256)]
    assert total == _corpus_targets()
    assert collections.Counter(r["global_step"] for r in chain["final"]["records"][0]) == {5: 1, 6: 1, 7: 1, 8: 1}
