"""A rank killed inside a mixed-cp round (issue 31): the others fail with a ``CollectiveError`` that
names the group they were waiting in, on the dead peer's closed connection, not after a timeout;
and a rank whose step raises in a rank pool no longer leaves the others hanging in a collective."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_hotspa.testing.spawn import RankFailure, RankPool

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 300.0  # the job kills what still runs then; the ranks' process-group timeout is 30 min


MODES = ("mixed", "blocks", "tp", "pp")


def _kill_jobs(out: Path) -> dict[str, dict]:
    """Runs tests/mixed_kill_job.py's three jobs one after the other from one subprocess (one import
    of torch and Lightning, not three) into ``out``: per mode its job.json and every rank's log."""
    deadline = DEADLINE_S * len(MODES)
    cmd = [sys.executable, str(ROOT / "tests" / "mixed_kill_job.py"), str(out), "--deadline", str(DEADLINE_S),
           "--modes", ",".join(MODES)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=deadline + 120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    jobs = {}
    for mode in MODES:
        job = json.loads((out / mode / "job.json").read_text())
        job["logs"] = {r: (out / mode / f"rank{r}.log").read_text(errors="replace") for r in range(4)}
        jobs[mode] = job
    return jobs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, dict]:
    return _kill_jobs(tmp_path_factory.mktemp("mixed-kill"))


@pytest.fixture
def killed(jobs) -> dict:
    return jobs["mixed"]


def _check_survivors(killed: dict, blocks: dict[int, str]) -> None:
    """Every survivor exits non-zero before the deadline with a CollectiveError naming the
    collective, its group's ranks (which include the dead rank 1) and its own block."""
    assert killed["hung"] == [], f"ranks {killed['hung']} still waited at the deadline"
    assert killed["exit_codes"]["1"] == -signal.SIGKILL
    for rank, block in blocks.items():
        log = killed["logs"][rank]
        assert killed["exit_codes"][str(rank)] != 0, log[-2000:]
        errors = [x for x in log.splitlines() if "CollectiveError:" in x]
        assert errors, f"rank {rank} failed without a CollectiveError:\n{log[-3000:]}"
        line = errors[-1]
        # the collective's note: a sub-group by its name and ranks, a world collective by its ranks
        group = re.search(r"in (?:an?|the) [\w\s'-]+ (?:over ranks|on process group '[^']+' \(ranks) \[([\d, ]+)\]\)? "
                          r"at rank (\d)", line)
        assert group and int(group.group(2)) == rank, line
        assert 1 in [int(x) for x in group.group(1).split(",")], line
        assert f"block {block}" in line and "global step 0" in line, line
        assert "timed out" not in line.lower(), line


def test_a_rank_killed_in_a_mixed_round_fails_the_others_with_the_group_named(killed):
    """Rank 1 (cp2 block with rank 0; ranks 2 and 3 at cp1) dies inside round 2 of the mixed stage.
    Every survivor exits non-zero before the job's deadline (its collective timeout is 30 min) with
    a CollectiveError naming the collective and its group's ranks, which include the dead rank,
    and where it was: the mixed stage, its own block's layout."""
    assert killed["kill"] is not None, "rank 1 never reached its kill point"
    assert "block dp2xcp2:fsdp" in killed["kill"]["where"], killed["kill"]
    _check_survivors(killed, {0: "dp2xcp2:fsdp", 2: "dp4:fsdp", 3: "dp4:fsdp"})


def test_a_rank_killed_in_a_block_fails_every_other_block_with_group_and_block_named(jobs):
    """Issue 38: rank 1 dies in its second micro-batch of a sharded Ulysses cp2 block {0, 1} of a
    block stage; rank 0 fails inside that block, ranks 2 and 3 (replicated dp blocks of their own,
    one with no micro-batch) in the stage's joint exchange: each names the group and its block."""
    killed = jobs["blocks"]
    assert killed["kill"] is not None, "rank 1 never reached its kill point"
    assert "block 1/3 (dp2xcp2, sharded, ranks 0-1)" in killed["kill"]["where"], killed["kill"]
    _check_survivors(killed, {0: "1/3 (dp2xcp2, sharded, ranks 0-1)", 2: "2/3 (dp4, replicated, ranks 2-2)",
                              3: "3/3 (dp4, replicated, ranks 3-3)"})


