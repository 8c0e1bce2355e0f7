"""Several nodes on one machine: two torchrun "nodes" started as docs/checkpoints-and-multinode.md
says, node-local checkpoints, a killed node, resume at the same shape and at other node counts.

One chain, as few process launches as possible (this is the costly test of the suite):

    torchrun x 2 (2 nodes x 2, recipes/train.py, checkpoint folder per node "node{node}", one
                 checkpoint per step): node 1's ranks stop at the start of step 3 (both nodes have
                 committed step 2; the Recorder pauses them) and the test then SIGKILLs node 1 (its
                 agent and workers); node 0, waiting in step 3's first collective, must fail with a
                 CollectiveError from the closed connection (not by waiting out its timeout)
    forked jobs (tests/multinode_job.py: train(cfg) on forked ranks posing as torchrun workers):
      ref14       1 node x 4 from scratch, uninterrupted (the reference)
      local22     2 x 2 resumes with ckpt_path=latest from the node-local folders, where node 0
                  also has a newer step only it committed: the agreed step must be 2
      reshape14   1 x 4 from the node-local folders: refused before training (needs a shared path)
      merged14/41 1 x 4 and 4 x 1 resume from the node copies merged into one shared checkpoint

Every step of every run records the documents and target tokens it trained on (Recorder), so
the tokens lost or repeated across the crash and the reshape are counted.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
# the strategy's collective timeout in every run here: it also bounds process-group creation, where
# the ranks of a loaded 2-core machine may arrive 10 s apart or more (8 s failed there), so it is
# generous. A killed peer closes its sockets: the survivors fail at once, never by this timeout.
PG_TIMEOUT_S = 120
# bounds on waiting for the torchrun nodes (imports, rendezvous, two steps): generous on a loaded
# machine; they only stop a hang
START_LIMIT_S = 600
STEPS = 4
COMMON = [
    "model=tiny", "data=synthetic_bimodal", "data.source_kwargs.kind=uniform",
    "+data.source_kwargs.params={low:2,high:256}", "data.source_kwargs.num_documents=128", "data.context_length=256",
    "data.tokens_per_batch=1024",
    "strategy.tokens_per_rank=64", f"+strategy.timeout={PG_TIMEOUT_S}", "hardware=cpu-gloo", "logger=none",
    "callbacks.hotspa_monitor.timeline_every_n_steps=0", "callbacks.hotspa_monitor.table_every_n_steps=0",
    "callbacks.progress_bar=null", f"trainer.max_steps={STEPS}", "trainer.accelerator=cpu",
    "trainer.precision=32-true", "trainer=multinode",
]
TIMINGS: dict[str, float] = {}
# the module fixture (every launch) runs inside the first test: ~50 s of CPU, minutes of wall time
# when the machine is shared; the limits below only stop a hang
pytestmark = pytest.mark.timeout(2400)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(predicate, timeout_s: float, what: str, procs=()) -> None:
    end = time.time() + timeout_s
    while not predicate():
        if time.time() > end or any(p.poll() is not None for p in procs):
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def two_torchrun_nodes(base: Path, ckpt: str) -> dict:
    """The two-node command of docs/checkpoints-and-multinode.md, twice, on localhost; node 1 pauses
    at the start of step 3 and is killed there."""
    port, env = _free_port(), {**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    overrides = COMMON + ["trainer.num_nodes=2", "trainer.devices=2", "checkpoint.every_n_steps=1",
                          "checkpoint.keep=-1", f'checkpoint.dirpath="{ckpt}"',
                          "+callbacks.recorder._target_=multinode_job.Recorder", f"+callbacks.recorder.out={base}/A",
                          "+callbacks.recorder.pause_node=1", "+callbacks.recorder.pause_at_step=2",
                          "hydra.verbose=lightning.pytorch.utilities.rank_zero"]  # the rank -> node map: DEBUG
    cmd = ["timeout", str(3 * START_LIMIT_S), str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "hotspa-test",
           str(ROOT / "recipes" / "train.py"), *overrides]
    t0 = time.perf_counter()
    logs = [base / f"node_launch{i}.log" for i in range(2)]
    procs = [subprocess.Popen(cmd, cwd=base, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for log in logs]
    try:
        text = [""] * 2

        def both_started() -> bool:
            text[:] = [log.read_text(errors="replace") for log in logs]
            return all("writes to run folder" in t for t in text)

        _wait_for(both_started, START_LIMIT_S, "both nodes to start", procs)
        node1 = next(i for i in range(2) if "hotspa: node 1 " in text[i])  # the rendezvous chose who is node 1
        paused = [base / "A" / f"paused{r}.json" for r in (2, 3)]  # node 1's ranks, stopped at step 3's start
        _wait_for(lambda: all(p.is_file() for p in paused), START_LIMIT_S, "node 1 to pause in step 3", procs)
        kill_time = time.time()
        _kill_tree(procs[node1])
        procs[1 - node1].wait(timeout=PG_TIMEOUT_S + 60)
        survivor_exit = time.time()
        TIMINGS["survivor exit after the kill"] = survivor_exit - kill_time
        procs[node1].wait(timeout=30)
    finally:
        for p in procs:
            _kill_tree(p)
    TIMINGS["two torchrun nodes"] = time.perf_counter() - t0
    return {"logs": [log.read_text(errors="replace") for log in logs], "node1": node1, "kill_time": kill_time,
            "survivor_exit_s": survivor_exit - kill_time, "survivor_rc": procs[1 - node1].returncode}


def forked_jobs(base: Path, jobs: dict[str, dict]) -> dict[str, dict]:
    spec = [{"out": str(base / name), **job} for name, job in jobs.items()]
    (base / "jobs.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "multinode_job.py"), str(base / "jobs.json")],
                            cwd=base, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=100 * len(jobs))
    finally:
        _kill_tree(proc)
    TIMINGS["forked jobs"] = time.perf_counter() - t0
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    reports = {name: _report(base / name) for name in jobs}
    TIMINGS.update({name: r.get("wall_s", -1.0) for name, r in reports.items()})
    return reports


def _report(out: Path) -> dict:
    report = json.loads((out / "job.json").read_text()) if (out / "job.json").exists() else {}
    report["logs"] = {int(p.stem[4:]): p.read_text(errors="replace") for p in out.glob("rank*.log")}
    report["steps"] = _steps(out)
    report["weights"] = torch.load(out / "weights.pt") if (out / "weights.pt").exists() else None
    return report


def _steps(out: Path) -> dict[int, dict]:
    """Per global step: the loss and every rank's documents and target tokens, summed over ranks."""
    steps: dict[int, dict] = {}
    for path in sorted(out.glob("record*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            step = steps.setdefault(r["global_step"], {"loss": r["loss"], "docs": [], "tokens": 0,
                                                        "position": r["position"]})
            step["docs"] += r["docs"]
            step["tokens"] += r["tokens"]
    for step in steps.values():
        step["docs"].sort()
    return steps


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from helpers import reseal

    from lightning_hotspa.adapter.checkpoints.nodes import merge_node_copies

    base = tmp_path_factory.mktemp("multinode")
    ckpt = str(base / "ckpt" / "node{node}")
    torchrun = two_torchrun_nodes(base, ckpt)
    node = [Path(ckpt.replace("{node}", str(n))) for n in (0, 1)]
    # a newer step only node 0 committed (node 1 died first): "latest" must not pick it
    fake = node[0] / "epoch=0-step=9.ckpt"
    shutil.copytree(node[0] / "epoch=0-step=1.ckpt", fake)
    marker = json.loads((fake / "commit.json").read_text())
    reseal(fake, {**marker, "global_step": 9})  # a consistent marker (its own checksum recomputed)
    shared = merge_node_copies([n / "epoch=0-step=2.ckpt" for n in node], base / "shared" / "epoch=0-step=2.ckpt")
    jobs = forked_jobs(base, {
        # latest_or_scratch in an empty folder: no step anywhere, so it starts from scratch (a first launch)
        "ref14": {"nodes": 1, "per_node": 4, "overrides": COMMON + ["ckpt_path=latest_or_scratch",
                                                                   f"checkpoint.dirpath={base}/empty"]},
        "local22": {"nodes": 2, "per_node": 2,
                    "overrides": COMMON + ["ckpt_path=latest", f'checkpoint.dirpath="{ckpt}"']},
        "reshape14": {"nodes": 1, "per_node": 4, "overrides": COMMON + ["ckpt_path=latest",
                                                                       f'checkpoint.dirpath="{ckpt}"']},
        "merged14": {"nodes": 1, "per_node": 4, "overrides": COMMON + [f'ckpt_path="{shared}"']},
        "merged41": {"nodes": 4, "per_node": 1, "overrides": COMMON + [f'ckpt_path="{shared}"']},
    })
    errors = {int(p.stem[5:]): json.loads(p.read_text()) for p in (base / "A").glob("error*.json")}
    torchrun["error_after_kill_s"] = {r: e["time"] - torchrun["kill_time"] for r, e in errors.items()}
    torchrun["errors"] = {r: e["error"] for r, e in errors.items()}
    TIMINGS.update({f"rank {r} error after the kill": t for r, t in torchrun["error_after_kill_s"].items()})
    print("\nmultinode timings (s):", {k: round(v, 1) for k, v in TIMINGS.items()})
    return {"torchrun": torchrun, "crashed": _steps(base / "A"), "node_dirs": node, "base": base, **jobs}


def _max_rel_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


@pytest.mark.slow
def test_two_torchrun_nodes_share_a_run_folder_and_keep_tp_within_a_node(chain):
    logs = chain["torchrun"]["logs"]
    folders = [line.split("writes to run folder ")[1] for log in logs for line in log.splitlines()
               if "writes to run folder" in line]
    assert len(folders) == 2 and folders[0] == folders[1] and folders[0].endswith("outputs/torchrun-hotspa-test")
    assert Path(folders[0]).is_dir()
    node1 = chain["torchrun"]["node1"]
    assert "hotspa: node 1 (ranks from 2, 2 per node)" in logs[node1]  # GROUP_RANK / LOCAL_WORLD_SIZE
    line = next(x for x in logs[1 - node1].splitlines() if "rank -> node map" in x)
    node_map = json.loads(line.split("rank -> node map ")[1].split(";")[0])
    assert node_map == [0, 0, 1, 1]
    groups = json.loads(line.split("tp groups ")[1].replace("'", '"'))
    assert set(groups) == {"dp2xtp2", "tp2xcp2"}
    for layout, ranks in groups.items():
        for group in ranks:
            assert len({node_map[r] for r in group}) == 1, (layout, group, node_map)


@pytest.mark.slow
def test_two_nodes_train_like_one_node_of_four(chain):
    assert "no complete checkpoint in" in chain["ref14"]["logs"][0]  # ckpt_path=latest, nothing there yet
    crashed, ref = chain["crashed"], chain["ref14"]["steps"]
    assert sorted(crashed) == [1, 2] and sorted(ref) == [1, 2, 3, 4]
    for step in (1, 2):
        assert crashed[step]["docs"] == ref[step]["docs"] and crashed[step]["tokens"] == ref[step]["tokens"]
        assert abs(crashed[step]["loss"] - ref[step]["loss"]) <= 1e-5 * abs(ref[step]["loss"]), step