def test_a_rank_killed_inside_a_tp_overlap_ring_fails_the_others_with_the_group_named(jobs):
    """Issue 52: rank 1 dies between two steps of a row-parallel layer's matmul + reduce-scatter ring
    (tp overlap on gloo) in the tp4 stage of a switching plan; every other rank fails with a
    CollectiveError naming the collective and the tp group (ranks 0-3), not a timeout."""
    killed = jobs["tp"]
    assert killed["kill"] is not None, "rank 1 never reached its kill point"
    assert "tp4" in killed["kill"]["where"], killed["kill"]
    assert killed["hung"] == [] and killed["exit_codes"]["1"] == -signal.SIGKILL
    for rank in (0, 2, 3):
        log = killed["logs"][rank]
        errors = [x for x in log.splitlines() if "CollectiveError:" in x]
        assert killed["exit_codes"][str(rank)] != 0 and errors, log[-3000:]
        line = errors[-1]
        assert re.search(r"(matmul|ring).* on process group '[^']+' \(ranks \[0, 1, 2, 3\]\)", line), line
        assert "timed out" not in line.lower(), line


def test_a_rank_killed_inside_a_pipeline_schedule_fails_the_others_naming_the_stage(jobs):
    """Issue 56: rank 1 (first pipeline stage of pp group {1, 3}) dies inside torch's 1F1B schedule
    of the dp2xpp2 stage; its pp peer 3 fails in that schedule's point-to-point, ranks 0 and 2 in the
    stage's gradient reduction: each a CollectiveError naming the step's stage and its layout (not
    the pipeline stage index: torch's P2P is not one of the package's named collectives), no timeout."""
    killed = jobs["pp"]
    assert killed["kill"] is not None, "rank 1 never reached its kill point"
    assert "stage 2/2 (layout dp2xpp2)" in killed["kill"]["where"], killed["kill"]
    assert killed["hung"] == [] and killed["exit_codes"]["1"] == -signal.SIGKILL
    for rank, phase in ((0, "phase reduce"), (2, "phase reduce"), (3, "phase forward-backward")):
        log = killed["logs"][rank]
        errors = [x for x in log.splitlines() if "CollectiveError:" in x]
        assert killed["exit_codes"][str(rank)] != 0 and errors, log[-3000:]
        line = errors[-1]
        assert f"at rank {rank}, global step 0" in line and "stage 2/2 (layout dp2xpp2)" in line and phase in line, line
        assert "timed out" not in line.lower(), line


def _one_rank_raises_while_the_other_gathers():
    """Rank 1 raises (a broken runner); rank 0 goes on to the world all-gather, as a step's records
    gather would."""
    import torch

    if dist.get_rank() == 1:
        raise ValueError("a broken runner")
    out = torch.zeros(dist.get_world_size())
    dist.all_gather_into_tensor(out, torch.ones(1))
    return float(out.sum())


def _failure_on_two_ranks(fn, timeout_s: float) -> str:
    """The :class:`RankFailure` message of ``fn`` run on a fresh 2-rank pool (30 min collective timeout,
    longer than ``timeout_s``), the pool closed after."""
    pool = RankPool(2, collective_timeout_s=1800.0)
    try:
        with pytest.raises(RankFailure) as failure:
            pool.run(fn, timeout_s=timeout_s)
    finally:
        pool.close(force=True)
    return str(failure.value)


def test_a_rank_that_raises_does_not_leave_the_others_in_a_collective():
    """The pool used to wait for every rank's answer while rank 0 waited in the gather for the rank
    that had raised: a hang until the collective timeout (here 30 min, longer than the call's
    deadline). Now the failed rank leaves and rank 0 fails on the closed connection: both answer."""
    message = _failure_on_two_ranks(_one_rank_raises_while_the_other_gathers, timeout_s=240.0)
    assert "timed out" not in message and "failed on ranks [0, 1]" in message, message[:2000]


def _rank_one_reads_freed_storage() -> int:
    """Rank 1 sums a tensor whose storage was released (a SIGSEGV in the native kernel); rank 0 waits."""
    import torch

    if dist.get_rank() == 1:
        t = torch.ones(64, 64)
        t.untyped_storage().resize_(0)
        return int(t.sum())
    dist.barrier()
    return 0


def test_a_rank_killed_by_a_fatal_signal_reports_its_python_stack():
    """A rank that dies of SIGSEGV used to say only its exit code (-11): now its faulthandler stacks
    (every thread's) come with the failure, naming the function it died in."""
    message = _failure_on_two_ranks(_rank_one_reads_freed_storage, timeout_s=120.0)
    assert "exit codes {1: -11}" in message and "rank 1 (fatal signal; faulthandler)" in message, message[:2000]
    assert "_rank_one_reads_freed_storage" in message, message[:2000]