@pytest.mark.slow
def test_a_killed_node_makes_the_other_fail_fast_with_a_collective_error(chain):
    run = chain["torchrun"]
    survivor = run["logs"][1 - run["node1"]]
    assert run["survivor_rc"] != 0
    assert "CollectiveError: a collective failed" in survivor and "global step 2" in survivor, survivor[-3000:]
    assert "another rank has probably died" in survivor
    # the survivors (ranks 0 and 1: node 0) raised it themselves, naming where they were: inside step 3
    # (node 1 paused at its start, after step 2's checkpoint was committed everywhere), failed by the
    # closed connection of the killed node, not by waiting out the timeout; its torchrun then ended
    # (two_torchrun_nodes waits for it, bounded)
    assert sorted(run["errors"]) == [0, 1], run["errors"]
    for rank, error in run["errors"].items():
        # the failed collective and its process group are named where the failing frame knows them
        assert re.match(rf"CollectiveError: a collective failed( in .+)? at rank {rank}, global step 2", error), error
        assert re.search(r"stage \d+/\d+ \(layout \w+", error) and "timed out" not in error.lower(), error


@pytest.mark.slow
def test_node_local_checkpoints_each_node_its_shards_metadata_and_marker(chain):
    for n, folder in enumerate(chain["node_dirs"]):
        step2 = folder / "epoch=0-step=2.ckpt"
        marker = json.loads((step2 / "commit.json").read_text())
        assert marker["node"] == n and marker["ranks"] == [2 * n, 2 * n + 1] and marker["global_step"] == 2
        shards = sorted(p.name for p in step2.glob("*.distcp"))
        assert shards == [f"__{2 * n}_0.distcp", f"__{2 * n + 1}_0.distcp"]
        metadata = pickle.loads((step2 / ".metadata").read_bytes())  # the coordinator's, this node's part
        files = {s.relative_path for s in metadata.storage_data.values()}
        assert files == set(shards), (n, files)


@pytest.mark.slow
def test_latest_is_the_newest_step_every_node_committed_and_resumes_exactly(chain):
    job, ref = chain["local22"], chain["ref14"]
    assert job["exit_codes"] == {"0": 0, "1": 0, "2": 0, "3": 0}, job["logs"][0][-2000:]
    assert "resuming from step 2, the newest every node has committed" in job["logs"][0]
    assert "node0/epoch=0-step=2.ckpt" in job["logs"][0] and "step=9" not in job["logs"][0].split("resuming from")[-1]
    assert sorted(job["steps"]) == [3, 4]
    for step in (3, 4):
        assert job["steps"][step]["docs"] == ref["steps"][step]["docs"]
    err = _max_rel_err(job["weights"]["weights"], ref["weights"]["weights"])
    assert err <= 1e-5, err


@pytest.mark.slow
def test_resume_at_another_node_layout_from_node_local_folders_is_refused_before_training(chain):
    job = chain["reshape14"]
    assert job["exit_codes"] and all(code != 0 for code in job["exit_codes"].values())
    text = job["logs"][0]
    assert "CheckpointError: cannot resume from the node-local checkpoint" in text, text[-2000:]
    assert "needs a checkpoint on a shared filesystem" in text and "ranks [0, 1] only" in text
    assert job["steps"] == {}  # not one step trained


@pytest.mark.slow
@pytest.mark.parametrize("name", ["merged14", "merged41"])
def test_crash_and_resume_at_another_node_count_loses_and_repeats_no_token(chain, name):
    """Steps 1-2 of the killed 2x2 run plus steps 3-4 of the resumed run are the reference's
    steps 1-4: same mini-batches in the same order, every document and target token once."""
    job, ref, crashed = chain[name], chain["ref14"]["steps"], chain["crashed"]
    assert job["exit_codes"] == {str(r): 0 for r in range(4)}, job["logs"][0][-2000:]
    assert sorted(job["steps"]) == [3, 4]
    trained = {**{s: crashed[s] for s in (1, 2)}, **job["steps"]}
    for step in range(1, STEPS + 1):
        assert trained[step]["position"] == ref[step]["position"], step
        assert trained[step]["docs"] == ref[step]["docs"] and trained[step]["tokens"] == ref[step]["tokens"], step
    ours = collections.Counter(tuple(d) for s in trained.values() for d in s["docs"])
    theirs = collections.Counter(tuple(d) for s in ref.values() for d in s["docs"])
    assert {ref[s]["position"]["epoch"] for s in ref} == {0}  # one pass over the data: nothing may repeat
    assert ours == theirs and max(ours.values()) == 1  # (document, start, length): none lost, none repeated
    assert sum(s["tokens"] for s in trained.values()) == sum(s["tokens"] for s in ref.values())
    err = _max_rel_err(job["weights"]["weights"], chain["ref14"]["weights"]["weights"])
    assert err <= 1e-5, err
    if name == "merged41":
        assert "tensor parallelism crosses nodes" in job["logs"][0]


def test_tp_groups_that_span_nodes_are_named():
    from lightning_hotspa.adapter.checkpoints.nodes import tp_groups_across_nodes
    from lightning_hotspa.layout import MeshShape

    shape = MeshShape.for_layouts(["dp4", "dp2xtp2", "tp2xcp2"], 4)
    assert tp_groups_across_nodes(shape, [0, 0, 1, 1]) == []  # torchrun's placement: consecutive ranks per node
    assert tp_groups_across_nodes(shape, [0, 1, 2, 3]) == ["dp2xtp2: tp group [0, 1] spans nodes [0, 1]",
                                                          "tp2xcp2: tp group [0, 1] spans nodes [0, 1]"]


def _node_copy(folder: Path, node: int, ranks: list[int], step: int = 2) -> Path:
    """A stand-in for one node's copy of a node-local checkpoint (files only, no tensors)."""
    from lightning_hotspa.adapter.checkpoints.trust import file_entries, write_marker

    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps({}))
    torch.save({"global_step": step}, folder / "meta.pt")
    write_marker(folder, {"kind": "node-local", "node": node, "ranks": ranks, "world_size": 4, "global_step": step,
                          "node_map": [0, 0, 1, 1], "layouts": ["dp4"]}, file_entries(folder, [".metadata", "meta.pt"]))
    return folder


def test_node_local_copies_are_refused_where_they_cannot_load_and_merged_only_when_complete(tmp_path):
    from lightning_hotspa.adapter.checkpoints.dcp_state import CheckpointError
    from lightning_hotspa.adapter.checkpoints.nodes import CheckpointPlacement, merge_node_copies

    copy0 = _node_copy(tmp_path / "node0" / "step=2", 0, [0, 1])
    placement = CheckpointPlacement(0, (0, 0, 0, 0), broadcast=lambda x: x, barrier=lambda: None)
    with pytest.raises(CheckpointError, match=r"holds the shards of ranks \[0, 1\] only.*needs a checkpoint on a "
                                              r"shared filesystem"):
        placement.resolve(str(copy0), ["dp4"])
    same_shape = CheckpointPlacement(0, (0, 0, 1, 1), broadcast=lambda x: x, barrier=lambda: None)
    assert same_shape.resolve(str(copy0), ["dp4"]) == copy0
    with pytest.raises(CheckpointError, match=r"do not add up to one checkpoint of 4 ranks: they hold ranks \[0, 1\]"):
        merge_node_copies([copy0], tmp_path / "merged")
    late = _node_copy(tmp_path / "node1" / "step=3", 1, [2, 3], step=3)
    with pytest.raises(CheckpointError, match=r"of steps \[2, 3\]"):
        merge_node_copies([copy0, late], tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
